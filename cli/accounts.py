"""`xpu accounts`: the accounts of xpud.toml and how they stand across the cluster (issue #33): quota,
limit, weight, deserved share, allocated, decayed usage, waiting demand, reclaims. `xpu report`: usage
from every host's ledger per account, user or card model over a window (as sreport)."""

from __future__ import annotations

from typing import Annotated

import typer
from xpu_cli import output

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _n(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") or "0"


def accounts(as_json: JsonOpt = False) -> None:
    """List the accounts (teams): quota, limit, weight, deserved share, allocated, decayed usage
    (GPU-hours), waiting, and the reclaims this host made from and for each. Amounts are GPU-equivalents
    (a whole card 1, a slice its memory fraction), across the cluster."""
    from xpu_cli.session import client

    with client() as c:
        reply = c.accounts()
    if as_json:
        output.print_json(reply)
        return
    if not reply.enabled:
        print("no [accounts.NAME] in xpud.toml: all work is charged to default")
        return
    rows = [
        (
            (a.name if not a.parent else f"{a.parent}/{a.name}") + (" (removed)" if a.removed else ""),
            _n(a.quota),
            _n(a.limit) if a.HasField("limit") else "-",
            _n(a.weight),
            _n(a.share),
            _n(a.allocated),
            f"{a.usage_gpu_hours:.1f}",
            _n(a.waiting),
            f"{a.reclaimed_from}/{a.reclaimed_for}",
        )
        for a in reply.accounts
    ]
    heads = (
        "ACCOUNT",
        "QUOTA",
        "LIMIT",
        "WEIGHT",
        "SHARE",
        "ALLOC",
        "USAGE-H",
        "WAITING",
        "RECLAIMED FROM/FOR",
    )
    output.table(heads, rows)
    print(f"{_n(reply.capacity)} GPU-equivalents in the cluster; reclaim {reply.reclaim}")


def register(app: typer.Typer) -> None:
    from xpu_cli.output import handled

    app.command()(handled(accounts))
    app.command()(handled(report))


def _when(flag: str, text: str | None, now: float) -> float:
    """``--since``/``--until``: an ISO date or time (local time when it has no zone), or ``-7d``/``-12h``
    (that long before now); None: 0 (the daemon's default)."""
    from datetime import datetime

    from xpud.errors import BadRequest

    if not text:
        return 0.0
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text.startswith("-") and text[-1:] in units and text[1:-1].replace(".", "", 1).isdigit():
        return now - float(text[1:-1]) * units[text[-1]]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise BadRequest(
            f"{flag} {text[:40]!r}: give an ISO date or time (2026-12-01, 2026-12-01T08:00) or -7d, -12h"
        ) from None


ReportBy = Annotated[str, typer.Option("--by", help="account, user or card-model.")]


def report(
    by: ReportBy = "account",
    since: Annotated[
        str | None,
        typer.Option(help="Start of the window: ISO date/time or -7d, -12h (default: 30 days back)."),
    ] = None,
    until: Annotated[str | None, typer.Option(help="End of the window (default: now).")] = None,
    as_json: JsonOpt = False,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="Print CSV (a header line, then one per row).")
    ] = False,
) -> None:
    """Usage from the ledgers of every host of the cluster (as sreport): GPU-hours (whole cards 1, a slice
    its memory fraction), jobs, mean and p95 wait in the queue, fair-share reclaims suffered and caused."""
    import csv
    import sys
    import time

    from xpu_cli.session import client

    from xpud.errors import BadRequest

    if as_json and as_csv:
        raise BadRequest("--json and --csv: give one")
    now = time.time()
    with client() as c:
        reply = c.report(by, _when("--since", since, now), _when("--until", until, now))
    if as_json:
        output.print_json(reply)
        return
    heads = ("KEY", "GPU-HOURS", "JOBS", "MEAN-WAIT-S", "P95-WAIT-S", "RECLAIMS-SUFFERED", "RECLAIMS-CAUSED")
    rows = [
        (
            r.key,
            f"{r.gpu_hours:.3f}",
            r.jobs,
            f"{r.mean_wait_s:.1f}" if r.HasField("mean_wait_s") else "",
            f"{r.p95_wait_s:.1f}" if r.HasField("p95_wait_s") else "",
            r.reclaims_suffered,
            r.reclaims_caused,
        )
        for r in reply.rows
    ]
    if as_csv:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow([h.lower().replace("-", "_") for h in ("by", *heads)])
        w.writerows((reply.by, *row) for row in rows)
        return
    output.table((reply.by.upper(), *heads[1:]), rows)
    print(
        f"hosts: {', '.join(reply.hosts)}"
        + (f"; not answering: {'; '.join(reply.hosts_missing)}" if reply.hosts_missing else "")
    )
