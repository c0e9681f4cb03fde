"""Co-location on MPS cards: which of several equally good cards a new slice should share.

MPS divides a card's SMs between its clients by active-thread percentage, but device-memory bandwidth,
the L2 cache and the card's power budget stay shared, so two jobs that lean on the same resource slow
each other more than a compute-bound job beside a memory-bound one (the idea Orion, Strati et al.,
EuroSys 2024, applies per kernel). A job's *profile* is what it keeps busy on average, ``(SM %,
memory-controller %)`` of the whole card, as per-process utilisation reports it
(``xpud.planning.usage.profile``).

What counts is which resource a job leans on, not how much it uses (best fit has already balanced the
card's shares): the likeness of two profiles is the cosine of their angle, 1 for two compute-bound (or two
memory-bound) jobs, near 0 for a compute-bound beside a memory-bound one. A new job's expected contention
beside a card's leases is the sum of its likeness to each measured one. Lower is better. It is a
tie-breaker only (``placement.host.choose_slice_card``'s ``tie_break``): best fit, health and every other
term decide first. Pure: profiles in, a number out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

Profile = tuple[float, float]  # (SM %, memory-controller %), each of the whole card


def likeness(a: Profile, b: Profile) -> float:
    """Cosine of the angle between two profiles, 0..1 (0 when either used nothing)."""
    na, nb = math.hypot(*a), math.hypot(*b)
    if na == 0 or nb == 0:
        return 0.0
    return (a[0] * b[0] + a[1] * b[1]) / (na * nb)


def overlap(new: Profile, beside: Iterable[Profile]) -> float:
    """Contention a job with profile ``new`` expects beside leases with profiles ``beside``: the sum of
    its likeness to each (0 when it would be alone or its neighbours are unmeasured: no evidence, no
    preference)."""
    return sum(likeness(new, b) for b in beside)
