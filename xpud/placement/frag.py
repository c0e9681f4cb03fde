"""GPU fragmentation of a host with respect to a workload mix (Weng et al., ATC'23, "FGD").

For a task class ``c`` (CPU, share per card, number of cards, allowed models) and a host, the host's free
GPU share is *usable* by ``c`` when the host has the model, enough free CPU and ``c`` fits on its cards;
the usable part is then the free share on cards where ``c`` fits (``free >= share``). The fragmentation
of the host is the expected free share that a task drawn from the mix could not use::

    F(host) = sum_c p_c * (free_total - usable_c)  =  free_total - U(host),   U = sum_c p_c * usable_c

All amounts are in milli-cards. CPU-only classes never use GPU, so they only add to ``free_total``.
``FragModel`` precomputes per-model, per-CPU-level weight tables so that ``U`` and its change for every
candidate (host, card) are a few vectorised gathers (O(hosts x cards)).

``WorkloadMix`` is the task-class distribution: given in advance (FGD as published) or learned online
from the tasks that have arrived so far (what a live scheduler knows).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from xpud.placement.cluster import CARD_MILLI, ClusterState, Demand

# FGD's typical-pod selection: the most popular classes covering this share of tasks.
POPULARITY_THRESHOLD = 0.95


@dataclass(frozen=True)
class TaskClass:
    """The part of a request that fragmentation looks at (memory is not part of it, as in FGD)."""

    cpu_milli: int
    gpu_milli: int
    gpus: int
    models: tuple[str, ...] = ()

    @classmethod
    def of(cls, d: Demand) -> TaskClass:
        return cls(d.cpu_milli, d.gpu_milli, d.gpus, tuple(sorted(d.models)))


class WorkloadMix:
    """Counts of task classes; ``typical()`` gives FGD's normalised distribution over popular classes."""

    def __init__(self, demands: Iterable[Demand] = (), threshold: float = POPULARITY_THRESHOLD):
        self.counts: Counter[TaskClass] = Counter()
        self.threshold = threshold
        self.total = 0
        for d in demands:
            self.add(d)

    def add(self, d: Demand, weight: int = 1) -> None:
        self.counts[TaskClass.of(d)] += weight
        self.total += weight

    def typical(self) -> list[tuple[TaskClass, float]]:
        """Most popular classes until they cover ``threshold`` of all tasks, probabilities summing to 1.

        Order and ties follow FGD's simulator: decreasing count, then decreasing (cpu, share, cards).
        """
        if not self.total:
            return []
        ranked = sorted(
            self.counts.items(),
            key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].gpus, kv[0].models),
            reverse=True,
        )
        chosen, cum = [], 0
        for cls, n in ranked:
            if cum >= self.threshold * self.total:
                break
            chosen.append((cls, n))
            cum += n
        return [(cls, n / cum) for cls, n in chosen]


