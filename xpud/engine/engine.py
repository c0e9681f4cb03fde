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
isolation backend.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from xpud.config.schema import Config
from xpud.engine.hooks import Sizing
from xpud.engine.moves import Moves
from xpud.engine.standby import Standby
from xpud.engine.stats import Stats
from xpud.engine.uninterrupted import uninterrupted
from xpud.engine.waitlist import Waiter, Waitlist, kind_of
from xpud.errors import BadRequest, Conflict, Forbidden, NoCapacity, NotFound, Unavailable
from xpud.isolation.base import STANDBY, Accounting, Held, Isolation, usable_memory, used_shares
from xpud.ledger.ledger import CardRecord, EventRecord, Ledger, LedgerUnavailable, Op
from xpud.model import (
    Caller,
    CardInfo,
    CardMode,
    CardSample,
    CardView,
    CommandEnd,
    HealthState,
    Lease,
    LeaseState,
    Mode,
    QueuedRequest,
    Request,
    Slice,
)
from xpud.placement.host import CardCapacity, best_group, choose_slice_card
from xpud.planning.windows import WindowSpec, whole_needed
from xpud.topology import Topology

log = logging.getLogger("xpud.engine.engine")

TIDY_INTERVAL_S = 1.0  # isolation upkeep (MIG instances, MPS servers kept idle past their grace)
QUEUE_BUSY_WAIT_S = 0.5  # the same for a request that may wait in the queue (then it is queued)
BUSY_WAIT_S = 10.0  # how long a request with no --wait waits for busy cards before it is refused


@dataclass
class CardState:
    """Mutable per-card state inside the engine."""

    info: CardInfo
    mode: CardMode = CardMode.WHOLE
    pinned: bool = False
    drained: bool = False
    drain_reason: str = ""
    health_state: HealthState = HealthState.HEALTHY
    health_score: int = 100
    health_reason: str = ""  # why the health monitor took it out (unhealthy) or avoids it (degraded)
    whole_lease: str | None = None
    slices: dict[str, Slice] = field(default_factory=dict)  # lease id -> slice
    sample: CardSample | None = None
    switched_at: float = 0.0  # when the engine last switched its mode (engine clock; 0: never)

    @property
    def idle(self) -> bool:
        return self.whole_lease is None and not self.slices

    @property
    def usable(self) -> bool:
        return not self.drained and self.health_state is not HealthState.UNHEALTHY

    def record(self) -> CardRecord:
        return CardRecord(self.info.uuid, self.mode.value, self.pinned, self.drained, self.drain_reason)


@dataclass(frozen=True)
class LeaseEvent:
    kind: str  # "held", "move", "revoke", "mark", "released"
    lease: Lease
    message: str = ""
    timestamp: float = 0.0


