"""Multi-host placement decision latency on the openb cluster (1,213 GPU hosts) seen as a federation view.

Each openb host becomes a ``HostOffer``: racks (domains) of 16 hosts in file order, blocks of 8 racks,
zones of 4 blocks; a seeded share of its cards busy; per group size the best group's bus bandwidth from
its card model (NVLink boards ~300 GB/s, PCIe boards 25 GB/s within a switch and 12 GB/s beyond). Then
``--decisions`` gang requests (N hosts x G cards, N in 2,4,8,16 and G in 1,2,4,8) are timed.

    .venv/bin/python bench/multihost.py --out bench/multihost.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xpud.placement.multihost import HostOffer, NoPlacement, place_gang
from xpud.sim.trace import DEFAULT_CLUSTER, default_path, load_cluster

NVLINK_MODELS = ("V100M16", "V100M32", "A100", "H100", "G3")


def offers(seed: int, busy: float) -> list[HostOffer]:
    rng = random.Random(seed)
    out = []
    for i, h in enumerate(load_cluster(default_path(DEFAULT_CLUSTER))):
        free = sum(rng.random() >= busy for _ in range(h.cards))
        nvlink = any(h.model.startswith(m) for m in NVLINK_MODELS)
        gbps = [float("inf")] + [300.0 if nvlink else (25.0 if k <= 2 else 12.0) for k in range(2, 9)]
        out.append(
            HostOffer(
                h.name,
                free,
                tuple(gbps[: max(h.cards, 1)]),
                rng.choice((100, 100, 100, 90, 60)),
                domain=f"r{i // 16}",
                block=f"b{i // 128}",
                zone=f"z{i // 512}",
                queue=rng.randrange(3),
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=4000)
    ap.add_argument("--busy", type=float, default=0.5, help="share of cards busy")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    view = offers(a.seed, a.busy)
    rng = random.Random(a.seed)
    times, cpu, levels, refused = [], [], {}, 0
    for _ in range(a.decisions):
        n, g = rng.choice((2, 4, 8, 16)), rng.choice((1, 2, 4, 8))
        t, c = time.perf_counter(), time.process_time()
        try:
            got = place_gang(view, n, g)
            levels[got.level] = levels.get(got.level, 0) + 1
        except NoPlacement:
            refused += 1
        times.append((time.perf_counter() - t) * 1000)
        cpu.append((time.process_time() - c) * 1000)
    times.sort()
    cpu.sort()
    row = {
        "hosts": len(view),
        "decisions": a.decisions,
        "busy": a.busy,
        "p50_ms": round(statistics.median(times), 3),
        "p99_ms": round(times[int(len(times) * 0.99) - 1], 3),
        "max_ms": round(times[-1], 3),
        "cpu_p50_ms": round(statistics.median(cpu), 3),  # CPU time: what a busy machine does not inflate
        "cpu_p99_ms": round(cpu[int(len(cpu) * 0.99) - 1], 3),
        "levels": levels,
        "refused": refused,
    }
    print(json.dumps(row))
    if a.out:
        a.out.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
