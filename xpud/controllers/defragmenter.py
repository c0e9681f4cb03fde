"""The daemon's defragmenter: moves restartable jobs so that whole cards, and islands of them, come free.

One run: the engine's cards and leases become a one-host snapshot for the pure planner
(``xpud.placement.defrag``, the same one ``xpu simulate --defrag`` uses), in milli-cards (a slice counts
the larger of its memory and compute shares); the planner's moves are checked against the engine's books
(usable cards, modes, the isolation backend's ``fits``: MIG geometry, MPS limits) and ordered in waves,
because a move holds its old placement until the job acknowledges; moves the engine would refuse pin
their lease and the planner runs again. Applying records the plan as an event, then moves each wave
through ``Engine.move`` and waits for the acknowledgements (``xpu run --restartable`` stops its command,
acknowledges and starts it again elsewhere) before the next wave; the cards it freed then go back to
whole mode (``Engine.to_whole``), ready for whole-card work.

Value (what a plan gains): idle whole cards, plus up to ``ISLAND_WEIGHT`` for how well they connect:
``free_quality`` of the idle cards over the best link on the host, so free cards on one NVLink island
or one PCIe switch are worth more than the same number scattered. Cost: ``[defrag] move_cost`` per move,
times the cards the job holds, times 1 + its earlier moves. A plan is proposed only if it gains more than
it costs, and makes at most ``move_budget_pct`` of the active leases' worth of moves.

Who runs it: an operator (``xpu defrag``), the periodic job (``[defrag] enabled``), and the make-room
check: a whole-card request that has waited ``make_room_after_s`` and does not fit becomes the target of
a plan (``[defrag] make_room``). One run moves jobs at a time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import combinations

import numpy as np

from xpud.config.schema import Config
from xpud.engine.engine import Engine
from xpud.errors import BadRequest, Conflict, XpudError
from xpud.isolation.base import usable_memory
from xpud.model import CardMode, Lease, Mode, Request, Slice
from xpud.placement import defrag as planner
from xpud.placement.cluster import CARD_MILLI, ClusterState, Demand, Host, Placement
from xpud.placement.host import EXACT_SEARCH_MAX_CARDS, best_group, free_quality
from xpud.topology import Topology

log = logging.getLogger("xpud.controllers.defragmenter")

# What perfectly connected idle cards add to their count. Below 1 - move_cost's default, so that freeing a
# card always pays even where the new idle card connects badly to the others.
ISLAND_WEIGHT = 0.5
REPLAN_ROUNDS = 4  # plans again at most this often after the engine refused some of the moves
SETTLE_POLL_S = 0.05
BOOKS_ONLY = ("mig",)  # backends whose fits() reads their own books, not the slices it is given


@dataclass(frozen=True)
class FreeCards:
    """What the idle whole cards can do (usable cards no lease holds)."""

    idle: tuple[int, ...]
    group: tuple[int, ...]  # the most idle cards joined at the best link among them
    group_gbps: float  # its modelled bus bandwidth, GB/s (0 for fewer than two cards)
    quality_gbps: float  # free_quality of the idle cards, GB/s
    value: float  # idle cards + ISLAND_WEIGHT x quality / best link


@dataclass(frozen=True)
class PlannedMove:
    lease_id: str
    mode: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    cost: float  # idle whole cards
    wave: int  # 1: starts at once; n: once wave n-1 is acknowledged


@dataclass(frozen=True)
class DefragPlan:
    moves: tuple[PlannedMove, ...]
    before: FreeCards
    after: FreeCards
    cost: float
    budget: int  # most moves allowed
    budget_pct: float
    active: int  # active leases
    movable: int
    gpus: int = 0  # the request made room for (0: consolidation)
    target_cards: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def gain(self) -> float:
        return self.after.value - self.before.value

    def describe(self) -> str:
        """One line: the moves and what they buy."""
        if not self.moves:
            return "no moves: " + ("; ".join(self.notes) or "nothing to gain")
        moves = ", ".join(f"{m.lease_id} {_cards(m.src)}->{_cards(m.dst)}" for m in self.moves)
        what = (
            f"room for {self.gpus} whole card(s) on {_cards(self.target_cards)}"
            if self.gpus
            else f"idle whole cards {len(self.before.idle)} -> {len(self.after.idle)}"
        )
        return f"{len(self.moves)} move(s) ({moves}), cost {self.cost:g}: {what}"


@dataclass
class MoveOutcome:
    move: PlannedMove
    state: str = "proposed"  # proposed, moving, done, abandoned, failed, skipped
    detail: str = ""


def _cards(cards: Sequence[int]) -> str:
    return ",".join(map(str, cards)) or "-"


# -- what the free cards are worth -------------------------------------------------------------------


@lru_cache(maxsize=8)
def _best_link(topo: Topology) -> float:
    if topo.size < 2 or topo.size > EXACT_SEARCH_MAX_CARDS:
        return 0.0
    return max(free_quality(topo, pair) for pair in combinations(range(topo.size), 2))


@lru_cache(maxsize=4096)
def free_cards(topo: Topology, idle: tuple[int, ...]) -> FreeCards:
    """The picture of ``idle`` (sorted card indices) on ``topo``."""
    best = _best_link(topo)
    quality = free_quality(topo, idle) if best and len(idle) >= 2 else 0.0
    group: tuple[int, ...] = idle[:1]
    gbps = 0.0
    if len(idle) >= 2:
        top = max(topo.bandwidth_gbps(a, b) for a, b in combinations(idle, 2))
        for k in range(len(idle), 1, -1):
            g = best_group(topo, list(idle), k)
            if g and topo.bottleneck_gbps(g) >= top - 1e-9:
                group, gbps = g, top
                break
    value = len(idle) + (ISLAND_WEIGHT * min(quality / best, 1.0) if best else 0.0)
    return FreeCards(idle, group, gbps, quality, round(value, 6))


# -- the engine's books, and a copy that moves can be tried on ---------------------------------------


class Books:
    """Who holds which card, as the engine says, with moves applied hypothetically."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.whole = {i: c.whole_lease for i, c in engine.cards.items()}
        self.slices = {i: dict(c.slices) for i, c in engine.cards.items()}
        self.mode = {i: c.mode for i, c in engine.cards.items()}
        self.changed: set[int] = set()

    def busy(self, i: int) -> bool:
        return self.whole[i] is not None or bool(self.slices[i])

    def idle_whole(self) -> tuple[int, ...]:
        """Usable cards that could serve whole-card work now (a pinned sliced card cannot)."""
        cards = self.engine.cards
        return tuple(
            i
            for i in sorted(cards)
            if cards[i].usable
            and not self.busy(i)
            and not (cards[i].pinned and self.mode[i] is CardMode.SLICED)
        )

    def why_not(self, lease: Lease, dst: tuple[int, ...]) -> str:
        """Why the engine would refuse to reserve ``dst`` for ``lease`` now ("" when it would not)."""
        e = self.engine
        if len(dst) != len(lease.cards) or len(set(dst)) != len(dst):
            return f"needs {len(lease.cards)} distinct card(s)"
        for i in dst:
            c = e.cards.get(i)
            if c is None:
                return f"there is no card {i}"
            if i in lease.cards:
                return f"it holds card {i} (a move never targets its own cards)"
            if not c.usable:
                return f"card {i} is drained or unhealthy"
            if i in e.busy_cards():  # its backend is at work: not to be read now
                return f"card {i} is busy being reconfigured"
            if lease.mode is Mode.XPU:
                if self.busy(i):
                    return f"card {i} is not idle"
                if self.mode[i] is CardMode.SLICED and c.pinned:
                    return f"card {i} is pinned to sliced mode"
                if self.mode[i] is CardMode.SLICED and (why := e.switch_blocker(i, False)):
                    return f"card {i} cannot switch to whole now: {why}"
                continue
            if self.whole[i] is not None:
                return f"card {i} is held whole"
            if self.mode[i] is CardMode.WHOLE and c.pinned:
                return f"card {i} is pinned to whole mode"
            kind = e.isolation_name(i)
            if kind in BOOKS_ONLY and i in self.changed:  # its backend can only judge the card as it is
                return f"card {i}'s {kind} layout changes earlier in this plan (tried at the next run)"
            spec = e.cfg.slices.get(lease.mode.value)
            if spec is None:  # a restored lease of a size the config no longer has
                return f"{lease.mode} is no longer a slice size in the config"
            if not e.slice_fits(i, list(self.slices[i].values()), lease.mode.value, lease.owner_uid):
                return f"the {kind} backend has no room for {lease.mode} on card {i}"
        return ""

    def reserve(self, lease: Lease, dst: tuple[int, ...]) -> None:
        for i in dst:
            self.changed.add(i)
            if lease.mode is Mode.XPU:
                self.whole[i], self.mode[i] = lease.id, CardMode.WHOLE
            else:
                self.slices[i][lease.id] = replace(lease.slices[0], card_index=i)
                self.mode[i] = CardMode.SLICED

    def free(self, lease: Lease, src: tuple[int, ...]) -> None:
        for i in src:
            self.changed.add(i)
            if self.whole[i] == lease.id:
                self.whole[i] = None
            self.slices[i].pop(lease.id, None)


