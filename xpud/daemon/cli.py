"""The ``xpud`` command: its options and subcommands (the daemon itself is ``xpud.daemon.app``).

``xpud --simulate dgx-h100 --runtime-dir /tmp/x --state-dir /tmp/x`` runs one on simulated hardware;
under systemd it runs with the defaults (/run/xpud, /var/lib/xpud) and tells systemd READY=1 once
serving. ``xpud check-hardware`` reads the real driver and changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from xpud import __version__, config
from xpud.daemon import serve
from xpud.daemon.serve import setup_logging
from xpud.errors import XpudError

log = logging.getLogger("xpud")


_METAVARS = {
    "config_path": "PATH",
    "runtime_dir": "DIR",
    "state_dir": "DIR",
    "root": "DIR",
    "prefix": "DIR",
    "seed": "N",
    "log_level": "LEVEL",
    "listen": "HOST:PORT",
    "cluster": "RUNTIME_DIR",
    "node": "NAME=RUNTIME_DIR",
}


class _Group(TyperGroup):
    """Help as `xpu --help` shows it: plain text ("[kubelet] enabled" stays), -h too, and each option's
    value named as a word (``DIR``) rather than Typer's ``<str>``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for command in (self, *self.commands.values()):
            for param in command.params:
                if not getattr(param, "is_flag", False) and param.name and not param.metavar:
                    param.metavar = _METAVARS.get(param.name, param.name.upper())


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="xpud: the dual-mode GPU scheduler daemon.",
)


_fail = serve.fail  # one line on stderr, then exit with the code


@app.callback(invoke_without_command=True)
def main_command(
    ctx: typer.Context,
    config_path: Annotated[
        str | None,
        typer.Option("--config", "-c", help="Config file (default $XPUD_CONFIG or /etc/xpud/xpud.toml)."),
    ] = None,
    simulate: Annotated[
        str | None,
        typer.Option(
            help="Run on a simulated machine (a name in etc/machines/ or a description file).",
            metavar="MACHINE",
        ),
    ] = None,
    runtime_dir: Annotated[str | None, typer.Option(help="Directory for the sockets.")] = None,
    state_dir: Annotated[str | None, typer.Option(help="Directory for the ledger.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the simulated machine.")] = None,
    sim_state: Annotated[
        str | None,
        typer.Option(
            help="File keeping the simulated machine's MIG and MPS state across restarts "
            "(default: simulated-hardware.json in the state directory).",
            metavar="PATH",
        ),
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error.")] = None,
    kubelet: Annotated[
        bool, typer.Option("--kubelet", help="Serve kubelet's device-plugin API ([kubelet] enabled).")
    ] = False,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    """Run the daemon (or a subcommand)."""
    if version:
        typer.echo(__version__)
        raise typer.Exit()

    cfg, overrides = serve.load(
        config_path, simulate, runtime_dir, state_dir, seed, sim_state, log_level, kubelet
    )
    ctx.obj = cfg
    if ctx.invoked_subcommand:
        return
    serve.run(cfg, overrides)


@app.command("check-hardware")
def check_hardware_command(
    ctx: typer.Context,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON record (loadable as a machine description).")
    ] = False,
) -> None:
    """Read the real driver through the adapter (read-only) and report what it sees."""
    from xpud.hw.check import check_hardware

    cfg = ctx.obj or config.Config()
    lib = None
    if cfg.devices.backend == "simulated":
        from xpud.hw.fakenvml import FakeNvml
        from xpud.hw.machines import load_machine

        lib = FakeNvml(load_machine(cfg.devices.machine), seed=cfg.devices.seed)
    code = check_hardware(
        lib, as_json=as_json, slices=cfg.slices, profile_map=cfg.cards.mig_profiles_file or None
    )
    raise typer.Exit(code)


@app.command("extender")
def extender_command(
    listen: Annotated[str, typer.Option(help="HOST:PORT to serve kube-scheduler's extender API on.")],
    cluster: Annotated[
        str,
        typer.Option(
            help="RUNTIME_DIR of a daemon with [cluster]: offers come from its federated view, one per "
            "host, by the host's name in the cluster (= the Kubernetes node name).",
        ),
    ] = "",
    node: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=RUNTIME_DIR: a Kubernetes node and the xpud sockets that speak for it (repeat; "
            "for hosts without [cluster]).",
        ),
    ] = None,
    domain: Annotated[str, typer.Option(help="The resources' domain (<domain>/gpu, ...).")] = "xpu.dev",
) -> None:
    """Serve kube-scheduler's extender verbs (filter, prioritize) from xpud's offers."""
    from xpud.bridges.extender import ClusterOffers, Extender, SocketOffers

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        _fail(f"--listen {listen!r}: use HOST:PORT, e.g. 0.0.0.0:8888 (port 0: any free one)", 2)
    if bool(cluster) == bool(node):
        _fail("give --cluster RUNTIME_DIR (a federated daemon) or --node NAME=RUNTIME_DIR, one of them", 2)
    nodes = {}
    for item in node or []:
        name, _, runtime = item.partition("=")
        if not name or not runtime:
            _fail(f"--node {item!r}: use NAME=RUNTIME_DIR, e.g. gpu-1=/run/xpud", 2)
        nodes[name] = runtime
    setup_logging("info")
    source = ClusterOffers(cluster) if cluster else SocketOffers(nodes)
    try:
        ext = Extender(source, host.strip("[]"), int(port), domain)
    except OSError as e:
        _fail(f"--listen {listen}: {e.strerror}")
    what = f"the cluster seen by {cluster}" if cluster else f"{len(nodes)} node(s)"
    log.info("extender serving on %s:%d for %s", *ext.address, what)
    with contextlib.suppress(KeyboardInterrupt):
        ext.serve_forever()


