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
from xpud.sim.defaults import DEFAULT_RATIO, DEFAULT_SEEDS, parse_seeds  # noqa: F401  (re-exported)


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
