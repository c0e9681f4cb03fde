"""Placement policies: which host and card(s) a task goes to. Pure: a state, a demand, a random generator.

Every policy scores the hosts that can take the task (higher is better); ties go to the host ranked first
in ``ClusterState.tie_rank`` (the simulator shuffles it per seed, as the FGD artifact does with its randomly
prefixed node names). A fractional task then goes to the card the policy names, or to the best-fitting card.
Baselines follow the ATC'23 FGD artifact (``hkust-adsl/kubernetes-scheduler-simulator``):

- ``random``: any feasible host; a random card that fits.
- ``best-fit``: least CPU + GPU left after placing (weights 0.5/0.5, normalised by 128 cores / 8 cards).
- ``dot-product``: smallest dot product of the host's free (CPU, GPU) and the task's request (Tetris).
- ``gpu-packing``: shared cards first, then idle cards on used hosts, then idle hosts.
- ``gpu-clustering``: hosts already running tasks of the same kind (share / k cards) first.
- ``fgd``: least growth of fragmentation (see :mod:`xpud.placement.frag`), coarse score as published.

Scores depend only on the host's own state, so they are cached per request shape and recomputed for the
hosts whose ``version`` changed since (and for all hosts when the policy's ``epoch`` moves). Policies whose
score is a function of that state alone (``host_pure``) score one idle host per kind (model and capacities)
and give the others of its kind the same score: after a mix refresh most of a cluster is often idle.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from xpud.placement.cluster import CARD_MILLI, ClusterState, Demand, Placement
from xpud.placement.frag import FragModel, WorkloadMix, sigmoid_score

MAX_SPEC_CPU = 128_000  # milli-cores; normalisers used by the FGD artifact's baselines
MAX_SPEC_GPU = 8_000  # milli-cards


@dataclass
class _Cached:
    version: np.ndarray
    score: np.ndarray
    card: np.ndarray
    epoch: int


class Policy:
    """Base class: cached per-host scores, tie-break by host rank, card choice."""

    name = "policy"
    cacheable = True
    host_pure = False  # True: a score is a function of the host's own state (idle hosts of a kind share it)

    def __init__(self) -> None:
        self.epoch = 0
        self._cache: dict[tuple, _Cached] = {}

    # hooks the replay calls -------------------------------------------------------------------------
    def observe(self, d: Demand) -> None:
        """A task arrived (before it is placed)."""

    def placed(self, state: ClusterState, d: Demand, p: Placement) -> None:
        """A task now runs at ``p``."""

    def removed(self, state: ClusterState, d: Demand, p: Placement) -> None:
        """A task left ``p`` (finished or moved)."""

    # scoring ---------------------------------------------------------------------------------------------
    def scores(
        self, state: ClusterState, d: Demand, hosts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Scores of feasible ``hosts`` for ``d`` (higher is better), and the card for a fractional task
        on each (or ``None`` to use the best-fitting card)."""
        raise NotImplementedError

    def host_scores(self, state: ClusterState, d: Demand) -> tuple[np.ndarray, np.ndarray]:
        """Score of every host (``-inf`` where ``d`` does not fit) and the chosen card (``-1``: default)."""
        key = (d.cpu_milli, d.memory_mib, d.gpus, d.gpu_milli, d.models)
        entry = self._cache.get(key) if self.cacheable else None
        if entry is None or entry.epoch != self.epoch:
            entry = _Cached(
                np.full(state.size, -1, dtype=np.int64),
                np.full(state.size, -np.inf),
                np.full(state.size, -1, dtype=np.int64),
                self.epoch,
            )
            if self.cacheable:
                self._cache[key] = entry
        stale = np.flatnonzero(entry.version != state.version)
        if stale.size:
            ok = state.feasible(d, stale)
            entry.score[stale] = -np.inf
            entry.card[stale] = -1
            hosts = stale[ok]
            if hosts.size:
                self._score_into(entry, state, d, hosts)
            entry.version[stale] = state.version[stale]
        return entry.score, entry.card

    def _score_into(self, entry: _Cached, state: ClusterState, d: Demand, hosts: np.ndarray) -> None:
        """Score ``hosts`` (all feasible for ``d``) into ``entry``."""
        if self.host_pure and hosts.size > 1:
            idle = state.idle(hosts)
            if np.count_nonzero(idle) > 1:
                idle_hosts, busy = hosts[idle], hosts[~idle]
                _, first, which = np.unique(state.kind[idle_hosts], return_index=True, return_inverse=True)
                scored = np.concatenate([busy, idle_hosts[first]])
                s, c = self.scores(state, d, scored)
                entry.score[busy] = s[: busy.size]
                entry.score[idle_hosts] = s[busy.size :][which]
                if c is not None:
                    entry.card[busy] = c[: busy.size]
                    entry.card[idle_hosts] = c[busy.size :][which]
                return
        s, c = self.scores(state, d, hosts)
        entry.score[hosts] = s
        if c is not None:
            entry.card[hosts] = c

    def choose(self, state: ClusterState, d: Demand, rng: np.random.Generator) -> Placement | None:
        """Where ``d`` goes, or ``None`` when no host can take it."""
        score, card = self.decision_scores(state, d)
        best = score.max()
        if best == -np.inf:
            return None
        h = self.pick(state, np.flatnonzero(score == best), rng, d)
        return Placement(h, self.cards(state, d, h, int(card[h]), rng))

    def decision_scores(self, state: ClusterState, d: Demand) -> tuple[np.ndarray, np.ndarray]:
        """The scores ``choose`` ranks by: the cached per-host scores, plus any term that depends on the
        whole cluster (so cannot be cached per host)."""
        return self.host_scores(state, d)

    def pick(
        self, state: ClusterState, ties: np.ndarray, rng: np.random.Generator, d: Demand | None = None
    ) -> int:
        """The host among equally scored ``ties`` for ``d`` (None: unknown)."""
        return int(ties[np.argmin(state.tie_rank[ties])]) if ties.size > 1 else int(ties[0])

    def cards(self, state: ClusterState, d: Demand, host: int, card: int, rng: np.random.Generator):
        return state.cards_for(d, host, card)

    def reset_cache(self) -> None:
        self._cache.clear()


