"""`xpu`: the command line of xpud. Thin: parse, call the daemon, print. Every listing has --json."""

from __future__ import annotations

import functools
import sys
import time
from typing import Annotated

import typer
from xpu_cli import output

from xpud.api.client import Client
from xpud.errors import XpudError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="xpu: lease whole GPUs (xpu) or isolated slices (vxpu-*) from xpud, and look after them.",
)
fault_app = typer.Typer(
    no_args_is_help=True, help="Inject and clear simulated faults (simulated daemons, operators only)."
)
app.add_typer(fault_app, name="fault")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


class State:
    runtime_dir: str | None = None


state = State()


@app.callback()
def main_callback(
    runtime_dir: Annotated[
        str | None,
        typer.Option(envvar="XPUD_RUNTIME_DIR", help="Where the daemon's sockets are (default /run/xpud)."),
    ] = None,
) -> None:
    state.runtime_dir = runtime_dir


def fail(message: str, code: int = 1):
    typer.echo(f"xpu: {message}", err=True)
    raise typer.Exit(code)


def handled(fn):
    """Turn daemon errors into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except XpudError as e:
            fail(str(e))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper


def client(admin: bool = False) -> Client:
    return Client(state.runtime_dir, admin=admin)


# ---------------------------------------------------------------------------------------------- run
@app.command(context_settings={"allow_interspersed_args": False})
@handled
def run(
    command: Annotated[
        list[str] | None,
        typer.Argument(help="The command and its arguments (after --).", show_default=False),
    ] = None,
    mode: Annotated[
        str,
        typer.Option(
            "--mode",
            "-m",
            help="xpu (whole cards), vxpu-half, vxpu-quarter, or "
            "another slice size from the daemon's config.",
        ),
    ] = "xpu",
    gpus: Annotated[int, typer.Option("--gpus", "-g", help="Whole cards to lease (mode xpu).", min=1)] = 1,
    wait: Annotated[
        float,
        typer.Option(
            "--wait",
            "-w",
            help="Queue up to this many seconds when it does not fit now (0: fail at once).",
            min=0,
        ),
    ] = 0.0,
    priority: Annotated[int, typer.Option("--priority", "-p", help="Higher goes first in the queue.")] = 0,
    restartable: Annotated[
        bool,
        typer.Option(
            help="The daemon may move the job: it stops the command and "
            "starts it again elsewhere (XPU_RESTART_COUNT counts)."
        ),
    ] = False,
    kill_grace: Annotated[
        float, typer.Option(help="Seconds between a forwarded signal and SIGKILL.", min=0)
    ] = 10.0,
    json_env: Annotated[
        bool,
        typer.Option(
            "--json-env",
            help="Run nothing: print the lease's environment as one JSON line, hold the lease until "
            "stdin closes or a signal comes, then release (for other launchers).",
        ),
    ] = False,
) -> None:
    """Lease, run COMMAND with the lease's environment, end as it ended (exit code or signal), release."""
    from xpu_cli.child import die_like
    from xpu_cli.run import run as run_leased

    with client() as c:
        outcome = run_leased(
            c,
            list(command or []),
            mode=mode,
            gpus=gpus,
            wait_s=wait,
            priority=priority,
            restartable=restartable,
            kill_grace_s=kill_grace,
            json_env=json_env,
        )
    raise typer.Exit(die_like(outcome))


# ---------------------------------------------------------------------------------------------- listings
def _held(card) -> str:
    if card.whole_lease:
        return f"lease {card.whole_lease}"
    if card.slices:
        return " ".join(f"{s.size.removeprefix('vxpu-')}:{s.lease_id}" for s in card.slices)
    return "-"


def _free(card) -> str:
    if card.drained:
        return "drained"
    if card.whole_lease:
        return "0"
    if card.mode == "sliced" or card.slices:
        return f"{card.free_memory_fraction * 100:.0f}% mem {card.free_compute_pct}% sm"
    return "whole"


