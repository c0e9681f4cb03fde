"""The daemon: wires hardware, ledger, engine, credential socket and the two gRPC servers.

``xpud --simulate dgx-h100 --runtime-dir /tmp/x --state-dir /tmp/x`` runs one on simulated hardware;
under systemd it runs with the defaults (/run/xpud, /var/lib/xpud) and tells systemd READY=1 once
serving. ``xpud check-hardware`` reads the real driver and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import grp
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from grpc import aio
from typer.core import TyperGroup

from xpud import __version__
from xpud.api.auth import CredentialIssuer
from xpud.bridges.anchors import AnchorReaper
from xpud.bridges.kubelet import Delivery, KubeletBridge, PodCheck
from xpud.bridges.slurm import JobCheck
from xpud.config import schema as config
from xpud.controllers.defragmenter import Defragmenter
from xpud.controllers.health import HealthMonitor
from xpud.daemon.periodic import OPTS, Jobs
from xpud.engine.engine import Engine
from xpud.errors import XpudError
from xpud.federation.hostjobs import HostJobs
from xpud.hw.devnodes import DevTree
from xpud.isolation.scope import device_scopes
from xpud.ledger.ledger import Ledger, LedgerDamaged
from xpud.planning.green import Signal
from xpud.service.node import AdminService, Context, NodeService, add_to_server

log = logging.getLogger("xpud")

USER_SOCKET, ADMIN_SOCKET, CRED_SOCKET = "xpud.sock", "admin.sock", "cred.sock"
POD_CHECK_INTERVAL_S = 5.0  # how often kubelet's PodResources API is asked for pods that are gone
LEDGER_DAMAGED_EXIT = 3  # systemd/xpud.service: RestartPreventExitStatus=3

# gRPC core cancels incoming calls that wait for the Python server to pick them up once more than
# max_pending_requests (default 1,000; all of them past 3,000) are waiting, or once one has waited
# server_max_unrequested_time_in_server (default 30 s): a burst of thousands of queued Acquire streams then
# saw CANCELLED. Waiting requests cost little; the daemon takes them at its pace (callers have deadlines).
SERVER_OPTIONS = [
    ("grpc.server.max_pending_requests", 50_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
    ("grpc.server_max_unrequested_time_in_server", 600),
]


class StartupError(XpudError):
    """A reason the daemon cannot start, as one line for the operator."""


def sd_notify(state: str) -> None:
    """Tell systemd our state (Type=notify). A no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(state.encode())


def open_hardware(cfg: config.Config):
    """(adapter, fake or None) for the configured backend. Raises StartupError when NVML is missing."""
    from xpud.hw.nvml import Nvml, NvmlError

    fake = None
    if cfg.devices.backend == "simulated":
        from xpud.hw.fakenvml import FakeNvml
        from xpud.hw.machines import MachineError, load_machine
        from xpud.hw.simstate import FILE_NAME, SimState

        try:
            fake = FakeNvml(load_machine(cfg.devices.machine), seed=cfg.devices.seed)
            SimState(cfg.devices.sim_state or cfg.state_dir / FILE_NAME).attach(fake)  # MIG/MPS outlive us
        except (XpudError, MachineError) as e:  # these name the machine or its file already
            raise StartupError(str(e)) from None
        except (OSError, ValueError, KeyError) as e:
            raise StartupError(f"simulated machine {cfg.devices.machine!r}: {e}") from None
    hw = Nvml(fake)
    try:
        hw.open()
    except NvmlError as e:
        raise StartupError(f"{e}") from None
    return hw, fake


def _claim_socket(path: Path) -> None:
    """Remove a stale socket file; refuse if a live daemon answers on it."""
    if not path.exists():
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            path.unlink()  # stale: left by a daemon that died
            return
    raise StartupError(
        f"{path}: another xpud answers on this socket; stop it, or give this one its own --runtime-dir"
    )


PID_FILE = "xpud.pid"  # in the runtime directory: `xpu config set` signals this process to reload


