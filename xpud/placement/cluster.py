"""Vectorised state of a cluster of GPU hosts, as placement policies see it. Pure: no I/O, no clock.

Units: CPU in milli-cores (``*_milli``), memory in MiB (``*_mib``), GPU share in milli-cards
(``1000`` = one whole card). Every host has up to ``max_cards`` cards of one model; a card that does not
exist has ``0`` free milli, so it never fits anything and never counts as free.

The same structure serves a single-host snapshot (the daemon's ``xpu defrag``) and the 1,213-host openb
cluster (the simulator): build it with :meth:`ClusterState.from_hosts`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

CARD_MILLI = 1000  # one whole card

# Host versions come from one process-wide counter, so two states (a snapshot and a planner's working copy)
# never give different contents the same version and score caches stay right across them.
_VERSIONS = itertools.count(1)


@dataclass(frozen=True)
class Host:
    """One host's capacity."""

    name: str
    cpu_milli: int
    memory_mib: int
    cards: int
    model: str = ""


@dataclass(frozen=True)
class Demand:
    """What one task needs: CPU, memory and either nothing, a share of one card, or whole cards.

    ``gpus`` is the number of cards and ``gpu_milli`` the share of each (``1..1000``); a fractional task
    has ``gpus == 1`` and ``gpu_milli < 1000``. ``models`` lists the allowed card models (empty = any).
    """

    cpu_milli: int
    memory_mib: int
    gpus: int = 0
    gpu_milli: int = 0
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.gpus < 0:
            raise ValueError(f"negative request: {self}")
        if self.gpus == 0 and self.gpu_milli != 0:
            raise ValueError(f"gpu_milli without gpus: {self}")
        if self.gpus > 0 and not 0 < self.gpu_milli <= CARD_MILLI:
            raise ValueError(f"gpu_milli must be 1..{CARD_MILLI} per card: {self}")
        if self.gpus > 1 and self.gpu_milli != CARD_MILLI:
            raise ValueError(f"a multi-card request takes whole cards: {self}")

    @property
    def fractional(self) -> bool:
        return self.gpus == 1 and self.gpu_milli < CARD_MILLI

    @property
    def gpu_total_milli(self) -> int:
        return self.gpus * self.gpu_milli


@dataclass(frozen=True)
class Placement:
    """Where a task goes: a host index and the card indices on it (empty for CPU-only tasks)."""

    host: int
    cards: tuple[int, ...] = ()


