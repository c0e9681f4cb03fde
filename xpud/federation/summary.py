"""This host's ``view.HostSummary``: what it offers the cluster now, from the engine's public views.

Two steps, so that the event loop never waits on the group search: ``snapshot`` reads the engine (cheap,
on the loop) and ``summarize`` turns a snapshot into a summary (``placement.host.best_group`` for every
group size: run it in a thread). ``GroupCache`` keeps the last answer per free set, since most changes
(a slice granted, the queue growing) leave the free whole cards as they were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from xpud.federation.view import MAX_CARDS, HostSummary
from xpud.model import CardMode, CardView, HealthState, SliceSpec
from xpud.placement.host import best_group


@dataclass(frozen=True)
class Snapshot:
    cards: int
    free: tuple[int, ...]  # idle usable cards a whole-card lease could take now
    scores: tuple[tuple[int, int], ...]  # (card, health score) of the free cards
    degraded: tuple[int, ...]
    slices: tuple[tuple[str, int], ...]  # (size, slices grantable now)
    health: int
    queue: int


def _slices_fit(free_mem: float, free_pct: int, spec: SliceSpec) -> int:
    return max(0, math.floor(min(free_mem / spec.memory_fraction, free_pct / spec.compute_pct) + 1e-9))


def snapshot(views: list[CardView], busy: set[int], queue: int, sizes: Mapping[str, SliceSpec]) -> Snapshot:
    """What is free, from ``Engine.card_views()``, ``busy_cards()`` and the queue's length.

    A slice size counts the slices that fit in sliced cards' free room plus those an idle card the engine
    may slice would hold (MPS arithmetic: a MIG card's geometry may allow fewer; an estimate for placement,
    which the host checks again when it reserves)."""
    free, offering, slices = [], [], dict.fromkeys(sizes, 0)
    for v in views:
        i = v.info.index
        if v.drained or v.health_state is HealthState.UNHEALTHY or i in busy:
            continue
        if v.idle and (v.mode is CardMode.WHOLE or not v.mode_pinned):
            free.append(i)
        can_slice = not v.whole_lease and (v.mode is CardMode.SLICED or (v.idle and not v.mode_pinned))
        if can_slice:
            for name, spec in sizes.items():
                slices[name] += _slices_fit(v.free_memory_fraction, v.free_compute_pct, spec)
        if v.idle or (can_slice and v.free_memory_fraction > 0):
            offering.append(v)
    return Snapshot(
        cards=len(views),
        free=tuple(free),
        scores=tuple((v.info.index, v.health_score) for v in views if v.info.index in free),
        degraded=tuple(v.info.index for v in views if v.health_state is HealthState.DEGRADED),
        slices=tuple(slices.items()),
        health=min((v.health_score for v in offering), default=100),
        queue=queue,
    )


class GroupCache:
    """Bus bandwidth of the best free k-card group, k = 1..len(free), for the last free set asked."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: tuple[float, ...] = ()

    def gbps(self, topology, snap: Snapshot) -> tuple[float, ...]:
        key = (snap.free, snap.scores, snap.degraded)
        if key != self._key:
            scores = dict(snap.scores)
            out: list[float] = []
            for k in range(1, min(len(snap.free), MAX_CARDS) + 1):
                group = best_group(topology, list(snap.free), k, scores, avoid=snap.degraded)
                out.append(topology.busbw_gbps(group) if group else 0.0)
            self._key, self._value = key, tuple(out)
        return self._value


def summarize(
    snap: Snapshot, topology, cache: GroupCache, zone: str = "", block: str = "", domain: str = ""
) -> HostSummary:
    """The summary of ``snap`` (runs the group search: call it off the event loop)."""
    return HostSummary(
        cards=min(snap.cards, MAX_CARDS),
        free_whole=min(len(snap.free), MAX_CARDS),
        group_gbps=cache.gbps(topology, snap),
        free_slices=dict(snap.slices),
        health=snap.health,
        queue=min(snap.queue, 10**6),
        zone=zone,
        block=block,
        domain=domain,
    )
