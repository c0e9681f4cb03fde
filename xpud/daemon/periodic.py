"""Periodic work on APScheduler (3.x, on the daemon's asyncio loop): the lease reaper (which also abandons
moves nobody acknowledged), card sampling, whose samples the health monitor judges, and the defragmenter
(periodic runs when ``[defrag] enabled``; making room for waiting whole-card requests when ``make_room``).

Hardware reads run in a worker thread so a slow driver call never stalls the API.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from datetime import datetime, timedelta

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from xpud.engine.engine import Engine
from xpud.planning import green as carbon
from xpud.planning import windows

log = logging.getLogger("xpud.daemon.periodic")
# APScheduler logs every run at INFO: with the reaper at 4 Hz and polls at up to 1 Hz that buries the log.
logging.getLogger("apscheduler.executors").setLevel(logging.WARNING)

REAP_INTERVAL_S = 0.25  # a reclaimed lease is back within the grace period plus this
MAKE_ROOM_INTERVAL_S = 1.0  # how often waiting whole-card requests are looked at
OPTS = {"max_instances": 1, "coalesce": True, "misfire_grace_time": None}
PRUNE_INTERVAL_S = 3600.0  # how often ended leases past [leases] history_days are dropped
PRUNE_FIRST_S = 60.0  # the first time: a minute after the start, not in its busiest moment
WINDOW_CHECK_S = 30.0  # how often the capacity window's share is checked between its starts
# the jobs ``reschedule`` makes from the live sections (and "window-*"); a reload leaves the others be
RESCHEDULED = ("defrag", "make-room", "forecast", "carbon")


def history_kept_days(cfg) -> int:
    """Days of ended history the ledger keeps: ``[leases] history_days`` (0: all), raised to the
    forecast's ``history_days`` when the forecast is on (it learns from those leases)."""
    days = cfg.leases.history_days
    if days and cfg.forecast.enabled:
        days = max(days, cfg.forecast.history_days)
    return days


def _logged(what: str):
    """A job whose failure is logged (with its traceback), never raised into the scheduler."""

    def wrap(fn):
        @functools.wraps(fn)
        async def job(*args, **kw):
            try:
                return await fn(*args, **kw)
            except Exception:
                log.exception("%s failed", what)

        return job

    return wrap


