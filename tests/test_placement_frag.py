"""The FGD fragmentation measure on worked examples, and its vectorised change against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from xpud.placement.cluster import ClusterState, Demand, Host, Placement
from xpud.placement.frag import FragModel, TaskClass, WorkloadMix, sigmoid_score

HALF = TaskClass(cpu_milli=4_000, gpu_milli=500, gpus=1)
WHOLE = TaskClass(cpu_milli=8_000, gpu_milli=1000, gpus=1)
PAIR = TaskClass(cpu_milli=8_000, gpu_milli=1000, gpus=2)
CPU_ONLY = TaskClass(cpu_milli=2_000, gpu_milli=0, gpus=0)


def one_host(cards: list[int], cpu_free: int, n: int = 4) -> ClusterState:
    s = ClusterState([Host("h", cpu_milli=64_000, memory_mib=10**6, cards=n, model="X")])
    s.card_free[0, :n] = cards
    s.cpu_free[0] = cpu_free
    s.n_full[:] = (s.card_free == 1000).sum(axis=1)
    s.max_free[:] = s.card_free.max(axis=1)
    return s


def frag_of(classes, s: ClusterState) -> float:
    return float(FragModel(classes, s.models, s.max_cards).frag(s)[0])


def test_worked_example_mixed_cards():
    # Cards free: 1000, 600, 300, 0 (total 1900). Plenty of CPU.
    s = one_host([1000, 600, 300, 0], cpu_free=32_000)
    # HALF fits on 1000 and 600 -> unusable: 300.  WHOLE fits on 1000 -> unusable: 900.
    assert frag_of([(HALF, 0.5), (WHOLE, 0.5)], s) == pytest.approx(0.5 * 300 + 0.5 * 900)
    # A CPU-only task can use no GPU: everything free is fragment for it.
    assert frag_of([(CPU_ONLY, 1.0)], s) == pytest.approx(1900)
    # Two whole cards are not there: all 1900 unusable for PAIR.
    assert frag_of([(PAIR, 1.0)], s) == pytest.approx(1900)


def test_lack_of_cpu_makes_everything_fragment():
    s = one_host([1000, 1000, 0, 0], cpu_free=6_000)
    # HALF needs 4 cores: fits, unusable 0. WHOLE needs 8 cores: lacks CPU -> all 2000 unusable.
    assert frag_of([(HALF, 0.5), (WHOLE, 0.5)], s) == pytest.approx(0.5 * 0 + 0.5 * 2000)
    assert frag_of([(PAIR, 1.0)], s) == pytest.approx(2000)
    s.cpu_free[0] = 8_000
    assert frag_of([(PAIR, 1.0)], s) == pytest.approx(0)


def test_model_restriction_is_no_access():
    s = one_host([1000, 1000, 0, 0], cpu_free=64_000)
    only_y = TaskClass(1_000, 500, 1, ("Y",))
    assert frag_of([(only_y, 1.0)], s) == pytest.approx(2000)


def test_typical_classes_cover_the_threshold_and_sum_to_one():
    demands = [Demand(1000, 1, 1, 500)] * 60 + [Demand(2000, 1, 1, 1000)] * 30 + [Demand(500, 1)] * 10
    mix = WorkloadMix(demands, threshold=0.85)
    typical = mix.typical()
    assert [c for c, _ in typical] == [TaskClass(1000, 500, 1), TaskClass(2000, 1000, 1)]
    assert sum(p for _, p in typical) == pytest.approx(1.0)
    assert typical[0][1] == pytest.approx(60 / 90)
    assert WorkloadMix(demands, threshold=1.0).typical()[-1][0] == TaskClass(500, 0, 0)


def test_usable_after_matches_brute_force_on_random_states():
    rng = np.random.default_rng(7)
    hosts = [Host(f"h{i}", 32_000, 10**6, int(rng.integers(1, 9)), rng.choice(["X", "Y"])) for i in range(40)]
    s = ClusterState(hosts)
    for h in range(s.size):
        n = s.n_cards[h]
        s.card_free[h, :n] = rng.choice([0, 80, 190, 350, 500, 1000, 1000], n)
        s.cpu_free[h] = rng.integers(0, 32_001)
    s.n_full[:] = (s.card_free == 1000).sum(axis=1)
    s.max_free[:] = s.card_free.max(axis=1)
    classes = [
        (HALF, 0.3),
        (WHOLE, 0.3),
        (PAIR, 0.1),
        (CPU_ONLY, 0.1),
        (TaskClass(2_000, 150, 1, ("Y",)), 0.2),
    ]
    model = FragModel(classes, s.models, s.max_cards)
    for d in (
        Demand(3_000, 1, 1, 300),
        Demand(5_000, 1, 1, 1000),
        Demand(6_000, 1, 2, 1000),
        Demand(9_000, 1),
    ):
        hosts_ok = np.flatnonzero(s.feasible(d))
        u0, u1, valid = model.usable_after(s, d, hosts_ok)
        f_before = model.frag(s, hosts_ok)
        for n, h in enumerate(hosts_ok):
            for j in np.flatnonzero(valid[n]):
                t = s.copy()
                t.place(d, Placement(int(h), t.cards_for(d, int(h), int(j) if d.fractional else -1)))
                f_after = model.frag(t, np.array([h]))[0]
                saved = d.gpu_total_milli + u1[n, j] - u0[n]
                assert saved == pytest.approx(f_before[n] - f_after), (d, h, j)


def test_sigmoid_score_is_coarse_and_monotone():
    s = sigmoid_score(np.array([-2000.0, -10.0, 0.0, 10.0, 39.0, 2000.0]))
    assert s.tolist() == [11.0, 49.0, 50.0, 50.0, 50.0, 88.0]
