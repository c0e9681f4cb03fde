"""Every policy on small hand-made clusters where the right answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from xpud.placement.cluster import ClusterState, Demand, Host, Placement
from xpud.placement.frag import TaskClass, WorkloadMix
from xpud.placement.fragaware import FragAware, fill_value
from xpud.placement.policies import FGD, BestFit, DotProduct, GpuClustering, GpuPacking, RandomFit
from xpud.placement.registry import POLICY_NAMES, make_policy

RNG = np.random.default_rng(0)


def hosts(n: int, cards: int = 4, cpu: int = 64_000, mem: int = 256_000, model: str = "X") -> list[Host]:
    return [Host(f"h{i}", cpu, mem, cards, model) for i in range(n)]


def put(s: ClusterState, d: Demand, host: int, cards: tuple[int, ...] = ()) -> None:
    s.place(d, Placement(host, cards or s.cards_for(d, host)))


def test_best_fit_picks_the_fullest_host():
    s = ClusterState(hosts(3))
    put(s, Demand(8_000, 1, 2, 1000), 1)
    put(s, Demand(40_000, 1), 2)
    # host 2: lots of CPU used, no GPU; host 1: 2 cards and some CPU used. Least left = host 2? Score is
    # 0.5*cpu_left/128 + 0.5*gpu_left/8: h1 = .5*56/128 + .5*1/8 = .281; h2 = .5*24/128 + .5*3/8 = .281.
    # Make h1 strictly fuller:
    put(s, Demand(8_000, 1), 1)
    assert BestFit().choose(s, Demand(1_000, 1, 1, 1000), RNG).host == 1


def test_dot_product_prefers_complementary_host():
    s = ClusterState(hosts(2))
    put(s, Demand(60_000, 1), 0)  # host 0: CPU nearly gone, all cards free
    put(s, Demand(0, 1, 4, 1000), 1)  # host 1: GPUs gone, CPU free
    # A CPU-heavy task: dot product with host 0's free vector (little CPU) is smaller.
    assert DotProduct().choose(s, Demand(4_000, 1), RNG).host == 0


def test_gpu_packing_shared_card_first_then_used_host():
    s = ClusterState(hosts(3))
    put(s, Demand(1_000, 1, 1, 1000), 1)  # host 1 used, idle cards left
    put(s, Demand(1_000, 1, 1, 400), 2, (0,))  # host 2 has a shared card with 600 free
    assert GpuPacking().choose(s, Demand(1_000, 1, 1, 500), RNG) == Placement(2, (0,))
    assert GpuPacking().choose(s, Demand(1_000, 1, 1, 1000), RNG).host in (1, 2)
    s2 = ClusterState(hosts(2))
    put(s2, Demand(1_000, 1, 1, 1000), 1)
    assert GpuPacking().choose(s2, Demand(1_000, 1, 1, 1000), RNG).host == 1  # not the idle host


def test_gpu_clustering_keeps_kinds_together():
    s = ClusterState(hosts(3))
    p = GpuClustering()
    for d, h in ((Demand(1_000, 1, 1, 300), 0), (Demand(1_000, 1, 2, 1000), 1)):
        pl = Placement(h, s.cards_for(d, h))
        s.place(d, pl)
        p.placed(s, d, pl)
    assert p.choose(s, Demand(1_000, 1, 1, 200), RNG).host == 0
    assert p.choose(s, Demand(1_000, 1, 2, 1000), RNG).host == 1


def test_random_fit_only_returns_feasible_hosts():
    s = ClusterState(hosts(5, cpu=8_000))
    for h in (0, 1, 3, 4):
        put(s, Demand(7_000, 1), h)
    for _ in range(20):
        assert RandomFit().choose(s, Demand(2_000, 1, 1, 500), RNG).host == 2


def test_fgd_fills_a_card_exactly_instead_of_opening_one():
    s = ClusterState(hosts(2))
    put(s, Demand(1_000, 1, 1, 500), 1, (2,))
    mix = WorkloadMix([Demand(1_000, 1, 1, 500)] * 5 + [Demand(1_000, 1, 1, 1000)] * 5)
    assert FGD(mix).choose(s, Demand(1_000, 1, 1, 500), RNG) == Placement(1, (2,))


def test_fgd_avoids_stranding_a_whole_card_class_by_cpu():
    # Host 0 has 9 cores free; placing a 2-core slice there leaves 7 < 8 cores a WHOLE task needs.
    s = ClusterState(hosts(2, cards=2, cpu=64_000))
    put(s, Demand(55_000, 1), 0)
    mix = WorkloadMix([Demand(8_000, 1, 1, 1000)] * 9 + [Demand(2_000, 1, 1, 300)])
    assert FGD(mix).choose(s, Demand(2_000, 1, 1, 300), RNG).host == 1


def test_ties_go_to_the_lowest_rank_and_xpud_prefers_smaller_hosts():
    s = ClusterState([*hosts(3), Host("small", 64_000, 256_000, 2, "X")])
    s.tie_rank = np.array([3, 1, 2, 0])
    assert BestFit().choose(s, Demand(0, 0, 1, 1000), RNG).host == 3
    s.tie_rank = np.array([2, 0, 1, 3])
    assert FGD(WorkloadMix([Demand(0, 0, 1, 1000)])).choose(s, Demand(0, 0, 1, 1000), RNG).host == 1
    assert FragAware().choose(s, Demand(0, 0, 1, 1000), RNG).host == 3  # fewest cards first


def test_xpud_counts_cpu_stranding_that_fgd_does_not_see():
    # Host 0: 4 idle cards, 20 cores free; host 1: 4 idle cards, 64 cores. A 4-core CPU-only task leaves a
    # whole-card task (8 cores) able to run on either, so FGD sees no difference and takes the first host;
    # but 16 cores can feed only 2 of host 0's 4 cards: xpud keeps host 0's CPU.
    s = ClusterState([Host("h0", 32_000, 256_000, 4, "X"), Host("h1", 64_000, 256_000, 4, "X")])
    put(s, Demand(12_000, 1), 0)
    whole = [Demand(8_000, 1, 1, 1000)] * 20
    assert FGD(WorkloadMix(whole)).choose(s, Demand(4_000, 1), RNG).host == 0
    p = FragAware()
    for d in whole:
        p.observe(d)
    assert p.choose(s, Demand(4_000, 1), RNG).host == 1


def test_xpud_fill_lookahead_pairs_complementary_shares():
    v = fill_value([(TaskClass(1_000, 300, 1), 1.0)])
    assert v[0] == 0 and v[300] == 0 and v[299] == 299 and v[1000] == pytest.approx(100)
    s = ClusterState(hosts(2))
    put(s, Demand(1_000, 1, 1, 700), 0, (0,))  # 300 left on host 0 card 0
    put(s, Demand(1_000, 1, 1, 600), 1, (0,))  # 400 left on host 1 card 0
    p = FragAware(WorkloadMix([Demand(1_000, 1, 1, 300)] * 5 + [Demand(1_000, 1, 1, 1000)] * 5))
    assert p.choose(s, Demand(1_000, 1, 1, 300), RNG) == Placement(0, (0,))


def test_xpud_keeps_a_scarce_model_for_the_tasks_that_name_it():
    # One P100 host and one T4 host, each with 2 idle cards. The tasks that name P100 each have their own
    # CPU size, so none is among FGD's popular classes: the fragmentation measure sees the two hosts alike
    # and the tie goes to the P100 host (ranked first). The scarcity term sends the task that may run
    # anywhere to the T4 host, leaving the P100 cards to the tasks that can only run there.
    s = ClusterState([Host("p", 64_000, 256_000, 2, "P100"), Host("t", 64_000, 256_000, 2, "T4")])
    anywhere = Demand(4_000, 1, 1, 1000)
    named = [Demand(1_000 + k, 1, 1, 1000, ("P100",)) for k in range(2)]
    for scarcity, host in ((20.0, 1), (0.0, 0)):
        p = FragAware(scarcity=scarcity)
        for d in [anywhere] * 40 + named:
            p.observe(d)
        assert p.choose(s, anywhere, RNG).host == host
    assert FragAware().scarcity_points(s, named[0]) is None  # one allowed model: nothing to weigh
    p = FragAware()
    p.observe(anywhere)
    assert p.scarcity_points(s, anywhere) is None  # no model-named task seen: FGD's measure alone


def test_xpud_keeps_the_only_idle_group_for_a_multi_card_class():
    # Host 0 (128 cores) is the only one that can take an 8-card task needing 120 cores; host 1 has 96.
    # The 8-card tasks each have their own CPU size, so none is among FGD's popular classes and the
    # fragmentation measure sees the two hosts alike (the tie goes to host 0, ranked first). The group term
    # sends a one-card task to host 1, so the 8-card task that arrives next still finds its group.
    s = ClusterState([Host("big", 128_000, 512_000, 8, "X"), Host("small", 96_000, 512_000, 8, "X")])
    one, eight = Demand(4_000, 1, 1, 1000), [Demand(120_000 + k, 1, 8, 1000) for k in range(2)]
    for groups, host in ((FragAware().groups, 1), (0.0, 0)):  # the default weight steers it
        p = FragAware(groups=groups, top_hosts=0.0)  # the group term alone (top_hosts also steers it)
        for d in [one] * 40 + eight:
            p.observe(d)
        chosen = p.choose(s, one, RNG)
        assert chosen.host == host
        if groups:
            t = s.copy()
            t.place(one, chosen)
            assert p.choose(t, eight[0], RNG) is not None
            only_big = np.array([True, False])
            assert p.group_points(s, eight[0], np.full(2, -1), only_big) is None  # it may use it


def test_xpud_keeps_the_only_group_for_a_cpu_heavy_class_from_a_lighter_task_of_as_many_cards():
    # Host 0 (128 cores) is again the only one for the 8-card tasks needing 120 cores; an 8-card task
    # needing 64 cores fits both. Before, only tasks with fewer cards were steered away from a class's last
    # groups, so the 64-core task took host 0 (the tie) and the 120-core task that came next found nothing.
    s = ClusterState([Host("big", 128_000, 512_000, 8, "X"), Host("small", 96_000, 512_000, 8, "X")])
    light, heavy = Demand(64_000, 1, 8, 1000), [Demand(120_000 + k, 1, 8, 1000) for k in range(2)]
    for groups, host in ((FragAware().groups, 1), (0.0, 0)):
        p = FragAware(groups=groups, small_hosts_first=False)  # the plain tie order: the group term alone
        for d in [Demand(4_000, 1, 1, 1000)] * 100 + [light] + heavy:  # FGD's popular classes: 1-card
            p.observe(d)
        chosen = p.choose(s, light, RNG)
        assert chosen.host == host
        t = s.copy()
        t.place(light, chosen)
        assert (p.choose(t, heavy[0], RNG) is not None) == bool(groups)
    # The heavy task itself, with no host outside its class's, is never steered (not even by its sibling
    # class 1 milli-core larger).
    assert p.group_points(s, heavy[0], np.full(2, -1), np.array([True, False])) is None


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_refuses_what_fits_nowhere_and_never_overbooks(name):
    rng = np.random.default_rng(3)
    s = ClusterState(hosts(4, cards=2, cpu=16_000, mem=32_000) + hosts(2, cards=8, cpu=32_000, model="Y"))
    demands = [
        Demand(int(rng.integers(0, 6)) * 1000, int(rng.integers(0, 9)) * 1000, g, m)
        for g, m in rng.choice([(0, 0), (1, 250), (1, 600), (1, 1000), (2, 1000), (8, 1000)], 120)
    ]
    policy = make_policy(name, demands)
    placed = dropped = 0
    for d in demands:
        policy.observe(d)
        p = policy.choose(s, d, rng)
        if p is None:
            assert not s.feasible(d).any(), f"{name} dropped a task that fits"
            dropped += 1
            continue
        assert s.fits(d, p), f"{name} chose {p} for {d}"
        s.place(d, p)
        policy.placed(s, d, p)
        placed += 1
    assert (s.cpu_free >= 0).all() and (s.mem_free >= 0).all() and (s.card_free >= 0).all()
    assert placed > 10 and dropped > 0


def test_xpud_gives_a_multi_card_task_the_least_capable_of_equal_hosts():
    # Nothing has asked for more than 64 cores yet, so no term tells the two idle 8-card hosts apart and the
    # tie used to go to host 0 (ranked first): the 128-core host, the only one a 120-core 8-card task that
    # arrives later could use. Ties for a multi-card task now go to fewer cores, then less memory.
    s = ClusterState([Host("big", 128_000, 512_000, 8, "X"), Host("small", 96_000, 512_000, 8, "X")])
    p = FragAware()
    light = Demand(64_000, 1, 8, 1000)
    p.observe(light)
    assert p.choose(s, light, RNG).host == 1
    one = Demand(4_000, 1, 1, 1000)  # a one-card task keeps the old order (measured: capacity ties cost it)
    assert FragAware(top_hosts=0.0).pick(s, np.array([0, 1]), RNG, one) == 0
    assert FragAware().pick(s, np.array([0, 1]), RNG, one) == 1  # ... except an idle top host goes last
    put(s, Demand(0, 0, 1, 1000), 0)
    assert FragAware().pick(s, np.array([0, 1]), RNG, one) == 0  # ... while it is idle
    assert FragAware().pick(s, np.array([0, 1]), RNG) == 0


@pytest.mark.parametrize("make", [lambda: FGD(None), FragAware])
def test_idle_hosts_of_a_kind_scored_once_get_the_scores_each_would_get(make):
    # Three kinds of host, most idle, some busy; the shortcut (one idle host scored per kind) must give
    # every host the score and card that scoring it alone gives.
    s = ClusterState(hosts(5) + hosts(4, cards=8, cpu=96_000, model="Y") + hosts(3, cards=2, cpu=16_000))
    assert len(set(s.kind.tolist())) == 3
    put(s, Demand(4_000, 1, 1, 500), 1, (2,))
    put(s, Demand(30_000, 1), 6)
    mix = [Demand(4_000, 1, 1, 500), Demand(8_000, 1, 2, 1000), Demand(2_000, 1), Demand(12_000, 1, 1, 1000)]
    for d in [*mix, Demand(6_000, 1, 1, 300), Demand(20_000, 1, 4, 1000)]:
        fast, slow = make(), make()
        slow.host_pure = False
        for m in mix:
            fast.observe(m)
            slow.observe(m)
        a, b = fast.host_scores(s, d), slow.host_scores(s, d)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), d
    assert s.idle(np.arange(s.size)).sum() == s.size - 2


def test_xpud_weighs_a_scarce_eight_card_class_by_its_cards():
    # Host 0 alone serves the 8-card, 120-core classes (two sizes). Each class's claim on the free share is
    # q_c * F = 8,000 / 56,000 * 16,000 = 2,286 milli against a supply of one group (8,000): r = 2/7 >= 1/4,
    # so breaking host 0's group costs groups * r * (8/4)^2 per class; host 1 serves neither class.
    s = ClusterState([Host("big", 128_000, 512_000, 8, "X"), Host("small", 96_000, 512_000, 8, "X")])
    one = Demand(4_000, 1, 1, 1000)
    p = FragAware()
    for d in [one] * 40 + [Demand(120_000 + k, 1, 8, 1000) for k in range(2)]:
        p.observe(d)
    pts = p.group_points(s, one, np.zeros(2, dtype=np.int64), np.array([True, True]))
    assert pts == pytest.approx([2 * p.groups * (2 / 7) * 4, 0.0])
    p.group_scarce = 0.5  # r below the threshold: the plain weight
    pts = p.group_points(s, one, np.zeros(2, dtype=np.int64), np.array([True, True]))
    assert pts == pytest.approx([2 * p.groups * (2 / 7), 0.0])


def test_xpud_group_points_only_for_hosts_that_can_rank_first_pick_the_same_hosts():
    # The pruned group term (points only where a host can still rank first) must leave the set of best
    # hosts exactly as the full term does, on a cluster with every kind of request in flight.
    rng = np.random.default_rng(7)
    s = ClusterState(hosts(6, cards=8, cpu=96_000) + hosts(3, cards=8, cpu=128_000) + hosts(4, cards=2))
    mix = [Demand(8_000, 1, 1, 1000), Demand(3_000, 1, 1, 500), Demand(120_000, 1, 8, 1000)]
    mix += [Demand(60_000, 1, 4, 1000), Demand(16_000, 1, 2, 1000), Demand(6_000, 1)]
    p = FragAware()
    for d in mix * 5:
        p.observe(d)
    checked = 0
    for _ in range(60):
        d = mix[int(rng.integers(len(mix)))]
        score, card = p.host_scores(s, d)
        feasible = score > -np.inf
        full = p.group_points(s, d, card, feasible)
        pruned = p.group_points(s, d, card, feasible, score)
        a = score - (0 if full is None else full)
        b = score - (0 if pruned is None else pruned)
        if feasible.any():
            assert set(np.flatnonzero(a == a.max())) == set(np.flatnonzero(b == b.max()))
            checked += full is not None
            s.place(d, p.choose(s, d, rng))
    assert checked > 10


# CPU kept for GPU work (--cpu-reserve) ---------------------------------------------------------------------


def _learnt(p: FragAware, *ds: Demand) -> FragAware:
    for d in ds:
        p.observe(d)
    return p


def test_xpud_learns_the_cpu_per_gpu_ratio_of_gpu_tasks_only():
    p = _learnt(FragAware(), Demand(8_000, 1, 1, 1000), Demand(2_000, 1, 1, 500), Demand(64_000, 1))
    assert p.cpu_per_gpu == pytest.approx(10_000 / 1_500)  # the CPU-only task does not count
    s = ClusterState(hosts(2))
    put(s, Demand(0, 0, 4, 1000), 1)  # host 1: every card allocated
    put(s, Demand(0, 0, 1, 250), 0, (0,))  # host 0: 3750 milli free
    assert p.reserved_cpu(s).tolist() == pytest.approx([3_750 * 10_000 / 1_500, 0.0])
    assert FragAware().cpu_per_gpu == 0.0  # nothing seen: no reserve


def test_xpud_prefers_to_put_cpu_only_work_where_no_free_gpu_needs_the_cpu():
    # Host 0: four cards with 400 milli free each (the mix only has whole-card tasks, so FGD's measure sees
    # no usable share there and a CPU-only task scores the same on both hosts), 20 cores; host 1: every card
    # allocated, 20 cores. At 8 cores per card host 0's 1,600 free milli need 12.8 cores: a 12-core task
    # there takes 4.8 of them. "off" follows the host order (host 0 first), "prefer" and "reserve" go to 1.
    s = ClusterState(hosts(2, cpu=20_000))
    for c in range(4):
        put(s, Demand(0, 0, 1, 600), 0, (c,))
    put(s, Demand(0, 0, 4, 1000), 1)
    s.tie_rank = np.array([0, 1])
    whole = [Demand(8_000, 1, 1, 1000)] * 8
    task = Demand(12_000, 1)
    assert _learnt(FragAware(cpu_reserve="off"), *whole).choose(s, task, RNG).host == 0
    assert _learnt(FragAware(cpu_reserve="prefer"), *whole).choose(s, task, RNG).host == 1
    assert _learnt(FragAware(cpu_reserve="reserve"), *whole).choose(s, task, RNG).host == 1


def test_xpud_reserve_refuses_cpu_only_work_that_fits_only_in_reserved_cpu():
    # One host, 4 idle cards, 48 cores; GPU tasks need 8 cores per card: 32 reserved, 16 spare.
    s = ClusterState(hosts(1, cpu=48_000))
    whole = [Demand(8_000, 1, 1, 1000)] * 8
    assert _learnt(FragAware(cpu_reserve="reserve"), *whole).choose(s, Demand(16_000, 1), RNG).host == 0
    assert _learnt(FragAware(cpu_reserve="reserve"), *whole).choose(s, Demand(17_000, 1), RNG) is None
    assert _learnt(FragAware(cpu_reserve="prefer"), *whole).choose(s, Demand(17_000, 1), RNG).host == 0
    assert _learnt(FragAware(cpu_reserve="off"), *whole).choose(s, Demand(17_000, 1), RNG).host == 0
    # GPU tasks are never refused; before any GPU task has arrived there is no reserve.
    assert _learnt(FragAware(cpu_reserve="reserve"), *whole).choose(s, Demand(40_000, 1, 1, 1000), RNG)
    assert FragAware(cpu_reserve="reserve").choose(s, Demand(48_000, 1), RNG).host == 0
    with pytest.raises(ValueError, match="cpu_reserve"):
        FragAware(cpu_reserve="sometimes")


def test_xpud_reserve_keeps_the_cpu_a_hungry_multi_card_class_needs():
    # Host 0: 8 cards, 128 cores (the only host an 8-card 120-core task fits); host 1: 8 cards, 96 cores.
    # At the average 5.4 cores per card both reserve 43 cores; the 120-core class raises host 0's to 120, so a
    # 12-core CPU-only task goes to host 1 although host 0 comes first in the host order.
    s = ClusterState([Host("big", 128_000, 768_000, 8, "X"), Host("g2", 96_000, 384_000, 8, "X")])
    s.tie_rank = np.array([0, 1])
    seen = [Demand(4_000, 1, 1, 1000)] * 56 + [Demand(120_000, 1, 8, 1000)]
    p = _learnt(FragAware(cpu_reserve="reserve"), *seen)
    avg = p.cpu_per_gpu * 8_000  # 43 cores
    assert p.reserved_cpu(s).tolist() == pytest.approx([120_000, avg])
    assert p.choose(s, Demand(12_000, 1), RNG).host == 1
    assert p.choose(s, Demand(int(96_000 - avg) + 1, 1), RNG) is None  # 53 spare cores on host 1, 8 on 0


def test_xpud_keeps_idle_top_hosts_whole_for_tasks_of_fewer_whole_cards():
    # An idle 128-core 8-card host and an idle 96-core one; a 1-card whole task goes to the smaller host even
    # before any class that needs the big one has arrived (with top_hosts=0 it takes the big host).
    s = ClusterState([Host("big", 128_000, 768_000, 8, "X"), Host("g2", 96_000, 384_000, 8, "X")])
    s.tie_rank = np.array([0, 1])
    task = Demand(18_000, 64_000, 1, 1000)
    p0 = FragAware(top_hosts=0.0)
    p0.observe(task)
    assert p0.choose(s, task, RNG).host == 0
    p = FragAware()
    p.observe(task)
    assert p.choose(s, task, RNG).host == 1
    assert p.decision_scores(s, task)[0][0] == p0.decision_scores(s, task)[0][0] - 3  # 3 points off
    fractional = Demand(18_000, 64_000, 1, 500)  # fractional tasks are left alone
    assert p.decision_scores(s, fractional)[0][0] == p0.decision_scores(s, fractional)[0][0]


def test_xpud_reserve_keeps_an_idle_scarce_top_host_unless_only_it_can_take_the_task():
    # One 128-core 8-card host among five 96-core ones (a scarce top kind): no class needing it has arrived,
    # yet a CPU-only task that fits elsewhere only by taking reserved CPU is refused rather than put on the
    # idle big host; a task that only the big host can take at all (memory) goes there.
    s = ClusterState(
        [Host("big", 128_000, 768_000, 8, "X")] + [Host(f"g{i}", 96_000, 384_000, 8, "X") for i in range(5)]
    )
    for h in range(1, 6):
        put(s, Demand(0, 0, 2, 1000), h)  # six free cards each need 48 of 96 cores at 8 per card
        put(s, Demand(40_000, 1), h)  # 56 cores left: 8 spare
    p = _learnt(FragAware(cpu_reserve="reserve"), *[Demand(8_000, 1, 1, 1000)] * 8)
    assert p.choose(s, Demand(16_000, 1), RNG) is None  # fits on g*, but only in their reserve
    assert (
        _learnt(FragAware(cpu_reserve="reserve", top_hosts=0.0), *[Demand(8_000, 1, 1, 1000)] * 8)
        .choose(s, Demand(16_000, 1), RNG)
        .host
        == 0
    )
    assert p.choose(s, Demand(8_000, 400_000), RNG).host == 0  # only the big host has the memory
