"""The scheduler's state machine: cards and their modes, leases, the wait queue.

Everything runs on the daemon's asyncio loop, so no locks. Each change is committed to the ledger
before the method returns (and so before the service replies). Placement decisions come from the pure
functions in ``xpud.placement``; slice preparation from the card's isolation backend.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from xpud.config import Config
from xpud.errors import BadRequest, Conflict, Forbidden, NoCapacity, NotFound
from xpud.hw.topology import Topology
from xpud.isolation.base import Accounting, Held, Isolation, used_shares
from xpud.ledger import CardRecord, EventRecord, Ledger
from xpud.model import (
    Caller,
    CardInfo,
    CardMode,
    CardSample,
    CardView,
    HealthState,
    Lease,
    LeaseState,
    Mode,
    QueuedRequest,
    Request,
    Slice,
)
from xpud.moves import Moves
from xpud.placement.host import CardCapacity, best_group, choose_slice_card
from xpud.waitlist import Waitlist

log = logging.getLogger("xpud.engine")


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

    # ------------------------------------------------------------------ restore and views
    def restore(self) -> list[Lease]:
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
                self.ledger.end_lease(lease.id, LeaseState.RECLAIMED, f"card {missing[0]} is gone")
                self.event(
                    "reclaim",
                    f"lease {lease.id} reclaimed at start-up: card {missing[0]} is gone",
                    lease_id=lease.id,
                )
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
            self.unheld_since[lease.id] = now  # holders get restore_grace_s from ``serving`` to reconnect
            self.restored_unheld.add(lease.id)
            restored.append(lease)
        if restored:
            self.event("restore", f"restored {len(restored)} active lease(s) from the ledger")
        self._reconcile()
        return [lease for lease in restored if lease.id in self.leases]

    def serving(self) -> None:
        """The daemon serves again: the grace of restored leases starts now, not at ``restore`` (start-up
        and reconciling may take a while, and holders cannot reconnect before this)."""
        now = self.clock()
        for lid in self.restored_unheld & set(self.unheld_since):
            self.unheld_since[lid] = now

    def _reconcile(self) -> None:
        """Compare each card's isolation on the hardware (MIG instances, MPS daemons) with the ledger:
        the backend adopts what matches and cleans up orphans; leases whose slice is gone are reclaimed."""
        lost: dict[str, str] = {}
        for i, c in sorted(self.cards.items()):
            held = [Held(lid, self.leases[lid].owner_uid, s) for lid, s in sorted(c.slices.items())]
            try:
                found = self._backends[i].reconcile(c.info, c.mode, held)
            except Exception as e:  # one card's trouble must not stop the daemon: say so and go on
                log.exception("reconciling card %d failed", i)
                self.event("error", f"card {i}: reconciling its isolation failed: {e}", card=i)
                continue
            for note in found.notes:
                self.event("reconcile", note, card=i)
            for lid in found.lost:
                lost[lid] = f"its slice on card {i} is gone from the hardware (found at start-up)"
            if c.whole_lease is None and found.mode is not c.mode and not set(c.slices) - set(found.lost):
                c.mode = found.mode
                self.ledger.save_card(c.record())
        for lid, why in lost.items():
            self.reclaim(lid, why)

    def card_views(self) -> list[CardView]:
        return [self._view(c) for c in sorted(self.cards.values(), key=lambda c: c.info.index)]

    def _view(self, c: CardState) -> CardView:
        mem, pct = used_shares(list(c.slices.values()), c.info, self._reserved(c.info))
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

    def lease_list(self) -> list[Lease]:
        return sorted(self.leases.values(), key=lambda lease: lease.created)

    def queue_view(self) -> list[QueuedRequest]:
        return self.waitlist.view()

    def is_held(self, lease_id: str) -> bool:
        return self.hold_count.get(lease_id, 0) > 0

    # ------------------------------------------------------------------ resolving names
    def resolve_card(self, selector: str) -> CardState:
        s = selector.strip()
        if s.isdigit():
            if int(s) in self.cards:
                return self.cards[int(s)]
            raise NotFound(f"no card {s}: this host has cards 0..{len(self.cards) - 1} (see `xpu ls`)")
        matches = [c for c in self.cards.values() if s and c.info.uuid.lower().startswith(s.lower())]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFound(f"no card matches {selector!r}: give an index or a UUID (see `xpu ls`)")
        raise BadRequest(f"{selector!r} matches {len(matches)} cards: give more of the UUID")

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
        if req.mode is Mode.XPU:
            if not 1 <= req.gpus <= n:
                raise BadRequest(f"--gpus {req.gpus}: this host has {n} card(s); ask for 1..{n}")
        elif req.gpus != 1:
            raise BadRequest(
                f"--gpus {req.gpus} with mode {req.mode}: a slice is part of one card; "
                "use --gpus 1 or --mode xpu"
            )
        elif req.mode.value not in self.cfg.slices:
            raise BadRequest(f"mode {req.mode}: no such slice size in the config")
        cap = self.cfg.leases.max_priority
        if not -cap <= req.priority <= cap:
            raise BadRequest(f"priority {req.priority} is outside -{cap}..{cap}")
        if not 0 <= req.wait_s <= self.cfg.leases.max_wait_s:
            raise BadRequest(f"--wait {req.wait_s:g}: must be 0..{self.cfg.leases.max_wait_s:g} seconds")
        return req

    def _capacity(self, c: CardState, avoid_extra: bool = False) -> CardCapacity:
        mem, pct = used_shares(list(c.slices.values()), c.info, self._reserved(c.info))
        return CardCapacity(
            index=c.info.index,
            sliced=c.mode is CardMode.SLICED,
            idle=c.idle,
            usable=c.usable,
            free_memory_fraction=max(0.0, 1 - mem),
            free_compute_pct=100 - pct,
            health_score=c.health_score,
            mode_pinned=c.pinned,
            avoid=c.health_state is HealthState.DEGRADED or avoid_extra,
        )

    def _reserved(self, card: CardInfo) -> int:
        return self._backends[card.index].reserved_bytes  # [cards] reserved_memory_mib, or its estimate

    def _whole_candidates(self, keep_whole_only: bool, exclude: frozenset[int] = frozenset()) -> list[int]:
        out = []
        for c in self.cards.values():
            if not (c.usable and c.idle) or c.info.index in exclude:
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
        g_any = best_group(self.topology, anyfree, req.gpus, scores, avoid=degraded)
        if g_whole and (not g_any or self._group_key(g_whole, degraded) <= self._group_key(g_any, degraded)):
            return g_whole  # as good without switching an (empty) sliced card back to whole
        return g_any

    def _group_key(self, group: tuple[int, ...], degraded: list[int]) -> tuple[int, float]:
        return sum(i in degraded for i in group), round(self.topology.allreduce_seconds(group), 12)

    def _place_slice(
        self, req: Request, reserve_whole: bool, exclude: frozenset[int] = frozenset()
    ) -> int | None:
        spec = self.cfg.slices[req.mode.value]
        caps = []
        for c in self.cards.values():
            # An idle whole card may be converted unless pinned, or reserved for a waiting whole-card request.
            convertible = c.mode is CardMode.SLICED or (c.idle and not c.pinned and not reserve_whole)
            feasible = (
                c.usable
                and c.info.index not in exclude
                and convertible
                and self._backends[c.info.index].fits(c.info, list(c.slices.values()), spec, req.owner_uid)
            )
            caps.append(replace(self._capacity(c), usable=feasible))
        # The backend decided feasibility (MIG geometry, MPS shares); placement only ranks. The whole-card
        # pool (for the harm a conversion does) includes pinned and reserved idle whole cards.
        pool = self._whole_candidates(True)
        return choose_slice_card(caps, 0.0, 0, self.topology, free_whole=pool)

    def _fit(
        self, req: Request, reserve_whole: bool = False, exclude: frozenset[int] = frozenset()
    ) -> tuple[int, ...] | None:
        """Cards for ``req`` now, or None. ``exclude``: cards it must not use (a move's source)."""
        if req.mode is Mode.XPU:
            return self._place_xpu(req, reserve_whole, exclude)
        card = self._place_slice(req, reserve_whole, exclude)
        return None if card is None else (card,)

    # ------------------------------------------------------------------ grant
    def _new_id(self) -> str:
        taken = self.leases.keys() | self.ledger.lease_ids()
        while True:
            lid = secrets.token_hex(4)
            if lid not in taken:
                return lid

    def _grant(self, req: Request, cards: tuple[int, ...]) -> tuple[Lease, str]:
        lease_id, token = self._new_id(), secrets.token_urlsafe(24)
        infos = [self.cards[i].info for i in cards]
        base_env = {
            "XPU_LEASE_ID": lease_id,
            "XPU_MODE": req.mode.value,
            "XPU_RESTART_COUNT": "0",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
        slices: tuple[Slice, ...] = ()
        if req.mode is Mode.XPU:
            for i in cards:  # an idle sliced card goes back to whole: MIG off, MPS stopped
                if self.cards[i].mode is CardMode.SLICED:
                    self._backends[i].leave_sliced(self.cards[i].info)
            env = {"CUDA_VISIBLE_DEVICES": ",".join(c.uuid for c in infos)}
        else:
            card = self.cards[cards[0]]
            spec = self.cfg.slices[req.mode.value]
            backend = self._backends[card.info.index]
            entered = card.mode is CardMode.WHOLE
            if entered:
                backend.enter_sliced(card.info)
            try:
                s, env = backend.prepare(card.info, list(card.slices.values()), spec, lease_id, req.owner_uid)
            except Exception:
                if entered:  # leave the card as it was, so the engine's mode stays true
                    try:
                        backend.leave_sliced(card.info)
                    except Exception as e:
                        log.error("card %d: switching back after a failed slice: %s", card.info.index, e)
                raise
            slices = (s,)
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
            created=self.clock(),
        )
        try:
            self.ledger.insert_lease(lease, token)  # committed before anyone is told
        except Exception:
            for s in slices:
                self._backends[s.card_index].teardown(self.cards[s.card_index].info, s)
            raise
        self.leases[lease_id] = lease
        self.unheld_since[lease_id] = self.clock()  # the holder must open Hold within the grace period
        for i in cards:
            c = self.cards[i]
            want = CardMode.WHOLE if req.mode is Mode.XPU else CardMode.SLICED
            if c.mode is not want:
                c.mode = want
                self.ledger.save_card(c.record())
                self.event("mode", f"card {i} switched to {want} for lease {lease_id}", card=i)
            if req.mode is Mode.XPU:
                c.whole_lease = lease_id
            else:
                c.slices[lease_id] = slices[0]
        where = ",".join(map(str, cards))
        self.event(
            "grant",
            f"lease {lease_id} ({req.mode}) on card {where} to uid {req.owner_uid}",
            card=cards[0] if len(cards) == 1 else -1,
            lease_id=lease_id,
        )
        return lease, token

    def try_grant(self, req: Request) -> tuple[Lease, str] | None:
        """Grant now if the request fits without jumping the queue; None otherwise."""
        self.validate(req)
        blocked_whole = any(
            w.request.mode is Mode.XPU and w.request.priority >= req.priority
            for w in self.waitlist.in_order()
        )
        cards = self._fit(req, reserve_whole=blocked_whole)
        return None if cards is None else self._grant(req, cards)

    async def acquire(
        self, req: Request, on_position: Callable[[QueuedRequest, int], None] | None = None
    ) -> tuple[Lease, str]:
        """Grant the request, waiting in the queue up to ``req.wait_s``. Raises NoCapacity on expiry."""
        granted = self.try_grant(req)
        if granted:
            return granted
        if req.wait_s <= 0:
            raise NoCapacity(self._why_not(req) + "; add --wait SECONDS to queue for it")
        w = self.waitlist.add(req, self.clock(), on_position)
        self._changed()
        try:
            return await asyncio.wait_for(asyncio.shield(w.future), timeout=max(w.deadline - self.clock(), 0))
        except TimeoutError:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                return w.future.result()  # granted in the same instant the wait ran out
            raise NoCapacity(f"waited {req.wait_s:g} s: {self._why_not(req)}") from None
        finally:
            if not w.future.done():
                w.future.cancel()
            self.waitlist.remove(w)
            self._changed()

    def _why_not(self, req: Request) -> str:
        usable = [c for c in self.cards.values() if c.usable]
        if req.mode is Mode.XPU:
            free = len(self._whole_candidates(False))
            return (
                f"{req.gpus} whole card(s) asked, {free} free of {len(usable)} usable "
                f"({len(self.cards) - len(usable)} drained or unhealthy)"
            )
        spec = self.cfg.slices.get(req.mode.value)
        reasons = []
        for c in usable:
            why = spec and self._backends[c.info.index].why_not(
                c.info, list(c.slices.values()), spec, req.owner_uid
            )
            if why and why not in reasons:
                reasons.append(why)
        detail = f"; {'; '.join(reasons[:3])}" if reasons else ""
        return f"no card has room for a {req.mode} slice ({len(usable)} usable card(s), see `xpu ls`){detail}"

    def pump(self) -> None:
        """Grant waiting requests that now fit, in priority order (FIFO within a priority).

        A whole-card request that does not fit reserves the idle whole cards: requests behind it may
        still use free room on sliced cards, so small work flows without starving large work.
        """
        reserve = False
        for w in self.waitlist.in_order():
            if w.future.done():
                continue
            cards = self._fit(w.request, reserve_whole=reserve)
            if cards is None:
                if w.request.mode is Mode.XPU:
                    reserve = True
                continue
            try:
                w.future.set_result(self._grant(w.request, cards))
            except Exception as e:  # the caller gets the error; the queue goes on
                w.future.set_exception(e)
            self.waitlist.remove(w)

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

    def release(self, lease_id: str, caller: Caller, token: str = "") -> Lease:
        lease = self.resolve_lease(lease_id)
        self.check_authority(lease, caller, token)
        return self._end(lease, LeaseState.RELEASED, f"released by uid {caller.uid}")

    def evict(self, lease_id: str, reason: str = "") -> Lease:
        lease = self.resolve_lease(lease_id)
        self._notify(lease, "revoke", f"evicted by an operator: {reason or 'no reason given'}")
        return self._end(lease, LeaseState.EVICTED, reason or "evicted by an operator")

    def reclaim(self, lease_id: str, reason: str) -> Lease | None:
        lease = self.leases.get(lease_id)
        return self._end(lease, LeaseState.RECLAIMED, reason) if lease else None

    def _end(self, lease: Lease, state: LeaseState, reason: str) -> Lease:
        self.moves.forget(lease.id)  # a move in flight: free what it reserved
        for s in lease.slices:
            card = self.cards[s.card_index]
            try:
                self._backends[s.card_index].teardown(card.info, s)
            except Exception as e:  # never lose the release over a teardown failure: log it loudly
                log.error("teardown of %s on card %d failed: %s", lease.id, s.card_index, e)
                self.event("error", f"teardown of lease {lease.id} failed: {e}", card=s.card_index)
        self.ledger.end_lease(lease.id, state, reason, self.clock())
        del self.leases[lease.id]
        self.unheld_since.pop(lease.id, None)
        for i in lease.cards:
            c = self.cards[i]
            if c.whole_lease == lease.id:
                c.whole_lease = None
            c.slices.pop(lease.id, None)
        ended = replace(lease, state=state)
        self._notify(ended, "released", reason)
        self.event(
            _EVENT_KIND[state],
            f"lease {lease.id} {state.value}: {reason}",
            lease_id=lease.id,
            card=lease.cards[0] if len(lease.cards) == 1 else -1,
        )
        self.pump()
        return ended

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
        if lease_id in self.leases:
            self.unheld_since[lease_id] = self.clock()
        self._changed()

    def reap(self) -> list[Lease]:
        """Reclaim leases whose holder has been gone longer than the grace period; expire waiters."""
        now, leases = self.clock(), self.cfg.leases
        self.moves.expire(now)
        out = []
        for lid, since in list(self.unheld_since.items()):
            # A holder cut off by a daemon restart reconnects with backoff: it gets the longer grace.
            grace = (
                max(leases.grace_s, leases.restore_grace_s) if lid in self.restored_unheld else leases.grace_s
            )
            if now - since >= grace and lid in self.leases:
                out.append(self.reclaim(lid, f"holder gone for {now - since:.1f} s (grace {grace:g} s)"))
        self._tidy_isolation()
        return [x for x in out if x]

    def _tidy_isolation(self) -> None:
        """Backend upkeep (idle MIG instances kept too long, instances freed by their processes)."""
        freed = False
        for i, backend in self._backends.items():
            try:
                for note in backend.tidy(time.monotonic()):
                    log.info("%s", note)
                    freed = True
            except Exception:
                log.exception("isolation upkeep on card %d failed", i)
        if freed:
            self.pump()

    def _notify(self, lease: Lease, kind: str, message: str) -> None:
        ev = LeaseEvent(kind, lease, message, self.clock())
        for q in self._lease_streams.get(lease.id, ()):
            q.put_nowait(ev)
        if kind == "released":
            self._lease_streams.pop(lease.id, None)

    # ------------------------------------------------------------------ operator actions
    def drain(self, selector: str, reason: str = "") -> CardView:
        c = self.resolve_card(selector)
        c.drained, c.drain_reason = True, reason or "drained by an operator"
        self.ledger.save_card(c.record())
        self.event("drain", f"card {c.info.index} drained: {c.drain_reason}", card=c.info.index)
        return self._view(c)

    def undrain(self, selector: str) -> CardView:
        c = self.resolve_card(selector)
        c.drained, c.drain_reason = False, ""
        self.ledger.save_card(c.record())
        if c.health_state is HealthState.UNHEALTHY:  # the operator's drain is gone; the monitor's stays
            msg = f"card {c.info.index}: operator drain lifted; still out while unhealthy: {c.health_reason}"
        else:
            msg = f"card {c.info.index} back in service"
        self.event("undrain", msg, card=c.info.index)
        self.pump()
        return self._view(c)

    def set_mode(self, selector: str, mode: str) -> CardView:
        c = self.resolve_card(selector)
        if mode == "auto":
            c.pinned = False
        elif mode in ("whole", "sliced"):
            want = CardMode(mode)
            if want is CardMode.WHOLE and c.slices:
                raise Conflict(
                    f"card {c.info.index} holds {len(c.slices)} slice(s) (lease "
                    f"{', '.join(sorted(c.slices))}): release them or wait, then switch it"
                )
            if want is CardMode.SLICED and c.whole_lease:
                raise Conflict(
                    f"card {c.info.index} is held whole by lease {c.whole_lease}: release it "
                    "or wait, then switch it"
                )
            if c.mode is not want:
                backend = self._backends[c.info.index]
                (backend.enter_sliced if want is CardMode.SLICED else backend.leave_sliced)(c.info)
            c.mode, c.pinned = want, True
        else:
            raise BadRequest(f"mode {mode!r}: use whole, sliced or auto")
        self.ledger.save_card(c.record())
        self.event("mode", f"card {c.info.index} set to {mode} by an operator", card=c.info.index)
        self.pump()
        return self._view(c)

    def to_whole(self, index: int, reason: str) -> bool:
        """Give an idle sliced card (not pinned) back to whole-card work now, as a whole-card grant would;
        the defragmenter does this for the cards it freed. Returns whether it switched."""
        c = self.cards[index]
        if c.mode is not CardMode.SLICED or not c.idle or c.pinned:
            return False
        if self._backends[index].switch_blocker(c.info, False):
            return False  # e.g. a process still runs on the MIG card: the next run tries again
        self._backends[index].leave_sliced(c.info)
        c.mode = CardMode.WHOLE
        self.ledger.save_card(c.record())
        self.event("mode", f"card {index} switched to whole: {reason}", card=index)
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

    def mark(self, lease_id: str, text: str) -> Lease:
        """Mark a lease for its holder's attention and tell the holder (a ``mark`` event); no-op if same."""
        lease = self.leases[lease_id]
        if lease.mark == text:
            return lease
        lease = replace(lease, mark=text)
        self.leases[lease_id] = lease
        self.ledger.set_mark(lease_id, text)
        self._notify(lease, "mark", text)
        self.event(
            "mark",
            f"lease {lease_id}: {text}",
            card=lease.cards[0] if len(lease.cards) == 1 else -1,
            lease_id=lease_id,
        )
        return lease

    def move(
        self,
        lease_id: str,
        reason: str,
        *,
        avoid: Collection[int] = (),
        to: Collection[int] | None = None,
        timeout_s: float | None = None,
    ) -> Lease:
        """Move a restartable lease elsewhere (see ``xpud.moves``): reserve, send ``move``, await AckMove.
        Returns the lease as it will be. Raises NoCapacity (nowhere to go) or Conflict."""
        return self.moves.start(lease_id, reason, avoid=avoid, to=to, timeout_s=timeout_s)

    def ack_move(self, lease_id: str, token: str) -> Lease:
        """The holder stopped its command after a ``move``: commit the new placement and return it."""
        return self.moves.ack(lease_id, token)

    def event(self, kind: str, message: str, card: int = -1, lease_id: str = "") -> EventRecord:
        log.info("%s", message)
        ev = self.ledger.add_event(kind, message, card, lease_id, self.clock())
        self._changed(ev)
        return ev

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
