"""The FGD paper's trace variants, built from the default openb trace, replayed with FGD beside xpud.

Each variant keeps the default trace's size (8,152 tasks) and its CPU-only tasks, and resamples (seeded) the
GPU tasks so that one property reaches a share of them, as the FGD paper's variant traces do:

- ``gpuspec{N}``: N % of GPU tasks name a GPU model (``gpu_spec``). The model is drawn in proportion to the
  cluster's cards of each model (among models whose hosts have enough cards for the task), so a named model
  is as scarce for its tasks as it is in the cluster;
- ``multigpu{N}``: N % of GPU tasks take 2..8 whole cards (drawn from the default trace's multi-GPU tasks);
- ``gpushare{N}``: N % of GPU tasks are fractional (drawn from the default trace's fractional tasks);
- ``cpu{N}``: CPU-only tasks (drawn from the default trace's) are added until the CPU they ask for is N %
  of what the GPU tasks ask for (the default trace: about 30 %).

Every variant is replayed with ``fgd`` (FGD as published: the whole trace's mix known in advance) and
``xpud`` (online) on the given seeds, with the simulator's protocol (``xpud/sim/protocol.py``). Results: the
mean allocation at every arrived-workload point 50..130 %, xpud minus FGD, written as JSON and markdown,
with the CPU-only tasks each policy did not place: dropped (fit nowhere) and refused (xpud's CPU reserve:
they fit only in GPU hosts' reserved CPU; ``--cpu-reserve`` as in ``xpu simulate``).

    python bench/variants.py --seeds 42-44 --workers 1 --save bench/variants.json --md bench/variants.md
    python bench/variants.py --only gpuspec33,multigpu50 --seeds 42,43  # a few, while developing
    python bench/variants.py --write-traces DIR  # only the CSVs, for xpu simulate --trace
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from xpud.placement.cluster import CARD_MILLI
from xpud.placement.names import CPU_RESERVE_MODES, DEFAULT_CPU_RESERVE
from xpud.sim.defaults import DEFAULT_CLUSTER, DEFAULT_TRACE, default_path, parse_seeds
from xpud.sim.runner import SimConfig, run
from xpud.sim.trace import load_cluster, load_trace

VARIANTS: dict[str, tuple[str, int]] = {
    **{f"gpuspec{n}": ("gpuspec", n) for n in (10, 25, 33, 50)},
    **{f"multigpu{n}": ("multigpu", n) for n in (20, 30, 50)},
    **{f"gpushare{n}": ("gpushare", n) for n in (60, 80)},
    **{f"cpu{n}": ("cpu", n) for n in (100, 200)},
}
POINTS = range(50, 131)
BUILD_SEED = 2023  # the variants' own seed (the replay seeds are separate)
FIELDS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec")


def _rows(trace: Path) -> list[dict]:
    with trace.open(newline="") as f:
        return [{k: r.get(k, "") for k in FIELDS} for r in csv.DictReader(f)]


def _card_counts(cluster: Path) -> dict[str, list[int]]:
    """Model -> the card count of each host of that model."""
    out: dict[str, list[int]] = {}
    for h in load_cluster(cluster):
        if h.cards:
            out.setdefault(h.model, []).append(h.cards)
    return out


def build(kind: str, level: int, rows: list[dict], cards: dict[str, list[int]], seed: int) -> list[dict]:
    """One variant's rows (see the module docstring)."""
    rng = np.random.default_rng([seed, level, sum(map(ord, kind))])
    cpu_only = [r for r in rows if int(r["num_gpu"]) == 0]
    gpu = [r for r in rows if int(r["num_gpu"]) > 0]
    share = level / 100.0
    if kind == "cpu":
        gpu_cpu = sum(int(r["cpu_milli"]) for r in gpu)
        out, have = list(gpu), 0
        while have < share * gpu_cpu:
            r = cpu_only[int(rng.integers(len(cpu_only)))]
            out.append(r)
            have += int(r["cpu_milli"])
        return _renamed(out, rng)
    if kind in ("multigpu", "gpushare"):
        special = [r for r in gpu if _is(kind, r)]
        plain = [r for r in gpu if not _is(kind, r)]
        picked = [
            special[int(rng.integers(len(special)))] if s else plain[int(rng.integers(len(plain)))]
            for s in (rng.random(len(gpu)) < share)
        ]
        return _renamed(cpu_only + picked, rng)
    if kind == "gpuspec":
        models = sorted(cards)
        out = list(cpu_only)
        for r in gpu:
            r = dict(r)
            if rng.random() < share:
                k = int(r["num_gpu"])
                ok = [m for m in models if max(cards[m]) >= k]
                w = np.array([sum(c for c in cards[m] if c >= k) for m in ok], dtype=float)
                r["gpu_spec"] = ok[int(rng.choice(len(ok), p=w / w.sum()))]
            out.append(r)
        return _renamed(out, rng)
    raise ValueError(f"unknown variant kind {kind!r}")


