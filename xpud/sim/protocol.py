"""The replay protocol of the FGD paper (ATC'23), so figures are comparable with it.

The trace is shuffled with the seed; then tasks sampled from it with replacement are appended until the
requested GPU share reaches ``ratio`` (1.3) times the cluster's capacity (the first sample that would pass
it stops the growth). A trace that already asks for more is trimmed by removing random tasks. Tasks only
arrive; the metric is sampled when the *arrived* GPU request crosses each integer percentage.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xpud.placement.cluster import Demand

DEFAULT_RATIO = 1.3
DEFAULT_SEEDS = tuple(range(42, 52))


def arrivals(
    demands: Sequence[Demand], capacity_milli: int, seed: int, ratio: float = DEFAULT_RATIO
) -> list[Demand]:
    """The arrival sequence for one seed: the shuffled trace grown (or trimmed) to ``ratio`` x capacity."""
    if not demands:
        return []
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(demands))
    seq = [demands[i] for i in order]
    target = ratio * capacity_milli
    total = sum(d.gpu_total_milli for d in seq)
    if total > target:
        while total > target and seq:
            d = seq.pop(int(rng.integers(len(seq))))
            total -= d.gpu_total_milli
        return seq
    while True:
        d = demands[int(rng.integers(len(demands)))]
        if total + d.gpu_total_milli > target:
            return seq
        seq.append(d)
        total += d.gpu_total_milli


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"42-51"``, ``"42,43,50"`` or ``"7"`` -> seeds. Raises ``ValueError`` with a readable message."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if a < 0 or b < a:
                raise ValueError
            seeds.extend(range(a, b + 1))
        except ValueError:
            raise ValueError(f"bad seed list {text!r}: use e.g. 42-51 or 42,43,44") from None
    if not seeds:
        raise ValueError(f"bad seed list {text!r}: use e.g. 42-51 or 42,43,44")
    return tuple(dict.fromkeys(seeds))
