"""`xpu events`: the daemon's event log (grants, releases, moves, health changes, drains, faults), the
log the dashboard's Events view shows; `--follow` goes on printing new events as they happen."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from xpu_cli import output, vocab

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def line(ev) -> str:
    card = f"card {ev.card}" if ev.card >= 0 else "-"
    message = vocab.with_user_names(ev.message)  # owners by name, as the tables show them
    return f"{vocab.timestamp(ev.timestamp)}  {ev.kind:<8} {card:<7} {ev.lease_id or '-':<8}  {message}"


def _keep(ev, card: int | None, lease: str) -> bool:
    return (card is None or ev.card == card) and ev.lease_id.startswith(lease)


def events(
    card: Annotated[
        int | None, typer.Option("--card", help="Only events about this card index.", min=0)
    ] = None,
    lease: Annotated[str, typer.Option("--lease", help="Only events about this lease (id or prefix).")] = "",
    limit: Annotated[
        int, typer.Option("--limit", "-n", help="Show the latest this many.", min=1, max=10_000)
    ] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Then print new events as they happen, until Ctrl-C.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """The daemon's event log, oldest first: grants, releases, moves, health changes, drains, faults.
    With --json one object per event (with --follow one per line, as JSON Lines)."""
    from xpu_cli.session import client

    with client() as c:
        history = c.events(card=card, lease_id=lease, limit=limit)
        if as_json and not follow:
            return output.print_json([output.to_dict(ev) for ev in history])
        last = 0
        for ev in history:
            _print(ev, as_json)
            last = max(last, ev.id)
        if not follow:
            return
        call = c.watch(0.2)
        try:
            for update in c.iterate(call):
                for ev in update.events:  # the first update repeats recent history: skip what was shown
                    if ev.id > last and _keep(ev, card, lease):
                        _print(ev, as_json)
                    last = max(last, ev.id)
        finally:
            call.cancel()


def _print(ev, as_json: bool) -> None:
    print(json.dumps(output.to_dict(ev)) if as_json else line(ev), flush=True)


def register(app: typer.Typer) -> None:
    from xpu_cli.output import handled

    app.command()(handled(events))