class RandomFit(Policy):
    name = "random"

    def scores(self, state, d, hosts):
        return np.zeros(hosts.size), None

    def pick(self, state, ties, rng, d=None):
        return int(ties[rng.integers(ties.size)])

    def cards(self, state, d, host, card, rng):
        if d.fractional:
            fits = np.flatnonzero(state.card_free[host] >= d.gpu_milli)
            return (int(fits[rng.integers(fits.size)]),)
        return state.cards_for(d, host)


class BestFit(Policy):
    name = "best-fit"

    def scores(self, state, d, hosts):
        cpu_left = (state.cpu_free[hosts] - d.cpu_milli) / MAX_SPEC_CPU
        gpu_left = (state.free_gpu_milli(hosts) - d.gpu_total_milli) / MAX_SPEC_GPU
        return np.floor((1.0 - 0.5 * cpu_left - 0.5 * gpu_left) * 100.0), None


class DotProduct(Policy):
    name = "dot-product"

    def scores(self, state, d, hosts):
        dot = (state.cpu_free[hosts] / MAX_SPEC_CPU) * (d.cpu_milli / MAX_SPEC_CPU) + (
            state.free_gpu_milli(hosts) / MAX_SPEC_GPU
        ) * (d.gpu_total_milli / MAX_SPEC_GPU)
        return np.floor(100.0 * (1.0 - dot / 2.0)), None