@app.command("ls")
@handled
def ls(as_json: JsonOpt = False) -> None:
    """Cards: mode, slices, free capacity, memory, utilisation, temperature, health."""
    with client() as c:
        reply = c.cards()
    if as_json:
        return output.print_json([output.to_dict(card) for card in reply.cards])
    rows = []
    for card in reply.cards:
        s = card.sample
        has = card.HasField("sample")
        mem = (
            f"{output.gib(s.memory_used_bytes) if has and s.HasField('memory_used_bytes') else '-'}"
            f"/{output.gib(card.memory_total_bytes)} GiB"
        )
        util = f"{s.utilization_gpu_pct}%" if has and s.HasField("utilization_gpu_pct") else "-"
        temp = f"{s.temperature_c}C" if has and s.HasField("temperature_c") else "-"
        power = f"{s.power_w:.0f}W" if has and s.HasField("power_w") else "-"
        if has and s.lost:
            util = temp = power = "lost"
        mode = card.mode + ("*" if card.mode_pinned else "")
        rows.append(
            [
                card.index,
                card.name,
                mode,
                card.isolation,
                _held(card),
                _free(card),
                mem,
                util,
                temp,
                power,
                f"{card.health_state} {card.health_score}",
            ]
        )
    output.table(
        ["CARD", "NAME", "MODE", "ISOL", "HELD BY", "FREE", "MEMORY", "UTIL", "TEMP", "POWER", "HEALTH"], rows
    )
    if any(card.mode_pinned for card in reply.cards):
        print("* mode pinned by an operator (`xpu mode CARD auto` lets the scheduler switch it again)")