@app.command("mps-keeper")
def mps_keeper_command(
    dir: Annotated[
        str, typer.Option("--dir", help="The MPS directory shared with xpud: <runtime_dir>/mps.")
    ] = "/run/xpud/mps",
    interval: Annotated[
        float, typer.Option(help="Seconds between scans of the card directories (0.05 to 10).")
    ] = 0.2,
) -> None:
    """Own the MPS control daemons for xpud ([cards] mps_keeper = true): they outlive its container."""
    import threading

    from xpud.isolation.mps_keeper import Keeper
    from xpud.isolation.runner import CommandRunner

    if not 0.05 <= interval <= 10.0:  # NaN fails this too
        _fail(f"--interval {interval}: give 0.05 to 10 seconds", 2)
    where = Path(dir)
    if not where.is_absolute():
        _fail(f"--dir {dir!r}: give an absolute path, xpud's <runtime_dir>/mps (e.g. /run/xpud/mps)", 2)
    where.mkdir(parents=True, exist_ok=True)
    setup_logging("info")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # the control daemons stay: they are not our children
        signal.signal(sig, lambda *_: stop.set())
    log.info("MPS keeper watching %s", where)
    Keeper(where, CommandRunner()).run(stop, interval)


@app.command("install-service")
def install_service_command(
    root: Annotated[
        str, typer.Option(help="Write everything under this directory (an image, a test).")
    ] = "/",
    prefix: Annotated[
        str | None,
        typer.Option(
            help="Installation prefix on the target: the unit runs PREFIX/bin/xpud (default: this xpud)."
        ),
    ] = None,
    no_start: Annotated[
        bool, typer.Option("--no-start", help="Write the files; enable and start nothing.")
    ] = False,
) -> None:
    """Install the systemd unit, the admin group's sysusers entry and a default config; enable and start."""
    from xpud.daemon.install import install

    try:
        report = install(Path(root), prefix, start=not no_start)
    except XpudError as e:
        _fail(str(e))
    typer.echo("\n".join(report.lines))
    typer.echo("changed" if report.changed else "nothing to change")


@app.command("uninstall-service")
def uninstall_service_command(
    root: Annotated[str, typer.Option(help="The directory install-service wrote under.")] = "/",
) -> None:
    """Stop and disable the unit and remove what install-service wrote (edited files stay)."""
    from xpud.daemon.install import uninstall

    try:
        report = uninstall(Path(root))
    except XpudError as e:
        _fail(str(e))
    typer.echo("\n".join(report.lines))


@app.command("doctor")
def doctor_command(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
    root: Annotated[str, typer.Option(help="Where the unit and the group database are (an image).")] = "/",
    simulate: Annotated[
        str | None, typer.Option(help="Check a simulated machine instead of the driver.", metavar="MACHINE")
    ] = None,
) -> None:
    """Check the host before it goes live: driver, MIG, persistence, MPS, admin group, sockets, unit."""
    import json

    from xpud.daemon import doctor

    cfg = ctx.obj or config.Config()
    if simulate:
        cfg = cfg.replace("devices", backend="simulated", machine=simulate)
    try:
        checks = doctor.run_checks(cfg, doctor.host_for(cfg, Path(root)))
    except XpudError as e:
        _fail(str(e))
    typer.echo(json.dumps(doctor.as_json(checks), indent=2) if as_json else doctor.render(checks))
    raise typer.Exit(doctor.exit_code(checks))


def main() -> None:
    app(prog_name="xpud")
