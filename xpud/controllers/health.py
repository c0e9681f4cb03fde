"""The health monitor: NVML events on a thread, polled signals, scoring, and what happens to the work.

Two inputs, one judge:
- a thread (``EventThread``) blocks in NVML's event wait (XID, ECC) and hands each batch to the daemon's
  asyncio loop (``call_soon_threadsafe``), so a fault is judged within milliseconds, not at the next poll;
- the APScheduler sample job (``xpud.daemon.periodic``) polls every card every ``[health] poll_interval_s``
in a
  worker thread and calls ``on_samples`` on the loop.
Both feed ``xpud.hw.health.CardHealth`` (pure, over ``xpud.hw.signals``), one per card, which answers a
report and, at times, a state change. Everything below runs on the loop, like the engine.

What a state change does:
- any: recorded in the ledger (``health_changes``, with its reasons) and the event log, before acting;
- degraded: ``Engine.set_health``; placement avoids the card while another fits;
- unhealthy: the card is drained (by the monitor, with the reasons; an operator's own drain is separate);
  restartable leases on it are moved (``Engine.move``), the others marked and told on their Hold stream;
  while it stays unhealthy, leases that could not move (no room yet) are tried again at every poll;
- better again, after the hysteresis: back in service; the engine grants what waits.
Application XIDs (``[health] xid_application``) are counted against the lease that caused them: on MIG
the event's GPU-instance id names the slice; otherwise the card's lease(s). The card is not judged by them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from xpud.config.schema import Config
from xpud.engine.engine import Engine
from xpud.errors import Conflict, NoCapacity, NotFound
from xpud.hw.health import BANDS, CardHealth, HealthReport, StateChange
from xpud.hw.signals import memory_fragmentation, xid_class, xid_text
from xpud.hw.types import HwEvent, NvmlError
from xpud.ledger.ledger import HealthChangeRecord
from xpud.model import CardSample, HealthState

log = logging.getLogger("xpud.controllers.health")

# How long one NVML wait blocks: bounds how long stopping the thread takes (a daemon's stop waited 0.25 s
# on average for it at 500 ms; ten waits a second cost the driver nothing measurable)
EVENT_WAIT_MS = 100
STOP_WAIT_S = 5.0  # beyond one wait: a rebuild or a delivery in progress when asked to stop
HISTORY = 20  # state changes `xpu health` shows by default


class EventThread(threading.Thread):
    """Waits for NVML events (XID, ECC) and delivers each batch with ``deliver(batch)``.

    A batch is a list of ``(HwEvent, gpu_instance_uuids)``: for events that name a MIG GPU instance, the
    MIG device UUIDs of that instance (read here, off the loop), so the loop can find the slice's lease.
    """

    def __init__(self, hw, waiter, indices: list[int], deliver: Callable[[list], None]):
        super().__init__(daemon=True, name="xpud-health-events")
        self.hw, self.waiter, self.indices, self.deliver = hw, waiter, indices, deliver
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                if self.waiter is None:
                    self.waiter = self.hw.event_waiter(self.indices)
                events = self.waiter.wait(EVENT_WAIT_MS)
            except NvmlError as e:  # the driver hiccuped: start over after a pause, never spin
                log.warning("waiting for NVML events failed: %s; retrying in 1 s", e)
                self._close_waiter()
                self._stopping.wait(1.0)
                continue
            if events:
                try:
                    self.deliver([(ev, self._instance_uuids(ev)) for ev in events])
                except RuntimeError:  # the loop is closed: the daemon is stopping
                    return
        self._close_waiter()

    def _instance_uuids(self, ev: HwEvent) -> tuple[str, ...]:
        if ev.gpu_instance_id is None or ev.card_index < 0:
            return ()
        try:
            for inst in self.hw.mig_instances(ev.card_index):
                if inst.gpu_instance_id == ev.gpu_instance_id:
                    return tuple(inst.device_uuids)
        except NvmlError as e:
            log.warning("card %d: cannot read MIG instances for an event: %s", ev.card_index, e)
        return ()

    def _close_waiter(self) -> None:
        if self.waiter is not None:
            with contextlib.suppress(NvmlError):
                self.waiter.close()
            self.waiter = None

    def stop(self) -> None:
        """Ask the thread to end; it does within one wait (``EVENT_WAIT_MS``). Call ``join`` to wait."""
        self._stopping.set()


class HealthMonitor:
    """Judges every card's health and acts on it. Create, ``restore``, ``start``; ``stop`` at the end."""

    def __init__(self, engine: Engine, hw, cfg: Config, clock: Callable[[], float] = time.time):
        self.engine, self.hw, self.clock = engine, hw, clock
        self.cfg = cfg.health
        self.slice_fraction = cfg.slices[cfg.health.fragmentation_slice].memory_fraction
        self.cards = {i: CardHealth(i, self.cfg, pcie_link=self._pcie_link(i)) for i in engine.cards}
        self.reports: dict[int, HealthReport] = {}
        self.why: dict[int, str] = {}  # reasons of the card's last turn for the worse
        self.app_xids: Counter[str] = Counter()  # lease id -> application XIDs counted against it
        self.thread: EventThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resampling: set[int] = set()
        self._lost: set[int] = set()  # cards that left the event set lost (readmitted when back)
        self._moving: set[str] = set()  # leases whose move is being started

    def _pcie_link(self, i: int) -> tuple[int | None, int | None]:
        """The card's PCIe (generation, width), which sets its replay allowance; read once, at start-up
        (fixed per board). Unknown: (None, None)."""
        try:
            gen, width = self.hw.pcie_link(i)
        except (NvmlError, AttributeError, TypeError, ValueError) as e:
            log.warning("card %d: cannot read its PCIe link (%s): PCIe replays judged as Gen4 x16", i, e)
            return (None, None)
        return (gen, width)

    # ------------------------------------------------------------------ lifecycle
    def restore(self) -> None:
        """Take back each card's last recorded state (the daemon restarted): a card that was out stays
        out until its signals have been clear for the clear time, counted from now."""
        now = self.clock()
        for i, ch in self.cards.items():
            info = self.engine.cards[i].info
            changes = self.engine.ledger.health_changes(info.uuid, limit=50)
            if not changes or changes[-1].to_state == HealthState.HEALTHY.value:
                continue
            last = changes[-1]
            state = HealthState(last.to_state)
            failures = [
                c.ts
                for c in changes
                if c.from_state == HealthState.HEALTHY.value and now - c.ts < self.cfg.flap_window_s
            ]
            ch.restore(state, failures)
            self.why[i] = "; ".join(last.reasons) + " (recorded before the restart)"
            self.engine.set_health(i, state, BANDS[state][1], self.why[i])

    def start(self) -> None:
        """Start waiting for NVML events (call on the daemon's loop)."""
        self._loop = asyncio.get_running_loop()
        indices = sorted(self.cards)
        waiter = None
        try:
            waiter = self.hw.event_waiter(indices)
            for i, ch in self.cards.items():
                ch.memory.xid_events = i in waiter.registered
            for i, why in waiter.unregistered.items():
                log.warning("card %d reports no XID/ECC events (%s): relying on polling", i, why)
        except NvmlError as e:
            log.warning("cannot wait for NVML events (%s): relying on polling", e)
            for ch in self.cards.values():
                ch.memory.xid_events = False
            return
        loop = self._loop
        self.thread = EventThread(
            self.hw, waiter, indices, lambda batch: loop.call_soon_threadsafe(self.on_events, batch)
        )
        self.thread.start()

    def stop(self) -> None:
        """End the event thread and wait until it has (it frees its event set itself, after its last
        wait): NVML must not be shut down under it. Blocks up to a wait plus ``STOP_WAIT_S``: call it
        off the loop."""
        if self.thread is not None:
            self.thread.stop()
            limit = EVENT_WAIT_MS / 1000 + STOP_WAIT_S
            self.thread.join(limit)
            if self.thread.is_alive():
                log.warning("the NVML event thread did not end within %g s", limit)
            self.thread = None

    # ------------------------------------------------------------------ inputs
    def on_samples(self, samples: dict[int, CardSample]) -> None:
        """A poll's samples (from the APScheduler job), judged at once."""
        for i, sample in samples.items():
            ch = self.cards.get(i)
            if ch is None:
                continue
            ch.observe_sample(sample, self._fragmentation(i))
            self._judge(i, self.clock())
            if i in self._lost and not sample.lost:  # back after a reset: its events too
                self._lost.discard(i)
                self._readmit(i)

    def on_events(self, batch: list[tuple[HwEvent, tuple[str, ...]]]) -> None:
        """A batch of NVML events from the event thread."""
        now = self.clock()
        touched: set[int] = set()
        for ev, instance_uuids in batch:
            ch = self.cards.get(ev.card_index)
            if ch is None:
                continue
            if ev.kind == "xid" and ev.xid is not None:
                if xid_class(ev.xid, self.cfg) == "application":
                    self.engine.stats.app_xids += 1
                    self._blame(ev, instance_uuids, now)
                else:
                    self.engine.stats.xids[ev.xid] += 1
                    ch.observe_xid(ev.xid, now)
                    log.warning("card %d: %s", ev.card_index, xid_text(ev.xid))
            elif ev.kind == "ecc-dbe":
                ch.observe_ecc_dbe(now)
            elif ev.kind == "lost":  # the card left the event set: its XID signal is absent from now
                ch.memory.xid_events = False
                self._lost.add(ev.card_index)
                log.error("card %d is lost (fallen off the bus): it reports no more events", ev.card_index)
            touched.add(ev.card_index)
        for i in sorted(touched):
            self._judge(i, now)
        self._resample(touched)  # the counters behind the event, without waiting for the next poll

    def _readmit(self, i: int) -> None:
        """Register the events of a card that was lost and answers again (off the loop: it waits for the
        event thread's current wait)."""
        thread, loop = self.thread, self._loop
        if thread is None or thread.waiter is None or loop is None:
            return
        waiter = thread.waiter

        async def readmit() -> None:
            try:
                self.cards[i].memory.xid_events = await loop.run_in_executor(None, waiter.readmit, i)
            except NvmlError as e:
                log.warning("card %d: its events could not be registered again: %s", i, e)

        loop.create_task(readmit())

    def _resample(self, indices: set[int]) -> None:
        todo = sorted(set(indices) - self._resampling)
        if not todo or self._loop is None:
            return
        self._resampling |= set(todo)

        async def sample() -> None:
            try:
                samples = await self._loop.run_in_executor(None, lambda: {i: self.hw.sample(i) for i in todo})
            except Exception:
                log.exception("sampling cards %s after an event failed", todo)
                return
            finally:
                self._resampling -= set(todo)
            for i, s in samples.items():
                self.engine.set_sample(i, s)
            self.on_samples(samples)

        self._loop.create_task(sample())

    # ------------------------------------------------------------------ judging and acting
    def _judge(self, i: int, now: float) -> None:
        report, change = self.cards[i].evaluate(now)
        self.reports[i] = report
        card = self.engine.cards[i]
        if change is not None:
            self._record(change)
            if change.to_state is not HealthState.HEALTHY and _worse(change):
                self.why[i] = "; ".join(change.reasons) or change.to_state.value
            self.engine.set_health(i, report.state, report.score, self.why.get(i, ""))
        elif report.score != card.health_score:
            self.engine.set_health(i, report.state, report.score, card.health_reason)
        if report.state is HealthState.UNHEALTHY:
            self._evacuate(i)

    def _record(self, change: StateChange) -> None:
        info = self.engine.cards[change.index].info
        self.engine.ledger.add_health_change(
            HealthChangeRecord(
                change.timestamp,
                info.uuid,
                change.index,
                change.from_state.value,
                change.to_state.value,
                change.score,
                change.reasons,
            )
        )
        self.engine.event(
            "health",
            f"card {change.index} {change.from_state} -> {change.to_state} (score {change.score}): "
            + ("; ".join(change.reasons) or "-"),
            card=change.index,
        )

    def _evacuate(self, i: int) -> None:
        """Move the restartable leases off an unhealthy card; mark and tell the others (once per text).
        A move runs as a task (the engine prepares the new placement off the loop)."""
        why = self.why.get(i, "unhealthy")
        for lease in self.engine.leases_on(i):
            if lease.id in self.engine.moves.pending or lease.id in self._moving:
                continue
            if lease.restartable and lease.id not in self.engine.moves.timed_out:
                self._moving.add(lease.id)
                task = asyncio.ensure_future(self._move(lease.id, i, why))
                task.add_done_callback(lambda _t, lid=lease.id: self._moving.discard(lid))
                continue
            if lease.restartable:
                continue  # its holder did not follow a move: marked then, not moved again
            text = (
                f"card {i} is unhealthy ({why}): the job may fail; release the lease and run it again "
                "(with --restartable xpud moves it by itself)"
            )
            self.engine.mark(lease.id, text)

    async def _move(self, lease_id: str, i: int, why: str) -> None:
        try:
            await self.engine.move(lease_id, f"card {i} is unhealthy: {why}")
            return
        except NoCapacity:
            text = (
                f"card {i} is unhealthy ({why}); no healthy card is free to move to: "
                "the job moves as soon as one is"
            )
        except (Conflict, NotFound) as e:
            text = f"card {i} is unhealthy ({why}); not moved: {e}"
        except Exception as e:  # e.g. the ledger cannot record the new card's mode now: tried again later
            log.error("moving lease %s off card %d failed: %s", lease_id, i, e)
            return
        self.engine.mark(lease_id, text)

    def _blame(self, ev: HwEvent, instance_uuids: tuple[str, ...], now: float) -> None:
        """An application XID: count it against the lease(s) that caused it, not the card."""
        i = ev.card_index
        c = self.engine.cards[i]
        if instance_uuids:  # MIG: the slice whose device is in that GPU instance
            leases = [lid for lid, s in c.slices.items() if s.handle in instance_uuids]
        elif ev.gpu_instance_id is None:
            leases = [c.whole_lease] if c.whole_lease else sorted(c.slices)
        else:
            leases = []
        self.cards[i].observe_application_xid(ev.xid, now, leases)
        what = xid_text(ev.xid)
        shared = " (the card's slices share one context: counted against each)" if len(leases) > 1 else ""
        for lid in leases:
            self.app_xids[lid] += 1
            self.engine.mark(
                lid,
                f"{what} on card {i}: an application error, counted against this lease "
                f"({self.app_xids[lid]} so far){shared}; the card stays in service",
            )
        who = ", ".join(leases) or "no lease"
        self.engine.event("xid", f"card {i}: {what}, application error counted against {who}", card=i)

    def _fragmentation(self, i: int) -> float:
        c = self.engine.cards[i]
        usable = c.info.memory_total_bytes - self.engine.reserved(c.info)
        return memory_fragmentation(
            list(c.slices.values()), usable, self.slice_fraction, whole_held=c.whole_lease is not None
        )

    # ------------------------------------------------------------------ the API's view
    def report(self, i: int) -> HealthReport:
        return self.cards[i].report(self.clock())

    def view(self, i: int, history: int = 0) -> HealthView:
        """One card's health for GetHealth (``xpud.api.convert.card_health_pb``): score, state, every
        signal, reasons, state-change history."""
        r = self.report(i)
        info = self.engine.cards[i].info
        changes = self.engine.ledger.health_changes(info.uuid, history or HISTORY)
        reasons = list(r.reasons) or (
            [self.why[i]] if r.state is not HealthState.HEALTHY and i in self.why else []
        )
        return HealthView(i, info.uuid, r, tuple(changes), tuple(reasons))


@dataclass(frozen=True)
class HealthView:
    """One card's health as GetHealth shows it."""

    index: int
    uuid: str
    report: HealthReport
    changes: tuple[HealthChangeRecord, ...]  # state changes, as the ledger keeps them
    reasons: tuple[str, ...]  # the report's, else why the monitor took the card out


def _worse(change: StateChange) -> bool:
    order = [HealthState.HEALTHY, HealthState.DEGRADED, HealthState.UNHEALTHY]
    return order.index(change.to_state) > order.index(change.from_state)
