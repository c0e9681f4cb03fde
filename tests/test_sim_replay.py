"""Replays: dropping, the allocation curve, slice rounding, moves, the trace loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from xpud.placement.cluster import Demand, Host
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
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,x,1,1,500\n", "non-negative integer"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,0,0\n", "no task asks for a GPU"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n", "no tasks"),
    ],
)
def test_loader_errors_name_the_problem(tmp_path, text, message):
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path / "t.csv", text))


def test_missing_file_says_how_to_fix(tmp_path):
    with pytest.raises(TraceError, match="--cluster FILE"):
        load_cluster(tmp_path / "nope.csv")
