"""Topology benchmark: which cards a multi-card job gets on one host, and what that costs it.

A simulated cluster of ``dgx-a100`` and ``pcie-8x-l40s`` hosts (their ``Topology`` read through the same
NVML adapter the daemon uses, over ``FakeNvml`` and ``etc/machines/*.toml``) receives a seeded stream of
jobs: Poisson arrivals, exponential durations, 2/4/8 cards each, one host type each, at a load that
keeps hosts fragmented. Every job goes to the same host under every policy (best fit by free card
count: which cards are free never changes how many are), so the policies differ only in which cards
they pick there, and in what that leaves for later jobs. Policies:

- ``first-fit``: the lowest free indices;
- ``pair-score``: the set with the highest total pair score (``Topology.pair_score``: 100 per NVLink
  link plus 50 same switch / 30 host bridge / 20 same CPU / 10 across CPUs); first such set on ties;
- ``nvidia-besteffort``: NVIDIA's go-gpuallocator best-effort policy, which scores a partition of all
  free cards into sets of the job's size and takes the best set of the best partition;
- ``xpud``: ``xpud.placement.host.best_group``.

Reported per host type and job size: mean and 10th percentile of the modelled all-reduce bus bandwidth
(``Topology.busbw_gbps``, GB/s) of the groups handed out, and the share of jobs that got a
cross-socket group although the free cards held a same-socket one. Also the decision time of each
policy, as CPU time of the deciding thread (so that other load on a shared machine does not count).
Usage::

    python bench/topology.py [--seeds 1-5] [--jobs 4000] [--hosts 16] [--load 0.9] [--json PATH]
    python bench/topology.py --mix 2:0.5,4:0.5 [--pack]      # one scenario of your own
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import combinations
from pathlib import Path

from xpud.hw.fakenvml import FakeNvml
from xpud.hw.machines import load_machine
from xpud.hw.nvml import Nvml
from xpud.placement.host import best_group
from xpud.topology import HOSTBRIDGE, NODE, SINGLE, SYSTEM, Topology, uniform

HOST_TYPES = ("dgx-a100", "pcie-8x-l40s")
REPORTED_SIZES = (2, 4, 8)  # 1-card jobs (``--mix``) only occupy cards: any card is as good
MEAN_DURATION = 1.0  # arbitrary time unit; arrivals are scaled to reach the load

Policy = Callable[[Topology, Sequence[int], int], tuple[int, ...]]


def machine_topology(name: str) -> Topology:
    """The host's topology as the daemon reads it: NVML adapter over the fake, from the machine file."""
    nvml = Nvml(FakeNvml(load_machine(name)))
    nvml.open()
    try:
        return nvml.topology()
    finally:
        nvml.close()


# ----------------------------------------------------------------------------------------------------
# Policies


def first_fit(topo: Topology, free: Sequence[int], n: int) -> tuple[int, ...]:
    return tuple(sorted(free)[:n])


def _pair_scores(topo: Topology) -> list[list[int]]:
    return [[topo.pair_score((a, b)) if a != b else 0 for b in range(topo.size)] for a in range(topo.size)]


_SCORES: dict[Topology, list[list[int]]] = {}


def _set_score(score: list[list[int]], group: Sequence[int | None]) -> int:
    return sum(score[a][b] for a, b in combinations([c for c in group if c is not None], 2))


def pair_score(topo: Topology, free: Sequence[int], n: int) -> tuple[int, ...]:
    score = _SCORES.setdefault(topo, _pair_scores(topo))
    return max(combinations(sorted(free), n), key=lambda g: _set_score(score, g))


def nvidia_besteffort(topo: Topology, free: Sequence[int], n: int) -> tuple[int, ...]:
    """go-gpuallocator's best-effort policy (no required devices), re-implemented."""
    score = _SCORES.setdefault(topo, _pair_scores(topo))
    devices: list[int | None] = sorted(free)
    if n == 1:
        return (devices[0],)
    while len(devices) % n:
        devices.append(None)  # padding, so that every card can be left out
    padding = devices.count(None)
    best: list[tuple] | None = None
    best_score = 0

    def walk(rest: list[int | None], acc: list[tuple]) -> None:
        nonlocal best, best_score
        if len(rest) == n:
            partition = [*acc, tuple(rest)]
            s = sum(_set_score(score, g) for g in partition)
            if best is None or s > best_score:
                best, best_score = partition, s
            return
        for tail in combinations(rest[1:], n - 1):
            group = (rest[0], *tail)
            if group.count(None) not in (0, padding):
                continue
            walk([c for c in rest if c not in group], [*acc, group])

    walk(devices, [])
    sets = [g for g in best if None not in g]
    return max(sets, key=lambda g: _set_score(score, g))  # first of the highest, as in the Go code


