"""The replay protocol: shuffle per seed, grow to 1.3x capacity, tasks only arrive."""

from __future__ import annotations

from collections import Counter

import pytest

from xpud.placement.cluster import Demand
from xpud.sim.protocol import arrivals, parse_seeds

TRACE = [Demand(1000 * i, 1, 1, 100 * (i % 10) + 50) for i in range(40)] + [Demand(500, 1)] * 10


def test_grows_to_the_ratio_and_stops_before_passing_it():
    cap = 20_000  # the trace asks for 20,000 milli: it must grow to 26,000
    seq = arrivals(TRACE, cap, seed=42, ratio=1.3)
    total = sum(d.gpu_total_milli for d in seq)
    assert total <= 1.3 * cap
    assert total > 1.3 * cap - 1000  # the next sample would have passed the target
    # the shuffled trace comes first, complete
    assert Counter(seq[: len(TRACE)]) == Counter(TRACE)
    assert len(seq) > len(TRACE)


def test_same_seed_same_sequence_different_seed_different():
    assert arrivals(TRACE, 5_000, 1) == arrivals(TRACE, 5_000, 1)
    assert arrivals(TRACE, 5_000, 1) != arrivals(TRACE, 5_000, 2)


def test_a_trace_larger_than_the_target_is_trimmed():
    seq = arrivals(TRACE, 1_000, seed=3, ratio=1.3)
    assert sum(d.gpu_total_milli for d in seq) <= 1_300
    assert set(seq) <= set(TRACE)


def test_parse_seeds():
    assert parse_seeds("42-51") == tuple(range(42, 52))
    assert parse_seeds("7") == (7,)
    assert parse_seeds("1,3-4,3") == (1, 3, 4)
    for bad in ("", "a-b", "5-3", "-1", "1,,x"):
        with pytest.raises(ValueError, match="bad seed list"):
            parse_seeds(bad)
