"""`xpu defrag`: the moves of restartable jobs that would free whole cards, and (operators) doing them.

The CLI's main module adds the command with ``register(app)``. Parsing and printing only; the plan is the
daemon's (``xpud.controllers.defragmenter``), reached on admin.sock.
"""

from __future__ import annotations

from typing import Annotated

import typer
from xpu_cli import output

from xpud.api.client import Client
from xpud.errors import XpudError


def _fail(message: str, code: int = 1):
    typer.echo(f"xpu: {message}", err=True)
    raise typer.Exit(code)


def defrag(
    ctx: typer.Context,
    plan: Annotated[
        bool, typer.Option("--plan", help="Show the moves and what they buy; move nothing (the default).")
    ] = False,
    apply: Annotated[
        bool, typer.Option("--apply", help="Move the jobs (operators) and report each move.")
    ] = False,
    move_budget: Annotated[
        float | None,
        typer.Option(
            "--move-budget",
            metavar="PCT",
            min=0.0,
            max=100.0,
            help="Most moves, as a percentage of the active leases (default: the daemon's "
            "[defrag] move_budget_pct).",
        ),
    ] = None,
    gpus: Annotated[
        int,
        typer.Option(
            "--gpus", "-g", min=0, help="Make room for a request of this many whole cards (0: consolidate)."
        ),
    ] = 0,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait/--no-wait",
            help="With --apply: wait until every moved job acknowledged (or the move was abandoned).",
        ),
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Move restartable jobs (`xpu run --restartable`) so that slices share fewer cards and whole cards,
    kept together where they connect best, come free. Operators only."""
    if plan and apply:
        _fail("--plan and --apply: give one (--plan shows, --apply moves)", 2)
    runtime = ctx.parent.params.get("runtime_dir") if ctx.parent else None
    try:
        with Client(runtime, admin=True) as c:
            reply = c.defrag(apply=apply, move_budget_pct=move_budget, gpus=gpus, wait=wait)
    except XpudError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if as_json:
        return output.print_json(reply)
    show(reply, apply_command(move_budget, gpus))


def apply_command(move_budget: float | None, gpus: int) -> str:
    """The command that carries out the plan just shown: the same budget and goal, with --apply."""
    words = ["xpu", "defrag", "--apply"]
    if move_budget is not None:
        words += ["--move-budget", f"{move_budget:g}"]
    if gpus:
        words += ["--gpus", str(gpus)]
    return " ".join(words)


def _picture(f) -> list[str]:
    idle = f"{len(f.idle)} ({output_cards(f.idle)})" if f.idle else "0"
    if len(f.group) >= 2:
        group = f"{len(f.group)} cards ({output_cards(f.group)}) at {f.group_gbps:.1f} GB/s"
    else:
        group = f"{len(f.group)} card" + (f" ({output_cards(f.group)})" if f.group else "s")
    return [idle, group, f"{f.quality_gbps:.1f} GB/s"]


def output_cards(cards) -> str:
    return ",".join(map(str, cards)) or "-"


def show(reply, apply_cmd: str = "xpu defrag --apply") -> None:
    """The plan (or what was done) as tables."""
    budget = (
        f"{reply.move_budget} allowed ({reply.move_budget_pct:g} % of {reply.active_leases} active "
        f"lease(s); {reply.movable_leases} movable)"
    )
    goal = f", making room for {reply.gpus} whole card(s)" if reply.gpus else ""
    if not reply.moves:
        print(f"defrag: no moves{goal}: {'; '.join(reply.notes) or reply.summary}")
        print(f"budget: {budget}")
    else:
        print(
            f"defrag {'applied' if reply.applied else 'plan'}: {len(reply.moves)} move(s) of {budget}{goal}"
        )
        freed = len(reply.after.idle) - len(reply.before.idle)
        print(
            f"frees {freed} whole card(s); value {reply.before.value:.2f} -> {reply.after.value:.2f} "
            f"(idle cards + how well they connect), cost {reply.cost:g}"
        )
    print()
    before, after = _picture(reply.before), _picture(reply.after)
    labels = ["idle whole cards", "best free group", "free-group quality"]
    output.table(
        ["", "BEFORE", "AFTER" if reply.moves else ""],
        [[label, b, a if reply.moves else ""] for label, b, a in zip(labels, before, after, strict=True)],
    )
    if reply.gpus and reply.target_cards:
        print(f"the request for {reply.gpus} card(s) fits on cards {output_cards(reply.target_cards)} after")
    if not reply.moves:
        return
    print()
    headers = ["LEASE", "MODE", "FROM", "TO", "COST", "WAVE"] + (["STATE", "DETAIL"] if reply.applied else [])
    rows = []
    for m in reply.moves:
        row = [
            m.lease_id,
            m.mode,
            output_cards(m.from_cards),
            output_cards(m.to_cards),
            f"{m.cost:g}",
            m.wave,
        ]
        rows.append(row + ([m.state, m.detail] if reply.applied else []))
    output.table(headers, rows)
    if any(m.wave > 1 for m in reply.moves):
        print("wave 2 and later start once the moves before them are acknowledged")
    for note in reply.notes:
        print(f"note: {note}")
    print()
    if reply.applied and any(m.state == "moving" for m in reply.moves):
        print(f"under way: {reply.summary} (the daemon goes on; see `xpu leases`)")
    elif reply.applied:
        print(f"done: {reply.summary}")
    else:
        print(f"nothing moved: `{apply_cmd}` moves these jobs (they restart on their new cards)")


def register(app: typer.Typer) -> None:
    """Add the ``defrag`` command to the ``xpu`` application."""
    app.command("defrag")(defrag)
