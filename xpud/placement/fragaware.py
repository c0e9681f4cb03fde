"""xpud's placement policy: FGD's fragmentation measure, learned online, made CPU/memory-aware, with a
look-ahead on how well each card's leftover will be filled.

What it adds to FGD (online mix, stranding, fill look-ahead, model scarcity, whole groups, CPU kept for GPU
work, most capable hosts kept whole, score and ties), each measured on the openb trace (``bench/
placement.md``): see docs/placement.md, The fragmentation-aware policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xpud.placement.cluster import CARD_MILLI, ClusterState, Demand
from xpud.placement.frag import FragModel, TaskClass, WorkloadMix
from xpud.placement.names import CPU_RESERVE_MODES, DEFAULT_CPU_RESERVE
from xpud.placement.policies import FGD

RESERVE_CORE_POINTS = 1000.0  # "prefer": points per reserved core taken (more than any score spans)


def fill_value(classes: Sequence[tuple[TaskClass, float]]) -> np.ndarray:
    """``V[r]`` (r = 0..1000): expected milli left unused on a card with ``r`` free if tasks drawn from the
    GPU classes of the mix that fit are placed on it until none fits. Multi-card classes count as whole
    cards (weight per card)."""
    weight: dict[int, float] = {}
    for c, p in classes:
        if c.gpus:
            share = c.gpu_milli if c.gpus == 1 else CARD_MILLI
            weight[share] = weight.get(share, 0.0) + p * c.gpus
    shares = sorted(weight)
    v = [0.0] * (CARD_MILLI + 1)
    for r in range(1, CARD_MILLI + 1):
        num = den = 0.0
        for s in shares:
            if s > r:
                break
            num += weight[s] * v[r - s]
            den += weight[s]
        v[r] = num / den if den else float(r)
    return np.array(v)


class FragAware(FGD):
    """The ``xpud`` policy (see the module docstring). ``mix=None`` learns the mix online."""

    name = "xpud"

    def __init__(
        self,
        mix: WorkloadMix | None = None,
        *,
        strand_cpu: float = 1.0,
        strand_mem: float = 1.0,
        fill_weight: float = 0.5,
        scale: float = 500.0,
        small_hosts_first: bool = True,
        scarcity: float = 20.0,
        groups: float = 20.0,
        group_scarce: float = 0.25,
        refresh_every: int = 512,
        cpu_reserve: str = DEFAULT_CPU_RESERVE,
        top_hosts: float = 3.0,
    ):
        if cpu_reserve not in CPU_RESERVE_MODES:
            modes = ", ".join(CPU_RESERVE_MODES)
            raise ValueError(f"cpu_reserve must be one of {modes}, got {cpu_reserve!r}")
        super().__init__(mix, refresh_every=refresh_every)
        self.cpu_reserve = cpu_reserve
        self.strand_cpu = strand_cpu
        self.strand_mem = strand_mem
        self.fill_weight = fill_weight
        self.scale = scale
        self.small_hosts_first = small_hosts_first
        self.scarcity = scarcity
        self.groups = groups
        self.group_scarce = group_scarce
        self.top_hosts = top_hosts
        self._top: tuple[int, np.ndarray, np.ndarray] | None = None
        self._multi: dict[tuple[int, int, tuple[str, ...]], int] = {}  # (cards, cpu, models) -> GPU milli
        self._multi_cache: tuple | None = None
        self._named: dict[str, float] = {}  # model -> arrived GPU milli that names it (split over a set)
        self._arrived_gpu = 0
        self._gpu = self._cpu = self._mem = 0  # sums over arrived GPU tasks
        self._seen = 0
        self.kappa_cpu = self.kappa_mem = 0.0
        self.fill = np.zeros(CARD_MILLI + 1)

    def observe(self, d: Demand) -> None:
        if d.gpus:
            self._arrived_gpu += d.gpu_total_milli
            if d.gpus > 1:
                key = (d.gpus, d.cpu_milli, d.models)
                self._multi[key] = self._multi.get(key, 0) + d.gpu_total_milli
            for m in d.models:
                self._named[m] = self._named.get(m, 0.0) + d.gpu_total_milli / len(d.models)
            self._gpu += d.gpu_total_milli
            self._cpu += d.cpu_milli
            self._mem += d.memory_mib
        if self.online:
            super().observe(d)
            return
        # Mix given in advance: the CPU/memory ratios are still learned, on the same schedule.
        self._seen += 1
        if self._seen >= self._next_refresh:
            self._next_refresh = (
                self._seen * 2 if self._seen < self.refresh_every else self._seen + self.refresh_every
            )
            self.model = None

    def frag_model(self, state: ClusterState) -> FragModel:
        rebuilt = self.model is None
        model = super().frag_model(state)
        if rebuilt:
            self.kappa_cpu = self._gpu / self._cpu if self._cpu else 0.0
            self.kappa_mem = self._gpu / self._mem if self._mem else 0.0
            self.fill = fill_value(model.classes)
        return model

    def saved(self, state: ClusterState, d: Demand, hosts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        model = self.frag_model(state)
        u0, u1, valid = model.usable_after(state, d, hosts)
        for strand, kappa, free, need in (
            (self.strand_cpu, self.kappa_cpu, state.cpu_free, d.cpu_milli),
            (self.strand_mem, self.kappa_mem, state.mem_free, d.memory_mib),
        ):
            if strand and kappa:
                cap0 = strand * kappa * free[hosts]
                u0 = np.minimum(u0, cap0)
                u1 = np.minimum(u1, (cap0 - strand * kappa * need)[:, None])
        saved = d.gpu_total_milli + u1 - u0[:, None]
        if d.fractional and self.fill_weight:
            f = np.clip(state.card_free[hosts], 0, CARD_MILLI)
            left = np.clip(f - d.gpu_milli, 0, CARD_MILLI)
            saved = saved - self.fill_weight * (self.fill[left] - self.fill[f])
        return saved, valid

    def scores(self, state, d, hosts):
        saved, valid = self.saved(state, d, hosts)
        s = np.where(valid, np.floor(100.0 / (1.0 + np.exp(-saved / self.scale))), -np.inf)
        card = s.argmax(axis=1)
        return s[np.arange(hosts.size), card], (card if d.fractional else None)

    @property
    def cpu_per_gpu(self) -> float:
        """Learnt CPU demand of GPU work: milli-cores per milli-card over the GPU tasks arrived so far."""
        return self._cpu / self._gpu if self._gpu else 0.0

    def reserved_cpu(self, state: ClusterState, keep_top: bool = False) -> np.ndarray:
        """Per host, the CPU (milli-cores) its free GPU share needs at the learnt ratio, and at least what
        the most CPU-hungry multi-card class seen so far that the host can serve now needs (an 8-card,
        120-core task can only run where a CPU-only task has not taken the cores beyond the average).
        ``keep_top``: all the CPU of an idle top host of a scarce kind (at most a quarter of the hosts with
        as many cards: the openb G3, not the 387 T4 hosts) is reserved too (see ``top_hosts``: kept whole for
        classes not seen yet; reserving an abundant kind would refuse CPU-only work in an empty cluster)."""
        reserve = self.cpu_per_gpu * state.card_free.sum(axis=1)
        if keep_top:
            keep = self.idle_top(state) & self._top_kind(state, scarce=True)
            np.maximum(reserve, np.where(keep, state.cpu_cap, 0), out=reserve)
        if self._multi:
            kk, need, mask_id, masks = self._multi_arrays(state)[:4]
            # Only classes hungrier than the ratio matter: a host serving class i has k_i idle cards, whose
            # reserve at the ratio is already at least k_i * 1000 * ratio.
            hungry = np.flatnonzero(need > self.cpu_per_gpu * kk * CARD_MILLI)
            if hungry.size:
                kk, need = kk[hungry], need[hungry]
                model_ok = np.array([masks[m] for m in mask_id[hungry].tolist()])  # (classes, hosts)
                serves = (state.n_full >= kk[:, None]) & (state.cpu_free >= need[:, None]) & model_ok
                np.maximum(reserve, (serves * need[:, None]).max(axis=0), out=reserve)
        return reserve

    def reserve_taken(self, state: ClusterState, d: Demand, keep_top: bool = False) -> np.ndarray:
        """Per host, how much of its reserve (milli-cores) CPU-only task ``d`` would take there."""
        spare = state.cpu_free - self.reserved_cpu(state, keep_top)
        return np.clip(d.cpu_milli - spare, 0.0, float(d.cpu_milli))

    def scarcity_points(self, state: ClusterState, d: Demand) -> np.ndarray | None:
        """Score points a host of each card model loses for ``d`` (indexed like ``state.models``), or None
        when no model is scarce or ``d`` can run on one model only."""
        if not (self.scarcity and self._named and d.gpus) or len(d.models) == 1:
            return None
        q = np.array([self._named.get(m, 0.0) for m in state.models]) / self._arrived_gpu
        if not q.any():
            return None
        free_h = state.card_free.sum(axis=1)
        free_m = np.bincount(state.model, weights=free_h, minlength=len(state.models))
        claim = q * free_h.sum()
        ratio = np.where(free_m > 0, np.minimum(1.0, claim / np.maximum(free_m, 1)), 1.0)
        return self.scarcity * ratio

    def group_points(
        self,
        state: ClusterState,
        d: Demand,
        card: np.ndarray,
        feasible: np.ndarray,
        score: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Score points each host loses for ``d`` (placed on ``card`` for a fractional task) because it
        breaks the host's last idle group for a multi-card class whose groups are scarce; None if none.
        A class is weighed only when ``d`` could go to a ``feasible`` host that cannot serve that class
        (a task steered away needs somewhere else to go: an 8-card task that only the class's hosts can
        take is not).

        With ``score`` (the scores the points are taken from), points are only worked out for the hosts
        that could still rank first once they are taken (those scoring at least what the best host keeps);
        the others get 0, which cannot change ``choose``'s pick, and the work shrinks from every host to a
        handful. Class supplies are counted over hosts sorted by free CPU (one cumulative sum per card
        count and model set), never as a (classes x hosts) matrix."""
        if not (self.groups and self._multi):
            return None
        kk, need, mask_id, masks, pair, pair_k, pair_m, milli = self._multi_arrays(state)
        # Only hosts with at least the smallest class's idle cards can serve (or break a group for) a class.
        near = np.flatnonzero(state.n_full >= kk.min())
        if not near.size:
            return None
        n_near, cpu_near = state.n_full[near], state.cpu_free[near]
        order = np.argsort(-cpu_near, kind="stable")
        n_sorted, desc_cpu = n_near[order], -cpu_near[order]
        rows = np.searchsorted(desc_cpu, -need, side="right")  # hosts (sorted) with cpu >= need, per class
        feas_sorted = feasible[near][order]
        cum_groups = np.zeros((len(pair_k), near.size + 1))
        cum_feasible = np.zeros((len(pair_k), near.size + 1))
        for j, (k, m) in enumerate(zip(pair_k, pair_m, strict=True)):
            ok = (n_sorted >= k) & masks[m][near][order]
            np.cumsum(np.where(ok, n_sorted // k, 0), out=cum_groups[j, 1:])
            np.cumsum(ok & feas_sorted, out=cum_feasible[j, 1:])
        supply_groups = cum_groups[pair, rows]
        serving_feasible = cum_feasible[pair, rows]
        outside = serving_feasible < np.count_nonzero(feasible)  # a feasible host that cannot serve c
        use = (kk > d.gpus) | ((kk == d.gpus) & (need > d.cpu_milli) & outside)
        if not use.any():
            return None
        kk, need, milli, mask_id = kk[use], need[use], milli[use], mask_id[use]
        supply = supply_groups[use] * kk * CARD_MILLI
        claim = milli / self._arrived_gpu * float(state.total_gpu_milli - state.used_gpu_milli)
        ratio = np.where(supply > 0, np.minimum(1.0, claim / np.maximum(supply, 1)), 0.0)
        model_ok = np.array([masks[m] for m in mask_id.tolist()])  # (classes, hosts)

        def points(hosts: np.ndarray) -> np.ndarray:
            n_full, cpu = state.n_full[hosts], state.cpu_free[hosts]
            if d.fractional:
                c = np.maximum(card[hosts], 0)
                n_after = n_full - ((card[hosts] >= 0) & (state.card_free[hosts, c] == CARD_MILLI))
            else:
                n_after = n_full - d.gpus
            serves = (n_full >= kk[:, None]) & (cpu >= need[:, None]) & model_ok[:, hosts]
            breaks = serves & ((n_after < kk[:, None]) | (cpu - d.cpu_milli < need[:, None]))
            # A class whose claim is at least ``group_scarce`` of its supply weighs (k/4)^2 times more: an
            # 8-card task that finds no group loses 8 cards, and the hosts it needs are the ones every
            # smaller task can also use (measured on the multigpu variants; below that share the plain weight
            # keeps the default trace where it was).
            weight = np.where(ratio >= self.group_scarce, (kk / 4.0) ** 2, 1.0)
            return self.groups * ((ratio * weight) @ breaks)

        if score is not None:
            best = int(np.argmax(score))
            if score[best] == -np.inf:
                return None
            keep = score[best] - points(np.array([best]))[0]
            near = near[score[near] >= keep]
        out = np.zeros(state.size)
        if near.size:
            out[near] = points(near)
        return out if out.any() else None

    def idle_top(self, state: ClusterState) -> np.ndarray:
        """Per host: a top host (``_top_kind``) with cards, all idle."""
        return self._top_kind(state) & (state.n_full == state.n_cards) & (state.n_cards > 0)

    def _top_kind(self, state: ClusterState, scarce: bool = False) -> np.ndarray:
        """Per host: whether no host with as many cards has more CPU or more memory (the hosts only the
        hungriest multi-card tasks may be able to use); ``scarce``: and such hosts are at most a quarter of
        the hosts with as many cards."""
        if self._top is None or self._top[0] != id(state.hosts):
            top = np.zeros(state.size, dtype=bool)
            rare = np.zeros(state.size, dtype=bool)
            for n in np.unique(state.n_cards).tolist():
                same = state.n_cards == n
                most_cpu = state.cpu_cap == state.cpu_cap[same].max()
                these = same & most_cpu & (state.mem_cap == state.mem_cap[same].max())
                top |= these
                if 4 * np.count_nonzero(these) <= np.count_nonzero(same):
                    rare |= these
            self._top = (id(state.hosts), top, rare)
        return self._top[2] if scarce else self._top[1]

    def _multi_arrays(self, state: ClusterState):
        """The multi-card classes seen so far as arrays: cards, CPU, model-set index, the model sets' host
        masks, each class's (cards, model set) pair and the pairs' cards and model sets, GPU milli."""
        key = (len(self._multi), state.models, state.size)
        if self._multi_cache is None or self._multi_cache[0] != key:
            ids: dict[tuple[str, ...], int] = {}
            rows = list(self._multi)
            mask_id = np.array([ids.setdefault(m, len(ids)) for _, _, m in rows], dtype=np.int64)
            masks = [state.model_mask(m) for m in ids]
            kk = np.array([k for k, _, _ in rows], dtype=np.int64)
            pairs: dict[tuple[int, int], int] = {}
            pair = np.array(
                [pairs.setdefault(km, len(pairs)) for km in zip(kk.tolist(), mask_id.tolist(), strict=True)],
                dtype=np.int64,
            )
            arrays = (
                kk,
                np.array([c for _, c, _ in rows], dtype=np.int64),
                mask_id,
                masks,
                pair,
                [k for k, _ in pairs],
                [m for _, m in pairs],
            )
            self._multi_cache = (key, arrays)
        return (*self._multi_cache[1], np.array(list(self._multi.values()), dtype=float))

    def decision_scores(self, state, d):
        score, card = self.host_scores(state, d)
        if not d.gpus and self.cpu_reserve != "off" and self._gpu:
            # Idle top hosts' CPU is kept too, unless only they could take the task at all.
            keep_top = bool(self.top_hosts) and bool(((score > -np.inf) & ~self.idle_top(state)).any())
            taken = self.reserve_taken(state, d, keep_top)
            if self.cpu_reserve == "reserve":
                score = np.where(taken > 0, -np.inf, score)
            else:  # fewest reserved cores taken first (a whole core outweighs any score), then the score
                score = score - RESERVE_CORE_POINTS * np.ceil(taken / 1000.0)
        pts = self.scarcity_points(state, d)
        if pts is not None:
            score = score - pts[state.model]
        if d.gpus and not d.fractional and self.top_hosts:
            score = score - self.top_hosts * (self.idle_top(state) & (state.n_cards > d.gpus))
        grp = self.group_points(state, d, card, score > -np.inf, score)
        return (score if grp is None else score - grp), card

    def pick(self, state, ties, rng, d=None):
        if ties.size == 1:
            return int(ties[0])
        if not self.small_hosts_first:
            return super().pick(state, ties, rng, d)
        keys = [state.tie_rank[ties]]
        if d is not None and d.gpus > 1:  # whole-card groups: the least capable host that fits first
            keys += [state.mem_cap[ties], state.cpu_cap[ties]]
        elif self.top_hosts:  # single-card: idle top hosts last
            top = self._top_kind(state)[ties]
            if top.any():
                keys += [top & state.idle(ties)]
        return int(ties[np.lexsort((*keys, state.n_cards[ties]))[0]])
