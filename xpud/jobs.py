"""Periodic work on APScheduler (3.x, on the daemon's asyncio loop): the lease reaper (which also abandons
moves nobody acknowledged), card sampling, whose samples the health monitor judges, and the defragmenter
(periodic runs when ``[defrag] enabled``; making room for waiting whole-card requests when ``make_room``).

Hardware reads run in a worker thread so a slow driver call never stalls the API.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from xpud.engine import Engine

log = logging.getLogger("xpud.jobs")
# APScheduler logs every run at INFO: with the reaper at 4 Hz and polls at up to 1 Hz that buries the log.
logging.getLogger("apscheduler.executors").setLevel(logging.WARNING)

REAP_INTERVAL_S = 0.25  # a reclaimed lease is back within the grace period plus this
MAKE_ROOM_INTERVAL_S = 1.0  # how often waiting whole-card requests are looked at


class Jobs:
    def __init__(
        self, engine: Engine, hw, sample_interval_s: float = 5.0, monitor=None, defrag=None, anchors=None
    ):
        self.engine = engine
        self.anchors = anchors  # xpud.bridges.anchors.AnchorReaper: leases of Slurm jobs and pods
        self.hw = hw
        self.sample_interval_s = sample_interval_s
        self.monitor = monitor  # xpud.monitor.HealthMonitor: judges each poll's samples
        self.defrag = defrag  # xpud.defrag.Defragmenter
        self.scheduler: AsyncIOScheduler | None = None
        self._reading: asyncio.Future | None = None  # the hardware read in progress, if any

    def start(self) -> None:
        self.scheduler = AsyncIOScheduler(event_loop=asyncio.get_running_loop())
        opts = {"max_instances": 1, "coalesce": True, "misfire_grace_time": None}
        self.scheduler.add_job(self.reap, "interval", seconds=REAP_INTERVAL_S, id="reap", **opts)
        self.scheduler.add_job(
            self.sample,
            "interval",
            seconds=self.sample_interval_s,
            id="sample",
            next_run_time=datetime.now(),
            **opts,
        )
        if self.defrag is not None and self.defrag.cfg.enabled:
            seconds = self.defrag.cfg.interval_s
            self.scheduler.add_job(self.run_defrag, "interval", seconds=seconds, id="defrag", **opts)
        if self.defrag is not None and self.defrag.cfg.make_room:
            self.scheduler.add_job(
                self.make_room, "interval", seconds=MAKE_ROOM_INTERVAL_S, id="make-room", **opts
            )
        self.scheduler.start()

    def stop(self) -> None:
        """No more runs (those in progress go on: ``drain`` waits for their hardware reads)."""
        if self.scheduler and self.scheduler.running:
            self.scheduler.shutdown(wait=False)

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

    async def run_defrag(self) -> None:
        try:
            await self.defrag.periodic()
        except Exception:
            log.exception("periodic defrag failed")

    async def make_room(self) -> None:
        try:
            await self.defrag.make_room()
        except Exception:
            log.exception("making room for a waiting request failed")
