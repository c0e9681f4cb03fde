"""One replay: a policy places an arrival sequence on a cluster; the allocation curve is recorded.

The curve holds, for every integer arrived percentage ``x`` (0..130), the GPU allocation ratio (%) when the
arrived GPU request is ``x`` % of capacity: the state after the last task whose arrival keeps the arrived
share at or below ``x`` %. Points beyond the last arrival take the final value. *Useful* allocation counts
the original request of every placed task; with slice rounding the cards also hold rounding waste, which
``occupied`` counts.

A task that is not placed is *dropped* when no host can take it, *refused* when one could but the policy
declined (xpud's CPU reserve refuses CPU-only tasks that fit only in GPU hosts' reserved CPU); refused tasks
get no moves. CPU-only tasks dropped and refused (and their CPU) are counted per arrived point too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from xpud.placement.cluster import ClusterState, Demand, Host, Placement
from xpud.placement.policies import Policy
from xpud.placement.slices import Rounding

CURVE_POINTS = 131  # 0..130 %


@dataclass
class ReplayResult:
    policy: str
    seed: int
    alloc_pct: np.ndarray  # (131,) useful allocation, % of capacity
    occupied_pct: np.ndarray  # (131,) share held on cards, incl. rounding waste
    tasks: int = 0
    placed: int = 0
    dropped: int = 0  # fit nowhere
    refused: int = 0  # fit somewhere, declined by the policy
    cpu_only_dropped: int = 0
    moves: int = 0
    moved_tasks: int = 0
    moved_gpu_milli: int = 0
    wall_s: float = 0.0
    decision_s: list[float] = field(default_factory=list)
    moves_curve: np.ndarray | None = None  # (131,) moves made so far, with a mover
    # (131,) CPU-only tasks dropped / refused so far, and their CPU (milli-cores)
    cpu_only_dropped_curve: np.ndarray | None = None
    refused_curve: np.ndarray | None = None
    cpu_only_dropped_cpu_curve: np.ndarray | None = None
    refused_cpu_curve: np.ndarray | None = None


class Mover:
    """What ``--defrag`` plugs into the replay: called when a task fits nowhere. It may move placed tasks
    (updating ``state``, ``placed`` and the policy) and returns where the task goes now (or ``None``) and
    the moves made as ``(task index, from, to)``."""

    def make_room(
        self, state: ClusterState, d: Demand, placed: dict[int, tuple[Demand, Placement]], policy: Policy, rng
    ) -> tuple[Placement | None, list[tuple[int, Placement, Placement]]]:
        raise NotImplementedError

    def placed(self, i: int, d: Demand, p: Placement) -> None:
        """Task ``i`` (its index in the arrival sequence) now runs at ``p``."""


def replay(
    hosts: Sequence[Host] | ClusterState,
    demands: Sequence[Demand],
    policy: Policy,
    *,
    seed: int = 0,
    rounding: Rounding | None = None,
    mover: Mover | None = None,
    time_decisions: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Place ``demands`` in order with ``policy``; tasks that fit nowhere are dropped (or make room via
    ``mover``). ``seed`` seeds the host order for tie-breaks and the policy's random choices."""
    t_start = time.perf_counter()
    state = hosts.copy() if isinstance(hosts, ClusterState) else ClusterState(hosts)
    rng = np.random.default_rng([seed, 0x5EED])
    state.shuffle_ties(rng)
    cap = state.total_gpu_milli
    alloc = np.full(CURVE_POINTS, np.nan)
    occ = np.full(CURVE_POINTS, np.nan)
    res = ReplayResult(policy.name, seed, alloc, occ, tasks=len(demands))
    moves_curve = np.zeros(CURVE_POINTS, dtype=np.int64) if mover is not None else None
    res.moves_curve = moves_curve
    lost = np.zeros((4, CURVE_POINTS), dtype=np.int64)  # CPU-only dropped, refused; their CPU
    lost_now = np.zeros(4, dtype=np.int64)
    placed: dict[int, tuple[Demand, Placement]] = {}
    arrived = useful = 0
    next_x = 0
    moved: set[int] = set()
    for i, d in enumerate(demands):
        arrived_after = arrived + d.gpu_total_milli
        while next_x < CURVE_POINTS and arrived_after * 100 > next_x * cap:
            alloc[next_x] = 100.0 * useful / cap
            occ[next_x] = 100.0 * state.used_gpu_milli / cap
            if moves_curve is not None:
                moves_curve[next_x] = res.moves
            lost[:, next_x] = lost_now
            next_x += 1
        arrived = arrived_after
        policy.observe(d)
        dd = rounding.apply(d) if rounding is not None else d
        t0 = time.perf_counter() if time_decisions else 0.0
        p = policy.choose(state, dd, rng)
        if time_decisions:
            res.decision_s.append(time.perf_counter() - t0)
        refused = p is None and bool(state.feasible(dd).any())
        if p is None and mover is not None and not refused:
            p, moves = mover.make_room(state, dd, placed, policy, rng)
            for task_id, _src, _dst in moves:
                res.moves += 1
                moved.add(task_id)
                res.moved_gpu_milli += placed[task_id][0].gpu_total_milli
        if p is None:
            if refused:
                res.refused += 1
            else:
                res.dropped += 1
            if not d.gpus:
                lost_now[1 if refused else 0] += 1
                lost_now[3 if refused else 2] += d.cpu_milli
        else:
            state.place(dd, p)
            policy.placed(state, dd, p)
            placed[i] = (dd, p)
            if mover is not None:
                mover.placed(i, dd, p)
            useful += d.gpu_total_milli
            res.placed += 1
        if progress is not None and (i + 1) % 1000 == 0:
            progress(i + 1, len(demands))
    alloc[next_x:] = 100.0 * useful / cap
    occ[next_x:] = 100.0 * state.used_gpu_milli / cap
    if moves_curve is not None:
        moves_curve[next_x:] = res.moves
    lost[:, next_x:] = lost_now[:, None]
    res.cpu_only_dropped = int(lost_now[0])
    (
        res.cpu_only_dropped_curve,
        res.refused_curve,
        res.cpu_only_dropped_cpu_curve,
        res.refused_cpu_curve,
    ) = lost
    res.moved_tasks = len(moved)
    res.wall_s = time.perf_counter() - t_start
    return res
