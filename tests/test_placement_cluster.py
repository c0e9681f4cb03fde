"""ClusterState: feasibility under CPU, memory, model, card-share and whole-card constraints."""

from __future__ import annotations

import numpy as np
import pytest

from xpud.placement.cluster import ClusterState, Demand, Host, Placement


def cluster() -> ClusterState:
    return ClusterState(
        [
            Host("a", cpu_milli=16_000, memory_mib=64_000, cards=2, model="T4"),
            Host("b", cpu_milli=64_000, memory_mib=256_000, cards=8, model="A100"),
            Host("cpu", cpu_milli=32_000, memory_mib=64_000, cards=0, model=""),
        ]
    )


def test_cpu_and_memory_limit_every_task():
    s = cluster()
    assert s.feasible(Demand(16_000, 1_000)).tolist() == [True, True, True]
    assert s.feasible(Demand(16_001, 1_000)).tolist() == [False, True, True]
    assert s.feasible(Demand(1_000, 64_001)).tolist() == [False, True, False]


def test_gpu_tasks_need_a_model_that_is_allowed_and_cards():
    s = cluster()
    assert s.feasible(Demand(1_000, 1_000, 1, 500)).tolist() == [True, True, False]
    assert s.feasible(Demand(1_000, 1_000, 1, 500, models=("A100",))).tolist() == [False, True, False]
    assert s.feasible(Demand(1_000, 1_000, 4, 1000)).tolist() == [False, True, False]  # k cards on one host


def test_fractional_needs_one_card_with_enough_share():
    s = cluster()
    s.place(Demand(0, 0, 1, 600), Placement(0, (0,)))
    s.place(Demand(0, 0, 1, 600), Placement(0, (1,)))
    assert s.card_free[0, :2].tolist() == [400, 400]
    # 800 milli free on the host in total, but no single card has 500.
    assert not s.feasible(Demand(0, 0, 1, 500))[0]
    assert s.feasible(Demand(0, 0, 1, 400))[0]
    assert s.n_full[0] == 0 and s.max_free[0] == 400


def test_whole_cards_must_be_idle():
    s = cluster()
    s.place(Demand(0, 0, 1, 100), Placement(1, (3,)))
    assert s.n_full[1] == 7
    assert s.feasible(Demand(0, 0, 7, 1000))[1]
    assert not s.feasible(Demand(0, 0, 8, 1000))[1]
    assert s.cards_for(Demand(0, 0, 4, 1000), 1) == (0, 1, 2, 4)


def test_place_and_remove_restore_the_state_and_track_allocation():
    s = cluster()
    d = Demand(4_000, 8_000, 2, 1000)
    before = s.copy()
    s.place(d, Placement(1, (0, 1)))
    assert s.used_gpu_milli == 2000 and s.allocation_ratio() == pytest.approx(2000 / 10_000)
    v = s.version[1]
    s.remove(d, Placement(1, (0, 1)))
    assert s.version[1] != v  # every change renews the version
    for name in ("cpu_free", "mem_free", "card_free", "n_full", "max_free"):
        assert np.array_equal(getattr(s, name), getattr(before, name))
    assert s.used_gpu_milli == 0


def test_fits_checks_an_exact_placement():
    s = cluster()
    d = Demand(1_000, 1_000, 1, 700)
    assert s.fits(d, Placement(0, (1,)))
    assert not s.fits(d, Placement(0, (2,)))  # host a has 2 cards
    assert not s.fits(d, Placement(2, (0,)))  # no cards on the CPU host
    s.place(d, Placement(0, (1,)))
    assert not s.fits(d, Placement(0, (1,)))


def test_best_fit_card_by_default():
    s = cluster()
    s.place(Demand(0, 0, 1, 300), Placement(1, (2,)))
    s.place(Demand(0, 0, 1, 600), Placement(1, (5,)))
    assert s.cards_for(Demand(0, 0, 1, 300), 1) == (5,)  # 400 left: the tightest that fits
    assert s.cards_for(Demand(0, 0, 1, 500), 1) == (2,)


def test_bad_demands_are_refused():
    with pytest.raises(ValueError):
        Demand(1, 1, 2, 500)  # fractional on two cards
    with pytest.raises(ValueError):
        Demand(1, 1, 1, 0)
    with pytest.raises(ValueError):
        Demand(-1, 1)