class FragModel:
    """Weight tables for one mix on one cluster's card models, and the vectorised measure.

    ``share_levels`` (D,) are the distinct per-card shares of single-card classes; ``cpu_levels`` (K,)
    the distinct CPU needs. ``w_single[m, i, d]`` is the probability mass of single-card classes with
    share ``share_levels[d]`` that model ``m`` serves and that need at most the ``i``-th CPU level;
    ``u_multi[m, i, n]`` is the expected usable share (milli) from multi-card classes on a host with
    ``n`` idle whole cards.
    """

    def __init__(self, classes: Sequence[tuple[TaskClass, float]], models: Sequence[str], max_cards: int):
        self.classes = list(classes)
        gpu_classes = [(c, p) for c, p in self.classes if c.gpus > 0]
        self.share_levels = np.array(
            sorted({c.gpu_milli for c, _ in gpu_classes if c.gpus == 1}), dtype=np.int64
        )
        self.cpu_levels = np.array(sorted({c.cpu_milli for c, _ in gpu_classes}), dtype=np.int64)
        n_models, n_cpu, n_share = len(models), len(self.cpu_levels) + 1, len(self.share_levels)
        self.w_single = np.zeros((n_models, n_cpu, n_share))
        self.u_multi = np.zeros((n_models, n_cpu, max_cards + 1))
        share_pos = {int(s): i for i, s in enumerate(self.share_levels)}
        nf = np.arange(max_cards + 1)
        for c, p in gpu_classes:
            level = int(np.searchsorted(self.cpu_levels, c.cpu_milli))  # ok once cpu index > level
            for m, name in enumerate(models):
                if c.models and name not in c.models:
                    continue
                if c.gpus == 1:
                    self.w_single[m, level + 1 :, share_pos[c.gpu_milli]] += p
                else:
                    self.u_multi[m, level + 1 :, :] += p * CARD_MILLI * nf * (nf >= c.gpus)
        # Cumulative over share levels, column k = levels below the k-th (what the measure gathers).
        self.cum_single = np.concatenate(
            [np.zeros((n_models, n_cpu, 1)), np.cumsum(self.w_single, axis=2)], axis=2
        )

    # -- the measure -------------------------------------------------------------------------------------
    # U = sum_cards f * C(f), where C(f) is the weight of single-card classes whose share is at most f (at
    # the host's CPU level), plus the multi-card term. Evaluated with gathers, never a cards x levels tensor.

    def cpu_index(self, cpu_free: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.cpu_levels, cpu_free, side="right")

    def _cum(self, model: np.ndarray, cpu_index: np.ndarray) -> np.ndarray:
        """(N, D+1) cumulative class weight over share levels; column k = levels below the k-th."""
        return self.cum_single[model, cpu_index]

    def _fit_index(self, card_free: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.share_levels, card_free, side="right")

    def usable(self, card_free: np.ndarray, cpu_free: np.ndarray, model: np.ndarray) -> np.ndarray:
        """Expected usable free GPU share ``U`` (milli) for hosts with these free cards (N, G), CPU, model."""
        i = self.cpu_index(cpu_free)
        cum = self._cum(model, i)
        n_full = (card_free == CARD_MILLI).sum(axis=-1)
        single = (card_free * np.take_along_axis(cum, self._fit_index(card_free), axis=1)).sum(axis=1)
        return single + self.u_multi[model, i, n_full]

    def frag(self, state: ClusterState, hosts: np.ndarray | None = None) -> np.ndarray:
        """Fragmentation ``F`` (milli) of each host: free GPU share a task from the mix could not use."""
        idx = np.arange(state.size) if hosts is None else hosts
        free = state.card_free[idx]
        return free.sum(axis=1) - self.usable(free, state.cpu_free[idx], state.model[idx])

    def usable_after(self, state: ClusterState, d: Demand, hosts: np.ndarray):
        """``U`` before (N,) and after placing ``d`` on each candidate (N, C), with a validity mask (N, C).

        For a fractional task the C = G candidates are the cards of each host; otherwise C = 1 (whole cards
        go to the first idle ones, CPU-only tasks touch no card).
        """
        free = state.card_free[hosts]
        model = state.model[hosts]
        cpu0 = state.cpu_free[hosts]
        i0 = self.cpu_index(cpu0)
        i1 = self.cpu_index(cpu0 - d.cpu_milli)
        n_full = state.n_full[hosts]
        cum0, cum1 = self._cum(model, i0), self._cum(model, i1)
        k0 = self._fit_index(free)
        u0 = (free * np.take_along_axis(cum0, k0, axis=1)).sum(axis=1) + self.u_multi[model, i0, n_full]
        at1 = free * np.take_along_axis(cum1, k0, axis=1)  # each card's usable share at the new CPU level
        s1 = at1.sum(axis=1)
        if d.gpus == 0:
            u1 = s1 + self.u_multi[model, i1, n_full]
            return u0, u1[:, None], np.ones((len(hosts), 1), dtype=bool)
        if not d.fractional:
            k = d.gpus
            full_w = cum1[:, -1]  # a whole card serves every single-card class
            nf1 = np.maximum(n_full - k, 0)
            u1 = s1 - CARD_MILLI * k * full_w + self.u_multi[model, i1, nf1]
            return u0, u1[:, None], (n_full >= k)[:, None]
        f1 = np.maximum(free - d.gpu_milli, 0)
        after = f1 * np.take_along_axis(cum1, self._fit_index(f1), axis=1)
        u1 = s1[:, None] - at1 + after
        nf1 = n_full[:, None] - (free == CARD_MILLI)
        u1 += self.u_multi[model[:, None], i1[:, None], nf1]
        return u0, u1, free >= d.gpu_milli


def sigmoid_score(saved_milli: np.ndarray) -> np.ndarray:
    """FGD's node score: ``int(100 * sigmoid(saved / 1000))`` (0..100, higher is better)."""
    return np.floor(100.0 / (1.0 + np.exp(-saved_milli / 1000.0)))