def xpud(topo: Topology, free: Sequence[int], n: int) -> tuple[int, ...]:
    return best_group(topo, free, n)


POLICIES: dict[str, Policy] = {
    "first-fit": first_fit,
    "pair-score": pair_score,
    "nvidia-besteffort": nvidia_besteffort,
    "xpud": xpud,
}


# ----------------------------------------------------------------------------------------------------
# Simulation


def jobs_for(
    seed: int, host_type: str, count: int, hosts: int, load: float, mix: dict[int, float]
) -> list[tuple[float, float, int]]:
    """``count`` jobs (arrival time, duration, cards) whose offered load is ``load`` of the capacity."""
    rng = random.Random(f"{seed}-{host_type}")
    mean_cards = sum(k * p for k, p in mix.items()) / sum(mix.values())
    rate = load * hosts * 8 / (mean_cards * MEAN_DURATION)
    sizes, weights = list(mix), list(mix.values())
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append((t, rng.expovariate(1 / MEAN_DURATION), rng.choices(sizes, weights)[0]))
    return out


def simulate(topo: Topology, jobs: list[tuple[float, float, int]], hosts: int, spread: bool) -> dict:
    """Replay ``jobs`` on ``hosts`` copies of ``topo`` under every policy in lockstep.

    A job goes to the host with the most free cards (``spread``, as Kubernetes' default LeastAllocated
    score does) or the fewest that fit; a job that fits on no host is dropped.
    """
    free = {p: [set(range(topo.size)) for _ in range(hosts)] for p in POLICIES}
    held: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}
    leaving: list[tuple[float, int]] = []
    records: dict[str, list[tuple[int, float, bool]]] = defaultdict(list)
    seconds: dict[str, list[float]] = defaultdict(list)
    dropped = 0
    sockets = topo.numa if topo.numa and None not in topo.numa else tuple(0 for _ in range(topo.size))
    for job, (t, duration, n) in enumerate(jobs):
        while leaving and leaving[0][0] <= t:
            _, done = heapq.heappop(leaving)
            for p in POLICIES:
                host, group = held.pop((p, done))
                free[p][host] |= set(group)
        counts = [len(f) for f in free["xpud"]]
        fits = [h for h in range(hosts) if counts[h] >= n]
        if not fits:
            dropped += 1
            continue
        host = min(fits, key=lambda h: (-counts[h] if spread else counts[h], h))
        for p, policy in POLICIES.items():
            cards = sorted(free[p][host])
            start = time.thread_time()
            group = tuple(policy(topo, cards, n))
            seconds[p].append(time.thread_time() - start)
            assert len(set(group)) == n and set(group) <= free[p][host], (p, group)
            per_socket = defaultdict(int)
            for c in cards:
                per_socket[sockets[c]] += 1
            avoidable = len({sockets[c] for c in group}) > 1 and max(per_socket.values()) >= n
            records[p].append((n, topo.busbw_gbps(group), avoidable))
            free[p][host] -= set(group)
            held[(p, job)] = (host, group)
        heapq.heappush(leaving, (t + duration, job))
    return {"records": records, "seconds": seconds, "dropped": dropped, "placed": len(records["xpud"])}


def p10(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.1 * (len(ordered) - 1))]


def summarise(runs: list[tuple[str, dict]]) -> list[dict]:
    """One row per host type, job size and policy, over every seed."""
    rows = []
    for host_type in HOST_TYPES:
        for size in REPORTED_SIZES:
            for p in POLICIES:
                recs = [r for ht, run in runs if ht == host_type for r in run["records"][p] if r[0] == size]
                bw = [r[1] for r in recs]
                rows.append(
                    {
                        "host_type": host_type,
                        "cards": size,
                        "policy": p,
                        "jobs": len(recs),
                        "mean_busbw_gbps": round(statistics.fmean(bw), 3),
                        "p10_busbw_gbps": round(p10(bw), 3),
                        "cross_socket_avoidable_pct": round(100 * sum(r[2] for r in recs) / len(recs), 2),
                    }
                )
    return rows


def latency(runs: list[tuple[str, dict]]) -> dict[str, dict[str, float]]:
    out = {}
    for p in POLICIES:
        s = sorted(x for _, run in runs for x in run["seconds"][p])
        out[p] = {
            "mean_ms": round(1e3 * statistics.fmean(s), 4),
            "p99_ms": round(1e3 * s[int(0.99 * len(s))], 4),
        }
    return out


