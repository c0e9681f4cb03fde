"""What each part of the ``xpud`` policy buys, and ideas that did not help: variants replayed on the openb
default trace with the same protocol as ``xpu simulate`` (10 seeds, two worker processes).

Usage: ``python bench/placement_ablation.py [--json bench/placement_ablation.json] [--seeds 42-51]``.
"""

from __future__ import annotations

import argparse

import ablation
import numpy as np

from xpud.placement.frag import WorkloadMix
from xpud.placement.fragaware import FragAware
from xpud.placement.policies import FGD
from xpud.sim.protocol import parse_seeds
from xpud.sim.replay import replay

POINTS = (90, 95, 96, 100, 110, 130)


def _online(policy, threshold: float):
    policy.mix.threshold = threshold
    return policy


# name -> (what it is, factory given the whole trace)
VARIANTS = {
    "fgd": ("FGD as published (mix known in advance)", lambda tr: FGD(WorkloadMix(tr))),
    "fgd-online": ("FGD, mix learned from arrivals", lambda tr: FGD(None)),
    "fgd-online-exact": (
        "... ranked by the raw change, not the coarse score",
        lambda tr: FGD(None, exact=True),
    ),
    "xpud": ("ours (default)", lambda tr: FragAware()),
    "xpud-no-fill": ("... without the card fill look-ahead", lambda tr: FragAware(fill_weight=0.0)),
    "xpud-no-mem": ("... without memory stranding", lambda tr: FragAware(strand_mem=0.0)),
    "xpud-no-strand": (
        "... without CPU and memory stranding",
        lambda tr: FragAware(strand_cpu=0.0, strand_mem=0.0),
    ),
    "xpud-random-ties": (
        "... ties by host rank only (not fewer cards first)",
        lambda tr: FragAware(small_hosts_first=False),
    ),
    "xpud-scale-1000": ("... FGD's sigmoid scale (1000) instead of 500", lambda tr: FragAware(scale=1000.0)),
    "xpud-fill-1.0": ("... fill weight 1.0 instead of 0.5", lambda tr: FragAware(fill_weight=1.0)),
    "xpud-strand-1.5": ("... CPU stranding x1.5", lambda tr: FragAware(strand_cpu=1.5)),
    "xpud-all-classes": (
        "... mix with every class (multi-card ones too)",
        lambda tr: _online(FragAware(), 1.0),
    ),
    "xpud-offline-mix": ("... with the mix known in advance", lambda tr: FragAware(WorkloadMix(tr))),
}


def _job(args):
    name, seed = args
    state, seq, tasks = ablation.workload(seed)
    r = replay(state, seq, VARIANTS[name][1](tasks), seed=seed)
    return name, seed, r.alloc_pct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--seeds", default="42-51")
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds)
    jobs = [(n, s) for n in VARIANTS for s in seeds]
    res = ablation.run(_job, jobs)
    curves = {n: np.vstack([a for m, _s, a in res if m == n]) for n in VARIANTS}
    fgd = curves["fgd"]
    out = {"seeds": list(seeds), "variants": {}}
    print(f"{'variant':<20}" + "".join(f"{p:>8}" for p in POINTS) + f"{'min vs fgd':>12}  what")
    for n, (what, _) in VARIANTS.items():
        m = curves[n].mean(axis=0)
        lead = float((curves[n] - fgd).mean(axis=0)[50:].min())
        print(f"{n:<20}" + "".join(f"{m[p]:>8.2f}" for p in POINTS) + f"{lead:>+12.3f}  {what}")
        out["variants"][n] = {
            "what": what,
            "mean": {str(p): round(float(m[p]), 3) for p in POINTS},
            "min_lead_over_fgd_50_130": round(lead, 3),
        }
    ablation.write_json(args.json, out)


if __name__ == "__main__":
    main()