class Daemon:
    def __init__(self, cfg: config.Config, hw, fake=None, overrides=None):
        self.cfg = cfg
        self.overrides = overrides or (lambda c: c)  # re-applies flags to a reloaded file
        self.hw = hw
        self.fake = fake
        self.runtime_dir = cfg.runtime_dir
        self.state_dir = cfg.state_dir
        self.ledger: Ledger | None = None
        self.engine: Engine | None = None
        self.servers: list[aio.Server] = []
        self.cred_server: asyncio.AbstractServer | None = None
        self.jobs: Jobs | None = None
        self.monitor: HealthMonitor | None = None
        self.defrag: Defragmenter | None = None
        self.hostjobs: HostJobs | None = None
        self.federation = None  # xpud.federation.node.Federation when [cluster] listen is set
        self.accounts = None  # xpud.controllers.accounts.Accounts when xpud.toml has [accounts.NAME]
        self.metrics = None  # xpud.daemon.metrics.MetricsServer when [metrics] listen is set
        self.kubelet: KubeletBridge | None = None  # the device plugin, when [kubelet] enabled
        self.started = time.time()
        self.serving = False  # start() finished: only then does stopping leave leases behind
        self.tools = self._tools()  # runs nvidia-cuda-mps-control and nvidia-smi (simulated with the fake)

    @property
    def user_socket(self) -> Path:
        return self.runtime_dir / USER_SOCKET

    @property
    def admin_socket(self) -> Path:
        return self.runtime_dir / ADMIN_SOCKET

    @property
    def cred_socket(self) -> Path:
        return self.runtime_dir / CRED_SOCKET

    def _tools(self):
        if self.fake is not None:
            from xpud.isolation.faketools import FakeNvidiaTools

            tools = FakeNvidiaTools(self.fake)
            state = getattr(self.fake, "sim_state", None)
            if state is not None:
                state.attach_tools(tools)  # the MPS control daemons that outlived the last daemon
            return tools
        from xpud.isolation.runner import CommandRunner

        return CommandRunner()

    def _isolation(self):
        from xpud.isolation import backend_for
        from xpud.isolation.mig_book import LedgerBook

        return backend_for(self.cfg, self.hw, self.tools, mig_book=LedgerBook(self.ledger))

    async def start(self) -> None:
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        for p in (self.user_socket, self.admin_socket, self.cred_socket):
            _claim_socket(p)
        self.ledger = Ledger(self.state_dir / "ledger.sqlite")
        self.engine = Engine(
            self.hw.cards(), self.hw.topology(), self.cfg, self.ledger, isolation=self._isolation()
        )
        if self.cfg.cluster.enabled:  # the certificate files are checked before anything serves
            from xpud.federation.certs import CertError
            from xpud.federation.node import Federation

            try:
                self.federation = Federation(self.cfg.cluster, self.engine, daemon=self)
            except CertError as e:
                raise StartupError(str(e)) from None
        await self.engine.restore()
        self.hostjobs = HostJobs(self)  # multi-host reservations: held ones outlive a restart
        await self.hostjobs.restore()
        self.monitor = HealthMonitor(self.engine, self.hw, self.cfg)
        self.monitor.restore()  # cards that were out before a restart stay out until they clear
        self.defrag = Defragmenter(self.engine, self.cfg)
        issuer = CredentialIssuer(self.cfg.leases.credential_ttl_s, self.cfg.daemon.admin_group)
        backend = f"simulated:{self.cfg.devices.machine}" if self.fake is not None else "nvml"
        ctx = Context(
            self.engine,
            issuer,
            fake=self.fake,
            health=self.monitor,
            defrag=self.defrag,
            federation=self.federation,
            info={
                "version": __version__,
                "hostname": socket.gethostname(),
                "backend": backend,
                "driver_version": self.hw.driver_version() or "",
                "started": self.started,
                "user_socket": str(self.user_socket),
                "admin_socket": str(self.admin_socket),
                "config_path": str(Path(self.cfg.path).absolute()) if self.cfg.path else "",
            },
        )
        ctx.extras["daemon"] = self  # Node.RunJob coordinates multi-host jobs through it
        ctx.extras["scopes"] = self.scopes = device_scopes(self.cfg, self.engine, self.fake is not None)
        ctx.info["device_isolation"] = self.scopes.enforcement.text
        ctx.extras["carbon"] = self.carbon = Signal()  # the jobs refresh it; Acquire plans green starts
        self.carbon.configured = bool(self.cfg.carbon.signal or self.cfg.carbon.command)
        self.context = ctx
        if self.cfg.metrics.listen:
            from xpud.daemon.metrics import MetricsServer

            self.metrics = MetricsServer(self, self.cfg.metrics.listen)
            try:
                self.metrics.start()
            except OSError as e:
                raise StartupError(str(e.strerror)) from None
        self.cred_server = await issuer.serve(str(self.cred_socket))
        user = aio.server(options=SERVER_OPTIONS)
        add_to_server(NodeService(ctx), user)
        user.add_insecure_port(f"unix:{self.user_socket}")
        admin = aio.server(options=SERVER_OPTIONS)
        add_to_server(NodeService(ctx), admin)
        add_to_server(AdminService(ctx), admin)
        admin.add_insecure_port(f"unix:{self.admin_socket}")
        for s in (user, admin):
            await s.start()
        self.servers = [user, admin]
        self._set_permissions()
        if self.federation is not None:
            try:
                await self.federation.start()
            except OSError as e:
                raise StartupError(str(e)) from None
        self.engine.serving()  # restored leases' holders can reconnect from now: their grace starts
        self.serving = True
        self.anchors = AnchorReaper(self.engine)
        slurm = self.cfg.slurm
        self.anchors.add("slurm", JobCheck(slurm.squeue, slurm.conf), slurm.check_interval_s)
        if self.cfg.kubelet.enabled:
            kube = self.cfg.kubelet
            proc = Path(kube.proc_root)
            tree = DevTree(Path(kube.dev_root), proc / "driver/nvidia/capabilities", proc / "devices")
            how = Delivery(kube.device_list_strategy, kube.cdi_vendor, kube.mps_shm_dir, tree)
            self.kubelet = KubeletBridge(self.engine, kube.socket_dir, kube.resources, how)
            await self.kubelet.start()
            interval = min(POD_CHECK_INTERVAL_S, kube.pod_gone_grace_s)
            self.anchors.add("pod", PodCheck(kube.pod_resources_socket, kube.pod_gone_grace_s), interval)
        self.jobs = Jobs(
            self.engine,
            self.hw,
            self.cfg.health.poll_interval_s,
            self.monitor,
            defrag=self.defrag,
            hostjobs=self.hostjobs,
            anchors=self.anchors,
            carbon_signal=self.carbon,
        )
        self.jobs.start()
        self.jobs.provisioner.scopes = self.scopes  # warm commands in their slice's device scope
        self._start_rightsizing()
        self._start_accounts()
        self.monitor.start()
        log.info(
            "xpud %s serving %d card(s) (%s) on %s (event loop: %s)",
            __version__,
            len(self.engine.cards),
            backend,
            self.user_socket,
            type(asyncio.get_running_loop()).__module__.split(".")[0],
        )
        (self.runtime_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        sd_notify("READY=1\nSTATUS=serving")

    def _start_rightsizing(self) -> None:
        """Measure leases every [auto] sample_s and act on --mode auto (xpud.controllers.rightsizer)."""
        from xpud.controllers.rightsizer import Rightsizer

        rs = Rightsizer(self.engine, self.hw)
        rs.restore()  # class histories and auto leases from the ledger (start-up, before it is used)
        self.engine.rightsizer = rs
        self.jobs.scheduler.add_job(
            rs.poll_logged, "interval", seconds=self.cfg.auto.sample_s, id="rightsize", **OPTS
        )

    def _start_accounts(self) -> None:
        """Fair share between the [accounts.NAME] of xpud.toml (xpud.controllers.accounts); without any,
        the queue keeps its plain order (priority, then age)."""
        from xpud.config.accounts import config_hash
        from xpud.controllers.accounts import TICK_S, Accounts

        self.accounts = None
        if not self.cfg.named_accounts:
            return
        fed = self.federation
        digest = config_hash(self.cfg.accounts, self.cfg.named_accounts)
        acc = Accounts(self.engine, fed.peer_accounts if fed is not None else dict, config_hash=digest)
        if fed is not None:
            fed.accounts_source = acc.published  # in its summary: the peers' shares count it
        acc.restore()
        acc.refresh()
        self.engine.queue_order = acc
        self.accounts = acc
        self.jobs.scheduler.add_job(acc.tick_logged, "interval", seconds=TICK_S, id="accounts", **OPTS)

    def reload(self) -> str:
        """SIGHUP (``systemctl reload xpud``): re-read the config file; apply what can change live
        (``xpud.daemon.reload``). Returns what it did, as recorded in the event log."""
        from xpud.daemon.reload import reload

        sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            return reload(self, self.overrides)
        finally:
            sd_notify("READY=1\nSTATUS=serving")

    def _set_permissions(self) -> None:
        os.chmod(self.user_socket, 0o666)  # anyone may connect; lease operations need a token
        os.chmod(self.cred_socket, 0o666)
        os.chmod(self.admin_socket, 0o660)
        if os.geteuid() == 0:
            with contextlib.suppress(KeyError):
                os.chown(self.admin_socket, 0, grp.getgrnam(self.cfg.daemon.admin_group).gr_gid)

    async def stop(self) -> None:
        """Stop in the order that keeps NVML safe: no new work (jobs, then requests), the hardware reads
        in progress return, the event thread ends (it frees its own event set), then NVML shuts down
        (``Nvml.close`` also waits for any other call, and nothing re-opens it afterwards)."""
        sd_notify("STOPPING=1")
        if self.federation is not None:
            await self.federation.stop()  # peers hear "left" at once, not "dead" after dead_after_s
        if self.metrics:
            await asyncio.to_thread(self.metrics.stop)  # a scrape in progress still gets its answer
        if self.jobs:
            self.jobs.stop()
        if self.kubelet:
            await self.kubelet.stop()
        for s in self.servers:
            await s.stop(grace=0.5)
        from xpud.federation import rankproc

        await rankproc.stop_all()  # ranks of multi-host jobs started here: their groups are killed
        if self.cred_server:
            self.cred_server.close()
        if self.cred_server or self.servers:  # ours: a start that failed early leaves another daemon's alone
            for p in (self.user_socket, self.admin_socket, self.cred_socket, self.runtime_dir / PID_FILE):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        if self.jobs:
            await self.jobs.drain()
        if self.monitor:
            await asyncio.to_thread(self.monitor.stop)  # joins the thread: up to one NVML wait
        if self.ledger:
            self.ledger.close()
        try:
            await asyncio.to_thread(self.hw.close)
        except Exception as e:  # stopping goes on whatever NVML says
            log.warning("closing NVML: %s", e)
        if self.serving:
            log.info("xpud stopped; active leases stay in the ledger and are restored at the next start")
        else:
            log.info("xpud did not start; what it had begun is undone")


def loop_factory(choice: str):
    """The event loop ``[daemon] event_loop`` asks for: uvloop's ``new_event_loop`` (libuv: ~15 % fewer
    instructions per grant+release, bench/RESULTS.md) when it is installed and not refused, else None
    (asyncio's own loop). ``"uvloop"`` without it installed is a StartupError."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise StartupError(
                '[daemon] event_loop = "uvloop", but uvloop is not installed: '
                'pip install \'xpud[fast]\', or set event_loop = "auto" or "asyncio"'
            ) from None
        return None
    return uvloop.new_event_loop


def keep_out_of_collections() -> None:
    """What the start made (modules, descriptors, the engine's state: ~65,000 objects) lives as long as
    the process: moved out of the cyclic garbage collector's generations, so that its full collections
    no longer walk it. Under grant load one ran every ~10 s and paused the loop ~45 ms; ~2 ms after this
    (bench/RESULTS.md, "garbage collection"). Garbage made so far is collected first."""
    gc.collect()
    gc.freeze()
    log.debug("kept %d start-up objects out of garbage collection", gc.get_freeze_count())


async def run_daemon(cfg: config.Config, hw, fake=None, overrides=None) -> None:
    d = Daemon(cfg, hw, fake, overrides)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: None)  # not a stop while starting; reload once serving
    try:
        await d.start()
    except BaseException:
        await d.stop()  # what did start (servers, sockets, threads) stops, so the process can exit
        raise
    keep_out_of_collections()
    loop.add_signal_handler(signal.SIGHUP, d.reload)
    try:
        await stop.wait()
    finally:
        await d.stop()


def _setup_logging(level: str) -> None:
    fmt = (
        "%(levelname)s %(name)s: %(message)s"
        if os.environ.get("JOURNAL_STREAM")
        else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr)
    if level != "debug":  # APScheduler's INFO lines ("Added job ...") are its own chatter
        logging.getLogger("apscheduler").setLevel(logging.WARNING)


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


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"xpud: {message}", err=True)
    raise typer.Exit(code)


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

    def overrides(cfg: config.Config) -> config.Config:
        """The command line's values over the file's (at start, and again at each reload)."""
        if simulate:
            cfg = config.checked(cfg, "devices", "machine", simulate, "--simulate")
            cfg = cfg.replace("devices", backend="simulated")
        if seed is not None:
            cfg = config.checked(cfg, "devices", "seed", seed, "--seed")
        if sim_state:
            cfg = config.checked(cfg, "devices", "sim_state", str(Path(sim_state).absolute()), "--sim-state")
        if runtime_dir:
            cfg = config.checked(
                cfg, "daemon", "runtime_dir", str(Path(runtime_dir).absolute()), "--runtime-dir"
            )
        if state_dir:
            cfg = config.checked(cfg, "daemon", "state_dir", str(Path(state_dir).absolute()), "--state-dir")
        if log_level:
            cfg = config.checked(cfg, "daemon", "log_level", log_level, "--log-level")
        if kubelet:
            cfg = cfg.replace("kubelet", enabled=True)
        return cfg

    try:
        cfg = overrides(config.load(config_path))
    except XpudError as e:
        _fail(str(e), 2)
    ctx.obj = cfg
    if ctx.invoked_subcommand:
        return
    _setup_logging(cfg.daemon.log_level)
    try:
        factory = loop_factory(cfg.daemon.event_loop)
        hw, fake = open_hardware(cfg)
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(run_daemon(cfg, hw, fake, overrides))
    except StartupError as e:
        _fail(str(e))
    except LedgerDamaged as e:  # not restarted by systemd (RestartPreventExitStatus): an operator decides
        _fail(str(e), LEDGER_DAMAGED_EXIT)
    except XpudError as e:
        _fail(str(e))
    except PermissionError as e:
        _fail(
            f"{e.filename}: permission denied; run as root, or give --runtime-dir and --state-dir "
            "directories you own"
        )


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
    _setup_logging("info")
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
    _setup_logging("info")
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
