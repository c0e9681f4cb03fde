"""What a host's cards leave free, as the daemon tells its clients (``ListCardsReply.free_whole`` and
``free_slices``): counted once, here, from the cards' messages, so that every view shows the daemon's
number instead of recomputing it. An estimate for views, not a placement."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from xpud.api.v1 import xpu_pb2 as pb
from xpud.model import SliceSpec


def _usable(card: pb.Card) -> bool:
    lost = card.HasField("sample") and card.sample.lost
    return not card.drained and card.health_state != "unhealthy" and not lost


def slices_that_fit(card: pb.Card, spec: SliceSpec) -> int:
    """Slices of ``spec`` that fit in a sliced card's free memory and compute (MPS arithmetic).

    A MIG card's geometry may allow fewer.
    """
    if not _usable(card) or card.mode != "sliced" or card.whole_lease:
        return 0
    by_memory = card.free_memory_fraction / spec.memory_fraction
    by_compute = card.free_compute_pct / spec.compute_pct
    return max(0, math.floor(min(by_memory, by_compute) + 1e-9))


def whole_free(card: pb.Card) -> bool:
    """An idle usable card a whole-card lease could take: whole, or sliced but empty and not pinned."""
    if not _usable(card) or card.whole_lease or card.slices:
        return False
    return card.mode == "whole" or not card.mode_pinned


def free(cards: Iterable[pb.Card], sizes: Mapping[str, SliceSpec]) -> dict:
    """``free_whole`` (cards a whole-card lease could take now) and ``free_slices`` (per slice size, the
    slices that fit in the free room of the sliced cards), as ``ListCardsReply`` fields."""
    cards = list(cards)
    return {
        "free_whole": sum(whole_free(c) for c in cards),
        "free_slices": {size: sum(slices_that_fit(c, spec) for c in cards) for size, spec in sizes.items()},
    }
