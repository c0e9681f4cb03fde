"""The scheduler's state machine: cards and their modes, leases, the wait queue.

It lives on the daemon's asyncio loop, and nothing in it blocks the loop:

- Ledger first. A release, eviction, reclaim, move or card-state change is committed to the ledger before
  anything is freed or changed on the hardware; a grant prepares its slice, commits, and only then is
  the lease anyone's (a failed commit tears the prepared slice down again). A commit that fails (ledger
  locked by another process, file system full) changes nothing in memory or on the hardware, and the
  caller gets ``LedgerUnavailable`` (UNAVAILABLE: retry).
- Isolation backend calls (MIG create/destroy, mode switches and resets, MPS control commands) run in
  worker threads. A card with backend work in flight is *busy*: placement leaves it out and its backend
  is touched by nobody else until the work ends; other cards keep serving. In-memory reservations (a
  slice or a whole card marked held) are made before any await, so interleaved requests never pick the
  same room, and undone when the step fails.

Placement decisions come from the pure functions in ``xpud.placement``; slice preparation from the card's
isolation backend. ``Engine`` is the facade over the engine's parts (``books``, ``streams``, ``effects``,
``granting``, ``endings``); ``from xpud.engine.engine import Engine`` is the one import the rest of the
package needs. See docs/engine.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import replace

from xpud.config.schema import Config
from xpud.engine.books import CardState
from xpud.engine.endings import Endings
from xpud.engine.granting import Granting
from xpud.engine.hooks import QueueOrder, Sizing
from xpud.engine.moves import Moves
from xpud.engine.standby import Standby
from xpud.engine.stats import Stats
from xpud.engine.uninterrupted import uninterrupted
from xpud.engine.waitlist import Waitlist
from xpud.errors import BadRequest
from xpud.isolation.base import STANDBY, Accounting, Held, Isolation
from xpud.ledger.ledger import Ledger, LedgerUnavailable
from xpud.model import CardInfo, CardMode, CardSample, CardView, HealthState, Lease, LeaseState, Mode
from xpud.placement.host import CardCapacity
from xpud.planning.windows import WindowSpec, whole_needed
from xpud.topology import Topology

log = logging.getLogger("xpud.engine.engine")


class Engine(Granting, Endings):
    """The engine's public face: one object the daemon, the service, the controllers and the bridges hold.
    Its parts: ``books`` (cards, capacity, views), ``streams`` (Hold/Watch, events), ``effects`` (claims,
    blocking work, ledger-first writes), ``granting`` (grants and the queue), ``endings`` (releases, the
    reaper); ``moves`` and ``standby`` act through the effects."""

    def __init__(
        self,
        cards: list[CardInfo],
        topology: Topology,
        cfg: Config,
        ledger: Ledger,
        isolation: Callable[[CardInfo], Isolation] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self.topology = topology
        self.ledger = ledger
        self.clock = clock
        self.cards: dict[int, CardState] = {c.index: CardState(c) for c in cards}
        self._isolation = isolation or (lambda card: Accounting())
        self._backends: dict[int, Isolation] = {c.index: self._isolation(c) for c in cards}
        self.leases: dict[str, Lease] = {}
        self.waitlist = Waitlist()
        self.hold_count: dict[str, int] = {}  # lease id -> open Hold streams
        self.unheld_since: dict[str, float] = {}  # lease id -> when its last Hold stream closed
        self.restored_unheld: set[str] = set()  # restored leases whose holder has not reconnected yet
        self._lease_streams: dict[str, set[asyncio.Queue]] = {}
        self._watchers: set[asyncio.Queue] = set()
        self.moves = Moves(self)
        self.rightsizer: Sizing | None = None  # set by the daemon (xpud.controllers.rightsizer)
        self.queue_order: QueueOrder | None = None  # set by the daemon (xpud.controllers.accounts)
        self._busy: set[int] = set()  # cards with backend work in flight
        self._freed: list[asyncio.Future] = []  # woken when a busy card is free again
        self._ending: set[str] = set()  # leases whose end is being committed
        # called on the loop with each ended lease once its end is committed, however it ended; a hook
        # answers at once (hooks.py's rule). The daemon's: stop the lease's device scope (isolation/scope.py)
        self.on_ended: list[Callable[[Lease], None]] = []
        self._granting: set = set()  # waiters whose grant is under way
        self._tasks: set[asyncio.Task] = set()
        self._pump_scheduled = False
        self._pumps = 0  # passes over the queue so far
        self._pump_timer: asyncio.TimerHandle | None = None  # a pump asked for later (bursts)
        self._next_tidy = 0.0
        self._granting_uids: dict[int, int] = {}  # uid -> grants under way
        self._arriving_uids: dict[int, int] = {}  # uid -> requests in try_grant, not yet granted or queued
        self._granting_accounts: dict[str, float] = {}  # account -> GPU-equivalents of grants under way
        self._capacities: dict[int, tuple[tuple, CardCapacity]] = {}  # card -> (what it depends on, it)
        self.stats = Stats()  # counters and latencies for /metrics (xpud.daemon.metrics)
        self.window: WindowSpec | None = None  # the capacity window in force (xpud.planning.windows), if any
        self.standby = Standby(self)  # slices pre-created ahead of a forecast peak (xpud.engine.standby)

    async def restore(self) -> list[Lease]:
        """Rebuild state from the ledger (after a start or crash). Returns the active leases."""
        records = self.ledger.cards()
        by_uuid = {c.info.uuid: c for c in self.cards.values()}
        for uuid, rec in records.items():
            card = by_uuid.get(uuid)
            if card:
                card.mode, card.pinned = CardMode(rec.mode), rec.mode_pinned
                card.drained, card.drain_reason = rec.drained, rec.drain_reason
        restored = []
        now = self.clock()
        for lease in self.ledger.active_leases():
            missing = [u for u in lease.card_uuids if u not in by_uuid]
            if missing:
                why = f"card {missing[0]} is gone"
                if await self._try_write(self.ledger.end_lease_op(lease.id, LeaseState.RECLAIMED, why)):
                    self.event("reclaim", f"lease {lease.id} reclaimed at start-up: {why}", lease_id=lease.id)
                continue
            # Card indices can change across reboots: trust UUIDs.
            indices = tuple(by_uuid[u].info.index for u in lease.card_uuids)
            lease = replace(lease, cards=indices)
            self.leases[lease.id] = lease
            if lease.mode is Mode.XPU:
                for i in indices:
                    self.cards[i].whole_lease = lease.id
                    self.cards[i].mode = CardMode.WHOLE
            else:
                for s in lease.slices:
                    s = replace(s, card_index=by_uuid[lease.card_uuids[0]].info.index)
                    self.cards[s.card_index].slices[lease.id] = s
                    self.cards[s.card_index].mode = CardMode.SLICED
            if not lease.anchor:  # an anchored lease lives as long as its job or pod, not a Hold stream
                self.unheld_since[lease.id] = now  # holders get restore_grace_s from ``serving``
                self.restored_unheld.add(lease.id)
            restored.append(lease)
        if restored:
            self.event("restore", f"restored {len(restored)} active lease(s) from the ledger")
        gone = self.standby.load(self.ledger.standby(), {u: c.info.index for u, c in by_uuid.items()})
        if gone:
            await self._try_write(*gone)
        await self._reconcile()
        return [lease for lease in restored if lease.id in self.leases]

    def serving(self) -> None:
        """The daemon serves again: the grace of restored leases starts now, not at ``restore`` (start-up
        and reconciling may take a while, and holders cannot reconnect before this)."""
        now = self.clock()
        for lid in self.restored_unheld & set(self.unheld_since):
            self.unheld_since[lid] = now

    async def _reconcile(self) -> None:
        """Compare each card's isolation on the hardware (MIG instances, MPS daemons) with the ledger:
        the backend adopts what matches and cleans up orphans; leases whose slice is gone are reclaimed."""
        lost: dict[str, str] = {}
        for i, c in sorted(self.cards.items()):
            held = [Held(lid, self.leases[lid].owner_uid, s) for lid, s in sorted(c.slices.items())]
            held += self.standby.helds(i) if self.standby.supported(i) else []
            await self._wait_claim([i])
            try:
                found = await self.run_blocking(self._backends[i].reconcile, c.info, c.mode, held)
            except Exception as e:  # one card's trouble must not stop the daemon: say so and go on
                log.exception("reconciling card %d failed", i)
                self.event("error", f"card {i}: reconciling its isolation failed: {e}", card=i)
                found = None
            finally:
                self._unclaim([i])
            if found is None:
                continue
            for note in found.notes:
                self.event("reconcile", note, card=i)
            for lid in found.lost:
                lost[lid] = f"its slice on card {i} is gone from the hardware (found at start-up)"
            gone = self.standby.spent([i])  # pre-created instances not found (or not adopted)
            if gone and await self._try_write(*self.standby.drop_ops(gone)):
                self.standby.forget(gone)
            if c.whole_lease is None and found.mode is not c.mode and not set(c.slices) - set(found.lost):
                c.mode = found.mode  # the hardware's mode (recorded when the ledger can take it)
                await self._try_write(self.ledger.save_card_op(c.record()))
        for lid, why in lost.items():
            if lid.startswith(STANDBY):
                continue
            try:
                await self.reclaim(lid, why)
            except LedgerUnavailable as e:  # the reaper tries again after the grace period
                log.error("lease %s: %s", lid, e)

    @uninterrupted
    async def drain(self, selector: str, reason: str = "") -> CardView:
        c = self.resolve_card(selector)
        reason = reason or "drained by an operator"
        await self.ledger.write(
            self.ledger.save_card_op(replace(c.record(), drained=True, drain_reason=reason))
        )
        c.drained, c.drain_reason = True, reason
        self.event("drain", f"card {c.info.index} drained: {c.drain_reason}", card=c.info.index)
        return self._view(c)

    @uninterrupted
    async def undrain(self, selector: str) -> CardView:
        c = self.resolve_card(selector)
        await self.ledger.write(self.ledger.save_card_op(replace(c.record(), drained=False, drain_reason="")))
        c.drained, c.drain_reason = False, ""
        if c.health_state is HealthState.UNHEALTHY:  # the operator's drain is gone; the monitor's stays
            msg = f"card {c.info.index}: operator drain lifted; still out while unhealthy: {c.health_reason}"
        else:
            msg = f"card {c.info.index} back in service"
        self.event("undrain", msg, card=c.info.index)
        self.pump()
        return self._view(c)

    @uninterrupted
    async def set_mode(self, selector: str, mode: str) -> CardView:
        c = self.resolve_card(selector)
        i = c.info.index
        if mode not in ("auto", "whole", "sliced"):
            raise BadRequest(f"mode {mode!r}: use whole, sliced or auto")
        if mode == "auto":
            await self.ledger.write(self.ledger.save_card_op(replace(c.record(), mode_pinned=False)))
            c.pinned = False
        else:
            await self._wait_claim([i])
            try:
                await self._switch(c, CardMode(mode), pinned=True, why="")
            finally:
                self._unclaim([i])
        self.event("mode", f"card {i} set to {mode} by an operator", card=i)
        self.pump()
        return self._view(c)

    def set_window(self, window: WindowSpec | None) -> None:
        """The capacity window in force from now (None: none); ``keep_whole`` applies its share."""
        if window != self.window:
            self.window = window
            if window is None:
                self.event("window", "no capacity window in force: every card may be sliced")
            else:
                usable = sum(c.usable for c in self.cards.values())
                need = whole_needed(window.whole_share, usable)
                self.event(
                    "window",
                    f"capacity window {window.name!r} in force: keeps {window.whole_share:.0%} of the usable "
                    f"cards whole ({need} of {usable}); running work is never evicted",
                )
            self.pump()

    async def keep_whole(self) -> list[int]:
        """Switch idle sliced cards back to whole until the window's share is met: not pinned ones, and not
        ones switched less than ``[bursts] hold_s`` ago (hysteresis). Never touches a card in use.
        Returns the cards switched."""
        out: list[int] = []
        hold = self.cfg.bursts.hold_s
        now = self.clock()
        idle = sorted(
            (c for c in self.cards.values() if c.mode is CardMode.SLICED and c.idle and c.usable),
            key=lambda c: c.switched_at,
        )
        for c in idle:
            if self.whole_short() <= 0 or self.window is None:
                break
            if c.switched_at and now - c.switched_at < hold:
                continue
            why = f"capacity window {self.window.name!r} keeps {self.window.whole_share:.0%} whole"
            if await self.to_whole(c.info.index, why):
                self.stats.conversions[("whole", "window")] += 1
                out.append(c.info.index)
        return out

    @uninterrupted
    async def to_sliced(self, index: int, reason: str) -> bool:
        """Switch an idle whole card (not pinned) to sliced ahead of demand (forecast pre-provisioning),
        unless the capacity window in force keeps it whole. Returns whether it switched."""
        c = self.cards[index]
        if index in self._busy or c.mode is not CardMode.WHOLE or not c.idle or c.pinned or not c.usable:
            return False
        if self.whole_short(1) > 0:
            return False
        self._claim([index])
        try:
            if await self.run_blocking(self._backends[index].switch_blocker, c.info, True):
                return False
            await self._switch(c, CardMode.SLICED, pinned=False, why=reason)
        finally:
            self._unclaim([index])
        return True

    @uninterrupted
    async def to_whole(self, index: int, reason: str) -> bool:
        """Give an idle sliced card (not pinned) back to whole-card work now, as a whole-card grant would;
        the defragmenter does this for the cards it freed. Returns whether it switched."""
        c = self.cards[index]
        if index in self._busy or c.mode is not CardMode.SLICED or not c.idle or c.pinned:
            return False
        self._claim([index])
        try:
            if await self.run_blocking(self._backends[index].switch_blocker, c.info, False):
                return False  # e.g. a process still runs on the MIG card: the next run tries again
            await self._switch(c, CardMode.WHOLE, pinned=False, why=reason)
        finally:
            self._unclaim([index])
        return True

    def set_sample(self, index: int, sample: CardSample) -> None:
        self.cards[index].sample = sample

    def set_health(self, index: int, state: HealthState, score: int, reason: str = "") -> None:
        """The health monitor's verdict: degraded cards are avoided, unhealthy ones unusable (drained
        until they recover; an operator's own drain is separate and stays)."""
        c = self.cards[index]
        before = c.usable
        c.health_state, c.health_score = state, score
        c.health_reason = reason if state is not HealthState.HEALTHY else ""
        if c.usable and not before:
            self.pump()
        self._changed()

    @uninterrupted
    async def move(
        self,
        lease_id: str,
        reason: str,
        *,
        avoid: Collection[int] = (),
        to: Collection[int] | None = None,
        timeout_s: float | None = None,
    ) -> Lease:
        """Move a restartable lease elsewhere (see ``xpud.engine.moves``): reserve, send ``move``, await
        AckMove.
        Returns the lease as it will be. Raises NoCapacity (nowhere to go) or Conflict."""
        return await self.moves.start(lease_id, reason, avoid=avoid, to=to, timeout_s=timeout_s)

    @uninterrupted
    async def ack_move(self, lease_id: str, token: str) -> Lease:
        """The holder stopped its command after a ``move``: commit the new placement and return it."""
        return await self.moves.ack(lease_id, token)

    @uninterrupted
    async def ack_anchored_move(self, lease_id: str, anchor: str) -> Lease:
        """``ack_move`` for a lease the daemon holds itself (a restartable detached job, ``anchor``
        ``job:<id>``): no token needed, so none is kept across a restart; the lease's anchor must match."""
        return await self.moves.ack(lease_id, None, anchor)
