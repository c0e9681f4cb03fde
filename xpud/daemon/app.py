"""The daemon's parts, built in order and wired with what each needs: hardware, ledger, engine, credential
socket, the two gRPC servers, federation, bridges, controllers and the periodic jobs.

``Daemon.start`` builds them; each part gets the objects or callables it uses (the engine, the ledger,
the config section), never the daemon itself. ``run_daemon`` runs one until SIGTERM/SIGINT and reloads
the config on SIGHUP. The command line is ``xpud.daemon.cli``.

The order holds these: no socket of a live daemon is taken over; the ledger opens (and refuses a damaged
file) before the engine is built; the cluster certificates are checked before anything serves; leases, then
reservations, then health states come back from the ledger before the servers start; restored leases'
grace starts only once the servers answer (``engine.serving``); systemd hears READY last. ``stop`` undoes
what started, jobs and requests first and NVML last.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import grp
import logging
import os
import shutil
import signal
import socket
import time
from pathlib import Path

from grpc import aio

from xpud import __version__, config
from xpud.api.auth import CredentialIssuer
from xpud.api.server import add_to_server
from xpud.bridges.anchors import AnchorReaper
from xpud.bridges.kubelet import Delivery, KubeletBridge, PodCheck
from xpud.bridges.slurm import JobCheck
from xpud.controllers.defragmenter import Defragmenter
from xpud.controllers.health import HealthMonitor
from xpud.daemon.periodic import OPTS, Jobs
from xpud.daemon.systemd import sd_notify
from xpud.engine.engine import Engine
from xpud.errors import XpudError
from xpud.federation.hostjobs import HostJobs
from xpud.hw.devnodes import DevTree
from xpud.isolation.scope import device_scopes
from xpud.ledger.ledger import Ledger
from xpud.planning.green import Signal
from xpud.service.admin import AdminService
from xpud.service.context import Context, DaemonInfo
from xpud.service.jobs import NodeService  # the node servicer with the jobs' RPCs

log = logging.getLogger("xpud")

USER_SOCKET, ADMIN_SOCKET, CRED_SOCKET = "xpud.sock", "admin.sock", "cred.sock"
POD_CHECK_INTERVAL_S = 5.0  # how often kubelet's PodResources API is asked for pods that are gone

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
    """The parts of one daemon, built in order by ``start`` (each given what it needs, not the daemon)
    and stopped in the order that keeps NVML safe by ``stop``."""

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
        self.jobbook = None  # xpud.jobs.book.JobBook, once started
        self.context = None  # xpud.service.context.Context, once the services are built
        self.accounts = None  # xpud.controllers.accounts.Accounts when xpud.toml has [accounts.NAME]
        self.federation = None  # xpud.federation.node.Federation when [cluster] listen is set
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
        # multi-host reservations (held ones outlive a restart): restored below, once the leases are
        self.scopes = device_scopes(self.cfg, self.engine, self.fake is not None)
        self.hostjobs = HostJobs(self.engine, self.ledger, self.cfg.cluster, scopes=self.scopes)
        if self.cfg.cluster.enabled:  # the certificate files are checked before anything serves
            from xpud.federation.certs import CertError
            from xpud.federation.node import Federation

            try:
                self.federation = Federation(self.cfg.cluster, self.engine, hostjobs=self.hostjobs)
            except CertError as e:
                raise StartupError(str(e)) from None
        await self.engine.restore()
        await self.hostjobs.restore()
        self.monitor = HealthMonitor(self.engine, self.hw, self.cfg)
        self.monitor.restore()  # cards that were out before a restart stay out until they clear
        self.defrag = Defragmenter(self.engine, self.cfg)
        issuer = CredentialIssuer(self.cfg.leases.credential_ttl_s, self.cfg.daemon.admin_group)
        backend = f"simulated:{self.cfg.devices.machine}" if self.fake is not None else "nvml"
        self.carbon = Signal()  # the jobs refresh it; Acquire plans green starts
        self.carbon.configured = bool(self.cfg.carbon.signal or self.cfg.carbon.command)
        ctx = Context(
            self.engine,
            issuer,
            scopes=self.scopes,
            fake=self.fake,
            health=self.monitor,
            defrag=self.defrag,
            federation=self.federation,
            hostjobs=self.hostjobs,  # Node.RunJob coordinates multi-host jobs through it
            carbon=self.carbon,
            info=DaemonInfo(
                version=__version__,
                hostname=socket.gethostname(),
                backend=backend,
                driver_version=self.hw.driver_version() or "",
                started=self.started,
                user_socket=str(self.user_socket),
                admin_socket=str(self.admin_socket),
                config_path=str(Path(self.cfg.path).absolute()) if self.cfg.path else "",
                device_isolation=self.scopes.enforcement.text,
            ),
        )
        self.context = ctx
        # however a lease ends, what escaped its command's process group ends too (its scope is stopped)
        self.engine.on_ended.append(lambda lease: self.scopes.end_later(lease.id))
        await self.scopes.reconcile(self.engine.leases, self.engine.ledger.lease_ids())  # ended while down
        await self._start_jobs()
        if self.cfg.metrics.listen:
            from xpud.daemon.metrics import MetricsServer, families

            snapshot = functools.partial(
                families, self.engine, self.monitor, __version__, backend, lambda: self.accounts
            )
            self.metrics = MetricsServer(self.cfg.metrics.listen, snapshot)
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

    async def _start_jobs(self) -> None:
        """Detached jobs (``xpud.jobs``): their supervisors are transient units under systemd."""
        from xpud.federation.sysunit import SYSTEMD_RUN, Units
        from xpud.jobs.book import JobBook
        from xpud.service.jobs import PeerJobs

        units = Units.detect()
        systemd_run = units.systemd_run if units else None
        if systemd_run is None and self.scopes.enforcement.enforced:  # not a service, but fenced: units
            systemd_run = shutil.which(SYSTEMD_RUN)
        host = self.federation.name if self.federation is not None else socket.gethostname()
        self.jobbook = JobBook(self.engine, self.state_dir, host, systemd_run, scopes=self.scopes)
        self.context.jobs = self.jobbook
        if self.federation is not None:  # what the other hosts ask of our jobs, and we of theirs (--after)
            handlers = NodeService(self.context)
            self.federation.peer_jobs = PeerJobs(handlers)
            self.jobbook.peer_state = handlers.peer_job_state
        self.engine.on_ended.append(self.jobbook.lease_ended)  # a job whose lease ends ends with it
        await self.jobbook.restore()
        self.jobbook.start()
        from xpud.service.gangjobs import Gang

        self.context.gang = Gang(self.context)  # submitted multi-host jobs placed here
        await self.context.gang.restore()

    def _start_accounts(self) -> None:
        """Fair share between the [accounts.NAME] of xpud.toml (xpud.controllers.accounts); without any,
        the queue keeps its plain order (priority, then age)."""
        from xpud.config.accounts import config_hash
        from xpud.controllers.accounts import TICK_S, Accounts

        self.accounts = None
        cfg = self.engine.cfg  # the running config (a reload may start the controller)
        if not cfg.named_accounts:
            return
        fed = self.federation
        digest = config_hash(cfg.accounts, cfg.named_accounts)
        acc = Accounts(
            self.engine,
            fed.peer_accounts if fed is not None else dict,
            config_hash=digest,
            own=fed.own_accounts if fed is not None else lambda: None,
        )
        if fed is not None:
            fed.accounts_source = acc.published  # in its summary: the peers' shares count it
        acc.restore()
        acc.refresh()
        self.engine.queue_order = acc
        self.accounts = self.context.accounts = acc
        self.jobs.scheduler.add_job(acc.tick_logged, "interval", seconds=TICK_S, id="accounts", **OPTS)

    def _reload_accounts(self, old: config.Config, new: config.Config) -> None:
        """A reload that changed ``[accounts]``: the controller takes it (started if it is the first
        account; kept, with no accounts, when the last is removed: their running leases stay charged)."""
        from xpud.config.accounts import config_hash

        if (old.accounts, list(old.named_accounts.items())) == (
            new.accounts,
            list(new.named_accounts.items()),
        ):
            return
        if self.accounts is None:
            self._start_accounts()
            return
        digest = config_hash(new.accounts, new.named_accounts) if new.named_accounts else ""
        self.accounts.reconfigure(digest)

    def _start_rightsizing(self) -> None:
        """Measure leases every [auto] sample_s and act on --mode auto (xpud.controllers.rightsizer)."""
        from xpud.controllers.rightsizer import Rightsizer

        rs = Rightsizer(self.engine, self.hw)
        rs.restore()  # class histories and auto leases from the ledger (start-up, before it is used)
        self.engine.rightsizer = rs
        self.jobs.scheduler.add_job(
            rs.poll_logged, "interval", seconds=self.cfg.auto.sample_s, id="rightsize", **OPTS
        )

    def reload(self) -> str:
        """SIGHUP (``systemctl reload xpud``): re-read the config file; apply what can change live
        (``xpud.daemon.reload``). Returns what it did, as recorded in the event log."""
        from xpud.daemon.reload import reload

        sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            self.cfg, msg = reload(
                self.cfg, self.overrides, self.engine, self.defrag, self.jobs, self._reload_accounts
            )
            return msg
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
        if self.context is not None and self.context.gang is not None:
            await self.context.gang.stop()  # their ranks run on; a restart watches them again
        if self.jobbook is not None:
            await self.jobbook.stop()  # queued jobs stay queued in the ledger; running ones run on
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
