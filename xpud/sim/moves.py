"""Moves during a replay (``xpu simulate --defrag``): when a task fits nowhere, ask the defrag planner to
make room by moving restartable tasks, within a move budget; count every move.

Every task in the trace is taken as restartable; with ``move_whole=False`` only fractional and CPU-only
tasks move (whole-card tasks stay). The budget is a share of the tasks placed so far: at any time the
moves made are at most ``budget_pct`` % of the tasks placed.
"""

from __future__ import annotations

from xpud.placement.cluster import ClusterState, Demand, Placement
from xpud.placement.defrag import Item, Movables, plan
from xpud.sim.replay import Mover


class Defragmenter(Mover):
    """``budget_pct``: moves allowed, % of tasks placed. ``move_whole``: whole-card tasks may move too, and
    groups of ``repack`` hosts may be repacked. ``swaps``: when no eviction makes room, the planner may
    swap two tasks (see :func:`xpud.placement.defrag.plan`). A request shape that found no plan is not
    tried again until ``retry_after`` more tasks have been placed (the state has barely changed before
    that). ``min_gain_milli``: each move must buy at least this much GPU share (a task of share ``s`` may
    use at most ``s // min_gain_milli`` moves; CPU-only tasks none). ``chain``: see :func:`plan`."""

    def __init__(
        self,
        budget_pct: float = 1.0,
        *,
        move_whole: bool = False,
        seed: int = 0,
        iterations: int = 60,
        repack: int | None = None,
        max_moves_per_task: int | None = None,
        retry_after: int = 25,
        swaps: bool = True,
        min_gain_milli: int = 0,
        chain: int = 0,
    ):
        self.budget_pct = budget_pct
        self.move_whole = move_whole
        self.seed = seed
        self.iterations = iterations
        self.repack = repack if repack is not None else (4 if move_whole else 0)
        self.max_moves_per_task = max_moves_per_task or (24 if move_whole else 3)
        self.retry_after = retry_after
        self.swaps = swaps
        self.min_gain_milli = min_gain_milli
        self.chain = chain
        self.moves = 0
        self.calls = 0
        self._failed: dict[tuple, int] = {}
        self.movables = Movables()  # movable tasks, kept in step with the replay

    def placed(self, i: int, d: Demand, p: Placement) -> None:
        if self.move_whole or not (d.gpus and not d.fractional):
            self.movables.add(Item(i, d, p))

    def make_room(
        self, state: ClusterState, d: Demand, placed: dict[int, tuple[Demand, Placement]], policy, rng
    ):
        allowed = int(self.budget_pct * len(placed) / 100.0) - self.moves
        if self.min_gain_milli > 0:
            allowed = min(allowed, d.gpu_total_milli // self.min_gain_milli)
        if allowed <= 0:
            return None, []
        key = (d.cpu_milli, d.memory_mib, d.gpus, d.gpu_milli, d.models)
        if len(placed) < self._failed.get(key, -1):
            return None, []
        self.calls += 1
        result = plan(
            state,
            (),
            movables=self.movables,
            target=d,
            policy=policy,
            max_moves=min(allowed, self.max_moves_per_task),
            move_whole=self.move_whole,
            iterations=self.iterations,
            repack=self.repack,
            swaps=self.swaps,
            chain=self.chain,
            seed=self.seed * 1_000_003 + self.calls,
        )
        if result.target is None:
            self._failed[key] = len(placed) + self.retry_after
            return None, []
        done = []
        for m in result.moves:
            dd = placed[m.item][0]
            state.remove(dd, m.src)
            policy.removed(state, dd, m.src)
        for m in result.moves:
            dd = placed[m.item][0]
            state.place(dd, m.dst)
            policy.placed(state, dd, m.dst)
            placed[m.item] = (dd, m.dst)
            done.append((m.item, m.src, m.dst))
            self.movables.move(m.item, m.dst)
        self.moves += len(done)
        return result.target, done