def markdown(rows: list[dict], lat: dict) -> str:
    names = list(POLICIES)
    lines = [
        "| host | cards | jobs | "
        + " | ".join(f"{p} mean / p10 GB/s" for p in names)
        + " | "
        + " | ".join(f"{p} cross-socket %" for p in names)
        + " |",
        "|---|---|---|" + "---|" * (2 * len(names)),
    ]
    by = {(r["host_type"], r["cards"], r["policy"]): r for r in rows}
    for host_type in HOST_TYPES:
        for size in REPORTED_SIZES:
            cells = [by[(host_type, size, p)] for p in names]
            lines.append(
                f"| {host_type} | {size} | {cells[0]['jobs']} | "
                + " | ".join(f"{c['mean_busbw_gbps']:.2f} / {c['p10_busbw_gbps']:.2f}" for c in cells)
                + " | "
                + " | ".join(f"{c['cross_socket_avoidable_pct']:.1f}" for c in cells)
                + " |"
            )
    lines += ["", "| policy | mean decision CPU ms | p99 decision CPU ms |", "|---|---|---|"]
    lines += [f"| {p} | {v['mean_ms']:.3f} | {v['p99_ms']:.3f} |" for p, v in lat.items()]
    return "\n".join(lines)


def irregular_hosts(seed: int, count: int) -> list[tuple[str, Topology]]:
    """8-card hosts whose links do not follow the PCIe tree, where pair sums and bottlenecks can differ.

    ``dgx-a100, NVLink degraded``: one or two cards have lost some or all of their NVLinks.
    ``pcie-8x + NVLink bridges``: the L40S-shaped PCIe box with 4-link bridges joining most pairs of a
    random pairing of its cards (a bridge joins neighbouring slots, which need not share a PCIe switch
    or even a socket).
    """
    rng = random.Random(seed)
    dgx, box = machine_topology("dgx-a100"), machine_topology("pcie-8x-l40s")
    out = []
    for i in range(count):
        nv = [[0 if a == b else 12 for b in range(8)] for a in range(8)]
        if i % 2 == 0:
            for card in rng.sample(range(8), rng.randint(1, 2)):
                left = rng.choice([0, 4, 8])
                for b in range(8):
                    if b != card:
                        nv[card][b] = nv[b][card] = min(nv[card][b], left)
            out.append(("dgx-a100, NVLink degraded", replace(dgx, nvlinks=tuple(map(tuple, nv)))))
        else:
            nv = [[0] * 8 for _ in range(8)]
            cards = rng.sample(range(8), 8)
            for a, b in zip(cards[::2], cards[1::2], strict=True):
                if rng.random() < 0.75:
                    nv[a][b] = nv[b][a] = 4
            out.append(("pcie-8x + NVLink bridges", replace(box, nvlinks=tuple(map(tuple, nv)))))
    return out


def irregular(seed: int = 0, count: int = 400) -> list[dict]:
    """Single decisions on random free sets of irregular hosts: how often each policy's group has a
    lower modelled bus bandwidth than the best possible, and by how much on average."""
    rng = random.Random(seed)
    hits: dict[tuple[str, str], list[float]] = defaultdict(list)
    for shape, topo in irregular_hosts(seed, count):
        free = sorted(rng.sample(range(8), rng.randint(2, 8)))
        n = rng.randint(2, len(free))
        best = max(topo.busbw_gbps(g) for g in combinations(free, n))
        for p, policy in POLICIES.items():
            hits[(shape, p)].append(topo.busbw_gbps(policy(topo, free, n)) / best)
    return [
        {
            "shape": shape,
            "policy": p,
            "decisions": len(r),
            "below_best_pct": round(100 * sum(x < 1 - 1e-9 for x in r) / len(r), 1),
            "mean_of_best_pct": round(100 * statistics.fmean(r), 2),
        }
        for (shape, p), r in hits.items()
    ]


def _tree_host(cards: int) -> Topology:
    """A tree-shaped PCIe host of any size: 2 cards per switch, 2 switches per bridge, 2 per socket."""

    def level(i: int, j: int) -> int:
        for size, lv in ((2, SINGLE), (4, HOSTBRIDGE), (8, NODE)):
            if i // size == j // size:
                return lv
        return SYSTEM

    return Topology(
        levels=tuple(tuple(0 if i == j else level(i, j) for j in range(cards)) for i in range(cards))
    )