class Engine:
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
        self._busy: set[int] = set()  # cards with backend work in flight
        self._freed: list[asyncio.Future] = []  # woken when a busy card is free again
        self._ending: set[str] = set()  # leases whose end is being committed
        self._granting: set = set()  # waiters whose grant is under way
        self._tasks: set[asyncio.Task] = set()
        self._pump_scheduled = False
        self._pumps = 0  # passes over the queue so far
        self._pump_timer: asyncio.TimerHandle | None = None  # a pump asked for later (bursts)
        self._next_tidy = 0.0
        self._granting_uids: dict[int, int] = {}  # uid -> grants under way
        self._arriving_uids: dict[int, int] = {}  # uid -> requests in try_grant, not yet granted or queued
        self._capacities: dict[int, tuple[tuple, CardCapacity]] = {}  # card -> (what it depends on, it)
        self.stats = Stats()  # counters and latencies for /metrics (xpud.daemon.metrics)
        self.window: WindowSpec | None = None  # the capacity window in force (xpud.planning.windows), if any
        self.standby = Standby(self)  # slices pre-created ahead of a forecast peak (xpud.engine.standby)

    # ------------------------------------------------------------------ restore and views
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

    async def _try_write(self, *ops: Op) -> bool:
        """Commit ``ops``; on failure log it and return False (for work that is retried later)."""
        try:
            await self.ledger.write(*ops)
            return True
        except LedgerUnavailable as e:
            log.error("%s", e)
            return False

    # ------------------------------------------------------------------ busy cards, backend calls
    def _claim(self, cards: Iterable[int]) -> None:
        """Mark free cards busy (call right after choosing them: no await in between)."""
        cards = list(cards)
        assert not self._busy.intersection(cards), f"cards {cards} are busy"
        self._busy.update(cards)

    def _unclaim(self, cards: Iterable[int]) -> None:
        self._busy.difference_update(cards)
        waiters, self._freed = self._freed, []
        for f in waiters:
            if not f.done():
                f.set_result(None)
        self._pump_soon()

    def _card_freed(self) -> asyncio.Future:
        """A future done when some busy card is free again, listening from this call on (a coroutine
        that registered only when first run missed a card freed before that: under ``wait_for`` on
        Python 3.11 a request waiting for a switching card then slept its whole wait)."""
        f = asyncio.get_running_loop().create_future()
        self._freed.append(f)
        return f

    async def _wait_claim(self, cards: Iterable[int]) -> None:
        """Wait until none of ``cards`` is busy, then claim them."""
        cards = list(cards)
        while self._busy.intersection(cards):
            await self._card_freed()
        self._claim(cards)

    async def run_blocking(self, fn: Callable, *args, inline: bool = False):
        """Run blocking work off the loop: a backend call (the caller holds the card's claim), or a
        controller's hardware read or file write. Bookkeeping-only backends, and calls the caller knows to
        be bookkeeping (``inline``), run on the loop. A full disk is ``Unavailable`` with one line."""
        try:
            if inline or isinstance(getattr(fn, "__self__", None), Accounting):
                return fn(*args)
            return await asyncio.to_thread(fn, *args)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # As the ledger's "full": one line that says what is full; the caller undoes what it began.
            where = f" in {Path(e.filename).parent}" if e.filename else ""
            raise Unavailable(
                f"disk full: no space left{where} ({getattr(fn, '__name__', 'hardware')}); "
                "nothing granted or changed: free space there and retry"
            ) from None

    def _bookkeeping(self, index: int, op: str, lease_id: str, owner_uid: int = -1) -> bool:
        """Whether card ``index``'s backend says ``op`` ("prepare", "teardown") for ``lease_id`` (of
        ``owner_uid``, for a prepare) runs no tool now (e.g. MPS with its control daemon known to run and
        no other user's idle server to shut down): then it runs on the loop, and the card's claim is not
        held across an await (other grants do not wait for it)."""
        needs_tool = getattr(self._backends[index], "needs_tool", None)
        return needs_tool is not None and not needs_tool(op, lease_id, owner_uid)

    def _inline(self, index: int, op: str, lease_id: str, owner_uid: int = -1) -> bool:
        """Whether card ``index``'s ``op`` for ``lease_id`` runs on the loop (as ``run_blocking`` decides)."""
        return isinstance(self._backends[index], Accounting) or self._bookkeeping(
            index, op, lease_id, owner_uid
        )

    def _spawn(self, coro: Awaitable, what: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %s", what, t.exception())

        task.add_done_callback(done)
        return task

    def busy_cards(self) -> set[int]:
        """Cards with backend work in flight (left out of placement until it ends)."""
        return set(self._busy)

    def card_views(self) -> list[CardView]:
        return [self._view(c) for c in sorted(self.cards.values(), key=lambda c: c.info.index)]

    def _view(self, c: CardState) -> CardView:
        mem, pct = used_shares(list(c.slices.values()), c.info, self.reserved(c.info))
        if c.whole_lease:
            mem, pct = 1.0, 100
        sick = c.health_state is HealthState.UNHEALTHY  # drained by the health monitor until it recovers
        info = c.info
        if info.mig_capable and self._backends[info.index].name == "mig":
            info = replace(info, mig_enabled=c.mode is CardMode.SLICED)  # MIG is on exactly when sliced
        return CardView(
            info=info,
            mode=c.mode,
            mode_pinned=c.pinned,
            drained=c.drained or sick,
            drain_reason=c.drain_reason or (f"unhealthy: {c.health_reason}" if sick else ""),
            health_state=c.health_state,
            health_score=c.health_score,
            whole_lease=c.whole_lease,
            slices=tuple(sorted(c.slices.items())),
            free_memory_fraction=max(0.0, round(1 - mem, 6)),
            free_compute_pct=max(0, 100 - pct),
            sample=c.sample,
        )

    def isolation_name(self, index: int) -> str:
        return self._backends[index].name

    def mig_device_ids(self, index: int, uuid: str) -> tuple[int, int] | None:
        """(GPU instance id, compute instance id) of MIG device ``uuid`` on card ``index``, from the
        isolation backend's records (no NVML call); None when it is not a MIG device there. The bridges
        name a MIG slice's capability nodes with them (``hw/devnodes.py``)."""
        ids = getattr(self._backends[index], "device_ids", None)
        return ids(uuid) if ids is not None else None

    def lease_list(self) -> list[Lease]:
        return sorted(self.leases.values(), key=lambda lease: lease.created)

    def queue_view(self) -> list[QueuedRequest]:
        return self.waitlist.view()

    def is_held(self, lease_id: str) -> bool:
        return self.hold_count.get(lease_id, 0) > 0

    # ------------------------------------------------------------------ resolving names
    def resolve_card(self, selector: str) -> CardState:
        s = selector.strip()
        if s.isascii() and s.isdigit():  # str.isdigit() also takes "²" and "٣"
            if int(s) in self.cards:
                return self.cards[int(s)]
            raise NotFound(f"no card {s}: this host has cards 0..{len(self.cards) - 1} (see `xpu ls`)")
        matches = [c for c in self.cards.values() if s and c.info.uuid.lower().startswith(s.lower())]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFound(f"no card matches {selector[:80]!r}: give an index or a UUID (see `xpu ls`)")
        raise BadRequest(f"{selector[:80]!r} matches {len(matches)} cards: give more of the UUID")

    def resolve_lease(self, selector: str) -> Lease:
        if selector in self.leases:
            return self.leases[selector]
        matches = [lease for lid, lease in self.leases.items() if selector and lid.startswith(selector)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFound(f"no active lease {selector!r} (see `xpu leases`)")
        raise BadRequest(f"{selector!r} matches {len(matches)} leases: give more of the id")

    # ------------------------------------------------------------------ placement
    def validate(self, req: Request) -> Request:
        """Check a request against this host and the config; raise BadRequest with the fix."""
        n = len(self.cards)
        if req.cards:
            self._validate_pinned(req)
        if req.mode is Mode.XPU:
            if not 1 <= req.gpus <= n:
                raise BadRequest(f"--gpus {req.gpus}: this host has {n} card(s); ask for 1..{n}")
        elif req.gpus != 1:
            raise BadRequest(
                f"--gpus {req.gpus} with mode {req.mode}: a slice is part of one card; "
                "use --gpus 1 or --mode xpu"
            )
        elif req.mode.value not in self.cfg.slices:
            sizes = ", ".join(["xpu", *self.cfg.slices])
            raise BadRequest(f"mode {req.mode!r}: no such slice size in the config; use one of {sizes}")
        cap = self.cfg.leases.max_priority
        if not -cap <= req.priority <= cap:
            raise BadRequest(f"priority {req.priority} is outside -{cap}..{cap}")
        if not 0 <= req.wait_s <= self.cfg.leases.max_wait_s:
            raise BadRequest(f"--wait {req.wait_s:g}: must be 0..{self.cfg.leases.max_wait_s:g} seconds")
        if req.not_before and not 0 < req.not_before - self.clock() <= 31 * 86400.0:
            raise BadRequest(f"not_before {req.not_before!r}: must be within 31 days from now")
        top = self.cfg.limits.max_user_priority
        if not req.exempt and req.priority > top:
            raise Forbidden(
                f"priority {req.priority}: uid {req.owner_uid} may ask for {top} at most "
                "([limits] max_user_priority; operators may go higher)"
            )
        return req

    def _validate_pinned(self, req: Request) -> None:
        unknown = [i for i in req.cards if i not in self.cards]
        if unknown:
            raise BadRequest(f"card {unknown[0]}: no such card here (cards 0..{len(self.cards) - 1})")
        if len(set(req.cards)) != len(req.cards):
            raise BadRequest(f"cards {list(req.cards)}: a card is named twice")
        if req.mode is Mode.XPU and req.gpus != len(req.cards):
            raise BadRequest(f"--gpus {req.gpus} with cards {list(req.cards)}: name as many cards as --gpus")

    def check_limits(self, req: Request) -> None:
        """[limits] for a grant that does not queue (a multi-host job's reservation is a lease)."""
        self._check_limits(req, queueing=False)

    def _check_limits(self, req: Request, queueing: bool) -> None:
        """Per-uid caps of [limits] (operators and exempt groups pass). Raises NoCapacity naming the key."""
        lim = self.cfg.limits
        if req.exempt:
            return
        uid = req.owner_uid
        queued = self.waitlist.count_of(uid)
        if queueing:
            if lim.max_queued_per_uid and queued >= lim.max_queued_per_uid:
                raise NoCapacity(
                    f"uid {uid} has {queued} request(s) in the queue, the most [limits] max_queued_per_uid "
                    f"({lim.max_queued_per_uid}) allows: wait for one to be granted or stop one"
                )
            return
        if not lim.max_leases_per_uid:
            return
        held = sum(1 for lease in self.leases.values() if lease.owner_uid == uid)
        held += self._granting_uids.get(uid, 0)  # grants under way count as held
        held += self._arriving_uids.get(uid, 0)  # and requests on their way to a grant (or the queue)
        if held + queued >= lim.max_leases_per_uid:
            raise NoCapacity(
                f"uid {uid} has {held} lease(s) and {queued} queued request(s), the most [limits] "
                f"max_leases_per_uid ({lim.max_leases_per_uid}) allows: release a lease first"
            )

    def _capacity(self, c: CardState, avoid_extra: bool = False, usable: bool | None = None) -> CardCapacity:
        """``usable`` overrides the card's own (placement's feasibility), without a copy of the record.
        Kept per card while nothing it is computed from changes (every slice grant asks it of every
        card; its slices are compared by identity first, so an unchanged card costs one tuple)."""
        usable = c.usable if usable is None else usable
        slices = tuple(c.slices.values())
        key = (c.info, c.mode, c.whole_lease, slices, usable, c.health_score, c.health_state, c.pinned,
               avoid_extra, self.reserved(c.info))  # fmt: skip
        kept = self._capacities.get(c.info.index)
        if kept is not None and kept[0] == key:
            return kept[1]
        if usable is False:
            mem, pct = 1.0, 100  # placement skips an unusable card: its shares are not read
        else:
            mem, pct = used_shares(slices, c.info, self.reserved(c.info))
        cap = CardCapacity(
            index=c.info.index,
            sliced=c.mode is CardMode.SLICED,
            idle=c.idle,
            usable=usable,
            free_memory_fraction=max(0.0, 1 - mem),
            free_compute_pct=100 - pct,
            health_score=c.health_score,
            mode_pinned=c.pinned,
            avoid=c.health_state is HealthState.DEGRADED or avoid_extra,
        )
        self._capacities[c.info.index] = (key, cap)
        return cap

    def reserved(self, card: CardInfo) -> int:
        """Bytes of ``card``'s memory its isolation backend keeps back from slices."""
        return self._backends[card.index].reserved_bytes  # [cards] reserved_memory_mib, or its estimate

    def _whole_candidates(self, keep_whole_only: bool, exclude: frozenset[int] = frozenset()) -> list[int]:
        out = []
        for c in self.cards.values():
            if not (c.usable and c.idle) or c.info.index in exclude or c.info.index in self._busy:
                continue
            if c.mode is CardMode.SLICED and (c.pinned or keep_whole_only):
                continue
            if c.mode is CardMode.SLICED and self._backends[c.info.index].switch_blocker(c.info, False):
                continue  # e.g. MIG cannot be switched off now
            if c.mode is CardMode.WHOLE or not c.pinned:
                out.append(c.info.index)
        return out

    def _place_xpu(
        self, req: Request, reserve_whole: bool, exclude: frozenset[int] = frozenset()
    ) -> tuple[int, ...] | None:
        if reserve_whole:
            return None
        scores = {i: c.health_score for i, c in self.cards.items()}
        degraded = [i for i, c in self.cards.items() if c.health_state is HealthState.DEGRADED]
        whole, anyfree = self._whole_candidates(True, exclude), self._whole_candidates(False, exclude)
        g_whole = best_group(self.topology, whole, req.gpus, scores, avoid=degraded)
        if anyfree == whole:  # no idle sliced card could switch back: the same question, the same answer
            return g_whole
        g_any = best_group(self.topology, anyfree, req.gpus, scores, avoid=degraded)
        if g_whole and (not g_any or self._group_key(g_whole, degraded) <= self._group_key(g_any, degraded)):
            return g_whole  # as good without switching an (empty) sliced card back to whole
        return g_any

    def _group_key(self, group: tuple[int, ...], degraded: list[int]) -> tuple[int, float]:
        return sum(i in degraded for i in group), round(self.topology.allreduce_seconds(group), 12)

    def _place_slice(
        self, req: Request, reserve_whole: bool, exclude: frozenset[int] = frozenset(), windows: bool = True
    ) -> int | None:
        spec = self.cfg.slices[req.mode.value]
        caps = []
        # An idle whole card may be converted unless pinned, reserved for a waiting whole-card request, or
        # kept whole by the capacity window in force (``windows``; a bridge's pinned card is not held back).
        reserve_whole = reserve_whole or (windows and self.whole_short(1) > 0)
        # Cards holding a pre-created slice of this size serve it first, without creating anything.
        ready = self.standby.ready(spec.name) - exclude - self._busy if self.standby.slices else None
        displaces = []  # sliced cards whose MPS server is kept idle for another uid: last (host.py)
        # Only the cards that can take it are passed (placement reads nothing of an unusable card). Sliced
        # cards first: when one that is not degraded takes the slice, no whole card is converted
        # (choose_slice_card), so the whole cards are not looked at (their feasibility is a backend call).
        sliced_fits = False
        for pass_sliced in (True, False):
            if sliced_fits:
                break
            for c in self.cards.values():
                if (c.mode is CardMode.SLICED) is not pass_sliced or (ready and c.info.index not in ready):
                    continue
                convertible = pass_sliced or (c.idle and not c.pinned and not reserve_whole)
                feasible = (
                    c.usable
                    and c.info.index not in exclude
                    and c.info.index not in self._busy  # its backend is at work: not to be read now
                    and convertible
                    and self._backends[c.info.index].fits(
                        c.info, list(c.slices.values()), spec, req.owner_uid
                    )
                )
                if not feasible:
                    continue
                caps.append(self._capacity(c, usable=True))
                if pass_sliced:
                    sliced_fits = sliced_fits or c.health_state is not HealthState.DEGRADED
                    if not c.slices:
                        idle = getattr(self._backends[c.info.index], "idle_server", None)
                        if idle is not None and idle() not in (None, req.owner_uid):
                            displaces.append(c.info.index)
        # The backend decided feasibility (MIG geometry, MPS shares); placement only ranks. The whole-card
        # pool (for the harm a conversion does) includes pinned and reserved idle whole cards; it is read
        # only when a whole card is converted (never when a sliced card fits: no whole card is passed).
        pool = () if sliced_fits else self._whole_candidates(True)
        rs = self.rightsizer  # ties between sliced cards: co-location on MPS cards (hooks.Sizing)
        tie = None if rs is None else rs.colocation(req)
        return choose_slice_card(
            caps, 0.0, 0, self.topology, free_whole=pool, tie_break=tie, displaces=displaces
        )

    def _fit(
        self, req: Request, reserve_whole: bool = False, exclude: frozenset[int] = frozenset()
    ) -> tuple[int, ...] | None:
        """Cards for ``req`` now, or None. ``exclude``: cards it must not use (a move's source)."""
        t0 = time.perf_counter()
        try:
            if req.cards:  # placed elsewhere (Slurm, kubelet): these cards or nothing, ahead of the queue
                return self._place_pinned(req, exclude)
            if req.mode is Mode.XPU:
                return self._place_xpu(req, reserve_whole, exclude)
            card = self._place_slice(req, reserve_whole, exclude)
            return None if card is None else (card,)
        finally:
            self.stats.decision.observe(time.perf_counter() - t0)

    def _place_pinned(self, req: Request, exclude: frozenset[int]) -> tuple[int, ...] | None:
        if req.mode is Mode.XPU:
            free = set(self._whole_candidates(False, exclude))
            return req.cards if free.issuperset(req.cards) else None
        card = self._place_slice(
            req, False, exclude | (frozenset(self.cards) - set(req.cards)), windows=False
        )
        return None if card is None else (card,)

    def _why_not_pinned(self, req: Request) -> str:
        reasons = []
        for i in req.cards:
            c = self.cards[i]
            if not c.usable:
                reasons.append(f"card {i} is {'drained' if c.drained else c.health_state.value}")
            elif c.whole_lease or (req.mode is Mode.XPU and c.slices):
                held = c.whole_lease or ", ".join(c.slices)
                reasons.append(f"card {i} is held by lease {held}")
            elif i in self._busy:
                reasons.append(f"card {i} is busy being reconfigured")
        why = "; ".join(reasons) or "no room for it there"
        return f"{req.mode} on card(s) {','.join(map(str, req.cards))} asked: {why}"

    # ------------------------------------------------------------------ what fits now (bridges)
    def free_whole_cards(self) -> list[int]:
        """Cards a whole-card request could take now (idle, usable, not pinned sliced)."""
        return self._whole_candidates(False)

    def slice_room(self, index: int, size: str, most: int = 16) -> int:
        """How many more ``size`` slices card ``index`` takes now, one after another (0 when it is held
        whole, drained, unhealthy, busy, or pinned whole). For the kubelet plugin's slots. A MIG card
        answers 0 or 1: its geometry is read from the hardware, so only the next slice can be checked."""
        c, spec = self.cards[index], self.cfg.slices[size]
        convertible = c.mode is CardMode.SLICED or (c.idle and not c.pinned)
        if not (c.usable and convertible and index not in self._busy):
            return 0
        backend, held = self._backends[index], list(c.slices.values())
        if self.isolation_name(index) == "mig":
            return int(backend.fits(c.info, held, spec))
        n = 0
        mem = int(usable_memory(c.info, backend.reserved_bytes) * spec.memory_fraction)  # as prepare makes it
        while n < most and backend.fits(c.info, held, spec):
            held.append(Slice(index, size, mem, spec.compute_pct))
            n += 1
        return n

    def preferred_group(
        self, candidates: Collection[int], n: int, must: Collection[int] = ()
    ) -> tuple[int, ...]:
        """The group of ``n`` cards among ``candidates`` placement would choose (with ``must`` in it:
        completed card by card at the least all-reduce cost); () when there are too few."""
        pool = [i for i in candidates if i in self.cards]
        if len(pool) < n or not set(must) <= set(pool):
            return ()
        degraded = [i for i, c in self.cards.items() if c.health_state is HealthState.DEGRADED]
        if not must:
            scores = {i: c.health_score for i, c in self.cards.items()}
            return best_group(self.topology, pool, n, scores, avoid=degraded) or ()
        group = list(must)
        while len(group) < n:
            group.append(
                min((i for i in pool if i not in group), key=lambda i: self._group_key((*group, i), degraded))
            )
        return tuple(group[:n])

    def preferred_slice_card(self, size: str, candidates: Collection[int]) -> int | None:
        """The card among ``candidates`` a ``size`` slice would go to now."""
        exclude = frozenset(self.cards) - set(candidates)
        return self._place_slice(Request(mode=Mode(size)), False, exclude)

    def fit(self, req: Request) -> tuple[int, ...] | None:
        """The cards ``req`` would be granted now (placement only: nothing is claimed), or None."""
        return self._fit(req)

    def switch_blocker(self, index: int, to_sliced: bool) -> str:
        """Why card ``index``'s backend cannot switch it to sliced (``to_sliced``) or whole now; "" when it
        can. Read on the loop, as placement reads it."""
        return self._backends[index].switch_blocker(self.cards[index].info, to_sliced)

    def slice_fits(self, index: int, held: list[Slice], size: str, owner_uid: int) -> bool:
        """Whether card ``index``'s backend would take a ``size`` slice for ``owner_uid`` beside ``held``
        (a plan's slices, not necessarily the card's own)."""
        return self._backends[index].fits(self.cards[index].info, held, self.cfg.slices[size], owner_uid)

    def slice_limits(self, index: int, size: str, name: str) -> tuple[Slice, dict[str, str]]:
        """The slice and environment a ``size`` slice named ``name`` would get on card ``index``, made by
        nobody (bookkeeping only: e.g. MPS servers started ahead of demand)."""
        return self._backends[index].limits(self.cards[index].info, self.cfg.slices[size], name)

    # ------------------------------------------------------------------ grant
    def _new_id(self) -> tuple[str, str]:
        """A new lease's id (8 hex digits, in use nowhere) and its token (24 random bytes, URL-safe
        base64, as ``secrets.token_urlsafe(24)``), from one read of the system's random source."""
        taken = self.ledger.lease_ids()  # every id in the ledger and every one being inserted
        while True:
            raw = os.urandom(28)
            lid = raw[:4].hex()
            if lid not in taken and lid not in self.leases:
                return lid, base64.urlsafe_b64encode(raw[4:]).rstrip(b"=").decode()

    async def _place(
        self, lease_id: str, mode: Mode, cards: tuple[int, ...], owner_uid: int
    ) -> tuple[tuple[Slice, ...], dict[str, str], list[int]]:
        """Bring claimed ``cards`` into the mode ``mode`` needs and prepare its slice, then reserve them for
        ``lease_id`` in memory (whole card marked held, or the slice added). Returns (slices, environment,
        cards whose mode was switched). On failure everything is undone and the error raised."""
        want = CardMode.WHOLE if mode is Mode.XPU else CardMode.SLICED
        switched: list[int] = []
        try:
            for i in cards:
                c = self.cards[i]
                if c.mode is not want:  # idle: MIG on/off, MPS started/stopped
                    backend = self._backends[i]
                    fresh = await self.run_blocking(
                        backend.enter_sliced if want is CardMode.SLICED else backend.leave_sliced, c.info
                    )
                    self._renumbered(c, fresh)
                    c.mode = want
                    c.switched_at = self.clock()
                    switched.append(i)
            if mode is Mode.XPU or self._inline(cards[0], "prepare", lease_id, owner_uid):
                return (*self._place_now(lease_id, mode, cards, owner_uid), switched)
            c = self.cards[cards[0]]
            spec = self.cfg.slices[mode.value]
            held = list(c.slices.values())
            s, env = await self.run_blocking(
                self._backends[c.info.index].prepare,
                *(c.info, held, spec, lease_id, owner_uid),
                inline=self._bookkeeping(c.info.index, "prepare", lease_id, owner_uid),
            )
            c.slices[lease_id] = s
            return (s,), env, switched
        except BaseException:
            await self._switch_back(switched, "after a failed placement")
            raise

    def _place_now(
        self, lease_id: str, mode: Mode, cards: tuple[int, ...], owner_uid: int
    ) -> tuple[tuple[Slice, ...], dict[str, str]]:
        """``_place`` on cards already in the mode ``mode`` needs, when the slice's prepare runs no tool
        (``_inline``): no await. Returns (slices, environment)."""
        if mode is Mode.XPU:
            env = {"CUDA_VISIBLE_DEVICES": ",".join(self.cards[i].info.uuid for i in cards)}
            for i in cards:
                self.cards[i].whole_lease = lease_id
            return (), env
        c = self.cards[cards[0]]
        spec = self.cfg.slices[mode.value]
        s, env = self._backends[c.info.index].prepare(
            c.info, list(c.slices.values()), spec, lease_id, owner_uid
        )
        c.slices[lease_id] = s
        return (s,), env

    async def _switch_back(self, switched: list[int], why: str) -> None:
        """Undo the mode switches of ``_place`` (cards claimed by the caller); idle cards only."""
        for i in switched:
            c = self.cards[i]
            if not c.idle:
                continue
            back = CardMode.WHOLE if c.mode is CardMode.SLICED else CardMode.SLICED
            backend = self._backends[i]
            try:
                fresh = await self.run_blocking(
                    backend.enter_sliced if back is CardMode.SLICED else backend.leave_sliced, c.info
                )
                self._renumbered(c, fresh)
                c.mode = back
            except Exception as e:
                log.error("card %d: switching back to %s %s failed: %s", i, back, why, e)

    async def _unplace(
        self, lease_id: str, cards: tuple[int, ...], slices: tuple[Slice, ...], switched: list[int]
    ) -> None:
        """Undo ``_place`` after a failed commit: tear the slice down, switch the cards back."""
        await self._wait_claim(cards)
        try:
            await self._free(lease_id, cards, slices)
            await self._switch_back(switched, "after a failed commit")
        finally:
            self._unclaim(cards)

    async def _free(self, lease_id: str, cards: Iterable[int], slices: tuple[Slice, ...]) -> None:
        """Tear down ``slices`` and drop ``lease_id``'s hold on ``cards`` in memory (claims held by the
        caller). A teardown failure is logged loudly, never raised: the ledger has moved on already."""
        for s in slices:
            card = self.cards[s.card_index]
            try:
                inline = self._bookkeeping(s.card_index, "teardown", lease_id)
                await self.run_blocking(self._backends[s.card_index].teardown, card.info, s, inline=inline)
            except Exception as e:
                self._teardown_failed(lease_id, s, e)
        self._drop(lease_id, cards)

    def _free_now(self, lease_id: str, cards: Iterable[int], slices: tuple[Slice, ...]) -> None:
        """``_free`` when every teardown is bookkeeping (``_inline``) and no card is busy: no await."""
        for s in slices:
            try:
                self._backends[s.card_index].teardown(self.cards[s.card_index].info, s)
            except Exception as e:
                self._teardown_failed(lease_id, s, e)
        self._drop(lease_id, cards)

    def _teardown_failed(self, lease_id: str, s: Slice, e: Exception) -> None:
        log.error("teardown of %s on card %d failed: %s", lease_id, s.card_index, e)
        self.event("error", f"teardown of lease {lease_id} failed: {e}", card=s.card_index)

    def _drop(self, lease_id: str, cards: Iterable[int]) -> None:
        for i in cards:
            c = self.cards[i]
            if c.whole_lease == lease_id:
                c.whole_lease = None
            c.slices.pop(lease_id, None)

    async def _free_claimed(self, lease_id: str, cards: Iterable[int], slices: tuple[Slice, ...]) -> None:
        """``_free`` under the cards' claims. When one of them is busy (its backend at work, perhaps hung)
        this runs in the background and returns at once: the caller (a release, the reaper) goes on, and
        what the lease held stays reserved in memory until its teardown is done."""
        cards = list(cards)

        async def free() -> None:
            await self._wait_claim(cards)
            try:
                await self._free(lease_id, cards, slices)
            finally:
                self._unclaim(cards)

        if self._busy.intersection(cards):
            self._spawn(free(), f"freeing what lease {lease_id} held")
        else:
            await free()

    def _claim_for(self, req: Request, cards: tuple[int, ...]) -> None:
        """Claim ``cards`` for granting ``req`` now (no await before ``_grant`` is started): the grant
        counts against its uid's [limits] from this instant."""
        self._claim(cards)
        self._granting_uids[req.owner_uid] = self._granting_uids.get(req.owner_uid, 0) + 1

    def _grant(self, req: Request, cards: tuple[int, ...], queued_s: float | None = None) -> asyncio.Future:
        """Grant ``req`` on ``cards`` (claimed by the caller, unclaimed here): prepare, commit, then it is
        the caller's. A failed commit undoes the preparation. It runs to its end whatever its caller
        does: a plain future when nothing awaits before the commit (cards in the right mode, a prepare
        that runs no tool: the commit's completion carries on, on the loop; cancelling the future says
        the requester went away, and the lease is then ended), else a task (the caller shields it)."""
        lease_id, token = self._new_id()
        want = CardMode.WHOLE if req.mode is Mode.XPU else CardMode.SLICED
        if all(self.cards[i].mode is want for i in cards) and (
            req.mode is Mode.XPU or self._inline(cards[0], "prepare", lease_id, req.owner_uid)
        ):
            return self._grant_inline(req, cards, queued_s, lease_id, token)
        return asyncio.ensure_future(self._grant_task(req, cards, queued_s, lease_id, token))

    def _granted(self, uid: int) -> None:
        """A grant for ``uid`` ended (committed or not): it no longer counts as in flight."""
        n = self._granting_uids.pop(uid, 0) - 1
        if n > 0:
            self._granting_uids[uid] = n

    async def _grant_task(
        self, req: Request, cards: tuple[int, ...], queued_s: float | None, lease_id: str, token: str
    ) -> tuple[Lease, str]:
        try:
            return await self._grant_now(req, cards, queued_s, lease_id, token)
        finally:
            self._granted(req.owner_uid)

    def _grant_inline(
        self, req: Request, cards: tuple[int, ...], queued_s: float | None, lease_id: str, token: str
    ) -> asyncio.Future:
        out, t0 = asyncio.get_running_loop().create_future(), time.perf_counter()

        def committed(error: BaseException | None) -> None:  # on the loop
            self._granted(req.owner_uid)
            if error is not None:
                undo = self._spawn(self._unplace(lease_id, cards, slices, []), f"undoing lease {lease_id}")
                undo.add_done_callback(lambda _: None if out.done() else out.set_exception(error))
                return
            self.standby.forget(spent)
            self._grant_done(lease, events, t0)
            if out.done():  # its requester went away (cancelled): end what was made
                why = "its requester went away before the grant"
                self._spawn(self.reclaim(lease.id, why), f"reclaiming lease {lease.id}")
                return
            out.set_result((lease, token))

        try:
            slices, env = self._place_now(lease_id, req.mode, cards, req.owner_uid)
            spent = self.standby.spent(cards) if self.standby.slices else []  # pre-created, taken by it
            lease, ops, events = self._grant_record(
                req, cards, lease_id, token, slices, env, [], queued_s, spent
            )
            # committed before anyone is told
            self.ledger.submit_then(committed, *ops, *(o for _, o in events))
        except BaseException:
            self._granted(req.owner_uid)
            raise
        finally:
            self._unclaim(cards)
        return out

    def _converted(
        self, i: int, lease_id: str, req: Request, queued_s: float | None
    ) -> tuple[EventRecord, Op]:
        """The event (committed with the grant) and counter of a card switched to serve a request, with
        the reason."""
        mode = self.cards[i].mode
        if req.mode is Mode.XPU:
            why = f"a {req.gpus}-card request found too few idle whole cards"
        else:
            why = f"a {req.mode} request found no room on a sliced card"
        if queued_s is not None:
            why += f" (queued {queued_s:.2f} s, {len(self.waitlist)} still waiting)"
        self.stats.conversions[(mode.value, "demand")] += 1
        return self._event_op("mode", f"card {i} switched to {mode} for lease {lease_id}: {why}", i)

    async def _grant_now(
        self, req: Request, cards: tuple[int, ...], queued_s: float | None, lease_id: str, token: str
    ) -> tuple[Lease, str]:
        t0 = time.perf_counter()
        try:
            slices, env, switched = await self._place(lease_id, req.mode, cards, req.owner_uid)
            spent = self.standby.spent(cards) if self.standby.slices else []  # taken or undone by it
        finally:
            self._unclaim(cards)
        lease, ops, events = self._grant_record(
            req, cards, lease_id, token, slices, env, switched, queued_s, spent
        )
        try:
            await self.ledger.write(*ops, *(o for _, o in events))  # committed before anyone is told
        except BaseException:
            await self._unplace(lease_id, cards, slices, switched)
            raise
        self.standby.forget(spent)
        self._grant_done(lease, events, t0)
        return lease, token

    def _grant_record(
        self,
        req: Request,
        cards: tuple[int, ...],
        lease_id: str,
        token: str,
        slices: tuple[Slice, ...],
        env: dict[str, str],
        switched: list[int],
        queued_s: float | None,
        spent: list[str],
    ) -> tuple[Lease, list[Op], list[tuple[EventRecord, Op]]]:
        """The lease placed on ``cards``, its ledger writes (with the removal of the ``spent`` pre-created
        slices' records: taken by it, or undone for its room) and its events (committed together)."""
        infos = [self.cards[i].info for i in cards]
        base_env = {
            "XPU_LEASE_ID": lease_id,
            "XPU_MODE": req.mode.value,
            "XPU_RESTART_COUNT": "0",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
        lease = Lease(
            id=lease_id,
            mode=req.mode,
            owner_uid=req.owner_uid,
            cards=cards,
            card_uuids=tuple(c.uuid for c in infos),
            slices=slices,
            env={**env, **base_env},
            priority=req.priority,
            restartable=req.restartable,
            holder_pid=req.holder_pid,
            command=req.command[:500],
            name=req.name,
            created=self.clock(),
            anchor=req.anchor,
        )
        ops = [self.ledger.insert_lease_op(lease, token), *self.standby.drop_ops(spent)]
        ops += [self.ledger.save_card_op(self.cards[i].record()) for i in switched]
        where = ",".join(map(str, cards))
        events = [
            *(self._converted(i, lease_id, req, queued_s) for i in switched),
            self._event_op(
                "grant",
                f"lease {lease_id} ({req.mode}) on card {where} to uid {req.owner_uid}",
                cards[0] if len(cards) == 1 else -1,
                lease_id,
            ),
        ]
        return lease, ops, events

    def _grant_done(self, lease: Lease, events: list[tuple[EventRecord, Op]], t0: float) -> None:
        """A committed grant in memory."""
        self.leases[lease.id] = lease
        self.stats.grant.observe(time.perf_counter() - t0)
        if not lease.anchor:
            self.unheld_since[lease.id] = self.clock()  # the holder must open Hold within the grace period
        self._committed(events)

    async def try_grant(self, req: Request, wait_busy_s: float = BUSY_WAIT_S) -> tuple[Lease, str] | None:
        """Grant now if the request fits without jumping the queue; None otherwise. While some cards are
        busy, a request that fits on none of the others, or only by switching a card's mode, waits up to
        ``wait_busy_s`` for them first (the busy card may be the one it belongs on: packing and
        hysteresis stay as they are when requests come one at a time)."""
        self.validate(req)
        deadline = time.monotonic() + wait_busy_s
        uid = req.owner_uid
        self._arriving_uids[uid] = self._arriving_uids.get(uid, 0) + 1  # counts against [limits] meanwhile
        arriving = True
        try:
            while True:
                blocked_whole = self.waitlist.whole_waiting_at(req.priority)
                cards = self._fit(req, reserve_whole=blocked_whole)
                left = deadline - time.monotonic()
                if cards is not None and (left <= 0 or not self._busy or not self._switches(req, cards)):
                    arriving = self._arrived(uid)
                    self._check_limits(req, queueing=False)  # again at the grant: others came meanwhile
                    self._claim_for(req, cards)
                    grant = self._grant(req, cards)
                    if not isinstance(grant, asyncio.Task):
                        return await grant  # cancelled: the grant ends the lease it makes (see _grant)
                    try:
                        return await asyncio.shield(grant)
                    except asyncio.CancelledError:  # the requester went away: the grant runs to its end
                        grant.add_done_callback(self._orphaned)
                        raise
                if not self._busy or left <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._card_freed(), left)
        finally:
            if arriving:  # not granted: its caller queues it (no await before) or refuses it
                self._arrived(uid)

    def _arrived(self, uid: int) -> bool:
        """A request of ``uid`` in ``try_grant`` is granted, or leaves it: it no longer counts as on its
        way (the grant counts in ``_granting_uids``, a queued request in the waitlist). Returns False."""
        n = self._arriving_uids.pop(uid, 0) - 1
        if n > 0:
            self._arriving_uids[uid] = n
        return False

    def _orphaned(self, grant: asyncio.Future) -> None:
        """A grant whose requester went away: end the lease it made."""
        if not grant.cancelled() and grant.exception() is None:
            lease = grant.result()[0]
            why = "its requester went away before the grant"
            self._spawn(self.reclaim(lease.id, why), f"reclaiming lease {lease.id}")

    def _switches(self, req: Request, cards: tuple[int, ...]) -> bool:
        """Whether granting ``req`` on ``cards`` switches a card's mode."""
        want = CardMode.WHOLE if req.mode is Mode.XPU else CardMode.SLICED
        return any(self.cards[i].mode is not want for i in cards)

    async def grant_or_queue(
        self, req: Request, on_position: Callable[[QueuedRequest, int], None] | None = None
    ) -> tuple[Lease, str] | Waiter:
        """``acquire``'s first step: the grant if the request fits now (after the brief wait for busy
        cards), else its place in the queue (``on_position`` hears its positions), taken in the same
        step as the last try: no task, no await between. Raises NoCapacity when it may not queue. The
        caller then awaits ``queued(w)``, or calls ``leave(w)`` itself when it goes away."""
        self._check_limits(req, queueing=False)
        # A request that may queue waits for busy cards only briefly: beyond that it shows in the queue.
        busy_wait = BUSY_WAIT_S if req.wait_s <= 0 else min(QUEUE_BUSY_WAIT_S, req.wait_s)
        pumps = self._pumps
        deferred = req.not_before > self.clock()  # queued until its start (a green hour), room or not
        granted = None if deferred else await self.try_grant(req, busy_wait)
        if granted:
            return granted
        if req.wait_s <= 0 and not deferred:
            raise NoCapacity(self.why_not(req) + "; add --wait 10m (any duration, or inf) to queue for it")
        self._check_limits(req, queueing=True)
        # try_grant found no room in this very state (no await since): the queue needs a pass only if
        # one ran while it waited for busy cards, before this request was in it. (One pass per queued
        # request made queueing quadratic: 6,000 requests took minutes and gRPC cancelled the last.)
        reason = (
            "BeginTime"
            if deferred
            else self._pending_reason(req, reserved=self.waitlist.whole_waiting_at(req.priority))
        )
        w = self.waitlist.add(req, self.clock(), on_position)
        w.reason = reason  # a queue pass keeps it current; this request may see none for a while
        # Its deadline is a timer, not a wait_for around its future: a waiter that leaves (thousands
        # cancelled at once) costs one synchronous `leave`, no task, shield or timeout wrapper.
        w.timer = asyncio.get_running_loop().call_later(max(w.deadline - self.clock(), 0), self._expire, w)
        self._changed()
        if deferred:
            self._start_deferred(w)
        elif self._pumps != pumps:
            self._pump_soon()
        return w

    def _start_deferred(self, w: Waiter) -> None:
        """A deferred request's own timer: at its start it waits as any other, and the queue gets a pass
        (its own timer, not the pump's: a pass that stops early, every kind ahead having failed, never
        reaches it to ask for one)."""
        w.start = None
        if not w.queued or w.future.done():
            return
        left = w.request.not_before - self.clock()
        if left > 0:
            w.start = asyncio.get_running_loop().call_later(left, self._start_deferred, w)
            return
        self.waitlist.activate(w)
        reserved = self.waitlist.whole_waiting_at(w.request.priority)
        w.reason = self._pending_reason(w.request, reserved=reserved)  # a pass may stop before it
        self._changed()
        self._pump_soon()

    def _expire(self, w: Waiter) -> None:
        """A queued request's wait ran out: it fails with the reason, unless its grant is under way (it
        then gets the grant) or it has its answer already."""
        if w.future.done() or w in self._granting:
            return
        w.future.set_exception(NoCapacity(f"waited {w.request.wait_s:g} s: {self.why_not(w.request)}"))

    async def queued(self, w: Waiter) -> tuple[Lease, str]:
        """Wait for a queued request's grant (NoCapacity when its wait runs out); it leaves the queue
        however this ends (its caller cancelled too)."""
        try:
            return await w.future
        finally:
            self.leave(w)

    def leave(self, w: Waiter) -> None:
        """Take a request out of the queue (granted, expired, or its caller gone: a grant under way for it
        is then ended by ``_grant_waiter``)."""
        if w.timer is not None:
            w.timer.cancel()
        if w.start is not None:
            w.start.cancel()
        # a whole-card request that leaves unserved held idle whole cards back from those behind it
        unserved = w.request.mode is Mode.XPU and (not w.future.done() or w.future.cancelled())
        if not w.future.done():
            w.future.cancel()
        if w.queued:
            self.waitlist.remove(w)
        self._changed()
        if unserved:
            self._pump_soon()

    async def acquire(
        self, req: Request, on_position: Callable[[QueuedRequest, int], None] | None = None
    ) -> tuple[Lease, str]:
        """Grant the request, waiting in the queue up to ``req.wait_s``. Raises NoCapacity on expiry or
        when the caller is at a [limits] cap."""
        got = await self.grant_or_queue(req, on_position)
        return got if isinstance(got, tuple) else await self.queued(got)

    def why_not(self, req: Request) -> str:
        """Why ``req`` does not fit now, in one line (for NoCapacity)."""
        if req.cards:
            return self._why_not_pinned(req)
        usable = [c for c in self.cards.values() if c.usable]
        if req.mode is Mode.XPU:
            free = len(self._whole_candidates(False))
            busy = f", {len(self._busy)} busy being reconfigured" if self._busy else ""
            return (
                f"{req.gpus} whole card(s) asked, {free} free of {len(usable)} usable "
                f"({len(self.cards) - len(usable)} drained or unhealthy{busy})"
            )
        spec = self.cfg.slices.get(req.mode.value)
        reasons = []
        for c in usable:
            if c.info.index in self._busy:
                reasons.append(f"card {c.info.index} is busy being reconfigured")
                continue
            why = spec and self._backends[c.info.index].why_not(
                c.info, list(c.slices.values()), spec, req.owner_uid
            )
            if why and why not in reasons:
                reasons.append(why)
        detail = f"; {'; '.join(reasons[:3])}" if reasons else ""
        w = self.window
        if (
            w is not None
            and self.whole_short(1) > 0
            and any(c.mode is CardMode.WHOLE and c.idle for c in usable)
        ):
            return (  # an idle whole card would take it: the window in force holds it back
                f"capacity window {w.name!r} keeps {w.whole_share:.0%} of the usable cards whole "
                f"({whole_needed(w.whole_share, len(usable))} of {len(usable)}, see `xpu windows`) and no "
                f"sliced card has room for a {req.mode} slice{detail}"
            )
        return f"no card has room for a {req.mode} slice ({len(usable)} usable card(s), see `xpu ls`){detail}"

    def _pump_soon(self) -> None:
        """Pump the queue at the loop's next turn (once, however many ask)."""
        if self._pump_scheduled or not len(self.waitlist):
            return
        self._pump_scheduled = True

        def run() -> None:
            self._pump_scheduled = False
            self.pump()

        asyncio.get_running_loop().call_soon(run)

    def pump(self) -> None:
        """Grant waiting requests that now fit, in priority order (FIFO within a priority).

        A whole-card request that does not fit reserves the idle whole cards: requests behind it may
        still use free room on sliced cards, so small work flows without starving large work. The grants
        run as tasks (their cards claimed now, so the next waiter's placement already leaves them out).
        """
        self._pumps += 1
        reserve = False
        # What did not fit in this pass (and why): an equal request behind it does not fit either (grants
        # only take room), so a long queue costs one placement per kind of request, not one per waiter,
        # and the pass ends once every kind still waiting has failed (it need not walk the rest).
        failed: dict[tuple, str] = {}  # (kind, reserve) -> the pending reason
        unseen = self.waitlist.kinds()  # kind -> waiters not yet looked at
        granted: list[tuple[Waiter, tuple[int, ...]]] = []
        retry: float | None = None
        now = self.clock()
        for w in self.waitlist:
            kind = kind_of(w.request)
            unseen[kind] -= 1
            if w.future.done():
                continue
            if w.deferred:  # waiting for its (green) start: its own timer brings a pass then
                if w.request.not_before > now:
                    w.reason = "BeginTime"
                    continue
                self.waitlist.activate(w)
            if (kind, reserve) in failed:
                w.reason = failed[(kind, reserve)]
                continue
            cards = self._fit(w.request, reserve_whole=reserve)
            switches = cards is not None and self._busy and self._switches(w.request, cards)
            left = w.enqueued + self.cfg.bursts.convert_within_s - self.clock()
            if switches and left > 0:
                # A busy card may be where it belongs (its new room): look again when it is free, or
                # switch this one's card once it has waited convert_within_s (a burst: in parallel).
                cards = None
                retry = left if retry is None else min(retry, left)
                failed[(kind, reserve)] = "Busy"
            if cards is None:
                key = (kind, reserve)
                if key not in failed:
                    failed[key] = self._pending_reason(w.request, reserve)
                w.reason = failed[key]
                if w.request.mode is Mode.XPU:
                    reserve = True
                if all(n == 0 or (k, reserve) in failed for k, n in unseen.items()):
                    break  # every waiter left is of a kind that did not fit
                continue
            self._claim_for(w.request, cards)
            granted.append((w, cards))
        for w, cards in granted:  # not removed while the waitlist was being walked
            self.waitlist.remove(w)
            self._granting.add(w)
            self._spawn(self._grant_waiter(w, cards), f"granting queued request {w.ticket}")
        if retry is not None:
            self._pump_later(retry)

    def _pump_later(self, delay_s: float) -> None:
        """Pump again in ``delay_s`` (one timer: the earliest asked for wins)."""
        loop = asyncio.get_running_loop()
        at = loop.time() + delay_s + 0.001
        if self._pump_timer is not None and not self._pump_timer.cancelled():
            if self._pump_timer.when() <= at:
                return
            self._pump_timer.cancel()

        def fire() -> None:
            self._pump_timer = None
            self.pump()

        self._pump_timer = loop.call_at(at, fire)

    def _pending_reason(self, req: Request, reserved: bool) -> str:
        """Why a queued request does not fit now, as squeue's REASON: "Priority" (it would fit, but
        the idle whole cards are held for a request ahead of it), "MPS user" (a card with room serves
        another user's MPS slices), else "Resources"."""
        if reserved and self._fit(req, reserve_whole=False) is not None:
            return "Priority"
        spec = self.cfg.slices.get(req.mode.value)
        if spec is not None:
            for c in self.cards.values():
                cap = self._capacity(c)
                room = (
                    cap.free_memory_fraction >= spec.memory_fraction
                    and cap.free_compute_pct >= spec.compute_pct
                )
                if (
                    c.usable
                    and c.slices
                    and room
                    and self._backends[c.info.index].serves_other_user(req.owner_uid)
                ):
                    return "MPS user"
        return "Resources"

    async def _grant_waiter(self, w, cards: tuple[int, ...]) -> None:
        try:
            got = await self._grant(w.request, cards, self.clock() - w.enqueued)
        except Exception as e:  # the caller gets the error; the queue goes on
            if not w.future.done():
                w.future.set_exception(e)
            return
        finally:
            self._granting.discard(w)
        if w.future.done():  # the requester went away while it was being granted
            try:
                await self._end(got[0], LeaseState.RECLAIMED, "its requester went away before the grant")
            except LedgerUnavailable as e:  # not held: the reaper takes it after the grace period
                log.error("lease %s: %s", got[0].id, e)
            return
        self.stats.queue_wait.observe(self.clock() - w.enqueued)
        w.future.set_result(got)

    # ------------------------------------------------------------------ release
    def check_authority(self, lease: Lease, caller: Caller, token: str) -> None:
        """Token, ownership or operator rights; a wrong token is refused even for the owner."""
        if token:
            if not self.ledger.token_matches(lease.id, token):
                raise Forbidden(f"wrong token for lease {lease.id}")
            return
        if caller.admin or caller.uid == lease.owner_uid:
            return
        raise Forbidden(
            f"lease {lease.id} belongs to uid {lease.owner_uid}: only its holder (with its "
            "token), that user or an operator may act on it"
        )

    async def release(
        self, lease_id: str, caller: Caller, token: str = "", end: CommandEnd | None = None
    ) -> Lease:
        """End a lease for its holder, owner or an operator; ``end``: how its command ended (recorded;
        a start time outside the lease's life is clamped into it)."""
        lease = self.resolve_lease(lease_id)
        self.check_authority(lease, caller, token)
        if end is not None and end.started is not None:
            end = replace(end, started=min(max(end.started, lease.created), self.clock()))
        return await self._end(lease, LeaseState.RELEASED, f"released by uid {caller.uid}", end=end)

    async def evict(self, lease_id: str, reason: str = "") -> Lease:
        lease = self.resolve_lease(lease_id)
        why = f"evicted by an operator: {reason or 'no reason given'}"
        return await self._end(lease, LeaseState.EVICTED, reason or "evicted by an operator", revoke=why)

    async def reclaim(
        self,
        lease_id: str,
        reason: str,
        state: LeaseState = LeaseState.RECLAIMED,
        also: tuple[Op, ...] = (),
    ) -> Lease | None:
        """End a lease on the daemon's own authority (reaper, start-up, a multi-host job's end: ``state``
        RELEASED). ``also``: ledger writes committed in the same transaction as the lease's end."""
        lease = self.leases.get(lease_id)
        if lease is None or lease_id in self._ending:
            return None
        return await self._end(lease, state, reason, also=also)

    def _end(
        self,
        lease: Lease,
        state: LeaseState,
        reason: str,
        revoke: str = "",
        end: CommandEnd | None = None,
        also: tuple[Op, ...] = (),
    ) -> asyncio.Future:
        """End a lease: commit it, then tell its holder, then free its cards (tear slices down); the
        future answers the ended lease. It runs to its end whatever its caller does (a cancelled gRPC
        call), without a task or shield around it: the commit's completion carries on, on the loop, and
        only a tail that must await (a teardown that runs a tool, a busy card, a move's reservation)
        continues in a task."""
        if lease.id in self._ending:
            raise NotFound(f"lease {lease.id} is being released already")
        now, end = self.clock(), end or CommandEnd()
        card = lease.cards[0] if len(lease.cards) == 1 else -1
        how = ""
        if end.exit_signal is not None:
            how = f" (its command ended by signal {end.exit_signal})"
        elif end.exit_code is not None:
            how = f" (its command exited {end.exit_code})"
        message = f"lease {lease.id} {state.value}: {reason}{how}"
        event = self._event_op(_EVENT_KIND[state], message, card, lease.id)
        out = asyncio.get_running_loop().create_future()

        def answer(result: Lease | None, error: BaseException | None = None) -> None:
            if out.done():  # its caller went away: nobody reads it
                if error is not None:
                    log.error("ending lease %s: %s", lease.id, error)
            elif error is not None:
                out.set_exception(error)
            else:
                out.set_result(result)

        def committed(error: BaseException | None) -> None:  # on the loop
            self._ending.discard(lease.id)
            if error is not None:
                return answer(None, error)
            # Committed: the lease is over. What it held is freed below, after its teardown.
            try:
                ended = self._ended(lease, state, reason, now, end, revoke, event)
                if not self._frees_at_once(lease):
                    tail = self._spawn(self._end_tail(lease), f"freeing what lease {lease.id} held")
                    tail.add_done_callback(lambda t: answer(ended, None if t.cancelled() else t.exception()))
                    return
                self._free_now(lease.id, lease.cards, lease.slices)
                self.pump()
            except Exception as e:
                return answer(None, e)
            answer(ended)

        self._ending.add(lease.id)
        try:
            self.ledger.submit_then(
                committed, self.ledger.end_lease_op(lease.id, state, reason, now, end), event[1], *also
            )
        except BaseException:
            self._ending.discard(lease.id)
            raise
        return out

    def _ended(
        self,
        lease: Lease,
        state: LeaseState,
        reason: str,
        now: float,
        end: CommandEnd,
        revoke: str,
        event: tuple[EventRecord, Op],
    ) -> Lease:
        """A committed end in memory: the lease is gone, its holder told; the ended lease."""
        self.leases.pop(lease.id, None)
        self.unheld_since.pop(lease.id, None)
        # ``dataclasses.replace`` without its per-field getattr and __init__ (a release's largest step
        # in memory): the copy of a frozen, validated Lease with the end's fields
        ended = object.__new__(Lease)
        ended.__dict__.update(
            lease.__dict__,
            state=state,
            mark="",
            ended=now,
            end_reason=reason,
            started=end.started,
            exit_code=end.exit_code,
            exit_signal=end.exit_signal,
        )
        if revoke:
            self.notify_holder(lease, "revoke", revoke)
        self.notify_holder(ended, "released", reason)
        self._committed([event])
        return ended

    def _frees_at_once(self, lease: Lease) -> bool:
        """Whether what ``lease`` held can be freed without an await: no move in flight for it, none of
        its cards busy, every teardown bookkeeping (no tool to run)."""
        return (
            self.moves.forget_at_once(lease.id)
            and not self._busy.intersection(lease.cards)
            and all(self._inline(s.card_index, "teardown", lease.id) for s in lease.slices)
        )

    async def _end_tail(self, lease: Lease) -> None:
        await self.moves.forget(lease.id)  # a move in flight: free what it reserved
        await self._free_claimed(lease.id, lease.cards, lease.slices)
        self.pump()

    # ------------------------------------------------------------------ holds
    def hold_opened(self, lease_id: str) -> asyncio.Queue:
        self.hold_count[lease_id] = self.hold_count.get(lease_id, 0) + 1
        self.unheld_since.pop(lease_id, None)
        self.restored_unheld.discard(lease_id)
        q: asyncio.Queue = asyncio.Queue()
        self._lease_streams.setdefault(lease_id, set()).add(q)
        self._changed()
        return q

    def hold_closed(self, lease_id: str, q: asyncio.Queue) -> None:
        self._lease_streams.get(lease_id, set()).discard(q)
        n = self.hold_count.get(lease_id, 1) - 1
        if n > 0:
            self.hold_count[lease_id] = n
            return
        self.hold_count.pop(lease_id, None)
        if lease_id in self.leases and not self.leases[lease_id].anchor:
            self.unheld_since[lease_id] = self.clock()
        self._changed()

    async def reap(self) -> list[Lease]:
        """Reclaim leases whose holder has been gone longer than the grace period; expire waiters."""
        now, leases = self.clock(), self.cfg.leases
        await self.moves.expire(now)
        out = []
        for lid, since in list(self.unheld_since.items()):
            # A holder cut off by a daemon restart reconnects with backoff: it gets the longer grace.
            grace = (
                max(leases.grace_s, leases.restore_grace_s) if lid in self.restored_unheld else leases.grace_s
            )
            if now - since >= grace and lid in self.leases:
                try:
                    out.append(
                        await self.reclaim(lid, f"holder gone for {now - since:.1f} s (grace {grace:g} s)")
                    )
                except LedgerUnavailable as e:  # tried again at the next run
                    log.error("reclaiming lease %s: %s", lid, e)
        self._tidy_isolation()
        return [x for x in out if x]

    def _tidy_isolation(self) -> None:
        """Backend upkeep (idle MIG instances and MPS servers kept too long, instances freed by their
        processes), off the loop, on the cards that are not busy, at most once a TIDY_INTERVAL_S."""
        now = time.monotonic()
        if now < self._next_tidy:
            return
        self._next_tidy = now + TIDY_INTERVAL_S
        for i in sorted(self._backends):
            due = getattr(self._backends[i], "tidy_due", None)
            if i in self._busy or isinstance(self._backends[i], Accounting) or (due and not due(now)):
                continue  # (claiming a card for nothing would hold up the grants that want it)
            self._claim([i])
            self._spawn(self._tidy(i), f"isolation upkeep on card {i}")

    async def _tidy(self, i: int) -> None:
        try:
            notes = await self.run_blocking(self._backends[i].tidy, time.monotonic())
        except Exception:
            log.exception("isolation upkeep on card %d failed", i)
            notes = []
        finally:
            self._unclaim([i])
        for note in notes:
            log.info("%s", note)
        if notes:
            self.pump()

    def notify_holder(self, lease: Lease, kind: str, message: str) -> None:
        """Tell ``lease``'s Hold streams (``kind``: held, move, resize, revoke, mark, released)."""
        streams = self._lease_streams.get(lease.id)
        if streams:  # (no Hold stream open, as for most releases: no event to make)
            ev = LeaseEvent(kind, lease, message, self.clock())
            for q in streams:
                q.put_nowait(ev)
        if kind == "released":
            self._lease_streams.pop(lease.id, None)

    # ------------------------------------------------------------------ operator actions
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

    def _renumbered(self, c: CardState, fresh: CardInfo | None) -> None:
        """Take a card's device-node minor as the driver reads it after a MIG mode change."""
        if fresh is not None and fresh.minor_number is not None and fresh.minor_number != c.info.minor_number:
            self.event(
                "mode",
                f"card {c.info.index}: the driver renumbered its device node /dev/nvidia{c.info.minor_number}"
                f" -> /dev/nvidia{fresh.minor_number}",
                card=c.info.index,
            )
            c.info = replace(c.info, minor_number=fresh.minor_number)

    async def _switch(self, c: CardState, want: CardMode, pinned: bool, why: str) -> None:
        """Switch a claimed card to ``want`` on the hardware, then commit (undone if the commit fails)."""
        i = c.info.index
        if want is CardMode.WHOLE and c.slices:
            raise Conflict(
                f"card {i} holds {len(c.slices)} slice(s) (lease "
                f"{', '.join(sorted(c.slices))}): release them or wait, then switch it"
            )
        if want is CardMode.SLICED and c.whole_lease:
            raise Conflict(
                f"card {i} is held whole by lease {c.whole_lease}: release it or wait, then switch it"
            )
        backend = self._backends[i]
        switched = c.mode is not want
        if switched:
            fresh = await self.run_blocking(
                backend.enter_sliced if want is CardMode.SLICED else backend.leave_sliced, c.info
            )
            self._renumbered(c, fresh)
            c.mode = want
            c.switched_at = self.clock()
        spent = self.standby.spent([i])  # pre-created slices a switch to whole destroyed
        try:
            await self.ledger.write(
                self.ledger.save_card_op(replace(c.record(), mode_pinned=pinned)),
                *self.standby.drop_ops(spent),
            )
        except BaseException:
            await self._switch_back([i] if switched else [], "after a failed commit")
            raise
        self.standby.forget(spent)
        c.pinned = pinned
        if why:
            self.event("mode", f"card {i} switched to {want}: {why}", card=i)

    # ------------------------------------------------------------------ capacity windows
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

    def whole_short(self, converting: int = 0) -> int:
        """How many more usable cards the window in force wants whole than there would be after switching
        ``converting`` more whole cards to sliced (0 when none is wanted). Cards busy being reconfigured
        do not count as whole (one may be on its way to sliced)."""
        if self.window is None or self.window.whole_share <= 0:
            return 0
        usable = [c for c in self.cards.values() if c.usable]
        whole = sum(c.mode is CardMode.WHOLE and c.info.index not in self._busy for c in usable)
        return max(0, whole_needed(self.window.whole_share, len(usable)) - (whole - converting))

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

    # ------------------------------------------------------------------ samples, health, events
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

    def leases_on(self, index: int) -> list[Lease]:
        """Active leases holding card ``index`` (whole or a slice), oldest first; not move reservations."""
        return [lease for lease in self.lease_list() if index in lease.cards]

    def mark(self, lease_id: str, text: str) -> Lease | None:
        """Mark a lease for its holder's attention and tell the holder (a ``mark`` event); no-op if same.
        The mark is a note, not a change of placement: its ledger write is queued, not awaited."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.mark == text:
            return lease
        lease = replace(lease, mark=text)
        self.leases[lease_id] = lease
        self.ledger.submit(self.ledger.set_mark_op(lease_id, text))
        self.notify_holder(lease, "mark", text)
        self.event(
            "mark",
            f"lease {lease_id}: {text}",
            card=lease.cards[0] if len(lease.cards) == 1 else -1,
            lease_id=lease_id,
        )
        return lease

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

    def event(self, kind: str, message: str, card: int = -1, lease_id: str = "") -> EventRecord:
        log.info("%s", message)
        self.stats.events[kind] += 1
        ev = self.ledger.add_event(kind, message, card, lease_id, self.clock())
        self._changed(ev)
        return ev

    def _event_op(self, kind: str, message: str, card: int, lease_id: str = "") -> tuple[EventRecord, Op]:
        """An event to commit in the same write as the change it reports (then ``_committed``)."""
        return self.ledger.event_op(kind, message, card, lease_id, self.clock())

    def _committed(self, events: Iterable[tuple[EventRecord, Op]]) -> None:
        """Events committed with their change: logged and shown to watchers, as ``event`` does."""
        for ev, _ in events:
            log.info("%s", ev.message)
            self.stats.events[ev.kind] += 1
            self._changed(ev)

    def watch(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._watchers.add(q)
        return q

    def unwatch(self, q: asyncio.Queue) -> None:
        self._watchers.discard(q)

    def _changed(self, event: EventRecord | None = None) -> None:
        for q in self._watchers:
            q.put_nowait(event)


_EVENT_KIND = {
    LeaseState.RELEASED: "release",
    LeaseState.RECLAIMED: "reclaim",
    LeaseState.EVICTED: "evict",
    LeaseState.ACTIVE: "grant",
}
