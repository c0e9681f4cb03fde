"""`xpu`: the command line of xpud. Thin: parse, call the daemon, print. Every listing has --json."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer
from xpu_cli import grammar, output, vocab
from xpu_cli.output import fail, handled
from xpu_cli.session import client, state

app = typer.Typer(
    add_completion=True,  # xpu --install-completion (bash, zsh, fish, PowerShell): README
    cls=grammar.XpuGroup,
    context_settings={"help_option_names": grammar.HELP_OPTIONS},
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


def _run_value_options() -> frozenset[str]:
    from xpu_cli.runopts import RUN_OPTIONS

    return frozenset(name for name, (_, kind) in RUN_OPTIONS.items() if not isinstance(kind, bool))


grammar.XpuGroup.passthrough = {"run": _run_value_options()}


@app.callback()
def main_callback(
    runtime_dir: Annotated[
        str | None,
        typer.Option(
            envvar="XPUD_RUNTIME_DIR",
            help="Where the daemon's sockets are (default /run/xpud). Accepted after the command too.",
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=grammar.version_option, is_eager=True, help="Print xpu's version and exit."
        ),
    ] = False,
) -> None:
    state.runtime_dir = runtime_dir


# ---------------------------------------------------------------------------------------------- run
def _duration(text: str) -> float:
    from xpu_cli.runopts import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


RUN_MODES = ("xpu", "vxpu-half", "vxpu-quarter")  # the built-in ones; a config may add slice sizes
CARD_MODES = ("whole", "sliced", "auto")


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
            metavar="MODE",
            autocompletion=lambda: list(RUN_MODES),
            help="xpu (whole cards), vxpu-half or vxpu-quarter (slices), or another slice size from the "
            "daemon's config (`xpu info` lists them); auto: the daemon picks it from the job class's "
            "measured history and, with --restartable, moves the job up or down as it measures it; any case.",
        ),
    ] = "xpu",
    job_class: Annotated[
        str,
        typer.Option(
            "--class",
            metavar="NAME",
            help="Job class for right-sizing (--mode auto learns per class); default: the command's first "
            "words.",
        ),
    ] = "",
    gpus: Annotated[int, typer.Option("--gpus", "-g", help="Whole cards to lease (mode xpu).", min=1)] = 1,
    wait: Annotated[
        float | None,
        typer.Option(
            "--wait",
            help="Queue up to this long when it does not fit now: seconds (30), 90s, 5m, 2h, 1d, 1h30m, "
            "or inf (as long as the daemon allows); 0: fail at once. Default: the daemon's "
            "[leases] default_wait_s.",
            parser=_duration,
            metavar="DURATION",
        ),
    ] = None,
    priority: Annotated[int, typer.Option("--priority", "-p", help="Higher goes first in the queue.")] = 0,
    restartable: Annotated[
        bool,
        typer.Option(
            help="The daemon may move the job: it stops the command and "
            "starts it again elsewhere (XPU_RESTART_COUNT counts)."
        ),
    ] = False,
    kill_grace: Annotated[
        float, typer.Option(help="Seconds between a forwarded signal and SIGKILL (0..86400).", min=0)
    ] = 10.0,
    name: Annotated[
        str,
        typer.Option(
            "--name", "-J", help="A name for the job, shown in `xpu leases` and `xpu show` (as sbatch -J)."
        ),
    ] = "",
    account: Annotated[
        str,
        typer.Option(
            "--account",
            "-A",
            help="The account (team) to charge, one you are a member of (xpud.toml [accounts]); "
            "default: your first account, else default (as sbatch -A).",
        ),
    ] = "",
    when_green: Annotated[
        bool,
        typer.Option(
            "--when-green",
            help="Deferrable work: start in the greenest hour before --deadline (the daemon's [carbon] "
            "signal), then lease as usual.",
        ),
    ] = False,
    deadline: Annotated[
        str | None,
        typer.Option(help="With --when-green: start by then (+90m, +6h, +2d, HH:MM or an ISO time)."),
    ] = None,
    json_env: Annotated[
        bool,
        typer.Option(
            "--json-env",
            help="Run nothing: print the lease's environment as one JSON line, hold the lease until "
            "stdin closes or a signal comes, then release (for other launchers).",
        ),
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No queue or placement lines on stderr.")
    ] = False,
    nodes: Annotated[
        int | None,
        typer.Option(
            "--nodes",
            "-N",
            help="Run across this many hosts of the cluster, one rank each (torchrun/srun style).",
            min=1,
        ),
    ] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option("--gpus-per-node", help="Whole cards per host (with --nodes).", min=1)
    ] = None,
    tasks_per_node: Annotated[
        int | None,
        typer.Option(
            "--tasks-per-node",
            help="Processes per host (with --nodes; srun's --ntasks-per-node), each with torch's env:// "
            "RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT.",
            min=1,
        ),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option("--replicas", help="Slices of --mode on several hosts (with --spread).", min=1),
    ] = None,
    spread: Annotated[bool, typer.Option("--spread", help="--replicas on distinct hosts.")] = False,
    label: Annotated[
        bool, typer.Option("--label", "-l", help="Prefix each output line with its rank ('N: ').")
    ] = False,
    kill_on_bad_exit: Annotated[
        bool,
        typer.Option(
            "--kill-on-bad-exit/--no-kill-on-bad-exit", help="One failing rank stops all (multi-host)."
        ),
    ] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="Multi-host: a JSON summary as the last line of stdout.")
    ] = False,
) -> None:
    """Lease, run COMMAND with the lease's environment, end as it ended (exit code or signal), release.
    With --nodes (or --replicas --spread): the same across hosts, one rank per host."""
    from xpu_cli.child import die_like
    from xpu_cli.launch import run_with
    from xpu_cli.runopts import RUN_DEFAULTS

    opts = dict(
        mode=mode,
        gpus=gpus,
        wait=wait,
        priority=priority,
        restartable=restartable,
        kill_grace=kill_grace,
        json_env=json_env,
        job_class=job_class,
        name=name,
        account=account,
        quiet=quiet,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        tasks_per_node=tasks_per_node,
        replicas=replicas,
        spread=spread,
        label=label,
        kill_on_bad_exit=kill_on_bad_exit,
        as_json=as_json,
        when_green=when_green,
        deadline=deadline,
    )
    opts = {k: opts[k] for k in RUN_DEFAULTS}  # the fast path's order
    with client() as c:
        outcome = run_with(c, opts, list(command or []))
    raise typer.Exit(die_like(outcome))


@app.command()
@handled
def resize(
    lease: Annotated[str, typer.Argument(help="The lease id (or a unique prefix).")],
    mode: Annotated[
        str, typer.Option("--mode", "-m", metavar="MODE", help="The new size: xpu or a slice size.")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Change a running lease's size (its owner or an operator). A --restartable job is stopped and
    restarted on the new size, as a move; no backend changes a running job's limits in place."""
    with client() as c:
        reply = c.resize(lease, mode.lower())
    if as_json:
        return output.print_json(reply)
    print(f"lease {reply.lease.id}: {reply.how}")