class ClusterState:
    """Free capacity of every host and card, updated in place as tasks are placed and removed.

    Arrays (``H`` hosts, ``G`` = ``max_cards``): ``cpu_free``/``mem_free`` (H,), ``card_free`` (H, G),
    ``n_full`` (H,) idle whole cards, ``max_free`` (H,) largest free share of one card, ``version`` (H,)
    renewed on every change from a process-wide counter (score caches compare it).
    """

    def __init__(self, hosts: Sequence[Host]):
        if not hosts:
            raise ValueError("a cluster needs at least one host")
        self.hosts = tuple(hosts)
        self.names = [h.name for h in hosts]
        self.models: tuple[str, ...] = tuple(sorted({h.model for h in hosts}))
        model_index = {m: i for i, m in enumerate(self.models)}
        self.model = np.array([model_index[h.model] for h in hosts], dtype=np.int64)
        self.cpu_cap = np.array([h.cpu_milli for h in hosts], dtype=np.int64)
        self.mem_cap = np.array([h.memory_mib for h in hosts], dtype=np.int64)
        self.n_cards = np.array([h.cards for h in hosts], dtype=np.int64)
        if (self.cpu_cap < 0).any() or (self.mem_cap < 0).any() or (self.n_cards < 0).any():
            raise ValueError("host capacities must not be negative")
        self.max_cards = max(1, int(self.n_cards.max()))
        self.card_exists = np.arange(self.max_cards)[None, :] < self.n_cards[:, None]
        self.total_gpu_milli = int(self.n_cards.sum()) * CARD_MILLI
        # Hosts of one kind (model and capacities): two idle hosts of one kind look the same to a policy.
        kinds = np.stack([self.model, self.cpu_cap, self.mem_cap, self.n_cards], axis=1)
        self.kind = np.unique(kinds, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
        # Ties between equally scored hosts go to the lowest rank. The simulator shuffles it per seed (the
        # FGD artifact does the same by prefixing node names with a random permutation).
        self.tie_rank = np.arange(len(hosts), dtype=np.int64)
        self.reset()

    @classmethod
    def from_hosts(cls, hosts: Iterable[Host]) -> ClusterState:
        return cls(list(hosts))

    def reset(self) -> None:
        """Every host empty."""
        self.cpu_free = self.cpu_cap.copy()
        self.mem_free = self.mem_cap.copy()
        self.card_free = np.where(self.card_exists, CARD_MILLI, 0).astype(np.int64)
        self.n_full = self.n_cards.copy()
        self.max_free = np.where(self.n_cards > 0, CARD_MILLI, 0).astype(np.int64)
        self.version = np.full(len(self.hosts), next(_VERSIONS), dtype=np.int64)
        self.used_gpu_milli = 0

    def shuffle_ties(self, rng: np.random.Generator) -> None:
        """A random host order for breaking score ties."""
        self.tie_rank = rng.permutation(self.size).astype(np.int64)

    def copy(self) -> ClusterState:
        other = object.__new__(ClusterState)
        other.__dict__.update(self.__dict__)
        for name in ("cpu_free", "mem_free", "card_free", "n_full", "max_free", "version"):
            setattr(other, name, getattr(self, name).copy())
        return other

    @property
    def size(self) -> int:
        return len(self.hosts)

    def model_mask(self, models: Sequence[str]) -> np.ndarray:
        """Hosts whose card model is allowed (all hosts when ``models`` is empty)."""
        if not models:
            return np.ones(self.size, dtype=bool)
        allowed = [i for i, m in enumerate(self.models) if m in set(models)]
        return np.isin(self.model, allowed)

    def feasible(self, d: Demand, hosts: np.ndarray | None = None) -> np.ndarray:
        """Boolean mask over ``hosts`` (default: all) of hosts that can take ``d`` now."""
        idx = slice(None) if hosts is None else hosts
        ok = (self.cpu_free[idx] >= d.cpu_milli) & (self.mem_free[idx] >= d.memory_mib)
        if d.gpus == 0:
            return ok
        if d.models:
            ok &= self.model_mask(d.models)[idx]
        if d.fractional:
            return ok & (self.max_free[idx] >= d.gpu_milli)
        return ok & (self.n_full[idx] >= d.gpus)

    def cards_for(self, d: Demand, host: int, card: int = -1) -> tuple[int, ...]:
        """Card indices a task takes on ``host``: the given card (fractional; default best fit), or the
        first ``gpus`` idle whole cards (in index order, as kube-scheduler's GPU-share plugin does)."""
        if d.gpus == 0:
            return ()
        free = self.card_free[host]
        if d.fractional:
            if card >= 0:
                return (card,)
            fits = np.flatnonzero(free >= d.gpu_milli)
            return (int(fits[np.argmin(free[fits])]),)
        whole = np.flatnonzero(free == CARD_MILLI)
        return tuple(int(c) for c in whole[: d.gpus])

    def fits(self, d: Demand, p: Placement) -> bool:
        """Whether ``d`` can go exactly to ``p`` now."""
        h = p.host
        if self.cpu_free[h] < d.cpu_milli or self.mem_free[h] < d.memory_mib:
            return False
        if d.gpus == 0:
            return not p.cards
        if d.models and self.models[self.model[h]] not in d.models:
            return False
        if len(p.cards) != d.gpus or len(set(p.cards)) != d.gpus:
            return False
        return all(0 <= c < self.n_cards[h] and self.card_free[h, c] >= d.gpu_milli for c in p.cards)

    def place(self, d: Demand, p: Placement) -> None:
        """Take ``d``'s resources at ``p`` (no checks beyond an assertion-free update)."""
        self._apply(d, p, -1)

    def remove(self, d: Demand, p: Placement) -> None:
        """Give back what ``d`` held at ``p``."""
        self._apply(d, p, +1)

    def _apply(self, d: Demand, p: Placement, sign: int) -> None:
        h = p.host
        self.cpu_free[h] += sign * d.cpu_milli
        self.mem_free[h] += sign * d.memory_mib
        if p.cards:
            row = self.card_free[h]
            for c in p.cards:
                row[c] += sign * d.gpu_milli
            self.n_full[h] = int((row == CARD_MILLI).sum())
            self.max_free[h] = int(row.max())
            self.used_gpu_milli -= sign * d.gpu_milli * len(p.cards)
        self.version[h] = next(_VERSIONS)

    def idle(self, hosts: np.ndarray) -> np.ndarray:
        """Boolean mask over ``hosts``: nothing placed there (every CPU, memory and card share free)."""
        return (
            (self.cpu_free[hosts] == self.cpu_cap[hosts])
            & (self.mem_free[hosts] == self.mem_cap[hosts])
            & (self.n_full[hosts] == self.n_cards[hosts])
        )

    def free_gpu_milli(self, hosts: np.ndarray | None = None) -> np.ndarray:
        """Total free GPU share per host (milli)."""
        idx = slice(None) if hosts is None else hosts
        return self.card_free[idx].sum(axis=1)

    def allocation_ratio(self) -> float:
        """Allocated GPU share / total GPU capacity (0..1)."""
        return self.used_gpu_milli / self.total_gpu_milli if self.total_gpu_milli else 0.0
