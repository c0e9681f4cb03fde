"""Placement decision latency on the 1,213-host openb cluster.

Replays the default openb trace (seed 42) with a policy and times every ``choose`` call:

- *warm*: as the daemon runs it, with per-shape score caches that only re-score hosts whose state changed;
- *cold*: the cache dropped before every decision, so every feasible host is scored (the worst case, e.g.
  right after the task mix is refreshed).

Usage: ``python bench/placement_latency.py [--policy xpud] [--trace CSV] [--json FILE]``
(``--trace``: another openb-format trace, e.g. a model-named variant written by
``bench/variants.py --write-traces DIR``).
Times are CPU-bound wall clock on this machine (2 cores, one used); nothing else should be running.
``--clock thread`` times each decision in this thread's CPU time (``time.thread_time``) instead: other
processes' load then counts far less (cache and frequency effects remain), for a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from xpud.placement.cluster import ClusterState
from xpud.placement.registry import make_policy
from xpud.sim.protocol import arrivals
from xpud.sim.trace import DEFAULT_CLUSTER, DEFAULT_TRACE, default_path, load_cluster, load_trace


def measure(
    policy_name: str,
    cold: bool,
    seed: int = 42,
    limit: int | None = None,
    trace: str | None = None,
    clock: str = "wall",
) -> dict:
    now = time.thread_time if clock == "thread" else time.perf_counter
    hosts = load_cluster(default_path(DEFAULT_CLUSTER))
    tasks = [t.demand for t in load_trace(trace or default_path(DEFAULT_TRACE))]
    state = ClusterState(hosts)
    rng = np.random.default_rng(seed)
    state.shuffle_ties(rng)
    seq = arrivals(tasks, state.total_gpu_milli, seed)[:limit]
    policy = make_policy(policy_name, tasks)
    times = []
    t_all = time.perf_counter()
    for d in seq:
        policy.observe(d)
        if cold:
            policy.reset_cache()
        t0 = now()
        p = policy.choose(state, d, rng)
        times.append(now() - t0)
        if p is not None:
            state.place(d, p)
            policy.placed(state, d, p)
    wall = time.perf_counter() - t_all
    ms = np.array(times) * 1e3
    return {
        "policy": policy_name,
        "trace": str(trace or DEFAULT_TRACE),
        "mode": "cold" if cold else "warm",
        "clock": clock,
        "hosts": state.size,
        "decisions": len(ms),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "max_ms": round(float(ms.max()), 3),
        "mean_ms": round(float(ms.mean()), 3),
        "replay_wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="xpud")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--cold-limit", type=int, default=3000, help="decisions measured cold (slow: full scoring)"
    )
    ap.add_argument("--trace", default=None, help="openb-format trace (default: the default openb trace)")
    ap.add_argument(
        "--clock", choices=("wall", "thread"), default="wall", help="wall clock or thread CPU time"
    )
    args = ap.parse_args()
    rows = [
        measure(args.policy, cold=False, trace=args.trace, clock=args.clock),
        measure(args.policy, cold=True, limit=args.cold_limit, trace=args.trace, clock=args.clock),
    ]
    for r in rows:
        print(
            f"{r['policy']:8} {r['mode']:5} ({r['clock']}) {r['hosts']} hosts, {r['decisions']} decisions: "
            f"p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms, max {r['max_ms']:.3f} ms "
            f"(replay {r['replay_wall_s']:.1f} s)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "results": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
