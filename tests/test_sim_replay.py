"""Replays: dropping, the allocation curve, slice rounding, moves, the trace loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from xpud.placement.cluster import ClusterState, Demand, Host, Placement
from xpud.placement.policies import BestFit
from xpud.placement.registry import make_policy
from xpud.placement.slices import Rounding
from xpud.sim.moves import Defragmenter
from xpud.sim.replay import replay
from xpud.sim.trace import TraceError, load_cluster, load_trace

HOSTS = [Host("a", 16_000, 64_000, 2, "X"), Host("b", 16_000, 64_000, 2, "X")]  # 4 cards, 4000 milli


def test_tasks_that_fit_nowhere_are_dropped_and_the_curve_follows_arrivals():
    tasks = [
        Demand(1_000, 1, 2, 1000),
        Demand(1_000, 1, 2, 1000),
        Demand(1_000, 1, 1, 1000),
        Demand(1_000, 1, 1, 500),
    ]
    r = replay(HOSTS, tasks, BestFit())
    assert (r.placed, r.dropped) == (2, 2)
    assert r.alloc_pct[50] == pytest.approx(50.0)  # first task arrived: 50 %
    assert r.alloc_pct[100] == pytest.approx(100.0)
    assert r.alloc_pct[125] == pytest.approx(100.0)  # third task (arrived 125 %) dropped
    assert r.alloc_pct[130] == pytest.approx(100.0)
    assert np.all(np.diff(r.alloc_pct) >= 0)


def test_cpu_and_memory_are_constraints_too():
    tasks = [Demand(16_000, 1), Demand(1, 1, 1, 1000), Demand(1, 64_001, 1, 1000)]
    r = replay(HOSTS, tasks, BestFit())
    assert (r.placed, r.dropped) == (2, 1)


def test_rounding_costs_useful_allocation():
    tasks = [Demand(1, 1, 1, 300)] * 12  # 3600 milli asked; 4 cards
    free = replay(HOSTS, tasks, BestFit())
    rounded = replay(HOSTS, tasks, BestFit(), rounding=Rounding.named("quarter-half"))
    assert free.placed == 12 and free.alloc_pct[-1] == pytest.approx(90.0)
    assert rounded.placed == 8  # two 500-milli slices per card
    assert rounded.alloc_pct[-1] == pytest.approx(60.0)
    assert rounded.occupied_pct[-1] == pytest.approx(100.0)


def test_moves_are_counted_and_bounded_by_the_budget():
    hosts = [Host("gpu", 16_000, 64_000, 1, "X"), Host("cpu", 32_000, 64_000, 1, "X")]
    tasks = [Demand(1_000, 1, 1, 1000)] + [Demand(12_000, 8_000)] * 100 + [Demand(8_000, 8_000, 1, 1000)]
    policy = make_policy("xpud")
    r = replay(hosts, tasks, policy, mover=Defragmenter(budget_pct=10.0))
    assert r.moves <= 0.10 * r.placed and r.moves_curve is not None
    r0 = replay(hosts, tasks, make_policy("xpud"), mover=Defragmenter(budget_pct=0.0))
    assert r0.moves == 0 and r.placed >= r0.placed


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_loader_reads_openb_csvs(tmp_path):
    c = write(tmp_path / "c.csv", "sn,cpu_milli,memory_mib,gpu,model\nn1,32000,65536,2,T4\nn2,8000,1000,0,\n")
    t = write(
        tmp_path / "t.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\np1,1000,100,1,500,T4|A10\np2,1000,100,0,0,\n"
        "p3,1000,100,2,1000,\n",
    )
    assert load_cluster(c)[0] == Host("n1", 32000, 65536, 2, "T4")
    tasks = load_trace(t)
    assert tasks[0].demand == Demand(1000, 100, 1, 500, ("A10", "T4"))
    assert tasks[1].demand == Demand(1000, 100)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name,cpu_milli\n", "missing column"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1500\n", "gpu_milli must be 1..1000"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,2,500\n", "must take whole cards"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,x,1,1,500\n", "integer from 0 to"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1e400,1,1,500\n", "cpu_milli must be an integer"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1e13,1,500\n", "memory_mib must be an integer"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,nan,1,1,500\n", "cpu_milli must be an integer"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,0,0\n", "no task asks for a GPU"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", "no tasks"),
    ],
)
def test_loader_errors_name_the_problem(tmp_path, text, message):
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path / "t.csv", text))


def test_a_file_that_is_not_utf8_text_is_one_error_from_its_first_line(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"\xb5\x00\xff" * 100)
    with pytest.raises(TraceError, match=r"t.csv:1: not a UTF-8 CSV file"):
        load_trace(path)


def test_missing_file_says_how_to_fix(tmp_path):
    with pytest.raises(TraceError, match="--cluster FILE"):
        load_cluster(tmp_path / "nope.csv")


def test_defragmenter_applies_a_swap_and_keeps_its_index_in_step():
    # Host 0: half a card free, CPU held by a heavy slice; host 1: CPU to spare, no free card, a light slice
    # of the same size. Only a swap makes room for the request (see test_placement_defrag).

    def setup(swaps: bool):
        s = ClusterState([Host("a", 16_000, 64_000, 2, "X"), Host("b", 64_000, 256_000, 2, "X")])
        placed = {
            0: (Demand(12_000, 8_000, 1, 500), Placement(0, (0,))),
            1: (Demand(3_000, 4_000, 1, 1000), Placement(0, (1,))),
            2: (Demand(2_000, 8_000, 1, 500), Placement(1, (0,))),
            3: (Demand(6_000, 8_000, 1, 500), Placement(1, (0,))),
            4: (Demand(2_000, 4_000, 1, 1000), Placement(1, (1,))),
        }
        mover = Defragmenter(budget_pct=100.0, swaps=swaps)
        for i, (d, p) in placed.items():
            s.place(d, p)
            mover.placed(i, d, p)
        return s, placed, mover

    request = Demand(8_000, 4_000, 1, 500)
    s, placed, mover = setup(swaps=False)
    assert mover.make_room(s, request, placed, make_policy("xpud"), np.random.default_rng(0)) == (None, [])
    s, placed, mover = setup(swaps=True)
    target, moves = mover.make_room(s, request, placed, make_policy("xpud"), np.random.default_rng(0))
    assert target == Placement(0, (0,)) and mover.moves == 2
    assert sorted((i, src.host, dst.host) for i, src, dst in moves) == [(0, 0, 1), (2, 1, 0)]
    assert placed[0][1] == Placement(1, (0,)) and placed[2][1] == Placement(0, (0,))
    assert s.cpu_free.tolist() == [16_000 - 3_000 - 2_000, 64_000 - 12_000 - 6_000 - 2_000]
    assert s.fits(request, target)
    assert sorted(it.id for it in mover.movables.by_host[0]) == [2]  # whole-card task 1 is not movable at 1 %
    assert sorted(it.id for it in mover.movables.by_host[1]) == [0, 3]


def test_cpu_only_tasks_refused_by_the_reserve_are_counted_apart_from_drops_and_get_no_moves():
    asked: list[Demand] = []

    class NoMoves(Defragmenter):
        def make_room(self, state, d, *a, **k):
            asked.append(d)
            return None, []

    hosts = [Host("a", 32_000, 64_000, 2, "X")]  # 2 cards; GPU tasks below need 8 cores per card
    tasks = [Demand(8_000, 1, 1, 500), Demand(20_000, 1), Demand(40_000, 1), Demand(1_000, 1, 1, 500)]
    r = replay(hosts, tasks, make_policy("xpud", cpu_reserve="reserve"), mover=NoMoves(budget_pct=100))
    # After the first task: 24 cores free, 1,500 milli free need 12 (16 cores per card: 8 cores / 500 milli):
    # the 20-core task fits only by taking the reserve -> refused; the 40-core one fits nowhere -> dropped.
    assert (r.placed, r.refused, r.dropped, r.cpu_only_dropped) == (2, 1, 1, 1)
    assert r.refused_curve[-1] == 1 and r.refused_cpu_curve[-1] == 20_000
    assert r.cpu_only_dropped_curve[-1] == 1 and r.cpu_only_dropped_cpu_curve[-1] == 40_000
    assert asked == [Demand(40_000, 1)]  # the dropped task may make room, the refused one may not
    off = replay(hosts, tasks, make_policy("xpud", cpu_reserve="off"))
    assert (off.placed, off.refused, off.dropped) == (3, 0, 1)
