"""How much GPU share *any* placement could allocate for a set of arrived tasks: an upper bound by MILP.

Hosts are grouped into types (same model, CPU, memory, cards) and tasks into shapes (same CPU, memory,
cards, share, models); ``n[t, s]`` is how many tasks of shape ``s`` go to hosts of type ``t``. Maximise the
placed GPU share subject to, per type: total CPU, memory and GPU share; cards (a whole-card task takes
its cards, and no two fractional tasks of more than half a card share one); and dual-feasible-function
cuts ``sum u_k(share) <= cards`` (``u_k(x) = floor((k+1)x)/k``, or ``x`` where ``(k+1)x`` is whole), which
a card-level packing must satisfy. Per type, not per host: a relaxation, so the optimum bounds every
feasible packing, offline ones included. Solved with SciPy's ``milp`` (HiGHS); the LP relaxation is a
looser bound that is always available.

``offline_packing`` gives a feasible packing of the same tasks seen all at once (best of a few orders and
policies): the bound and it bracket the best possible.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xpud.placement.cluster import CARD_MILLI, ClusterState, Demand, Host

DFF_ORDERS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class Bound:
    """Upper bound on the allocatable GPU share (milli and % of capacity)."""

    gpu_milli: float
    capacity_milli: int
    exact: bool  # True: MILP optimum; False: LP relaxation (or MILP stopped early: its dual bound)
    seconds: float

    @property
    def pct(self) -> float:
        return 100.0 * self.gpu_milli / self.capacity_milli if self.capacity_milli else 0.0


def _dff(x: float, k: int) -> float:
    y = (k + 1) * x
    return x if abs(y - round(y)) < 1e-9 else math.floor(y) / k


def packing_bound(
    hosts: Sequence[Host], tasks: Sequence[Demand], *, integer: bool = True, time_limit_s: float = 30.0
) -> Bound:
    """Upper bound on the GPU share (milli) that can be placed from ``tasks`` on ``hosts``."""
    import time

    from scipy.optimize import Bounds, LinearConstraint, milp

    t0 = time.perf_counter()
    types = Counter((h.model, h.cpu_milli, h.memory_mib, h.cards) for h in hosts)
    shapes = Counter((d.cpu_milli, d.memory_mib, d.gpus, d.gpu_milli, tuple(sorted(d.models))) for d in tasks)
    capacity = sum(h.cards for h in hosts) * CARD_MILLI
    tkeys, skeys = list(types), [s for s in shapes if s[2] > 0]  # CPU-only tasks add no GPU share
    var: list[tuple[int, int]] = []
    for ti, (model, cpu, mem, cards) in enumerate(tkeys):
        for si, (scpu, smem, gpus, _milli, models) in enumerate(skeys):
            if gpus <= cards and scpu <= cpu and smem <= mem and (not models or model in models):
                var.append((ti, si))
    if not var:
        return Bound(0.0, capacity, True, time.perf_counter() - t0)
    nv = len(var)
    gain = np.array([skeys[si][2] * skeys[si][3] for _, si in var], dtype=float)
    rows, ub = [], []

    def per_type(coef) -> None:
        for ti, (_m, cpu, mem, cards) in enumerate(tkeys):
            row = np.zeros(nv)
            for j, (tj, si) in enumerate(var):
                if tj == ti:
                    row[j] = coef(skeys[si])
            limit = types[tkeys[ti]] * coef(("cap", cpu, mem, cards))
            if row.any():
                rows.append(row)
                ub.append(limit)

    per_type(lambda s: s[1] if s[0] == "cap" else s[0])  # CPU
    per_type(lambda s: s[2] if s[0] == "cap" else s[1])  # memory
    per_type(lambda s: s[3] * CARD_MILLI if s[0] == "cap" else s[2] * s[3])  # GPU share
    per_type(lambda s: s[3] if s[0] == "cap" else (s[2] if s[3] == CARD_MILLI else float(s[3] > 500)))
    for k in DFF_ORDERS:
        per_type(
            lambda s, k=k: (
                s[3] if s[0] == "cap" else (s[2] if s[3] == CARD_MILLI else _dff(s[3] / CARD_MILLI, k))
            )
        )
    for si, key in enumerate(skeys):  # at most the tasks that arrived
        row = np.zeros(nv)
        for j, (_tj, sj) in enumerate(var):
            if sj == si:
                row[j] = 1.0
        rows.append(row)
        ub.append(shapes[key])
    a = np.vstack(rows)
    res = milp(
        c=-gain,
        constraints=LinearConstraint(a, -np.inf, np.array(ub)),
        integrality=np.ones(nv) if integer else np.zeros(nv),
        bounds=Bounds(0, np.inf),
        options={"time_limit": time_limit_s},
    )
    if res.x is None:
        raise RuntimeError(f"packing bound: solver failed ({res.message})")
    exact = bool(integer and res.status == 0)
    # A MILP stopped early reports its incumbent; the dual bound is what bounds the optimum.
    value = -float(res.fun) if exact or not integer else -float(getattr(res, "mip_dual_bound", res.fun))
    return Bound(value, capacity, exact, time.perf_counter() - t0)


def offline_packing(hosts: Sequence[Host] | ClusterState, tasks: Sequence[Demand]) -> float:
    """A feasible packing of ``tasks`` seen all at once: GPU milli placed by the best of a few orders
    (as given; whole-card tasks largest first, then fractional largest first) and policies (FGD, xpud)
    that know the mix."""
    from xpud.placement.frag import WorkloadMix
    from xpud.placement.fragaware import FragAware
    from xpud.placement.policies import FGD

    base = hosts if isinstance(hosts, ClusterState) else ClusterState(hosts)
    orders = (
        list(tasks),
        sorted(tasks, key=lambda d: (d.gpus == 0, d.fractional, -d.gpu_total_milli, -d.cpu_milli)),
    )
    best = 0
    for order in orders:
        for make in (lambda: FGD(WorkloadMix(tasks)), lambda: FragAware(WorkloadMix(tasks))):
            state, policy, rng = base.copy(), make(), np.random.default_rng(0)
            placed = 0
            for d in order:
                policy.observe(d)
                p = policy.choose(state, d, rng)
                if p is not None:
                    state.place(d, p)
                    policy.placed(state, d, p)
                    placed += d.gpu_total_milli
            best = max(best, placed)
    return float(best)