def _is(kind: str, r: dict) -> bool:
    n, milli = int(r["num_gpu"]), int(r["gpu_milli"])
    return n > 1 if kind == "multigpu" else (n == 1 and milli < CARD_MILLI)


def _renamed(rows: list[dict], rng) -> list[dict]:
    rows = [rows[i] for i in rng.permutation(len(rows))]
    return [{**r, "name": f"openb-pod-{i:05d}"} for i, r in enumerate(rows)]


def write_traces(out: Path, names: list[str], trace: Path, cluster: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows, cards = _rows(trace), _card_counts(cluster)
    paths = {}
    for name in names:
        kind, level = VARIANTS[name]
        p = out / f"openb_pod_list_{name}.csv"
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(build(kind, level, rows, cards, BUILD_SEED))
        paths[name] = p
    return paths


def mix_facts(path: Path) -> dict:
    ds = [t.demand for t in load_trace(path)]
    g = [d for d in ds if d.gpus]
    return {
        "tasks": len(ds),
        "gpu_tasks": len(g),
        "fractional_pct": round(100 * sum(d.fractional for d in g) / len(g), 1),
        "multigpu_pct": round(100 * sum(d.gpus > 1 for d in g) / len(g), 1),
        "gpuspec_pct": round(100 * sum(bool(d.models) for d in g) / len(g), 1),
        "cpu_only_cpu_pct_of_gpu": round(
            100 * sum(d.cpu_milli for d in ds if not d.gpus) / max(1, sum(d.cpu_milli for d in g)), 1
        ),
    }


def replay_all(
    paths: dict[str, Path],
    cluster: Path,
    seeds,
    workers: int,
    policies,
    cpu_reserve: str = DEFAULT_CPU_RESERVE,
) -> dict:
    out = {}
    for name, path in paths.items():
        t0 = time.perf_counter()
        pols = tuple(policies)
        seeds = tuple(seeds)
        cfg = SimConfig(cluster, path, policies=pols, seeds=seeds, workers=workers, cpu_reserve=cpu_reserve)
        rep = run(cfg)
        entry = {"mix": mix_facts(path), "curves": {}, "cpu_only": {}}
        for pol in policies:
            c = rep.curves(pol)
            entry["curves"][pol] = {"mean": c.mean(axis=0).round(4).tolist(), "per_seed": c.round(4).tolist()}
            rs = [r for r in rep.results if r.policy == pol]
            entry["cpu_only"][pol] = {
                f"{what}@{x}": round(float(np.mean([getattr(r, f"{what}_curve")[x] for r in rs])), 1)
                for what in ("cpu_only_dropped", "refused", "cpu_only_dropped_cpu", "refused_cpu")
                for x in (80, 100, 130)
            }
        out[name] = entry
        print(f"{name}: {_summary(entry)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return out


def _diff(entry: dict) -> np.ndarray:
    d = np.array(entry["curves"]["xpud"]["mean"]) - np.array(entry["curves"]["fgd"]["mean"])
    return np.where(np.abs(d) < 1e-9, 0.0, d)  # equal curves: 0, not -0.00 from float noise


def _summary(entry: dict) -> str:
    d = _diff(entry)[50:131]
    worst = int(np.argmin(d)) + 50
    return f"xpud-fgd at 100%: {_diff(entry)[100]:+.2f}; worst {d.min():+.2f} at {worst}%"


def markdown(results: dict, seeds, command: str) -> str:
    cols = (50, 60, 70, 80, 85, 90, 95, 100, 110, 120, 130)
    lines = [
        "# xpud vs FGD on the FGD paper's trace variants (`bench/variants.py`)",
        "",
        f"Seeds {','.join(map(str, seeds))} ({len(seeds)} seed(s)); variants built with seed {BUILD_SEED}.",
        f"Command: `{command}`",
        "",
        "xpud minus FGD (percentage points of GPU allocation, mean over the seeds) at arrived workload (%);",
        "'min 50-130' is the lowest difference at any integer point from 50 to 130 % and where it is.",
        "",
        "| variant | FGD @100 | xpud @100 | " + " | ".join(f"{c}" for c in cols) + " | min 50-130 |",
        "|---|---|---|" + "---|" * len(cols) + "---|",
    ]
    for name, e in results.items():
        d = _diff(e)
        sub = d[50:131]
        w = int(np.argmin(sub)) + 50
        fgd100, x100 = e["curves"]["fgd"]["mean"][100], e["curves"]["xpud"]["mean"][100]
        cells = " | ".join(f"{d[c]:+.2f}" for c in cols)
        lines.append(f"| {name} | {fgd100:.2f} | {x100:.2f} | {cells} | {sub.min():+.2f} @{w} |")
    lines += [
        "",
        "CPU-only tasks not placed, mean per replay at 80 / 100 / 130 % arrived: FGD dropped (fit nowhere);",
        "xpud dropped + refused (fit only in GPU hosts' reserved CPU); cores at 130 %.",
        "",
        "| variant | FGD dropped | xpud dropped | xpud refused | FGD cores @130 "
        "| xpud cores @130 (dropped+refused) |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in results.items():
        co = e.get("cpu_only", {})
        if not co:
            continue
        f, x = co.get("fgd", {}), co.get("xpud", {})

        def three(c: dict, what: str) -> str:
            return " / ".join(f"{c.get(f'{what}@{p}', 0):.0f}" for p in (80, 100, 130))

        fc = f.get("cpu_only_dropped_cpu@130", 0) / 1000
        xc = (x.get("cpu_only_dropped_cpu@130", 0) + x.get("refused_cpu@130", 0)) / 1000
        lines.append(
            f"| {name} | {three(f, 'cpu_only_dropped')} | {three(x, 'cpu_only_dropped')} | "
            f"{three(x, 'refused')} | {fc:,.0f} | {xc:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="42-44")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--policies", default="fgd,xpud")
    ap.add_argument("--cpu-reserve", default=DEFAULT_CPU_RESERVE, choices=tuple(CPU_RESERVE_MODES))
    ap.add_argument("--save", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--write-traces", type=Path, help="only write the variant CSVs to this folder")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n] or list(VARIANTS)
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        print(f"unknown variant(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    cluster, trace = default_path(DEFAULT_CLUSTER), default_path(DEFAULT_TRACE)
    if a.write_traces:
        for n, p in write_traces(a.write_traces, names, trace, cluster).items():
            print(f"{n}: {p} {mix_facts(p)}")
        return 0
    seeds = parse_seeds(a.seeds)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_traces(Path(tmp), names, trace, cluster)
        results = replay_all(paths, cluster, seeds, a.workers, a.policies.split(","), a.cpu_reserve)
    command = "python bench/variants.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.save:
        a.save.write_text(json.dumps({"seeds": list(seeds), "command": command, "variants": results}))
    md = markdown(results, seeds, command)
    if a.md:
        a.md.write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
