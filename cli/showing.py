"""`xpu show LEASE|CARD`: one object and everything about it (as `scontrol show job`, `kubectl
describe`): a lease's placement, owner, how it ended and its events; a card's state, health, leases and
events."""

from __future__ import annotations

import time

from xpu_cli import output, vocab
from xpu_cli.vocab import exit_status, run_time, status

from xpud.errors import BadRequest, NotFound

EVENTS = 10  # the latest events shown with the object


def when(ts: float | None) -> str:
    if not ts:
        return "-"
    return f"{vocab.timestamp(ts)} ({vocab.age(time.time() - ts)} ago)"


def show(c, what: str, as_json: bool) -> None:
    cards = list(c.cards().cards)
    if what.isdigit() and len(what) <= 4 and int(what) < len(cards):  # a card index (lease ids are 8 long)
        return _card(c, cards, int(what), as_json)
    try:
        job = c.job(what)
    except (NotFound, BadRequest) as e:
        if "names" in str(e):  # several of your jobs have that name: listed, none guessed
            raise
        job = None
    if job is not None and job.kind != "attached":
        return _job(job, as_json)
    try:
        lease = c.lease(what)
    except (NotFound, BadRequest) as lease_error:
        try:
            (health,) = c.health(what).cards
        except (NotFound, BadRequest):
            raise NotFound(f"{what!r} is neither a lease nor a card: {lease_error}") from None
        return _card(c, cards, health.index, as_json)
    return _lease(c, lease, as_json)


def _job(j, as_json: bool) -> None:
    from xpu_cli.joblist import end_text as _end
    from xpu_cli.joblist import row as _row

    row = _row(j, time.time())
    if as_json:
        return output.print_json({"job": row})
    _pairs(
        [
            ("job", j.id),
            ("name", j.name or "-"),
            ("user", row["user"]),
            ("state", j.state + (f" ({_end(row)})" if _end(row) else "")),
            ("reason", j.reason or "-"),
            ("mode", f"{j.mode} x{j.gpus}" if j.mode == "xpu" else j.mode),
            ("hosts", ", ".join(j.hosts) or "-"),
            ("lease", j.lease_id or "-"),
            ("command", j.command or "-"),
            ("directory", j.cwd or "-"),
            ("output", j.output or "-"),
            ("error", j.error or "(with the output)"),
            ("time limit", vocab.age(j.time_limit_s) if j.time_limit_s else "-"),
            ("after", ", ".join(j.after) or "-"),
            ("submitted", when(j.submitted)),
            ("started", when(row["started"])),
            ("ended", when(row["ended"])),
            *(
                (f"rank {x['rank']}", f"{x['host']}: {x['state']}" + (f" ({_end(x)})" if _end(x) else ""))
                for x in row["ranks"]
            ),
        ]
    )


def _pairs(rows: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k + ':':<{width + 1}} {v}")


def _events(events) -> None:
    from xpu_cli.events import line

    print(f"\nevents (latest {EVENTS}):" if events else "\nevents: none")
    for ev in events:
        print(f"  {line(ev)}")


def _lease(c, le, as_json: bool) -> None:
    events = c.events(lease_id=le.id, limit=EVENTS)
    if as_json:
        return output.print_json(
            {
                "lease": {**output.to_dict(le), "status": status(le)},
                "events": [output.to_dict(e) for e in events],
            }
        )
    now = time.time()
    rows: list[tuple[str, object]] = [
        ("lease", le.id),
        ("name", le.name or "-"),
        ("status", status(le) + (f" (shell status {exit_status(le)})" if le.state != "active" else "")),
        ("mode", le.mode),
        ("cards", ", ".join(f"{i} ({u})" for i, u in zip(le.cards, le.card_uuids, strict=False)) or "-"),
    ]
    for s in le.slices:
        rows.append(
            ("slice", f"{s.size}: {vocab.gib(s.memory_bytes)} GiB, {s.compute_pct}% compute, {s.handle}")
        )
    rows += [
        ("uid", le.owner_uid),
        ("holder pid", le.holder_pid or "-"),
        ("held", "yes" if le.held else f"by {le.anchor}" if le.anchor else "no"),
        ("priority", le.priority),
        ("restartable", "yes" if le.restartable else "no"),
        ("restarts", le.restart_count),
        ("command", le.command or "-"),
        ("granted", when(le.created)),
        ("started", when(le.started) if le.HasField("started") else "- (its wrapper reports it at release)"),
        ("ended", when(le.ended) if le.HasField("ended") else "-"),
        ("run time", vocab.age(run_time(le, now))),
        ("end reason", le.end_reason or "-"),
        ("note", le.mark or "-"),
    ]
    _pairs(rows)
    _events(events)


def _card(c, cards, index: int, as_json: bool) -> None:
    card = next(x for x in cards if x.index == index)
    (health,) = c.health(str(index), history=5).cards
    leases = [le for le in c.leases().leases if index in le.cards]
    events = c.events(card=index, limit=EVENTS)
    if as_json:
        return output.print_json(
            {
                "card": output.to_dict(card),
                "health": output.to_dict(health),
                "leases": [{**output.to_dict(le), "status": status(le)} for le in leases],
                "events": [output.to_dict(e) for e in events],
            }
        )
    held = [f"{le.id} ({le.mode}{', ' + le.name if le.name else ''})" for le in leases]
    _pairs(
        [
            ("card", f"{card.index} ({card.uuid})"),
            ("name", card.name),
            ("pci bus", card.pci_bus_id),
            ("mode", card.mode + (" (pinned)" if card.mode_pinned else "")),
            ("isolation", card.isolation),
            ("drained", card.drain_reason if card.drained else "no"),
            ("health", f"{health.state}, score {health.score}"),
            ("because", "; ".join(health.reasons) or "-"),
            ("memory", f"{vocab.gib(card.memory_total_bytes)} GiB"),
            ("leases", ", ".join(held) or "none"),
        ]
    )
    _events(events)
