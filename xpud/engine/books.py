"""The engine's books: cards, their capacity, leases and the queue as the engine sees them, and where a
request would go now. Synchronous and free of I/O: nothing here awaits, writes the ledger or touches the
hardware (a backend is asked only what it decides from its own records: ``fits``, ``why_not``,
``switch_blocker``). Placement decisions come from the pure functions in ``xpud.placement``.

Invariant: a card with backend work in flight (``_busy``) is never read for placement here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from xpud.config.schema import Config
from xpud.engine.hooks import QueueOrder, Sizing
from xpud.engine.stats import Stats
from xpud.engine.waitlist import Waitlist
from xpud.errors import BadRequest, Forbidden, NoCapacity, NotFound
from xpud.isolation.base import Isolation, usable_memory, used_shares
from xpud.ledger.ledger import CardRecord
from xpud.model import (
    CardInfo,
    CardMode,
    CardSample,
    CardView,
    HealthState,
    Lease,
    Mode,
    QueuedRequest,
    Request,
    Slice,
)
from xpud.placement.host import CardCapacity, best_group, choose_slice_card
from xpud.planning.windows import WindowSpec, whole_needed
from xpud.topology import Topology


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


class Books:
    """The engine's state read as cards, capacity and views (a part of ``Engine``; its state is set up in
    ``Engine.__init__``)."""

    cfg: Config
    topology: Topology
    clock: Callable[[], float]
    cards: dict[int, CardState]
    leases: dict[str, Lease]
    waitlist: Waitlist
    hold_count: dict[str, int]
    stats: Stats
    window: WindowSpec | None
    rightsizer: Sizing | None
    queue_order: QueueOrder | None
    _backends: dict[int, Isolation]
    _busy: set[int]
    _capacities: dict[int, tuple[tuple, CardCapacity]]
    _granting_uids: dict[int, int]
    _arriving_uids: dict[int, int]
    _granting_accounts: dict[str, float]

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

    def leases_on(self, index: int) -> list[Lease]:
        """Active leases holding card ``index`` (whole or a slice), oldest first; not move reservations."""
        return [lease for lease in self.lease_list() if index in lease.cards]

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

    def _switches(self, req: Request, cards: tuple[int, ...]) -> bool:
        """Whether granting ``req`` on ``cards`` switches a card's mode."""
        want = CardMode.WHOLE if req.mode is Mode.XPU else CardMode.SLICED
        return any(self.cards[i].mode is not want for i in cards)

    def whole_short(self, converting: int = 0) -> int:
        """How many more usable cards the window in force wants whole than there would be after switching
        ``converting`` more whole cards to sliced (0 when none is wanted). Cards busy being reconfigured
        do not count as whole (one may be on its way to sliced)."""
        if self.window is None or self.window.whole_share <= 0:
            return 0
        usable = [c for c in self.cards.values() if c.usable]
        whole = sum(c.mode is CardMode.WHOLE and c.info.index not in self._busy for c in usable)
        return max(0, whole_needed(self.window.whole_share, len(usable)) - (whole - converting))

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
