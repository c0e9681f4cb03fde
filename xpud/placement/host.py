"""Placement on one host: which whole cards form a group, which card takes a slice. Pure functions.

The engine (live daemon), the simulator and the device plugin's preferred-allocation hook all call these
with a snapshot; nothing here reads the hardware, the clock or the ledger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from xpud.hw.topology import Topology

# Exact search is used up to this many free cards; C(16, 8) = 12,870 groups is still cheap.
EXACT_SEARCH_MAX_CARDS = 16


@dataclass(frozen=True)
class CardCapacity:
    """What placement needs to know about one card right now."""

    index: int
    sliced: bool  # the card is in sliced mode
    idle: bool  # no lease holds it (whole or slice)
    usable: bool  # not drained, not unhealthy
    free_memory_fraction: float = 1.0
    free_compute_pct: int = 100
    health_score: int = 100
    mode_pinned: bool = False  # an operator fixed its mode
    avoid: bool = False  # degraded: use only when nothing else fits


def _group_key(topo: Topology, group: tuple[int, ...], scores: Mapping[int, int]) -> tuple:
    # Smaller is better: modelled all-reduce time, then tighter overall connectivity, then health.
    pair_bw = sum(min(topo.bandwidth_gbps(a, b), 1e6) for a, b in combinations(group, 2))
    return (
        round(topo.allreduce_seconds(group), 9),
        -round(pair_bw, 6),
        -sum(scores.get(c, 100) for c in group),
        group,
    )


def _leftover_quality(topo: Topology, free: Sequence[int], group: tuple[int, ...]) -> float:
    """How well the cards left free stay connected (higher is better): their best-pair bandwidth sum."""
    rest = [c for c in free if c not in group]
    total = 0.0
    for c in rest:
        total += max((min(topo.bandwidth_gbps(c, o), 1e6) for o in rest if o != c), default=0.0)
    return total


def best_group(
    topo: Topology,
    free: Sequence[int],
    n: int,
    scores: Mapping[int, int] | None = None,
) -> tuple[int, ...] | None:
    """The best group of ``n`` cards among ``free`` under the ring all-reduce cost model.

    Ties on cost go to the group that leaves the remaining free cards best connected, then to higher
    health scores. Returns ``None`` when fewer than ``n`` cards are free.
    """
    scores = scores or {}
    free = sorted(free)
    if n <= 0 or len(free) < n:
        return None
    if n == 1:
        # One card: take the one whose departure hurts the remaining groups least.
        return min(
            ((c,) for c in free),
            key=lambda g: (-_leftover_quality(topo, free, g), -scores.get(g[0], 100), g),
        )
    if len(free) <= EXACT_SEARCH_MAX_CARDS:
        candidates = combinations(free, n)
    else:
        candidates = _cluster_candidates(topo, free, n)
    best = None
    best_key = None
    for group in candidates:
        k = _group_key(topo, group, scores)
        key = (k[0], k[1], -_leftover_quality(topo, free, group), k[2], k[3])
        if best_key is None or key < best_key:
            best, best_key = group, key
    return best


def _cluster_candidates(topo: Topology, free: Sequence[int], n: int):
    """Candidate groups for large hosts: each card grown greedily with its best-connected neighbours."""
    seen = set()
    for seed in free:
        group = [seed]
        while len(group) < n:
            nxt = max(
                (c for c in free if c not in group),
                key=lambda c: (min(topo.bandwidth_gbps(c, g) for g in group), -c),
            )
            group.append(nxt)
        g = tuple(sorted(group))
        if g not in seen:
            seen.add(g)
            yield g


def choose_slice_card(
    cards: Sequence[CardCapacity],
    memory_fraction: float,
    compute_pct: int,
    topo: Topology | None = None,
) -> int | None:
    """The card a new slice goes to, or ``None`` when no card can take it.

    Already-sliced cards come first, best fit (least memory left over), so whole cards stay whole;
    otherwise an idle whole card is converted, chosen so the whole cards left keep the best groups.
    Degraded cards (``avoid``) are used only when nothing else fits; health scores break ties.
    """
    eps = 1e-9
    for avoid in (False, True):
        sliced = [
            c
            for c in cards
            if c.usable
            and c.sliced
            and c.avoid == avoid
            and c.free_memory_fraction + eps >= memory_fraction
            and c.free_compute_pct >= compute_pct
        ]
        if sliced:
            best = min(
                sliced, key=lambda c: (c.free_memory_fraction - memory_fraction, -c.health_score, c.index)
            )
            return best.index
        convertible = [
            c for c in cards if c.usable and not c.sliced and c.idle and not c.mode_pinned and c.avoid == avoid
        ]
        if convertible:
            free_whole = [c.index for c in cards if c.usable and not c.sliced and c.idle]
            if topo is not None and len(free_whole) > 1:
                pick = min(
                    convertible,
                    key=lambda c: (
                        -_leftover_quality(topo, free_whole, (c.index,)),
                        -c.health_score,
                        c.index,
                    ),
                )
            else:
                pick = min(convertible, key=lambda c: (-c.health_score, c.index))
            return pick.index
    return None