# ---------------------------------------------------------------------------------------------- listings
@app.command("ls")
@handled
def ls(
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Redraw at every change until Ctrl-C (as kubectl -w).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Cards: mode, slices, free capacity, memory, utilisation, temperature, health."""
    with client() as c:
        if watch:
            from xpu_cli.watching import follow

            return follow(c, lambda update: _print_cards(update.cards, as_json))
        reply = c.cards()
    _print_cards(reply, as_json)


def _print_cards(reply, as_json: bool) -> None:
    if as_json:
        return output.print_json([output.to_dict(card) for card in reply.cards])
    rows = []
    for card in reply.cards:
        s = card.sample
        has = card.HasField("sample")
        used = s.memory_used_bytes if has and s.HasField("memory_used_bytes") else None
        util = f"{s.utilization_gpu_pct}%" if has and s.HasField("utilization_gpu_pct") else "-"
        temp = f"{s.temperature_c}C" if has and s.HasField("temperature_c") else "-"
        power = f"{s.power_w:.0f}W" if has and s.HasField("power_w") else "-"
        if has and s.lost:
            util = temp = power = "lost"
        rows.append(
            [
                card.index,
                vocab.card_name(card),
                vocab.mode(card),
                vocab.held_by(card),
                output.Styled(vocab.free(card), "yellow") if card.drained else vocab.free(card),
                vocab.memory(used, card.memory_total_bytes),
                util,
                temp,
                power,
                output.Styled(
                    f"{card.health_state} {card.health_score}",
                    output.HEALTH_STYLES.get(card.health_state, ""),
                ),
            ]
        )
    output.table(
        ["CARD", "NAME", "MODE", "HELD BY", "FREE", "MEMORY", "UTIL", "TEMP", "POWER", "HEALTH"],
        rows,
        optional=("POWER", "TEMP", "NAME"),
    )
    for card in reply.cards:
        if card.drained:
            output.note(f"card {card.index} drained: {card.drain_reason or '(no reason given)'}")
    if any(card.mode_pinned for card in reply.cards):
        output.note("* mode pinned by an operator (`xpu mode CARD auto` lets the scheduler switch it again)")


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
    from xpud.topology import LEVEL_MEANING

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
    shown["started"] = f"{vocab.timestamp(i.started)} ({vocab.age(time.time() - i.started)} ago)"
    shown["config_path"] = i.config_path or "(none: defaults)"
    shown["slice_sizes"] = ", ".join(  # what --mode accepts besides xpu
        f"{s.name} ({s.memory_fraction * 100:.4g}% memory, {s.compute_pct}% compute)" for s in i.slice_sizes
    )
    for k, v in shown.items():
        output.note(f"{k:16} {v}", indent=" " * 17)


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
            from xpu_cli.health import recovery

            (h,) = c.health(str(card_msg.index)).cards
            print(f"card {card_msg.index}: operator drain lifted; still out of service: {recovery(h)}")
            return
    print(f"card {card_msg.index} back in service")


@app.command("mode")
@handled
def mode_cmd(
    card: Annotated[str, typer.Argument(help="Card index or UUID.")],
    mode: Annotated[
        str,
        typer.Argument(
            metavar="whole|sliced|auto",
            autocompletion=lambda: list(CARD_MODES),
            help="whole, sliced, or auto (the scheduler decides); any case.",
        ),
    ],
) -> None:
    """Switch a card between whole and sliced mode (operators); refused while a lease holds it."""
    mode = mode.lower()
    if mode not in CARD_MODES:
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
    """Clear injected faults on a simulated card (and say when it will be back in service)."""
    from xpu_cli.health import recovery

    with client(admin=True) as c:
        print(c.clear_fault(card))
        for h in c.health(card).cards:
            if h.state != "healthy":
                print(f"card {h.index} stays out for now: {recovery(h)}")


def _register_commands() -> None:
    """Commands that live in their own modules (defrag, simulator, dashboard, certs, cluster, config,
    leases, events, health, slurm, confine, jobs, accounts) register themselves."""
    from xpu_cli import (
        accounts,
        certs,
        cluster,
        configure,
        confine,
        defrag,
        events,
        health,
        jobs,
        leases,
        simulate,
        slurm,
        top,
    )

    verbs = (accounts, certs, cluster, configure, confine, defrag, events, health, jobs, leases, simulate)
    for module in (*verbs, slurm, top):
        module.register(app)


_register_commands()


def main() -> None:
    try:
        app(prog_name="xpu")
    except BrokenPipeError:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------- windows
@app.command()
@handled
def windows(
    as_json: JsonOpt = False,
    config_path: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            help="The config (default: the one the running xpud reads, as `xpu info` shows; with no xpud "
            "answering, $XPUD_CONFIG or /etc/xpud/xpud.toml).",
        ),
    ] = None,
) -> None:
    """Capacity windows ([[windows]] in xpud.toml): the one in force, each one's last and next start and the
    share of usable cards it keeps whole."""
    from datetime import datetime

    from xpu_cli.configure import load_running

    from xpud.planning import windows as win

    cfg = load_running(config_path, state.runtime_dir)
    now = datetime.now().astimezone()
    states = win.states(cfg.windows, now)
    cur = next((s for s in states if s.current), None)
    if as_json:
        return output.print_json(
            {
                "now": now.timestamp(),
                "current": cur.spec.name if cur else None,
                "whole_share_pct": 100 * cur.spec.whole_share if cur else 0.0,
                "windows": [
                    {
                        "name": s.spec.name,
                        "cron": s.spec.cron,
                        "timezone": s.spec.timezone or None,
                        "whole_share_pct": 100 * s.spec.whole_share,
                        "current": s.current,
                        "last_start": s.started.timestamp() if s.started else None,
                        "next_start": s.next.timestamp() if s.next else None,
                    }
                    for s in states
                ],
            }
        )
    if not states:
        print("no capacity windows ([[windows]] in xpud.toml): every idle card may be sliced")
        return

    def when(t) -> str:
        return t.strftime("%a %Y-%m-%d %H:%M %Z") if t else "-"

    rows = [
        [
            "*" if s.current else "",
            s.spec.name,
            s.spec.cron,
            f"{s.spec.whole_share:.0%}",
            when(s.started),
            when(s.next),
        ]
        for s in states
    ]
    output.table(["", "WINDOW", "CRON", "KEEPS WHOLE", "LAST START", "NEXT START"], rows)
    print(f"* in force: keeps {cur.spec.whole_share:.0%} of usable cards whole" if cur else "none in force")


# ---------------------------------------------------------------------------------------------- forecast
@app.command()
@handled
def forecast(
    as_json: JsonOpt = False,
    hours: Annotated[int, typer.Option(help="Hours of past and future to show.", min=1, max=24)] = 12,
) -> None:
    """Slice demand: the forecast for the next hours, the past hours' actual demand beside what was
    forecast for them, and the error (APE per hour; MAPE over the last week)."""
    import json
    from datetime import datetime

    from xpud.api.client import runtime_dir
    from xpud.planning.runfiles import FORECAST_FILE

    path = runtime_dir(state.runtime_dir) / FORECAST_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        fail(
            f"{path}: no forecast published yet; is xpud running (it forecasts every [forecast] interval_s)?"
        )
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read the forecast: {e}")
    if as_json:
        return output.print_json(data)

    def num(v) -> str:
        return "-" if v is None else f"{v:.2f}"

    def pct(v) -> str:
        return "-" if v is None else f"{v:.0f}%"

    def hour(t: float) -> str:
        return datetime.fromtimestamp(t).astimezone().strftime("%a %Y-%m-%d %H:%M")

    print(
        f"forecast of {hour(data['generated'])}; pre-provisioning {'on' if data['enabled'] else 'off'}; "
        f"sliced cards wanted {data['lead_s'] / 60:.0f} min ahead: {data['sliced_cards_wanted']}"
        + (
            f" (provisioned: {', '.join(map(str, data['provisioned_cards']))})"
            if data["provisioned_cards"]
            else ""
        )
    )
    ready = data.get("slices") or {}
    made = [f"{n} {size}" for size, n in (ready.get("standby") or {}).items() if n]
    planned = [f"{n} {size}" for size, n in (ready.get("planned_mps") or {}).items() if n]
    if made or planned:
        print(
            f"slices ready: pre-created (MIG) {', '.join(made) or 'none'}; "
            f"planned (MPS) {', '.join(planned) or 'none'}"
        )
    for size, s in data["sizes"].items():
        m = s["mape_last_week_pct"]
        print(f"\n{size}: MAPE over the last week {'-' if m is None else f'{m:.1f}%'}")
        rows = [
            [hour(p["hour"]), num(p["actual"]), num(p["forecast"]), pct(p["ape_pct"])]
            for p in s["past"][-hours:]
        ]
        rows += [[hour(n["hour"]), "", num(n["forecast"]), ""] for n in s["next"][:hours]]
        output.table(["HOUR", "ACTUAL", "FORECAST", "APE"], rows)