class Jobs:
    def __init__(
        self,
        engine: Engine,
        hw,
        sample_interval_s: float = 5.0,
        monitor=None,
        defrag=None,
        hostjobs=None,
        anchors=None,
        carbon_signal: carbon.Signal | None = None,
    ):
        self.engine = engine
        self.anchors = anchors  # xpud.bridges.anchors.AnchorReaper: leases of Slurm jobs and pods
        self.hw = hw
        self.sample_interval_s = sample_interval_s
        self.monitor = monitor  # xpud.controllers.health.HealthMonitor: judges each poll's samples
        self.defrag = defrag  # xpud.controllers.defragmenter.Defragmenter
        self.hostjobs = hostjobs  # xpud.federation.hostjobs.HostJobs: expires multi-host reservations
        self.scheduler: AsyncIOScheduler | None = None
        self._reading: asyncio.Future | None = None  # the hardware read in progress, if any
        self.provisioner = None  # xpud.controllers.provisioner.Provisioner, from start()
        self.carbon = carbon_signal or carbon.Signal()  # the signal read last; Acquire plans from it

    def start(self) -> None:
        from xpud.controllers.provisioner import Provisioner

        self.scheduler = AsyncIOScheduler(event_loop=asyncio.get_running_loop())
        self.scheduler.add_job(self.reap, "interval", seconds=REAP_INTERVAL_S, id="reap", **OPTS)
        self.scheduler.add_job(
            self.sample,
            "interval",
            seconds=self.sample_interval_s,
            id="sample",
            next_run_time=datetime.now(),
            **OPTS,
        )
        self.provisioner = Provisioner(self.engine)
        self.scheduler.add_job(
            self.prune,
            "interval",
            seconds=PRUNE_INTERVAL_S,
            id="prune",
            next_run_time=datetime.now() + timedelta(seconds=PRUNE_FIRST_S),
            **OPTS,
        )
        self.reschedule()
        self.scheduler.start()

    def reschedule(self) -> None:
        """(Re)schedule the jobs that follow the config's live sections (at start, and after a reload):
        defrag, make-room, the capacity windows, the forecast and the carbon signal."""
        cfg = self.engine.cfg
        for job in list(self.scheduler.get_jobs()):  # only its own: others' (accounts, rightsize) go on
            if job.id in RESCHEDULED or job.id.startswith("window-"):
                job.remove()
        if self.defrag is not None and self.defrag.cfg.enabled:
            seconds = self.defrag.cfg.interval_s
            self.scheduler.add_job(self.run_defrag, "interval", seconds=seconds, id="defrag", **OPTS)
        if self.defrag is not None and self.defrag.cfg.make_room:
            self.scheduler.add_job(
                self.make_room, "interval", seconds=MAKE_ROOM_INTERVAL_S, id="make-room", **OPTS
            )
        self.start_windows()
        self.scheduler.add_job(
            self.run_forecast,
            "interval",
            seconds=cfg.forecast.interval_s,
            id="forecast",
            next_run_time=datetime.now(),
            **OPTS,
        )
        self.carbon.configured = bool(cfg.carbon.signal or cfg.carbon.command)
        if self.carbon.configured:
            self.scheduler.add_job(
                self.refresh_carbon,
                "interval",
                seconds=cfg.carbon.refresh_s,
                id="carbon",
                next_run_time=datetime.now(),
                **OPTS,
            )

    # ------------------------------------------------------------------ capacity windows
    def start_windows(self) -> None:
        """One cron job per ``[[windows]]`` entry (its start), and a check every WINDOW_CHECK_S that keeps
        the share as cards come free; the window in force now is applied at once."""
        specs = self.engine.cfg.windows
        if not specs:
            self.engine.set_window(None)
            return
        for i, spec in enumerate(specs):
            self.scheduler.add_job(self.apply_windows, spec.trigger(), id=f"window-{i}-{spec.name}", **OPTS)
        self.scheduler.add_job(
            self.apply_windows, "interval", seconds=WINDOW_CHECK_S, id="window-check", **OPTS
        )
        self.scheduler.add_job(self.apply_windows, id="window-now", **OPTS)  # at once

    @_logged("pruning the ledger")
    async def prune(self) -> None:
        """Drop ended leases, their events, finished reservations and usage readings older than
        ``[leases] history_days`` (0: never), keeping at least the forecast's ``history_days`` when it is
        on. Committed by the ledger's writer thread, off the loop."""
        cfg = self.engine.cfg
        days = history_kept_days(cfg)
        if days:
            await self.engine.ledger.write(*self.engine.ledger.prune_ops(days))

    @_logged("forecast and pre-provisioning")
    async def run_forecast(self) -> None:
        await self.provisioner.run()

    async def refresh_carbon(self) -> None:
        """Read the carbon signal (off the loop) and publish it for ``xpu run --when-green``."""
        cfg = self.engine.cfg
        try:
            hours = await asyncio.to_thread(carbon.read, cfg.carbon.signal, cfg.carbon.command)
            self.carbon.hours = hours  # deferrable requests plan their start from it
            await asyncio.to_thread(carbon.publish, hours, cfg.runtime_dir)
        except (carbon.SignalError, OSError) as e:  # the last published signal stays
            log.warning("carbon signal: %s", e)

    async def apply_windows(self, now: datetime | None = None) -> None:
        """Put the window in force at ``now`` (default: the host's clock) and keep its share whole."""
        try:
            now = now or datetime.now().astimezone()
            self.engine.set_window(windows.current(self.engine.cfg.windows, now))
            short = self.engine.whole_short()
            if short:
                await self.engine.keep_whole()
            if self.engine.whole_short() and self.defrag is not None and self.defrag.cfg.enabled:
                await self.defrag.periodic()  # slices on few cards free whole ones (restartable jobs move)
        except Exception:
            log.exception("applying the capacity windows failed")

    def stop(self) -> None:
        """No more runs (those in progress go on: ``drain`` waits for their hardware reads)."""
        if self.scheduler and self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        if self.provisioner is not None:
            self.provisioner.stop()  # warm commands still running are killed, with their sessions

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait for a hardware read in progress (in its worker thread) to return: NVML is shut down next."""
        if self._reading is not None:
            await asyncio.wait({self._reading}, timeout=timeout_s)

    async def reap(self) -> None:
        try:
            for lease in await self.engine.reap():
                log.info("reclaimed lease %s", lease.id)
            for lease in await self.anchors.reap() if self.anchors else ():
                log.info("reclaimed lease %s (%s ended)", lease.id, lease.anchor)
        except Exception:
            log.exception("lease reaper failed")
        if self.hostjobs is not None:
            try:
                await self.hostjobs.expire()  # reservations past their TTL end here, with no help
            except Exception:
                log.exception("expiring reservations failed")

    async def sample(self) -> None:
        indices = sorted(self.engine.cards)
        loop = asyncio.get_running_loop()
        reading = loop.run_in_executor(None, lambda: [self.hw.sample(i) for i in indices])
        self._reading = reading
        try:
            samples = await reading
        except Exception:
            log.exception("sampling the cards failed")
            return
        finally:
            if self._reading is reading:
                self._reading = None
        for i, s in zip(indices, samples, strict=True):
            self.engine.set_sample(i, s)
        if self.monitor is not None:
            try:
                self.monitor.on_samples(dict(zip(indices, samples, strict=True)))
            except Exception:
                log.exception("judging the cards' health failed")

    @_logged("periodic defrag")
    async def run_defrag(self) -> None:
        await self.defrag.periodic()

    @_logged("making room for a waiting request")
    async def make_room(self) -> None:
        await self.defrag.make_room()
