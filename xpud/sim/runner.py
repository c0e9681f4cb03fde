"""Running policies over seeds: one replay per (policy, seed), spread over worker processes.

Each worker loads the cluster and the trace once. Results come back as :class:`~xpud.sim.replay.
ReplayResult` (curves as arrays) in a :class:`SimReport`, in the order of the jobs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from xpud.placement.bound import Bound, offline_packing, packing_bound
from xpud.placement.cluster import ClusterState, Demand, Host
from xpud.placement.registry import DEFAULT_CPU_RESERVE, forced_slices, make_policy
from xpud.placement.slices import Rounding
from xpud.sim.protocol import DEFAULT_RATIO, DEFAULT_SEEDS, arrivals
from xpud.sim.replay import ReplayResult, replay
from xpud.sim.trace import load_cluster, load_trace


@dataclass(frozen=True)
class SimConfig:
    cluster: Path
    trace: Path
    policies: tuple[str, ...] = ("xpud",)
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    slices: str = "free"
    ratio: float = DEFAULT_RATIO
    defrag: bool = False
    move_budget_pct: float = 1.0  # moves allowed, % of placed tasks
    move_whole: bool | None = None  # None: whole-card tasks may move when the budget exceeds 1 %
    swaps: bool = True  # with defrag: the planner may swap two tasks when no eviction makes room
    cpu_reserve: str = DEFAULT_CPU_RESERVE  # xpud and CPU-only tasks (names.CPU_RESERVE_MODES)
    bound_points: tuple[int, ...] = ()  # arrived % at which to compute the packing bound
    workers: int = 0  # 0: one per CPU, at most the number of jobs


@dataclass
class SimReport:
    config: SimConfig
    results: list[ReplayResult]
    bounds: dict[tuple[int, int], Bound] = field(default_factory=dict)  # (seed, arrived %) -> bound
    offline: dict[tuple[int, int], float] = field(default_factory=dict)  # (seed, %) -> feasible packing %
    tasks: int = 0
    hosts: int = 0
    capacity_milli: int = 0

    def curves(self, policy: str, occupied: bool = False) -> np.ndarray:
        """(seeds, 131) allocation curves of one policy."""
        rows = [r.occupied_pct if occupied else r.alloc_pct for r in self.results if r.policy == policy]
        return np.vstack(rows) if rows else np.zeros((0, 131))

    def policies(self) -> list[str]:
        return list(dict.fromkeys(r.policy for r in self.results))


_WORKER: dict = {}


def _init_worker(hosts: list[Host], tasks: list[Demand], qtable=None) -> None:
    _WORKER["hosts"] = hosts
    _WORKER["tasks"] = tasks
    _WORKER["state"] = ClusterState(hosts)
    _WORKER["qtable"] = qtable


def _job(args: tuple[str, int, SimConfig]) -> ReplayResult:
    name, seed, cfg = args
    state: ClusterState = _WORKER["state"]
    tasks: list[Demand] = _WORKER["tasks"]
    seq = arrivals(tasks, state.total_gpu_milli, seed, cfg.ratio)
    mode = forced_slices(name) or cfg.slices
    rounding = Rounding.named(mode) if mode != "free" else None
    mover = None
    if cfg.defrag:
        from xpud.sim.moves import Defragmenter

        whole = cfg.move_whole if cfg.move_whole is not None else cfg.move_budget_pct > 1.0
        mover = Defragmenter(budget_pct=cfg.move_budget_pct, move_whole=whole, seed=seed, swaps=cfg.swaps)
    policy = make_policy(name, tasks, _WORKER.get("qtable"), cpu_reserve=cfg.cpu_reserve)
    res = replay(state, seq, policy, seed=seed, rounding=rounding, mover=mover)
    res.policy = name
    return res


def run(
    cfg: SimConfig,
    progress: Callable[[str], None] | None = None,
) -> SimReport:
    """Replay every policy on every seed; also the packing bound at ``cfg.bound_points``."""
    hosts = load_cluster(cfg.cluster)
    tasks = [t.demand for t in load_trace(cfg.trace)]
    jobs = [(p, s, cfg) for p in cfg.policies for s in cfg.seeds]
    workers = cfg.workers or min(len(jobs), os.cpu_count() or 1)
    results: dict[tuple[str, int], ReplayResult] = {}
    say = progress or (lambda _msg: None)
    qtable = None
    if "xpud-q" in cfg.policies:
        from xpud.placement.qlearn import TRAIN_SEEDS, train

        capacity = ClusterState(hosts).total_gpu_milli
        seeds = [s for s in TRAIN_SEEDS if s not in cfg.seeds]
        say(f"training xpud-q on seeds {seeds} ...")
        qtable = train(hosts, [arrivals(tasks, capacity, s, cfg.ratio) for s in seeds])
    if workers <= 1:
        _init_worker(hosts, tasks, qtable)
        for n, job in enumerate(jobs, 1):
            r = _job(job)
            results[(r.policy, r.seed)] = r
            say(_line(n, len(jobs), r))
    else:
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with ctx.Pool(workers, initializer=_init_worker, initargs=(hosts, tasks, qtable)) as pool:
            for n, r in enumerate(pool.imap_unordered(_job, jobs), 1):
                results[(r.policy, r.seed)] = r
                say(_line(n, len(jobs), r))
    state = ClusterState(hosts)
    report = SimReport(
        cfg,
        [results[(p, s)] for p, s, _ in jobs],
        tasks=len(tasks),
        hosts=len(hosts),
        capacity_milli=state.total_gpu_milli,
    )
    for seed in cfg.seeds if cfg.bound_points else ():
        seq = arrivals(tasks, state.total_gpu_milli, seed, cfg.ratio)
        for pct in cfg.bound_points:
            arrived = arrived_prefix(seq, state.total_gpu_milli, pct)
            report.bounds[(seed, pct)] = packing_bound(hosts, arrived)
            report.offline[(seed, pct)] = 100.0 * offline_packing(state, arrived) / state.total_gpu_milli
            say(f"bound seed {seed} at {pct}%: {report.bounds[(seed, pct)].pct:.2f}%")
    return report


def arrived_prefix(seq: Sequence[Demand], capacity_milli: int, pct: int) -> list[Demand]:
    """The tasks that have arrived when the arrived GPU request is ``pct`` % of capacity."""
    out, total = [], 0
    for d in seq:
        if (total + d.gpu_total_milli) * 100 > pct * capacity_milli:
            break
        total += d.gpu_total_milli
        out.append(d)
    return out


def _line(n: int, total: int, r: ReplayResult) -> str:
    extra = f", {r.moves} moves" if r.moves else ""
    return (
        f"[{n}/{total}] {r.policy} seed {r.seed}: {r.alloc_pct[100]:.2f}% at 100% arrived, "
        f"{r.alloc_pct[-1]:.2f}% at 130% ({r.wall_s:.1f} s{extra})"
    )
