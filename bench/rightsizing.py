"""Right-sizing simulation: fixed requests against ``--mode auto`` over a synthetic mix whose real demand
differs from what the jobs ask for. The auto side runs xpud's own decision code (``xpud.planning.sizing``,
``xpud.planning.usage``) on readings the simulation makes every ``sample_s``; placement is a first-fit model
of
slices on cards (memory and compute shares), whole cards for xpu.

    .venv/bin/python bench/rightsizing.py [--jobs 300] [--seed 1] [--json bench/rightsizing.json]
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from xpud.config.schema import DEFAULT_SLICES, AutoSection
from xpud.planning.sizing import AutoState, caps, decide, first_mode
from xpud.planning.usage import Reading, UsageBook

GIB = 1 << 30
CARD_MEM = 80 * GIB
RESTART_S = 60.0  # job time lost per move: stop, reload the model, warm up


def mix(n: int, rng) -> list[dict]:
    """70 % inference asking for vxpu-half: half over-ask (need ~ a quarter), a tenth under-ask (need a
    whole card), the rest fit; 30 % training asking for whole cards and using them."""
    jobs = []
    for i in range(n):
        start = float(rng.uniform(0, 20 * 3600))
        if rng.random() < 0.7:
            u = rng.random()
            if u < 0.5:
                cls, demand, mem = "infer-small", float(rng.uniform(3, 11)), float(rng.uniform(2, 12)) * GIB
            elif u < 0.6:
                cls, demand, mem = "infer-big", float(rng.uniform(45, 80)), float(rng.uniform(20, 35)) * GIB
            else:
                cls, demand, mem = "infer-mid", float(rng.uniform(14, 26)), float(rng.uniform(8, 30)) * GIB
            jobs.append(
                dict(
                    id=f"j{i}",
                    cls=cls,
                    ask="vxpu-half",
                    demand=demand,
                    mem=mem,
                    start=start,
                    work=float(rng.uniform(1, 3)) * 3600,
                )
            )
        else:
            jobs.append(
                dict(
                    id=f"j{i}",
                    cls="train",
                    ask="xpu",
                    demand=float(rng.uniform(80, 100)),
                    mem=float(rng.uniform(40, 75)) * GIB,
                    start=start,
                    work=float(rng.uniform(2, 6)) * 3600,
                )
            )
    return sorted(jobs, key=lambda j: j["start"])


def cards_used(modes: list[str]) -> int:
    """Whole cards plus slices packed first-fit decreasing by memory share, compute share checked."""
    whole = sum(1 for m in modes if m == "xpu")
    bins: list[list[float]] = []  # [memory share, compute %]
    for m in sorted((m for m in modes if m != "xpu"), key=lambda m: -caps(m, DEFAULT_SLICES)[1]):
        cpu, memf = caps(m, DEFAULT_SLICES)
        for b in bins:
            if b[0] + memf <= 1.0 + 1e-9 and b[1] + cpu <= 100:
                b[0] += memf
                b[1] += cpu
                break
        else:
            bins.append([memf, cpu])
    return whole + len(bins)


def simulate(jobs: list[dict], auto: bool, cfg: AutoSection, noise, dt: float, learn: bool = True) -> dict:
    """``learn`` False: every auto job starts in ``[auto] first`` (no class history), so only moves fix it."""
    book = UsageBook(cfg.history)
    running: dict[str, dict] = {}
    pending = list(jobs)
    t, used, peak, hot_time, lost, moves = 0.0, [], 0, {}, 0.0, 0
    while pending or running:
        while pending and pending[0]["start"] <= t:
            j = dict(pending.pop(0))
            if not auto:
                j["mode"] = j["ask"]
            else:
                j["mode"] = first_mode(
                    book if learn else UsageBook(1), j["cls"], cfg, DEFAULT_SLICES, CARD_MEM
                )[0]
            j.update(done=0.0, state=AutoState(), hist=[], paused=0.0)
            running[j["id"]] = j
        for j in list(running.values()):
            cap, _ = caps(j["mode"], DEFAULT_SLICES)
            want = min(100.0, max(0.0, j["demand"] + float(noise.normal(0, 1.5))))
            got = min(want, cap)
            if j["paused"] > 0:  # restarting after a move: no progress
                j["paused"] -= dt
                continue
            j["done"] += dt * (got / want if want > 0 else 1.0)  # held back at its cap: slower
            if want > cap * 1.0 + 1e-9:
                hot_time[j["id"]] = hot_time.get(j["id"], 0.0) + dt
            r = Reading(t, got, int(j["mem"]), cap, int(caps(j["mode"], DEFAULT_SLICES)[1] * CARD_MEM))
            j["hist"].append(r)
            j["hist"] = j["hist"][-cfg.history :]
            book.add(j["id"], j["cls"], r)
            if auto:
                d = decide(j["id"], j["mode"], True, j["hist"], j["state"], t, cfg, DEFAULT_SLICES, CARD_MEM)
                if d is not None and d.move:
                    j["mode"], j["hist"] = d.to, []
                    j["state"].moves += 1
                    j["state"].last_move_t, j["state"].last_direction = t, d.direction
                    j["paused"] = RESTART_S
                    lost += RESTART_S
                    moves += 1
            if j["done"] >= j["work"]:
                del running[j["id"]]
                book.end(j["id"])
        n = cards_used([j["mode"] for j in running.values()])
        used.append(n)
        peak = max(peak, n)
        t += dt
    throttled = sum(1 for j in jobs if hot_time.get(j["id"], 0.0) > 0.25 * j["work"])
    return {
        "card_hours": round(sum(used) * dt / 3600, 1),
        "peak_cards": peak,
        "mean_cards": round(float(np.mean(used)), 2),
        "jobs_throttled": throttled,
        "moves": moves,
        "job_hours_lost_to_moves": round(lost / 3600, 2),
        "makespan_h": round(t / 3600, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dt", type=float, default=30.0, help="sample period of the simulation (s)")
    ap.add_argument("--down-below", type=float, default=0.25, help="[auto] down_below")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    cfg = AutoSection(
        sample_s=a.dt, up_after_s=300, down_after_s=900, hold_s=1800, max_moves=4, down_below=a.down_below
    )
    jobs = mix(a.jobs, np.random.default_rng(a.seed))
    out = {
        "jobs": a.jobs,
        "seed": a.seed,
        "down_below": a.down_below,
        "fixed": simulate(jobs, False, cfg, np.random.default_rng(a.seed + 1), a.dt),
        "auto": simulate(jobs, True, cfg, np.random.default_rng(a.seed + 1), a.dt),
        "auto_no_class_history": simulate(jobs, True, cfg, np.random.default_rng(a.seed + 1), a.dt, False),
    }
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    assert math.isfinite(out["auto"]["card_hours"])


if __name__ == "__main__":
    main()
