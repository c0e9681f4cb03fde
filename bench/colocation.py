"""Co-location on MPS cards: job slowdown with and without xpud's tie-breaker (issue 16 item 4).

Placement is the daemon's own: a real ``Engine`` (8 cards, MPS-named accounting backend, SQLite ledger in
a temp directory) with a ``Rightsizer`` whose usage book the simulation feeds (the readings a poll would
take), so ``choose_slice_card`` and ``Rightsizer.colocation`` decide exactly as in the daemon. What the
daemon cannot know is what co-location does to the jobs: that is a model, stated here and in
``bench/rightsizing.md``.

Contention model (an assumption, not a measurement). MPS gives each client its active-thread percentage
of the SMs, but memory bandwidth (and the L2, the power budget) stay shared. A job with profile
``(s, b)`` (SM %, memory-controller % of the card, what it uses alone) spends ``s / (s + b)`` of its time
in compute phases and ``b / (s + b)`` in memory phases. On a card whose jobs together ask ``L_b`` % of
the memory controller, a memory phase takes ``max(1, L_b / 100)`` times longer; compute phases take
``max(1, L_s / sm_capacity)`` times longer, where ``L_s`` is the card's total SM use and ``sm_capacity``
the SM load the card sustains at full clock (100: compute never contends under MPS's partition;
``--sm-capacity 40``: compute-heavy neighbours also slow each other, e.g. through the power limit).
A job's slowdown is the time-weighted sum; its progress per step is ``dt / slowdown``.

    .venv/bin/python bench/colocation.py [--jobs 600] [--seed 1] [--sm-capacity 100] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from xpud.config.schema import Config
from xpud.controllers.rightsizer import Rightsizer
from xpud.engine.engine import Engine
from xpud.isolation.base import Accounting
from xpud.ledger.ledger import Ledger
from xpud.model import Caller, CardInfo, Mode, Request
from xpud.planning.sizing import caps
from xpud.planning.usage import Reading
from xpud.topology import NODE, SINGLE, SYSTEM, Topology

GIB = 1 << 30
CARDS = 8
# (SM %, memory-controller %) of the card each class uses alone on a quarter slice (a half: twice that)
CLASSES = {"gemm": (14.0, 8.0), "stream": (8.0, 45.0), "mixed": (11.0, 22.0)}
SHARE = {"gemm": 0.4, "stream": 0.4, "mixed": 0.2}


class MpsShares(Accounting):
    """MPS as placement sees it (free-size shares) without the control tool: the bench's stand-in."""

    name = "mps"


def topology() -> Topology:
    def level(i, j):
        return SINGLE if i // 2 == j // 2 else NODE if i // 4 == j // 4 else SYSTEM

    return Topology(
        levels=tuple(tuple(0 if i == j else level(i, j) for j in range(CARDS)) for i in range(CARDS))
    )


def workload(n: int, rng, load: float) -> list[dict]:
    """``n`` slice jobs, Poisson arrivals sized so that ``load`` of the cards' quarter slots is busy on
    average; work exponential, mean 1 h; 80 % quarter slices, 20 % halves."""
    mean_work, slots = 3600.0, CARDS * 4
    rate = load * slots / (mean_work * 1.2)  # a half takes two slots: 1.2 slots per job on average
    t, jobs = 0.0, []
    for i in range(n):
        t += float(rng.exponential(1 / rate))
        cls = str(rng.choice(list(SHARE), p=list(SHARE.values())))
        mode = "vxpu-half" if rng.random() < 0.2 else "vxpu-quarter"
        k = 2.0 if mode == "vxpu-half" else 1.0
        s, b = CLASSES[cls]
        jobs.append(
            dict(id=i, cls=cls, mode=mode, s=s * k, b=b * k, start=t, work=float(rng.exponential(mean_work)))
        )
    return jobs


def slowdowns(on_card: list[dict], sm_capacity: float) -> list[float]:
    ls, lb = sum(j["s"] for j in on_card), sum(j["b"] for j in on_card)
    os_, ob = max(1.0, ls / sm_capacity), max(1.0, lb / 100.0)
    return [(j["s"] * os_ + j["b"] * ob) / (j["s"] + j["b"]) for j in on_card]