class GpuPacking(Policy):
    name = "gpu-packing"

    def scores(self, state, d, hosts):
        if d.gpus == 0:
            return np.zeros(hosts.size), None
        out = np.empty(hosts.size)
        for n, h in enumerate(hosts):
            free = state.card_free[h]
            n_full = int(state.n_full[h])
            if n_full == state.n_cards[h]:  # idle host
                out[n] = max(100 // 3 - n_full, n_full)
                continue
            order = np.argsort(free, kind="stable")
            use = [int(c) for c in order if free[c] >= d.gpu_milli][: d.gpus]
            whole = sum(1 for c in use if free[c] == CARD_MILLI)
            if whole:
                out[n] = max(100 // 2 - whole, 100 // 3)
            else:
                left = sum(int(free[c]) * 100 // CARD_MILLI for c in use)
                out[n] = max(100 - left // 10, 100 // 2)
        return out, None


def _affinity(d: Demand) -> str:
    if d.gpus == 0:
        return ""
    return "share" if d.fractional else f"{d.gpus}-gpu"


class GpuClustering(Policy):
    name = "gpu-clustering"

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, Counter[str]] = {}

    def placed(self, state, d, p):
        if d.gpus:
            self.tags.setdefault(p.host, Counter())[_affinity(d)] += 1

    def removed(self, state, d, p):
        if d.gpus:
            tags = self.tags[p.host]
            tags[_affinity(d)] -= 1
            if tags[_affinity(d)] <= 0:
                del tags[_affinity(d)]

    def scores(self, state, d, hosts):
        if d.gpus == 0:
            return np.zeros(hosts.size), None
        tag = _affinity(d)
        out = np.empty(hosts.size)
        for n, h in enumerate(hosts):
            tags = self.tags.get(int(h), Counter())
            used = 25 * (MAX_SPEC_GPU - int(state.free_gpu_milli(np.array([h]))[0])) // MAX_SPEC_GPU
            if tags.get(tag, 0) > 0:
                out[n] = used + (75 if len(tags) == 1 else 50)
            else:
                out[n] = used + (25 if not tags else 0)
        return out, None


class FGD(Policy):
    """Fragmentation gradient descent: the host and card where fragmentation grows least.

    ``mix`` given: the published FGD (task mix known in advance). ``mix=None``: the mix is learned from
    arrivals, refreshed on a doubling schedule (1, 2, 4, ... tasks, then every ``refresh_every``).
    ``exact=True`` ranks by the raw change instead of the coarse 0..100 score (measured worse: it stops
    spreading load).
    """

    name = "fgd"
    host_pure = True

    def __init__(self, mix: WorkloadMix | None = None, *, exact: bool = False, refresh_every: int = 512):
        super().__init__()
        self.online = mix is None
        self.mix = mix if mix is not None else WorkloadMix()
        self.exact = exact
        self.refresh_every = refresh_every
        self._next_refresh = 1
        self.model: FragModel | None = None
        self._models: tuple[str, ...] = ()
        self._max_cards = 0

    def observe(self, d):
        if self.online:
            self.mix.add(d)
            if self.mix.total >= self._next_refresh:
                self._next_refresh = (
                    self.mix.total * 2
                    if self.mix.total < self.refresh_every
                    else self.mix.total + self.refresh_every
                )
                self.model = None

    def frag_model(self, state: ClusterState) -> FragModel:
        if self.model is None or self._models != state.models or self._max_cards != state.max_cards:
            self.model = FragModel(self.mix.typical(), state.models, state.max_cards)
            self._models, self._max_cards = state.models, state.max_cards
            self.epoch += 1
        return self.model

    def saved(self, state: ClusterState, d: Demand, hosts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fragmentation removed (milli, may be negative) by placing ``d`` on each candidate, and validity."""
        model = self.frag_model(state)
        u0, u1, valid = model.usable_after(state, d, hosts)
        return d.gpu_total_milli + u1 - u0[:, None], valid

    def scores(self, state, d, hosts):
        saved, valid = self.saved(state, d, hosts)
        s = saved if self.exact else sigmoid_score(saved)
        s = np.where(valid, s, -np.inf)
        card = s.argmax(axis=1)
        best = s[np.arange(hosts.size), card]
        return best, (card if d.fractional else None)

    def host_scores(self, state, d):
        self.frag_model(state)  # refresh the epoch before the cache is consulted
        return super().host_scores(state, d)
