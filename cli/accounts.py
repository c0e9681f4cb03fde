"""`xpu accounts`: the accounts of xpud.toml and how they stand across the cluster (issue #33): quota,
limit, weight, deserved share, allocated, decayed usage, waiting demand, reclaims."""

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
    from xpu_cli.main import client

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
            a.name if not a.parent else f"{a.parent}/{a.name}",
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
