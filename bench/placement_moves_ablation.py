"""What the parts of ``--defrag`` buy, and move ideas that did not help: variants of the replay's mover (and
of the policy by trace phase) on the openb default trace, same protocol as ``xpu simulate`` (10 seeds, two
worker processes). Every variant moves at most ``budget`` % of the placed tasks.

Usage: ``python bench/placement_moves_ablation.py [--json bench/placement_moves_ablation.json]
[--seeds 42-51] [--only NAME,...]``.
"""

from __future__ import annotations

import argparse

import ablation
import numpy as np

from xpud.placement.fragaware import FragAware
from xpud.sim.moves import Defragmenter
from xpud.sim.protocol import parse_seeds
from xpud.sim.replay import replay

POINTS = (95, 100, 110, 130)


class Phased(FragAware):
    """``xpud`` with some parameters changed once the cluster's GPU allocation reaches ``at``."""

    def __init__(self, early: dict, late: dict, at: float):
        super().__init__()
        self.early, self.late, self.at = early, late, at
        self._late: bool | None = None

    def host_scores(self, state, d):
        late = state.allocation_ratio() >= self.at
        if late != self._late:
            self._late = late
            for k, v in (self.late if late else self.early).items():
                setattr(self, k, v)
            self.epoch += 1  # cached scores are stale
        return super().host_scores(state, d)


def _mover(budget: float, **kw):
    return lambda seed: Defragmenter(budget, seed=seed, **kw)


# name -> (what it is, policy factory, mover factory or None)
VARIANTS = {
    "xpud": ("arrival only", FragAware, None),
    "d1-no-swaps": (
        "--defrag --move-budget 1 --no-swaps (evictions only)",
        FragAware,
        _mover(1, swaps=False),
    ),
    "d1": ("--defrag --move-budget 1 (evictions, then swaps)", FragAware, _mover(1)),
    "d1-whole": ("... --move-whole", FragAware, _mover(1, move_whole=True)),
    "d1-gain-150": ("... a move must buy >= 150 milli", FragAware, _mover(1, min_gain_milli=150)),
    "d1-gain-300": ("... a move must buy >= 300 milli", FragAware, _mover(1, min_gain_milli=300)),
    "d1-retry-8": (
        "... a failed shape retried after 8 placements (not 25)",
        FragAware,
        _mover(1, retry_after=8),
    ),
    "d10": ("--defrag --move-budget 10 (whole-card moves, repacks)", FragAware, _mover(10, move_whole=True)),
    "d10-retry-8": (
        "... a failed shape retried after 8 placements",
        FragAware,
        _mover(10, move_whole=True, retry_after=8),
    ),
    "phase-strand": (
        "arrival only, CPU stranding x0.8 until 85 % allocated",
        lambda: Phased({"strand_cpu": 0.8}, {"strand_cpu": 1.0}, 0.85),
        None,
    ),
    "phase-strand-late": (
        "arrival only, CPU stranding x1.2 from 90 % allocated",
        lambda: Phased({"strand_cpu": 1.0}, {"strand_cpu": 1.2}, 0.90),
        None,
    ),
    "phase-scale": (
        "arrival only, sigmoid scale 1000 until 85 % allocated",
        lambda: Phased({"scale": 1000.0}, {"scale": 500.0}, 0.85),
        None,
    ),
    "phase-scale-late": (
        "arrival only, sigmoid scale 250 from 90 % allocated",
        lambda: Phased({"scale": 500.0}, {"scale": 250.0}, 0.90),
        None,
    ),
    "phase-fill": (
        "arrival only, fill weight 0.25 from 90 % allocated",
        lambda: Phased({"fill_weight": 0.5}, {"fill_weight": 0.25}, 0.90),
        None,
    ),
    "phase-no-fill": (
        "arrival only, no fill look-ahead from 90 % allocated",
        lambda: Phased({"fill_weight": 0.5}, {"fill_weight": 0.0}, 0.90),
        None,
    ),
}


def _job(args):
    name, seed = args
    state, seq, _ = ablation.workload(seed)
    _, policy, mover = VARIANTS[name]
    r = replay(state, seq, policy(), seed=seed, mover=mover(seed) if mover else None)
    return name, seed, r.alloc_pct, 100.0 * r.moves / max(r.placed, 1), r.wall_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--only", default="", help="comma-separated variant names")
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds)
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    jobs = [(n, s) for n in names for s in seeds]
    res = ablation.run(_job, jobs)
    out = {"seeds": list(seeds), "variants": {}}
    print(f"{'variant':<18}" + "".join(f"{p:>8}" for p in POINTS) + f"{'moved %':>9}{'s/replay':>9}  what")
    for n in names:
        curves = np.vstack([a for m, _s, a, _mv, _w in res if m == n])
        moved = float(np.mean([mv for m, _s, _a, mv, _w in res if m == n]))
        wall = float(np.mean([w for m, _s, _a, _mv, w in res if m == n]))
        mean = curves.mean(axis=0)
        what = VARIANTS[n][0]
        print(f"{n:<18}" + "".join(f"{mean[p]:>8.2f}" for p in POINTS) + f"{moved:>9.2f}{wall:>9.1f}  {what}")
        out["variants"][n] = {
            "what": what,
            "mean": {str(p): round(float(mean[p]), 3) for p in POINTS},
            "per_seed_at_130": [round(float(x), 3) for x in curves[:, 130]],
            "moved_pct_of_placed": round(moved, 3),
            "replay_wall_s_mean": round(wall, 2),
        }
    ablation.write_json(args.json, out)


if __name__ == "__main__":
    main()
