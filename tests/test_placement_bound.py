"""The packing upper bound: valid (never below a feasible packing) and tight on small known cases."""

from __future__ import annotations

import pytest

from xpud.placement.bound import offline_packing, packing_bound
from xpud.placement.cluster import Demand, Host


def test_two_large_slices_cannot_share_a_card():
    hosts = [Host("h", 64_000, 10**6, 2, "X")]
    tasks = [Demand(1_000, 1, 1, 600)] * 3
    # Share alone would allow 1800 of 2000; cards allow only two tasks of more than half a card.
    b = packing_bound(hosts, tasks)
    assert b.gpu_milli == pytest.approx(1200)
    assert b.exact and b.pct == pytest.approx(60.0)
    assert offline_packing(hosts, tasks) == pytest.approx(1200)


def test_cpu_limits_the_bound():
    hosts = [Host("h", 10_000, 10**6, 4, "X")]
    tasks = [Demand(4_000, 1, 1, 1000)] * 4
    assert packing_bound(hosts, tasks).gpu_milli == pytest.approx(2000)


def test_model_and_card_count_limits():
    hosts = [Host("a", 64_000, 10**6, 2, "X"), Host("b", 64_000, 10**6, 8, "Y")]
    tasks = [Demand(1_000, 1, 4, 1000, models=("X",))] * 2 + [Demand(1_000, 1, 8, 1000)]
    assert packing_bound(hosts, tasks).gpu_milli == pytest.approx(8000)


def test_dff_cut_for_thirds():
    hosts = [Host("h", 64_000, 10**6, 1, "X")]
    tasks = [Demand(1, 1, 1, 400)] * 3  # 1200 of share, but only two fit on one card
    assert packing_bound(hosts, tasks).gpu_milli == pytest.approx(800)
    assert packing_bound(hosts, tasks, integer=False).gpu_milli <= 1000 + 1e-6


def test_bound_is_at_least_any_feasible_packing():
    hosts = [Host(f"h{i}", 32_000, 128_000, c, "X") for i, c in enumerate((2, 4, 8, 8))]
    tasks = [
        Demand(c, m, g, s)
        for c, m, g, s in [
            (4000, 8000, 1, 300),
            (12000, 9000, 1, 1000),
            (2000, 500, 1, 810),
            (30000, 100000, 8, 1000),
            (6000, 2000, 2, 1000),
        ]
        * 6
    ]
    b = packing_bound(hosts, tasks)
    assert b.gpu_milli >= offline_packing(hosts, tasks) - 1e-6
    assert b.gpu_milli <= sum(h.cards for h in hosts) * 1000 + 1e-6
