"""Shared by the placement ablation scripts: the default openb cluster and trace, loaded once in each
worker, and a pool that runs a script's (variant, seed) jobs over them.

Imported by the scripts beside it (``python bench/X.py`` puts this folder on the path)."""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Callable, Sequence

from xpud.placement.cluster import ClusterState
from xpud.sim.protocol import arrivals
from xpud.sim.trace import DEFAULT_CLUSTER, DEFAULT_TRACE, default_path, load_cluster, load_trace

DATA: dict = {}


def _init() -> None:
    DATA["tasks"] = [t.demand for t in load_trace(default_path(DEFAULT_TRACE))]
    DATA["state"] = ClusterState(load_cluster(default_path(DEFAULT_CLUSTER)))


def workload(seed: int):
    """(cluster state, the seed's arrivals, the trace's tasks) in a worker."""
    state, tasks = DATA["state"], DATA["tasks"]
    return state, arrivals(tasks, state.total_gpu_milli, seed), tasks


def run(job: Callable, jobs: Sequence) -> list:
    """``job`` over ``jobs`` in two forked workers (the 2-core build machine)."""
    with mp.get_context("fork").Pool(2, initializer=_init) as pool:
        return pool.map(job, jobs)


def write_json(path: str | None, out: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