def sequence(engine: Engine, moves: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[list[list[int]], dict]:
    """Order ``(lease id, destination)`` moves in waves the engine accepts: a move reserves its destination
    while its source is still held, so one that needs another's source waits for the next wave. Returns
    (waves of indices into ``moves``, {index: why the engine refuses it} for those that fit in no wave)."""
    books = Books(engine)
    left = list(range(len(moves)))
    waves: list[list[int]] = []
    why: dict[int, str] = {}
    while left:
        wave = []
        for k in left:
            lease = engine.leases.get(moves[k][0])
            why[k] = books.why_not(lease, moves[k][1]) if lease else "it ended"
            if not why[k]:
                books.reserve(lease, moves[k][1])
                wave.append(k)
        if not wave:
            break
        for k in wave:
            books.free(engine.leases[moves[k][0]], engine.leases[moves[k][0]].cards)
            del why[k]
        waves.append(wave)
        left = [k for k in left if k not in wave]
    return waves, why


def immovable(engine: Engine, lease: Lease) -> str:
    """Why the defragmenter leaves ``lease`` where it is ("" when it may move it)."""
    if not lease.restartable:
        return "not restartable"
    if lease.id in engine.moves.pending:
        return "already moving"
    if lease.id in engine.moves.timed_out:
        return "its holder did not follow an earlier move"
    if not engine.is_held(lease.id):
        return "no holder connected"
    if any(not engine.cards[i].usable for i in lease.cards):
        return "on a drained or unhealthy card"
    return ""


# -- planning ------------------------------------------------------------------------------------------


class Defragmenter:
    """Plans and applies defragmentation on one daemon's engine (everything runs on the daemon's loop)."""

    def __init__(self, engine: Engine, cfg: Config, clock: Callable[[], float] | None = None):
        self.engine = engine
        self.cfg = cfg.defrag
        self.clock = clock or engine.clock
        self.running: str = ""  # who is moving jobs now ("" when nobody)
        self._room_tried: dict[str, float] = {}  # waiting ticket -> when room was last made for it
        self._task: asyncio.Future | None = None  # the daemon's own run, applying in the background

    def _share(self, s: Slice) -> int:
        """A slice's size in milli-cards: the larger of its memory and compute shares."""
        info = self.engine.cards[s.card_index].info
        usable = usable_memory(info, self.engine.reserved(info)) or 1
        frac = max(s.memory_bytes / usable, s.compute_pct / 100)
        return min(CARD_MILLI, max(1, round(frac * CARD_MILLI)))

    def _snapshot(self, pinned: set[str]) -> tuple[ClusterState, list[planner.Item], dict[str, float]]:
        """The planner's one-host state, its items (movable leases and fixed occupants) and move costs."""
        e = self.engine
        state = ClusterState([Host("host", 0, 0, len(e.cards))])
        items: list[planner.Item] = []
        costs: dict[str, float] = {}
        fixed = 0

        def occupy(milli: int, card: int) -> None:
            nonlocal fixed
            milli = min(milli, int(state.card_free[0, card]))
            if milli > 0:
                d, p = Demand(0, 0, 1, milli), Placement(0, (card,))
                state.place(d, p)
                items.append(planner.Item(f"fixed-{fixed}", d, p, restartable=False))
                fixed += 1

        for lease in e.lease_list():
            placed = set(lease.cards) == {
                i for i, c in e.cards.items() if c.whole_lease == lease.id or lease.id in c.slices
            }
            if lease.id in pinned or immovable(e, lease) or not placed:
                continue
            if lease.mode is Mode.XPU:
                d = Demand(0, 0, len(lease.cards), CARD_MILLI)
            else:
                d = Demand(0, 0, 1, self._share(lease.slices[0]))
            p = Placement(0, tuple(lease.cards))
            if not state.fits(d, p):
                continue  # shares rounded past a card: leave it to the fixed occupants
            state.place(d, p)
            items.append(planner.Item(lease.id, d, p))
            costs[lease.id] = self.cfg.move_cost * len(lease.cards) * (1 + lease.restart_count)
        movable = {it.id for it in items}
        for i, c in e.cards.items():
            if c.whole_lease and c.whole_lease not in movable:
                occupy(CARD_MILLI, i)
            for lid, held in c.slices.items():
                if lid not in movable:
                    occupy(self._share(held), i)
            if not c.usable:
                occupy(CARD_MILLI, i)  # never a destination, never counted as free
            elif c.pinned and c.mode is CardMode.SLICED:
                occupy(1, i)  # takes slices but never serves whole-card work
        return state, items, costs

    def budget(self, budget_pct: float | None) -> tuple[float, int]:
        pct = self.cfg.move_budget_pct if budget_pct is None else budget_pct
        if not 0 <= pct <= 100 or math.isnan(pct):
            raise BadRequest(f"move budget {pct:g} %: give a percentage of the active leases, 0..100")
        return pct, int(pct * len(self.engine.leases) / 100 + 1e-9)

    def plan(
        self, budget_pct: float | None = None, gpus: int = 0, seed: int = 0, iterations: int = 300
    ) -> DefragPlan:
        """Propose moves: consolidate (``gpus`` 0) or make room for ``gpus`` whole cards. Raises BadRequest
        (budget) or Conflict (nothing may move) with the reason. The planner runs in this thread."""
        steps = self._planning(budget_pct, gpus, seed, iterations)
        try:
            call = next(steps)
            while True:
                call = steps.send(call())
        except StopIteration as done:
            return done.value

    async def plan_async(
        self, budget_pct: float | None = None, gpus: int = 0, seed: int = 0, iterations: int = 300
    ) -> DefragPlan:
        """``plan``, with the pure planner in a worker thread so that the daemon's loop stays responsive;
        the engine is read (and each move checked) on the loop."""
        loop = asyncio.get_running_loop()
        steps = self._planning(budget_pct, gpus, seed, iterations)
        try:
            call = next(steps)
            while True:
                call = steps.send(await loop.run_in_executor(None, call))
        except StopIteration as done:
            return done.value

    def _planning(self, budget_pct, gpus, seed, iterations) -> Generator[Callable, planner.Plan, DefragPlan]:
        """The steps of ``plan``: yields each planner call (run by the caller, anywhere), receives its
        result, returns the plan. Everything else reads the engine and runs on the caller's thread."""
        e = self.engine
        pct, budget = self.budget(budget_pct)
        active = len(e.leases)
        if budget_pct is not None and pct == 0:
            raise BadRequest("--move-budget 0: a budget of 0 % allows no move; give a percentage above 0")
        if gpus and not 1 <= gpus <= len(e.cards):
            raise BadRequest(f"--gpus {gpus}: this host has {len(e.cards)} card(s)")
        reasons: dict[str, int] = {}
        for lease in e.lease_list():
            why = immovable(e, lease)
            if why:
                reasons[why] = reasons.get(why, 0) + 1
        movable = active - sum(reasons.values())
        notes: list[str] = []
        if not movable:  # nothing to do is a result, not an error
            detail = "; ".join(f"{n} {why}" for why, n in sorted(reasons.items())) or "no active leases"
            notes.append(
                f"nothing restartable to move: {active} active lease(s) ({detail}); jobs started with "
                "`xpu run --restartable` may be moved"
            )
        elif budget == 0:
            need = math.ceil(100 / active)
            notes.append(
                f"a move budget of {pct:g} % of {active} active lease(s) allows no move (it rounds down); "
                f"give --move-budget {need} or more"
            )

        def result(moves=(), after=None, cost=0.0, target=()) -> DefragPlan:
            before = free_cards(e.topology, Books(e).idle_whole())
            return DefragPlan(
                tuple(moves),
                before,
                after or before,
                cost,
                budget,
                pct,
                active,
                movable,
                gpus,
                target,
                tuple(notes),
            )

        if notes:
            return result()
        if gpus and best_group(e.topology, list(Books(e).idle_whole()), gpus):
            notes.append(f"{gpus} whole card(s) are free already: nothing to move")
            return result()
        pinned: set[str] = set()
        for attempt in range(REPLAN_ROUNDS):
            state, items, costs = self._snapshot(pinned)
            found = yield functools.partial(
                planner.plan,
                state,
                items,
                target=Demand(0, 0, gpus, CARD_MILLI) if gpus else None,
                max_moves=budget,
                move_cost=functools.partial(_cost_of, costs),
                hosts=[0],
                seed=seed + attempt,
                iterations=iterations,
                host_value=functools.partial(_host_value, e.topology),
                chain=1 if gpus else 0,  # one host: an evicted job may only go elsewhere on it
            )
            wanted = [(m.item, m.dst.cards) for m in found.moves]
            waves, refused = sequence(e, wanted)
            for k, why in refused.items():
                pinned.add(wanted[k][0])
                notes.append(f"lease {wanted[k][0]} stays: {why}")
            if not refused:
                break
        if not gpus:  # the targeted planner's notes speak of hosts; the daemon's own note says more
            notes.extend(found.notes)
        if len(found.moves) > budget:  # the planner promises this; never exceed an operator's budget
            notes.append(f"the planner exceeded the budget of {budget} move(s)")
            return result()
        moves = [
            PlannedMove(lid, e.leases[lid].mode.value, tuple(e.leases[lid].cards), dst, costs[lid], n + 1)
            for n, wave in enumerate(waves)
            for lid, dst in (wanted[k] for k in wave)
        ]
        books = Books(e)
        for m in moves:
            books.reserve(e.leases[m.lease_id], m.dst)
            books.free(e.leases[m.lease_id], m.src)
        after = free_cards(e.topology, books.idle_whole())
        cost = round(sum(m.cost for m in moves), 6)
        if gpus:
            target = best_group(e.topology, list(after.idle), gpus) or ()
            if moves and target:
                return result(moves, after, cost, target)
            notes.append(f"no plan within {budget} move(s) frees {gpus} whole card(s)")
            return result()
        if not moves:
            notes.extend(() if notes else ("nothing to gain",))
            return result()
        if after.value - free_cards(e.topology, Books(e).idle_whole()).value <= cost + 1e-9:
            notes.append("no move pays for itself")
            return result()
        return result(moves, after, cost)

    # -- applying ------------------------------------------------------------------------------------

    async def apply(
        self,
        plan: DefragPlan,
        who: str,
        started: asyncio.Event | None = None,
        outcomes: list[MoveOutcome] | None = None,
    ) -> list[MoveOutcome]:
        """Record the plan as an event, then move wave by wave, waiting for each wave's acknowledgements.
        ``started`` is set once the first wave is under way; ``outcomes`` (one per move, updated as they
        go) may be given by a caller that wants to read them before the end."""
        e = self.engine
        self.check_idle()
        outcomes = outcomes if outcomes is not None else [MoveOutcome(m) for m in plan.moves]
        if not outcomes:
            if started:
                started.set()
            return outcomes
        self.running = who
        try:
            e.event("defrag", f"defrag ({who}): plan: {plan.describe()}; moving now")  # before it acts
            reason = (
                f"defrag ({who}): making room for {plan.gpus} whole card(s)"
                if plan.gpus
                else f"defrag ({who}): freeing whole cards"
            )
            for wave in sorted({m.wave for m in plan.moves}):
                todo = [o for o in outcomes if o.move.wave == wave]
                for o in todo:
                    await self._start(o, reason)
                if started:
                    started.set()
                await self._settle(todo)
            await self._whole_again(plan, who)
            done = sum(o.state == "done" for o in outcomes)
            rest = ", ".join(f"{o.move.lease_id} {o.state}" for o in outcomes if o.state != "done")
            idle = len(Books(e).idle_whole())
            e.event(
                "defrag",
                f"defrag ({who}): {done} of {len(outcomes)} move(s) done{'; ' + rest if rest else ''}; "
                f"{idle} idle whole card(s) now",
            )
            return outcomes
        finally:
            self.running = ""
            if started:
                started.set()

    async def _whole_again(self, plan: DefragPlan, who: str) -> None:
        """The cards the plan freed go back to whole mode (unless something took them meanwhile)."""
        for i in sorted(set(plan.after.idle) - set(plan.before.idle)):
            try:
                await self.engine.to_whole(i, f"freed by defrag ({who})")
            except Exception as err:  # it stays sliced and idle; a whole-card grant tries again
                log.error("card %d: switching back to whole after defrag failed: %s", i, err)

    def check_idle(self) -> None:
        if self.running:
            raise Conflict(f"a defragmentation is moving jobs already ({self.running}); wait for it")

    async def _start(self, o: MoveOutcome, reason: str) -> None:
        lease = self.engine.leases.get(o.move.lease_id)
        if lease is None:
            o.state, o.detail = "skipped", "the lease ended"
        elif tuple(lease.cards) != o.move.src or lease.id in self.engine.moves.pending:
            o.state, o.detail = "skipped", "it moved since the plan was made"
        else:
            try:
                await self.engine.move(lease.id, reason, to=o.move.dst)
                o.state = "moving"
            except XpudError as err:  # the engine checks again: room taken since the plan, holder gone
                o.state, o.detail = "failed", str(err)

    async def _settle(self, todo: list[MoveOutcome]) -> None:
        """Wait until every started move is acknowledged, abandoned (the reaper gives up after
        ``[health] move_ack_timeout_s``) or its lease ended."""
        e = self.engine
        deadline = self.clock() + e.cfg.health.move_ack_timeout_s + 5.0
        while True:
            for o in todo:
                if o.state != "moving":
                    continue
                lease = e.leases.get(o.move.lease_id)
                if lease is None:
                    o.state, o.detail = "skipped", "the lease ended while moving"
                elif lease.id in e.moves.pending:
                    if self.clock() > deadline:
                        o.detail = "still waiting for its holder"
                elif tuple(lease.cards) == o.move.dst:
                    o.state = "done"
                else:
                    o.state, o.detail = "abandoned", "its holder did not acknowledge the move in time"
            if all(o.state != "moving" for o in todo) or self.clock() > deadline:
                return
            await asyncio.sleep(SETTLE_POLL_S)

    # -- the daemon's own runs -----------------------------------------------------------------------

    def _in_background(self, plan: DefragPlan, who: str) -> None:
        """Apply without holding up the caller (a periodic job: the scheduler would skip and warn about
        its next runs while this one waits for acknowledgements). ``running`` is set before it returns."""
        self.running = who  # no other run starts in between

        async def run() -> None:
            self.running = ""
            try:
                await self.apply(plan, who)
            except Exception:
                log.exception("defrag (%s) failed", who)

        self._task = asyncio.ensure_future(run())  # a reference, so that the task is not collected

    def _quiet(self) -> bool:
        """Whether nothing else is moving jobs (a defrag run, or the health monitor's evacuations)."""
        return not self.running and not self.engine.moves.pending

    async def periodic(self) -> DefragPlan | None:
        """The periodic run (``[defrag] enabled``): plan; act when the plan frees at least ``min_gain``
        whole cards (with ``min_gain`` 0, any plan that pays, e.g. one that only joins free cards up).
        Returns the plan it started applying (the moves go on in the background; ``running`` says)."""
        if not self._quiet():
            return None
        try:
            plan = await self.plan_async()
        except XpudError as err:
            log.debug("periodic defrag: %s", err)
            return None
        freed = len(plan.after.idle) - len(plan.before.idle)
        if not plan.moves or freed < self.cfg.min_gain:
            log.debug("periodic defrag: nothing worth moving (frees %d): %s", freed, plan.describe())
            return None
        if not self._quiet():  # something started moving jobs while the planner ran
            return None
        self._in_background(plan, "periodic")
        return plan

    async def make_room(self) -> DefragPlan | None:
        """Make room for the first whole-card request that waited ``make_room_after_s`` and does not fit."""
        e = self.engine
        now = self.clock()
        waiting = [w for w in e.waitlist.in_order() if not w.future.done()]
        live = {w.ticket for w in waiting}
        self._room_tried = {t: at for t, at in self._room_tried.items() if t in live}
        if not self._quiet():
            return None
        for w in waiting:
            req: Request = w.request
            if req.mode is not Mode.XPU or now - w.enqueued < self.cfg.make_room_after_s:
                continue
            if now - self._room_tried.get(w.ticket, -math.inf) < max(self.cfg.make_room_after_s, 1.0):
                return None  # tried lately: give the last attempt's moves and releases time
            self._room_tried[w.ticket] = now
            if e.fit(req) is not None:
                return None  # it fits: the queue grants it
            try:
                plan = await self.plan_async(gpus=req.gpus)
            except XpudError as err:
                log.info("cannot make room for request %s (%d card(s)): %s", w.ticket, req.gpus, err)
                return None
            if not plan.moves:
                log.info("cannot make room for request %s: %s", w.ticket, plan.describe())
                return None
            if w.future.done() or not self._quiet():  # granted, gone, or others moving, meanwhile
                return None
            who = f"make room for request {w.ticket} ({req.gpus} card(s), waiting {now - w.enqueued:.0f} s)"
            self._in_background(plan, who)
            return plan
        return None


def _cost_of(costs: dict[str, float], item: planner.Item) -> float:
    return costs.get(item.id, 0.0)


def _host_value(topo: Topology, state: ClusterState, h: int) -> float:
    return free_cards(topo, _idle_of(state, h)).value


def _idle_of(state: ClusterState, h: int) -> tuple[int, ...]:
    """Idle cards of host ``h`` in a planner state (card indices are the engine's)."""
    return tuple(int(c) for c in np.flatnonzero(state.card_free[h, : state.n_cards[h]] == CARD_MILLI))
