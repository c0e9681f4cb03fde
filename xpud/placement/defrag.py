"""Defragmentation: a simulated-annealing planner that proposes moves of restartable tasks.

Two goals, one planner, the same on a single-host snapshot (the daemon's ``xpu defrag --plan/--apply``)
and on a whole cluster (``xpu simulate --defrag``):

- ``plan(state, items, target=demand)``: make room for a request that fits nowhere. Candidate hosts are
  those where it would fit if movable tasks left; annealing over which tasks to evict (energy = move cost +
  shortfall) finds a cheap set, and the evicted tasks are re-placed elsewhere by the placement policy. The
  first candidate whose evicted tasks all find a new place wins. With ``swaps=True``, when no eviction
  works, a *swap* is tried: a task ``t`` on a host where the request fits but for CPU or memory trades
  places with a task ``t'`` that needs less CPU/memory, on a host that can feed ``t`` (two moves). ``t'``
  has the same GPU shape, or is a smaller slice whose card has room for ``t``: the cards stay (nearly) as
  they were, CPU and memory change hands.
- ``plan(state, items)``: consolidate. Annealing over the cards of the movable tasks maximises idle whole
  cards (``host_value``, by default idle cards plus a bonus for keeping them together on one host, i.e.
  whole islands), minus the cost of each move.

A plan never changes the state it is given. Its moves are executed by stopping every moved task, then
starting each at its destination (the final layout is feasible, so any order of starts works).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from xpud.placement.cluster import CARD_MILLI, ClusterState, Demand, Placement

SHORTFALL_WEIGHT = 100.0  # energy per unit of shortfall (1 core, 4 GiB, 0.1 card)


@dataclass(frozen=True)
class Item:
    """A running task: what it holds and where. Only ``restartable`` items may move."""

    id: Hashable
    demand: Demand
    placement: Placement
    restartable: bool = True


@dataclass(frozen=True)
class Move:
    item: Hashable
    src: Placement
    dst: Placement
    cost: float


@dataclass(frozen=True)
class Plan:
    """Moves to apply (stop all, then start each at ``dst``), where ``target`` then goes (if one was
    given), and the objective before/after (higher is better; consolidation only)."""

    moves: tuple[Move, ...] = ()
    target: Placement | None = None
    cost: float = 0.0
    value_before: float = 0.0
    value_after: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.target is not None or (bool(self.moves) and self.value_after > self.value_before)


class Movables:
    """The tasks that may move, by host and as arrays (for the vectorised swap search), kept in step by the
    caller with :meth:`add`, :meth:`move` and :meth:`remove` (a replay or the daemon's lease table).

    ``by_host`` is what :func:`plan` takes as ``by_host``; its lists are replaced, never changed in place,
    so a plan in progress never sees them change.
    """

    def __init__(self, items: Iterable[Item] = ()):
        self.by_host: dict[int, list[Item]] = {}
        self._row: dict[Hashable, int] = {}
        self._items: list[Item | None] = []
        self._free: list[int] = []  # rows given back by remove(), used again first
        self.host = np.zeros(0, dtype=np.int64)  # -1: row unused
        self.gpus = np.zeros(0, dtype=np.int64)
        self.milli = np.zeros(0, dtype=np.int64)
        self.cpu = np.zeros(0, dtype=np.int64)
        self.mem = np.zeros(0, dtype=np.int64)
        self.cards = np.zeros(0, dtype=np.int64)  # bit c set: the task holds share on card c
        self.card0 = np.zeros(0, dtype=np.int64)  # its first card (0 for CPU-only tasks)
        for it in items:
            self.add(it)

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, item_id: Hashable) -> bool:
        return item_id in self._row

    def item(self, row: int) -> Item:
        it = self._items[row]
        assert it is not None
        return it

    def add(self, it: Item) -> None:
        if not it.restartable:
            return
        if it.id in self._row:
            raise ValueError(f"task {it.id!r} is already indexed")
        row = self._free.pop() if self._free else len(self._items)
        if row >= self.host.size:
            grow = max(64, 2 * self.host.size)
            for name in ("host", "gpus", "milli", "cpu", "mem", "cards", "card0"):
                old = getattr(self, name)
                new = np.full(grow, -1 if name == "host" else 0, dtype=np.int64)
                new[: old.size] = old
                setattr(self, name, new)
        d = it.demand
        self.host[row] = it.placement.host
        self.gpus[row], self.milli[row] = d.gpus, d.gpu_milli
        self.cpu[row], self.mem[row] = d.cpu_milli, d.memory_mib
        self.cards[row] = sum(1 << c for c in it.placement.cards)
        self.card0[row] = it.placement.cards[0] if it.placement.cards else 0
        if row == len(self._items):
            self._items.append(it)
        else:
            self._items[row] = it
        self._row[it.id] = row
        self.by_host[it.placement.host] = [*self.by_host.get(it.placement.host, ()), it]

    def remove(self, item_id: Hashable) -> Item | None:
        row = self._row.pop(item_id, None)
        if row is None:
            return None
        it = self.item(row)
        self._items[row] = None
        self.host[row] = -1
        self._free.append(row)
        h = it.placement.host
        self.by_host[h] = [x for x in self.by_host[h] if x.id != item_id]
        return it

    def move(self, item_id: Hashable, dst: Placement) -> None:
        """The task now runs at ``dst`` (a move applied)."""
        it = self.remove(item_id)
        if it is not None:
            self.add(Item(it.id, it.demand, dst, it.restartable))

    def rows(self) -> np.ndarray:
        """Rows in use (``host >= 0``)."""
        return np.flatnonzero(self.host[: len(self._items)] >= 0)

    def room_if_all_leave(
        self, state: ClusterState, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Free CPU (H,), memory (H,) and card share (H, G) of every host if all its movable tasks (or those
        of ``rows``) left: a request that would not fit even then cannot be made room for by evicting them."""
        rows = self.rows() if rows is None else rows
        host = self.host[rows]

        def per_host(weights: np.ndarray, on: np.ndarray | slice = slice(None)) -> np.ndarray:
            return np.bincount(host[on], weights=weights[on], minlength=state.size).astype(np.int64)

        cpu = state.cpu_free + per_host(self.cpu[rows])
        mem = state.mem_free + per_host(self.mem[rows])
        card = state.card_free.copy()
        for c in range(state.max_cards):
            on = (self.cards[rows] >> c) & 1 == 1
            if on.any():
                card[:, c] += per_host(self.milli[rows], on)
        return cpu, mem, card


def default_host_value(state: ClusterState, h: int) -> float:
    """Idle whole cards on host ``h``, plus half a card per card of the largest idle group (all idle cards
    on one host count as one group here; the daemon passes a topology-aware value instead)."""
    n = float(state.n_full[h])
    cards = max(int(state.n_cards[h]), 1)
    return n + 0.5 * n * n / cards


def _shortfall(state: ClusterState, d: Demand, h: int) -> float:
    """How far ``d`` is from fitting on host ``h`` now (0 = fits): cores + 4 GiB units + tenth-cards."""
    s = max(0, d.cpu_milli - int(state.cpu_free[h])) / 1000.0
    s += max(0, d.memory_mib - int(state.mem_free[h])) / 4096.0
    if d.gpus:
        if d.models and state.models[state.model[h]] not in d.models:
            return math.inf
        if d.fractional:
            s += max(0, d.gpu_milli - int(state.max_free[h])) / 100.0
        else:
            s += max(0, d.gpus - int(state.n_full[h])) * 10.0
    return s


def _cost(cost: float | Callable[[Item], float], item: Item) -> float:
    return cost(item) if callable(cost) else float(cost)


def plan(
    state: ClusterState,
    items: Sequence[Item],
    *,
    target: Demand | None = None,
    policy=None,
    max_moves: int = 8,
    move_cost: float | Callable[[Item], float] = 1.0,
    move_whole: bool = True,
    hosts: Sequence[int] | None = None,
    candidates: int = 6,
    iterations: int = 300,
    repack: int = 0,
    seed: int = 0,
    host_value: Callable[[ClusterState, int], float] = default_host_value,
    by_host: Mapping[int, Sequence[Item]] | None = None,
    chain: int = 0,
    swaps: bool = False,
    movables: Movables | None = None,
) -> Plan:
    """Propose moves (see the module docstring). ``items``: running tasks (non-restartable ones and, with
    ``move_whole=False``, whole-card ones stay put). ``policy``: where evicted tasks go (default: the
    ``xpud`` policy). ``hosts``: restrict the hosts involved (e.g. ``[0]`` for a single-host snapshot).
    ``move_cost``: a number or a function of the item. ``max_moves``: the move budget of this plan.
    ``repack``: when evicting from one host is not enough, also try repacking groups of this many hosts.
    ``by_host``: the movable items already grouped by host (callers that keep such an index pass it
    instead of ``items``; it is used as given). ``chain``: an evicted task that fits nowhere may make room
    for itself this many levels deep (1 bought +0.005 points on openb at three times the planning time).
    ``swaps``: when no eviction makes room, try a two-move swap (see the module docstring). ``movables``:
    the movable tasks as a :class:`Movables` index kept by the caller (used instead of ``items`` and
    ``by_host``; built from them otherwise)."""
    rng = np.random.default_rng(seed)
    if movables is not None:
        by_host = movables.by_host
    if by_host is None:
        grouped: dict[int, list[Item]] = {}
        for it in items:
            if it.restartable and (move_whole or not _is_whole(it.demand)):
                grouped.setdefault(it.placement.host, []).append(it)
        by_host = grouped
    if max_moves <= 0 or not any(by_host.values()):
        return Plan(notes=("nothing may move",))
    scope = np.arange(state.size) if hosts is None else np.asarray(hosts, dtype=np.int64)
    if policy is None:
        from xpud.placement.fragaware import FragAware

        policy = FragAware()
    if target is not None:
        if movables is None:
            movables = Movables(it for its in by_host.values() for it in its)
        return _plan_target(
            state,
            by_host,
            target,
            policy,
            max_moves,
            move_cost,
            scope,
            candidates,
            iterations,
            rng,
            repack,
            chain,
            movables=movables,
            swaps=swaps,
        )
    movable = [it for its in by_host.values() for it in its]
    return _plan_consolidate(state, movable, max_moves, move_cost, scope, iterations, rng, host_value)


def _is_whole(d: Demand) -> bool:
    return d.gpus > 0 and not d.fractional


# -- making room for one request -----------------------------------------------------------------------


def _plan_target(
    state,
    by_host,
    target,
    policy,
    max_moves,
    move_cost,
    scope,
    candidates,
    iterations,
    rng,
    repack,
    depth=0,
    movables=None,
    swaps=False,
) -> Plan:
    # Only tasks that fit on some other host right now are worth evicting.
    where: dict[tuple, tuple[int, int]] = {}  # shape -> (hosts it fits on, one of them)

    def elsewhere(it: Item, h: int) -> bool:
        key = _key(it.demand)
        if key not in where:
            ok = scope[state.feasible(it.demand, scope)]
            where[key] = (int(ok.size), int(ok[0]) if ok.size else -1)
        n, first = where[key]
        return depth > 0 or n > 1 or (n == 1 and first != h)

    notes = []
    ranked = []
    could = None
    if movables is not None and depth <= 0:  # (a chain's index would be stale after its first moves)
        cpu, mem, card = movables.room_if_all_leave(state, _maybe_elsewhere(state, movables, scope))
        could = (cpu >= target.cpu_milli) & (mem >= target.memory_mib)
        if target.fractional:
            could &= card.max(axis=1) >= target.gpu_milli
        elif target.gpus:
            could &= (card == CARD_MILLI).sum(axis=1) >= target.gpus
    for h in _by_shortfall(state, target, scope, by_host, could=could):
        evictable = [it for it in by_host[h] if elsewhere(it, h)]
        if not evictable or not _clearable(state, target, h, evictable):
            continue
        ranked.append(h)
        evict = _anneal_eviction(state, target, h, evictable, max_moves, move_cost, iterations, rng)
        if evict is not None:
            chain = (by_host, candidates, iterations, depth - 1, max_moves) if depth > 0 else None
            result = _try_evict(state, target, h, evict, policy, rng, move_cost, scope, chain)
            if result is not None:
                return result
            notes.append(f"host {h}: evicted tasks found no other place")
        if len(ranked) >= candidates:
            break
    if swaps and movables is not None and max_moves >= 2:
        result = _plan_swap(state, target, movables, policy, rng, move_cost, scope)
        if result is not None:
            return result
        notes.append("no swap makes room")
    if repack > 1:
        for h in ranked[: max(1, candidates // 2)]:
            result = _group_repack(
                state, target, h, by_host, policy, rng, max_moves, move_cost, scope, repack
            )
            if result is not None:
                return result
        notes.append(f"no group of {repack} hosts could be repacked within {max_moves} moves")
    return Plan(notes=tuple(notes) or ("no host can be cleared for the request",))


def _maybe_elsewhere(state: ClusterState, movables: Movables, scope: np.ndarray) -> np.ndarray:
    """Rows of ``movables`` that might fit on some host of ``scope`` now (a necessary condition, cheap: per
    GPU need, the most free CPU and memory among hosts with that much GPU room; models are ignored)."""
    rows = movables.rows()
    gpus, milli = movables.gpus[rows], movables.milli[rows]
    frac = (gpus == 1) & (milli < CARD_MILLI)
    level = np.where(frac, milli, gpus * CARD_MILLI)  # 0: CPU only; k * 1000: k idle cards
    ok = np.zeros(rows.size, dtype=bool)
    cpu_s, mem_s = state.cpu_free[scope], state.mem_free[scope]
    for lv in np.unique(level):
        if lv == 0:
            room = np.ones(scope.size, dtype=bool)
        elif lv < CARD_MILLI:
            room = state.max_free[scope] >= lv
        else:
            room = state.n_full[scope] >= lv // CARD_MILLI
        if not room.any():
            continue
        at = level == lv
        ok[at] = (movables.cpu[rows[at]] <= cpu_s[room].max()) & (movables.mem[rows[at]] <= mem_s[room].max())
    return rows[ok]


def _by_shortfall(state: ClusterState, d: Demand, scope: np.ndarray, by_host, limit: int = 400, could=None):
    """Hosts of ``scope`` that hold movable tasks, smallest shortfall for ``d`` first (at most ``limit``);
    only those where ``could`` holds, when given (hosts where ``d`` would fit if all movable tasks left)."""
    if could is not None:
        scope = scope[could[scope]]
    cand = np.array([h for h in scope if by_host.get(int(h))], dtype=np.int64)
    if cand.size == 0:
        return []
    short = np.maximum(0, d.cpu_milli - state.cpu_free[cand]) / 1000.0
    short = short + np.maximum(0, d.memory_mib - state.mem_free[cand]) / 4096.0
    if d.gpus:
        if d.fractional:
            short = short + np.maximum(0, d.gpu_milli - state.max_free[cand]) / 100.0
        else:
            short = short + np.maximum(0, d.gpus - state.n_full[cand]) * 10.0
        if d.models:
            short = np.where(state.model_mask(d.models)[cand], short, np.inf)
    order = np.argsort(short, kind="stable")[:limit]
    return [int(cand[i]) for i in order if np.isfinite(short[i])]


def _clearable(state: ClusterState, d: Demand, h: int, its: Sequence[Item]) -> bool:
    """Whether ``d`` would fit on ``h`` if all of ``its`` left."""
    if state.cpu_free[h] + sum(it.demand.cpu_milli for it in its) < d.cpu_milli:
        return False
    if state.mem_free[h] + sum(it.demand.memory_mib for it in its) < d.memory_mib:
        return False
    if d.gpus:
        card = state.card_free[h].copy()
        for it in its:
            for c in it.placement.cards:
                card[c] += it.demand.gpu_milli
        if d.fractional:
            return bool(card.max() >= d.gpu_milli)
        return int((card == CARD_MILLI).sum()) >= d.gpus
    return True


def _key(d: Demand) -> tuple:
    return (d.cpu_milli, d.memory_mib, d.gpus, d.gpu_milli, d.models)


SWAP_HOSTS = 30  # hosts short of CPU/memory for the request that a swap tries, least short first
SWAP_PARTNERS = 5  # partners tried per task on such a host
SWAP_GPU = (
    False  # experiment: also hosts where the request's share fits only once a slice trades for a smaller one
)


def _plan_swap(state, d, movables: Movables, policy, rng, move_cost, scope) -> Plan | None:
    """Make room for ``d`` on a host whose cards could take it but whose CPU or memory falls short: a task
    ``t`` there trades places with a task ``t'`` elsewhere that needs at least the shortfall less CPU and
    memory, where the partner's host can feed ``t``. ``t'`` has the same GPU shape as ``t`` or, for a
    single-card ``t``, a share no larger whose card has room for ``t`` (CPU-only tasks trade with CPU-only
    ones). ``d`` then goes where the policy puts it on the freed host. Partners on hosts with the least
    free GPU share come first (a swap there strands nothing), then those leaving most CPU."""
    in_scope = np.zeros(state.size, dtype=bool)
    in_scope[scope] = True
    ok = in_scope & ~state.feasible(d)
    if d.gpus:
        ok &= state.model_mask(d.models)
        ok &= (state.max_free >= d.gpu_milli) if d.fractional else (state.n_full >= d.gpus)
    need_cpu = np.maximum(0, d.cpu_milli - state.cpu_free)
    need_mem = np.maximum(0, d.memory_mib - state.mem_free)
    hosts = np.flatnonzero(ok)
    if hosts.size == 0:
        return None
    hosts = hosts[np.argsort(need_cpu[hosts] / 1000.0 + need_mem[hosts] / 4096.0, kind="stable")]
    rows = movables.rows()
    rows = rows[in_scope[movables.host[rows]]]
    r_host = movables.host[rows]
    r_gpus, r_milli = movables.gpus[rows], movables.milli[rows]
    r_cpu, r_mem = movables.cpu[rows], movables.mem[rows]
    cpu_room = state.cpu_free[r_host] + r_cpu  # what a partner's host offers once the partner leaves
    mem_room = state.mem_free[r_host] + r_mem
    card_room = state.card_free[r_host, movables.card0[rows]] + r_milli  # and its card
    free_gpu = state.card_free[r_host].sum(axis=1)
    model_ok: dict[tuple[str, ...], np.ndarray] = {}
    tried = 0
    for h in hosts:
        if tried >= SWAP_HOSTS:
            break
        nc, nm = int(need_cpu[h]), int(need_mem[h])
        its = [
            it
            for it in movables.by_host.get(int(h), ())
            if it.demand.cpu_milli >= nc and it.demand.memory_mib >= nm
        ]
        if not its:
            continue
        tried += 1
        seen = set()
        for t in its:
            td = t.demand
            if (td, t.placement.cards) in seen:
                continue
            seen.add((td, t.placement.cards))
            if td.gpus == 1:
                mask = (r_gpus == 1) & (r_milli <= td.gpu_milli) & (card_room >= td.gpu_milli)
            else:
                mask = (r_gpus == td.gpus) & (r_milli == td.gpu_milli)
            mask &= r_host != h
            mask &= (r_cpu <= td.cpu_milli - nc) & (r_mem <= td.memory_mib - nm)
            mask &= (cpu_room >= td.cpu_milli) & (mem_room >= td.memory_mib)
            if td.gpus and td.models:
                if td.models not in model_ok:
                    model_ok[td.models] = state.model_mask(td.models)[r_host]
                mask &= model_ok[td.models]
            idx = np.flatnonzero(mask)
            if idx.size == 0:
                continue
            left = cpu_room[idx] - td.cpu_milli
            for j in idx[np.lexsort((-left, free_gpu[idx]))][:SWAP_PARTNERS]:
                p = movables.item(int(rows[j]))
                pd = p.demand
                if pd.gpus and pd.models and state.models[state.model[h]] not in pd.models:
                    continue
                to_p = Placement(p.placement.host, p.placement.cards)
                to_t = Placement(t.placement.host, t.placement.cards)
                work = state.copy()
                work.remove(td, t.placement)
                work.remove(pd, p.placement)
                work.place(td, to_p)
                work.place(pd, to_t)
                target = _choose_on(policy, work, d, rng, [int(h)])
                if target is None:
                    continue
                moves = (
                    Move(t.id, t.placement, to_p, _cost(move_cost, t)),
                    Move(p.id, p.placement, to_t, _cost(move_cost, p)),
                )
                return Plan(moves, target, sum(m.cost for m in moves), notes=(f"swap via host {h}",))
    return None


def _group_repack(state, d, h, by_host, policy, rng, max_moves, move_cost, scope, size) -> Plan | None:
    """Repack the movable tasks of host ``h`` and the ``size - 1`` hosts with the most partly used card
    share (largest first, by the policy, inside the group), with ``d`` placed on ``h`` first."""
    free = state.card_free
    partial = np.where((free > 0) & (free < CARD_MILLI), free, 0).sum(axis=1)
    cand = [int(x) for x in scope if int(x) != h and int(x) in by_host and partial[int(x)] > 0]
    cand.sort(key=lambda x: -partial[x])
    group = [h, *cand[: size - 1]]
    items = [it for g in group for it in by_host.get(g, [])]
    work = state.copy()
    for it in items:
        work.remove(it.demand, it.placement)
    fixed = {
        g: {int(c) for c in np.flatnonzero(work.card_free[g] < CARD_MILLI) if c < work.n_cards[g]}
        for g in group
    }
    target = _choose_on(policy, work, d, rng, [h])
    if target is None:
        return None
    work.place(d, target)
    new: dict[Hashable, Placement] = {}
    for it in sorted(
        items, key=lambda it: (-it.demand.gpu_total_milli, -it.demand.cpu_milli, -it.demand.memory_mib)
    ):
        dst = _choose_on(policy, work, it.demand, rng, group) or _choose_on(
            policy, work, it.demand, rng, scope
        )
        if dst is None:
            return None
        work.place(it.demand, dst)
        new[it.id] = dst
    relabel = _card_relabelling(items, new, group, fixed, state.n_cards)
    target = relabel(target)
    moves = []
    for it in items:
        dst = relabel(new[it.id])
        if dst != it.placement:
            moves.append(Move(it.id, it.placement, dst, _cost(move_cost, it)))
    if len(moves) > max_moves or not _feasible_after(state, items, moves, d, target):
        return None
    return Plan(tuple(moves), target, sum(m.cost for m in moves), notes=(f"repacked hosts {group}",))


def _feasible_after(state: ClusterState, items, moves, d: Demand | None, target: Placement | None) -> bool:
    """Whether stopping the moved tasks, then starting them at their destinations (and ``d`` at ``target``)
    works on ``state``."""
    work = state.copy()
    demand = {it.id: it.demand for it in items}
    for m in moves:
        work.remove(demand[m.item], m.src)
    for m in moves:
        if not work.fits(demand[m.item], m.dst):
            return False
        work.place(demand[m.item], m.dst)
    return d is None or target is None or work.fits(d, target)


def _card_relabelling(items, new, group, fixed, n_cards):
    """Cards of one host are interchangeable: rename them so that as many tasks as possible keep their card
    (cards holding tasks that stay put keep their names)."""
    from scipy.optimize import linear_sum_assignment

    maps: dict[int, dict[int, int]] = {}
    for g in group:
        pairs = [
            (c_new, c_old)
            for it in items
            if it.placement.host == g and new[it.id].host == g
            for c_new, c_old in zip(new[it.id].cards, it.placement.cards, strict=True)
        ]
        if not pairs:
            continue
        cards = int(n_cards[g])
        weight = np.zeros((cards, cards))
        for a, b in pairs:
            weight[a, b] += 1
        for f in fixed.get(g, ()):
            weight[f, f] += 1e6
        rows, cols = linear_sum_assignment(-weight)
        maps[g] = {int(r): int(c) for r, c in zip(rows, cols, strict=True)}

    def relabel(p: Placement) -> Placement:
        m = maps.get(p.host)
        return Placement(p.host, tuple(m.get(c, c) for c in p.cards)) if m else p

    return relabel


def _anneal_eviction(state, d, h, its, max_moves, move_cost, iterations, rng) -> list[Item] | None:
    """A cheap set of tasks to evict from host ``h`` so that ``d`` fits there (annealing over subsets,
    energy = move cost + ``SHORTFALL_WEIGHT`` x shortfall); ``None`` when no set within budget works."""
    n = len(its)
    work = state.copy()
    costs = np.array([_cost(move_cost, it) for it in its])

    def shortfall(mask: np.ndarray) -> float:
        chosen = np.flatnonzero(mask)
        for i in chosen:
            work.remove(its[i].demand, its[i].placement)
        s = _shortfall(work, d, h)
        for i in chosen:
            work.place(its[i].demand, its[i].placement)
        return s

    def energy(mask: np.ndarray) -> float:
        if int(mask.sum()) > max_moves:
            return math.inf
        return SHORTFALL_WEIGHT * shortfall(mask) + float(costs[mask].sum())

    # Greedy start: the biggest consumers first, until the request fits.
    size = [
        it.demand.cpu_milli / 1000 + it.demand.memory_mib / 4096 + it.demand.gpu_total_milli / 100
        for it in its
    ]
    cur = np.zeros(n, dtype=bool)
    for i in sorted(range(n), key=lambda i: -size[i]):
        if shortfall(cur) == 0:
            break
        cur[i] = True
    cur_e = energy(cur)
    best, best_e = cur.copy(), cur_e
    t0 = max(1.0, float(costs.max()))
    for step in range(iterations if n > 1 else 0):
        temp = t0 * (1.0 - step / iterations) + 1e-3
        cand = cur.copy()
        cand[int(rng.integers(n))] ^= True
        e = energy(cand)
        if e <= cur_e or (math.isfinite(e) and rng.random() < math.exp(-(e - cur_e) / temp)):
            cur, cur_e = cand, e
            if e < best_e:
                best, best_e = cand.copy(), e
    if not math.isfinite(best_e) or shortfall(best) > 0:
        return None
    return [its[i] for i in np.flatnonzero(best)]


def _try_evict(state, d, h, evict, policy, rng, move_cost, scope, chain=None) -> Plan | None:
    """Evict ``evict`` from ``h``, put ``d`` there, re-place the evicted tasks; ``None`` if one cannot.
    With ``chain``, an evicted task that fits nowhere may itself make room elsewhere (one level deeper)."""
    work = state.copy()
    for it in evict:
        work.remove(it.demand, it.placement)
    target = _choose_on(policy, work, d, rng, [h])
    if target is None:
        return None
    work.place(d, target)
    moves: list[Move] = []
    for it in sorted(evict, key=lambda it: (-it.demand.gpu_total_milli, -it.demand.cpu_milli)):
        dst = _choose_on(policy, work, it.demand, rng, scope)
        if dst is None and chain is not None:
            by_host, candidates, iterations, depth, max_moves = chain
            budget = max_moves - len(evict) - len(moves)
            rest = scope[scope != h]
            sub = _plan_target(
                work,
                by_host,
                it.demand,
                policy,
                budget,
                move_cost,
                rest,
                candidates,
                iterations,
                rng,
                0,
                depth,
            )
            if sub.target is None or len(sub.moves) > budget:
                return None
            for m in sub.moves:
                work.remove(_demand_of(by_host, m.item, m.src), m.src)
            for m in sub.moves:
                work.place(_demand_of(by_host, m.item, m.src), m.dst)
            moves.extend(sub.moves)
            dst = sub.target
        if dst is None:
            return None
        work.place(it.demand, dst)
        if dst != it.placement:
            moves.append(Move(it.id, it.placement, dst, _cost(move_cost, it)))
    return Plan(tuple(moves), target, sum(m.cost for m in moves))


def _demand_of(by_host, item_id, src: Placement) -> Demand:
    return next(it.demand for it in by_host[src.host] if it.id == item_id)


def _choose_on(policy, state: ClusterState, d: Demand, rng, hosts) -> Placement | None:
    """The policy's choice restricted to ``hosts``."""
    score, card = policy.host_scores(state, d)
    allowed = np.full(state.size, -np.inf)
    hosts = np.asarray(hosts, dtype=np.int64)
    allowed[hosts] = score[hosts]
    best = allowed.max()
    if best == -np.inf:
        return None
    h = policy.pick(state, np.flatnonzero(allowed == best), rng, d)
    return Placement(h, policy.cards(state, d, h, int(card[h]), rng))


# -- consolidation ---------------------------------------------------------------------------------------


def _plan_consolidate(state, movable, max_moves, move_cost, scope, iterations, rng, host_value) -> Plan:
    allowed = set(int(h) for h in scope)
    its = [it for it in movable if it.placement.host in allowed and it.demand.gpus]
    if not its:
        return Plan(notes=("no movable GPU task",))
    work = state.copy()
    hosts = sorted(allowed)
    value = {h: host_value(work, h) for h in hosts}
    before = sum(value.values())
    pos = [it.placement for it in its]
    n_moved = 0
    cur_e = -before
    best_e, best_pos = cur_e, list(pos)
    t0 = 1.0
    for step in range(iterations * max(1, len(its))):
        temp = t0 * (1.0 - step / (iterations * max(1, len(its)))) + 1e-3
        i = int(rng.integers(len(its)))
        it = its[i]
        home = it.placement
        dst = home if (pos[i] != home and rng.random() < 0.3) else _random_spot(work, it.demand, hosts, rng)
        if dst is None or dst == pos[i]:
            continue
        moved_delta = (dst != home) - (pos[i] != home)
        if n_moved + moved_delta > max_moves:
            continue
        src = pos[i]
        work.remove(it.demand, src)
        if not work.fits(it.demand, dst):
            work.place(it.demand, src)
            continue
        work.place(it.demand, dst)
        touched = {src.host, dst.host}
        new_vals = {h: host_value(work, h) for h in touched}
        dv = sum(new_vals[h] - value[h] for h in touched)
        e = cur_e - dv + moved_delta * _cost(move_cost, it)
        if e <= cur_e or rng.random() < math.exp(-(e - cur_e) / temp):
            pos[i] = dst
            value.update(new_vals)
            n_moved += moved_delta
            cur_e = e
            if e < best_e - 1e-12:
                best_e, best_pos = e, list(pos)
        else:
            work.remove(it.demand, dst)
            work.place(it.demand, src)
    moves = tuple(
        Move(it.id, it.placement, p, _cost(move_cost, it))
        for it, p in zip(its, best_pos, strict=True)
        if p != it.placement
    )
    final = state.copy()
    for m, it in ((m, next(x for x in its if x.id == m.item)) for m in moves):
        final.remove(it.demand, m.src)
    for m in moves:
        final.place(next(x for x in its if x.id == m.item).demand, m.dst)
    after = sum(host_value(final, h) for h in hosts)
    cost = sum(m.cost for m in moves)
    if after - cost <= before:
        return Plan(value_before=before, value_after=before, notes=("no move pays for itself",))
    return Plan(moves, None, cost, before, after)


def _random_spot(state: ClusterState, d: Demand, hosts: list[int], rng) -> Placement | None:
    """A random (host, cards) among ``hosts`` where ``d`` fits now."""
    cand = np.asarray(hosts, dtype=np.int64)
    ok = cand[state.feasible(d, cand)]
    if ok.size == 0:
        return None
    h = int(ok[rng.integers(ok.size)])
    if d.fractional:
        fits = np.flatnonzero(state.card_free[h] >= d.gpu_milli)
        return Placement(h, (int(fits[rng.integers(fits.size)]),))
    return Placement(h, state.cards_for(d, h))