@app.command()
@handled
def leases(
    all_: Annotated[
        bool, typer.Option("--all", "-a", help="Include ended leases (most recent first).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Active leases and the requests waiting in the queue."""
    with client() as c:
        reply = c.leases(all=all_)
    if as_json:
        return output.print_json(reply)
    now = time.time()
    rows = [
        [
            le.id,
            le.mode,
            ",".join(map(str, le.cards)),
            le.owner_uid,
            le.holder_pid or "-",
            output.age(le.created, now),
            le.state if all_ else ("yes" if le.held else "NO"),
            ("R " if le.restartable else "") + (f"[{le.mark}] " if le.mark else "") + le.command[:60],
        ]
        for le in reply.leases
    ]
    output.table(
        ["LEASE", "MODE", "CARDS", "UID", "PID", "AGE", "STATE" if all_ else "HELD", "COMMAND"], rows
    )
    if reply.queue:
        print(f"\nqueue ({len(reply.queue)} waiting):")
        output.table(
            ["POS", "TICKET", "MODE", "GPUS", "PRIO", "UID", "WAITED", "GIVES UP IN", "COMMAND"],
            [
                [
                    q.position,
                    q.ticket,
                    q.mode,
                    q.gpus,
                    q.priority,
                    q.owner_uid,
                    output.age(q.enqueued, now),
                    f"{max(0, q.deadline - now):.0f}s",
                    q.command[:50],
                ]
                for q in reply.queue
            ],
        )


@app.command()
@handled
def release(lease_id: Annotated[str, typer.Argument(help="Lease id (or a unique prefix).")]) -> None:
    """Release a lease you own (operators: any lease)."""
    with client() as c:
        lease = c.release(lease_id)
    print(f"released lease {lease.id} (cards {','.join(map(str, lease.cards))})")


@app.command()
@handled
def topo(as_json: JsonOpt = False) -> None:
    """The card-to-card topology matrix, as `nvidia-smi topo -m` shows it."""
    from xpud.hw.topology import LEVEL_MEANING

    with client() as c:
        t = c.topology()
    n = t.size
    if as_json:
        return output.print_json(
            {
                "size": n,
                "labels": [list(t.labels[i * n : (i + 1) * n]) for i in range(n)],
                "levels": [list(t.levels[i * n : (i + 1) * n]) for i in range(n)],
                "nvlinks": [list(t.nvlinks[i * n : (i + 1) * n]) for i in range(n)],
                "bandwidth_gbps": [list(t.bandwidth_gbps[i * n : (i + 1) * n]) for i in range(n)],
                "cards": [
                    {
                        "index": card.index,
                        "uuid": card.uuid,
                        "numa_node": card.numa_node if card.HasField("numa_node") else None,
                        "cpu_affinity": list(card.cpu_affinity),
                    }
                    for card in t.cards
                ],
            }
        )
    headers = ["", *[f"GPU{i}" for i in range(n)], "CPU Affinity", "NUMA Affinity"]
    rows = []
    for i, card in enumerate(t.cards):
        numa = str(card.numa_node) if card.HasField("numa_node") else "N/A"
        rows.append(
            [f"GPU{i}", *t.labels[i * n : (i + 1) * n], output.cpu_ranges(list(card.cpu_affinity)), numa]
        )
    output.table(headers, rows)
    print("\nLegend:\n")
    for key, meaning in LEVEL_MEANING.items():
        print(f"  {key:<4} = {meaning}")


@app.command()
@handled
def info(as_json: JsonOpt = False) -> None:
    """The daemon: version, backend, sockets, and who you are to it."""
    with client() as c:
        i = c.info()
    if as_json:
        return output.print_json(i)
    shown = output.to_dict(i)
    shown["started"] = (
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(i.started))} ({output.age(i.started)} ago)"
    )
    shown["config_path"] = i.config_path or "(none: defaults)"
    shown["slice_sizes"] = ", ".join(  # what --mode accepts besides xpu
        f"{s.name} ({s.memory_fraction:.4g} memory, {s.compute_pct}% compute)" for s in i.slice_sizes
    )
    for k, v in shown.items():
        print(f"{k:16} {v}")


@app.command()
@handled
def health(
    card: Annotated[str | None, typer.Argument(help="Card index or UUID (default: every card).")] = None,
    history: Annotated[int, typer.Option(help="State changes to show per card.", min=1)] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Health score, state, every signal with its threshold, and the history of state changes."""
    with client() as c:
        reply = c.health(card or "", history=history)
        cards = {x.index: x for x in c.cards().cards}
    if as_json:
        return output.print_json([output.to_dict(h) for h in reply.cards])
    now = time.time()
    for n, h in enumerate(reply.cards):
        if n:
            print()
        print(f"card {h.index} ({h.uuid}): {h.state}, score {h.score}")
        for reason in h.reasons:
            print(f"  because: {reason}")
        info = cards.get(h.index)
        if info is not None and info.drained:
            print(f"  drained: {info.drain_reason}")
        if h.state != "healthy":
            if h.clear_since:
                print(
                    f"  signals say {h.raw_state}, clear for {now - h.clear_since:.0f} s of "
                    f"{h.clear_needed_s:g} s needed to recover"
                )
            else:
                print(
                    f"  signals say {h.raw_state}: {h.clear_needed_s:g} s of clear signals needed to recover"
                )
        output.table(
            ["  SIGNAL", "VALUE", "THRESHOLD", "STATUS", "REASON"],
            [
                [
                    f"  {s.name}",
                    _signal_value(s, "value"),
                    _signal_value(s, "threshold"),
                    s.status,
                    s.reason,
                ]
                for s in h.signals
            ],
        )
        if h.history:
            print("  history:")
        for ch in h.history:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ch.timestamp))
            print(f"  {when}  {ch.from_state} -> {ch.to_state} (score {ch.score}): {'; '.join(ch.reasons)}")


def _signal_value(sig, name: str) -> str:
    """A signal's value or threshold in human units (the daemon sends raw numbers and a unit)."""
    if not sig.HasField(name):
        return "-"
    v = getattr(sig, name)
    unit = sig.unit
    if unit == "bytes":
        return f"{output.gib(v)} GiB"
    if unit == "mask":
        return f"0x{int(v):x}"
    if unit == "ratio":
        return f"{v * 100:.0f}%"
    if unit == "P":
        return f"P{int(v)}"
    if sig.name in ("lost", "inforom") and name == "value":
        return {"lost": ("no", "yes"), "inforom": ("invalid", "valid")}[sig.name][int(v)]
    text = f"{v:g}"
    return f"{text} {unit}" if unit and unit != "%" else text + unit


# ---------------------------------------------------------------------------------------------- operators
@app.command()
@handled
def drain(
    card: Annotated[str, typer.Argument(help="Card index or UUID.")],
    reason: Annotated[str, typer.Option(help="Why (shown in listings).")] = "",
) -> None:
    """Stop placing new leases on a card (operators). Running leases continue."""
    with client(admin=True) as c:
        card_msg = c.drain(card, reason)
    print(f"card {card_msg.index} drained")


@app.command()
@handled
def undrain(card: Annotated[str, typer.Argument(help="Card index or UUID.")]) -> None:
    """Put a drained card back in service (operators)."""
    with client(admin=True) as c:
        card_msg = c.undrain(card)
    if card_msg.drained:  # the health monitor's drain stays until the card recovers
        print(f"card {card_msg.index}: operator drain lifted; still out: {card_msg.drain_reason}")
    else:
        print(f"card {card_msg.index} back in service")


@app.command("mode")
@handled
def mode_cmd(
    card: Annotated[str, typer.Argument(help="Card index or UUID.")],
    mode: Annotated[str, typer.Argument(help="whole, sliced, or auto (the scheduler decides).")],
) -> None:
    """Switch a card between whole and sliced mode (operators); refused while a lease holds it."""
    if mode not in ("whole", "sliced", "auto"):
        fail(f"mode {mode!r}: use whole, sliced or auto", 2)
    with client(admin=True) as c:
        card_msg = c.set_mode(card, mode)
    print(f"card {card_msg.index} is {card_msg.mode}" + (" (pinned)" if card_msg.mode_pinned else " (auto)"))


@app.command()
@handled
def evict(
    lease_id: Annotated[str, typer.Argument(help="Lease id (or a unique prefix).")],
    reason: Annotated[str, typer.Option(help="Told to the holder.")] = "",
) -> None:
    """End someone's lease now (operators); its holder is told and stops its command."""
    with client(admin=True) as c:
        lease = c.evict(lease_id, reason)
    print(f"evicted lease {lease.id}")


@fault_app.command("inject")
@handled
def fault_inject(
    card: Annotated[str, typer.Argument(help="Card index or UUID.")],
    kind: Annotated[
        str, typer.Argument(help="xid, ecc-dbe, ecc-sbe, overheat, nvlink-down, lost or inforom.")
    ],
    xid: Annotated[int | None, typer.Argument(help="The XID number (kind xid).")] = None,
) -> None:
    """Inject a fault into a simulated card; the daemon's health monitor sees it as real hardware."""
    with client(admin=True) as c:
        print(c.inject_fault(card, kind, xid or 0))


@fault_app.command("clear")
@handled
def fault_clear(card: Annotated[str, typer.Argument(help="Card index or UUID.")]) -> None:
    """Clear injected faults on a simulated card."""
    with client(admin=True) as c:
        print(c.clear_fault(card))


def _register_commands() -> None:
    """Commands that live in their own modules (defrag, simulator, dashboard, certs) register themselves."""
    from xpu_cli import certs, defrag, simulate, slurm, top

    for module in (certs, defrag, simulate, slurm, top):
        module.register(app)


_register_commands()


def main() -> None:
    try:
        app(prog_name="xpu")
    except BrokenPipeError:
        sys.exit(1)