def speed(calls: int = 300) -> list[dict]:
    """Decision time of ``best_group`` (ms) on random free sets; clustering above 16 free cards."""
    hosts = {
        "dgx-a100": machine_topology("dgx-a100"),
        "pcie-8x-l40s": machine_topology("pcie-8x-l40s"),
        "tree-16": _tree_host(16),
        "uniform-16 (worst case)": uniform(16),
        "tree-32 (big host)": _tree_host(32),
        "tree-64 (big host)": _tree_host(64),
    }
    rows = []
    rng = random.Random(0)
    for name, topo in hosts.items():
        best_group(topo, range(topo.size), 2)  # builds the per-topology tables once, as the daemon does
        for n in (2, 4, 8):
            times = []
            for _ in range(calls if topo.size <= 16 else calls // 10):
                free = rng.sample(range(topo.size), rng.randint(n, topo.size))
                start = time.thread_time()
                best_group(topo, free, n)
                times.append(time.thread_time() - start)
            times.sort()
            rows.append(
                {
                    "host": name,
                    "cards": n,
                    "mean_ms": round(1e3 * statistics.fmean(times), 3),
                    "p99_ms": round(1e3 * times[int(0.99 * (len(times) - 1))], 3),
                }
            )
    return rows


def parse_seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def parse_mix(text: str) -> dict[int, float]:
    return {int(k): float(v) for k, v in (part.split(":") for part in text.split(","))}


# name: (arrivals by cards per job, spread over hosts rather than pack)
SCENARIOS = {
    "fragmented": ("2:0.5,4:0.35,8:0.15", True),
    "fragmented, with 1-card jobs": ("1:0.4,2:0.3,4:0.2,8:0.1", True),
    "packed, with 1-card jobs": ("1:0.4,2:0.3,4:0.2,8:0.1", False),
}


def run_scenario(args: argparse.Namespace, mix: dict[int, float], spread: bool) -> dict:
    runs = []
    for seed in parse_seeds(args.seeds):
        for name in HOST_TYPES:
            jobs = jobs_for(seed, name, args.jobs, args.hosts, args.load, mix)
            run = simulate(machine_topology(name), jobs, args.hosts, spread)
            runs.append((name, run))
            print(f"  seed {seed} {name}: {run['placed']} placed, {run['dropped']} dropped", file=sys.stderr)
    return {
        "mix": mix,
        "spread": spread,
        "placed": sum(run["placed"] for _, run in runs),
        "dropped": sum(run["dropped"] for _, run in runs),
        "rows": summarise(runs),
        "decision_latency": latency(runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1-5", help="seed range, e.g. 1-5")
    ap.add_argument("--jobs", type=int, default=4000, help="arrivals per seed and host type")
    ap.add_argument("--hosts", type=int, default=16, help="hosts of each type")
    ap.add_argument("--load", type=float, default=0.9, help="offered load, share of the cards")
    ap.add_argument("--mix", help="one scenario instead of the standard ones: cards:share,... of arrivals")
    ap.add_argument("--pack", action="store_true", help="with --mix: send jobs to the fullest host that fits")
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("topology.json"))
    args = ap.parse_args(argv)
    scenarios = {"custom": (args.mix, not args.pack)} if args.mix else SCENARIOS
    result = {
        "command": " ".join(["python bench/topology.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": {"seeds": args.seeds, "jobs": args.jobs, "hosts": args.hosts, "load": args.load},
        "mean_duration": MEAN_DURATION,
        "scenarios": {},
    }
    for name, (mix, spread) in scenarios.items():
        print(f"{name}:", file=sys.stderr)
        out = result["scenarios"][name] = run_scenario(args, parse_mix(mix), spread)
        print(f"\n### {name} ({out['placed']} jobs placed, {out['dropped']} dropped)\n")
        print(markdown(out["rows"], out["decision_latency"]))
    if not args.mix:
        rows = result["irregular"] = irregular()
        print("\n### single decisions on irregular hosts (share of the best possible bus bandwidth)\n")
        print("| host shape | policy | decisions | below best % | mean % of best |\n|---|---|---|---|---|")
        for r in rows:
            cells = (r["shape"], r["policy"], r["decisions"], r["below_best_pct"], r["mean_of_best_pct"])
            print("| " + " | ".join(map(str, cells)) + " |")
        rows = result["speed"] = speed()
        print("\n### best_group decision time (random free sets)\n")
        print("| host | cards | mean CPU ms | p99 CPU ms |\n|---|---|---|---|")
        print(
            "\n".join(
                f"| {r['host']} | {r['cards']} | {r['mean_ms']:.3f} | {r['p99_ms']:.3f} |" for r in rows
            )
        )
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