def simulate(jobs: list[dict], colocate: bool, sm_capacity: float, dt: float, rng) -> dict:
    clock = [0.0]
    with tempfile.TemporaryDirectory() as tmp:
        cards = [CardInfo(i, f"GPU-{i:04d}", "Fake", 48 * GIB, f"0000:{i:02x}:00.0") for i in range(CARDS)]
        cfg = Config()
        e = Engine(
            cards, topology(), cfg, Ledger(Path(tmp) / "l.sqlite"), lambda c: MpsShares(), lambda: clock[0]
        )
        rs = Rightsizer(e, None)
        e.rightsizer = rs if colocate else None
        loop = asyncio.new_event_loop()
        pending, running, done = list(jobs), {}, []
        changed = grants = 0
        while pending or running:
            t = clock[0]
            while pending and pending[0]["start"] <= t:
                j = pending[0]
                req = Request(Mode(j["mode"]), owner_uid=1000, job_class=j["cls"], command=j["cls"])
                if colocate:  # how often the tie-breaker changed the card
                    e.rightsizer = None
                    plain = e._fit(req)
                    e.rightsizer = rs
                got = loop.run_until_complete(e.try_grant(req))
                if got is None:
                    break  # no room: it waits (FIFO) for a release
                pending.pop(0)
                lease = got[0]
                if colocate:
                    grants += 1
                    changed += plain != lease.cards
                    rs.track(lease.id, j["cls"], False)
                running[lease.id] = dict(j, card=lease.cards[0], done=0.0, elapsed=0.0)
            by_card: dict[int, list[dict]] = {}
            for j in running.values():
                by_card.setdefault(j["card"], []).append(j)
            for card_jobs in by_card.values():
                for j, slow in zip(card_jobs, slowdowns(card_jobs, sm_capacity), strict=True):
                    step = min(dt / slow, j["work"] - j["done"])  # the last step: only what is left
                    j["done"] += step
                    j["elapsed"] += step * slow
            for lid, j in list(running.items()):
                cap, memf = caps(j["mode"], cfg.slices)
                noise = rng.normal(0, 1.0, 2)
                r = Reading(
                    t,
                    max(0.0, j["s"] + noise[0]),
                    GIB,
                    cap,
                    int(memf * 48 * GIB),
                    max(0.0, j["b"] + noise[1]),
                )
                rs.book.add(lid, j["cls"], r)
                if j["done"] >= j["work"] - 1e-9:
                    loop.run_until_complete(e.release(lid, Caller(uid=0, admin=True)))
                    rs.ended(lid)
                    del running[lid]
                    done.append(dict(cls=j["cls"], slowdown=j["elapsed"] / j["work"] if j["work"] else 1.0))
            clock[0] = t + dt
        loop.close()
        e.ledger.close()
    sl = sorted(d["slowdown"] for d in done)
    out = {
        "jobs": len(done),
        "mean_slowdown": round(statistics.fmean(sl), 4),
        "p95_slowdown": round(sl[int(0.95 * (len(sl) - 1))], 4),
        "share_slowed_over_10pct": round(sum(s > 1.1 for s in sl) / len(sl), 4),
        "per_class_mean": {
            c: round(statistics.fmean(d["slowdown"] for d in done if d["cls"] == c), 4) for c in CLASSES
        },
    }
    if colocate:
        out["grants_moved_by_tie_break"] = changed
        out["grants"] = grants
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=0.7, help="mean share of the cards' quarter slots busy")
    ap.add_argument("--sm-capacity", type=float, default=100.0)
    ap.add_argument("--dt", type=float, default=60.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    jobs = workload(a.jobs, np.random.default_rng(a.seed), a.load)
    out = {
        "jobs": a.jobs,
        "seed": a.seed,
        "load": a.load,
        "sm_capacity": a.sm_capacity,
        "without": simulate(jobs, False, a.sm_capacity, a.dt, np.random.default_rng(a.seed + 1)),
        "with_colocation": simulate(jobs, True, a.sm_capacity, a.dt, np.random.default_rng(a.seed + 1)),
    }
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
