"""API speed: lease grants per second through the socket, and the overhead `xpu run` adds to a command.

    .venv/bin/python bench/api.py [--machine pcie-8x-l40s] [--seconds 5] [--runs 20] [--json bench/api.json]

Starts a real simulated daemon on temp sockets, then
1. grant+release round trips (Acquire then Release, one client, sequential), per second and p50/p99 ms;
2. the same from 8 client threads at once;
3. `xpu run --mode vxpu-quarter -- true` against `true` run directly (median wall time of --runs runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import simdaemon

from xpud.api.client import Client


def round_trips(runtime: Path, seconds: float, threads: int) -> dict:
    lat: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker():
        mine = []
        with Client(runtime) as c:
            c.info()
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                g = c.acquire_lease("vxpu-quarter")
                c.release(g.lease.id, g.token)
                mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    lat.sort()
    return {
        "threads": threads,
        "grants": len(lat),
        "grants_per_s": round(len(lat) / wall, 1),
        "p50_ms": round(lat[len(lat) // 2] * 1e3, 2),
        "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 2),
    }


def run_overhead(runtime: Path, runs: int) -> dict:
    env = {"XPUD_RUNTIME_DIR": str(runtime), "PATH": "/usr/bin:/bin"}

    def median(cmd):
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    direct = median(["true"])
    wrapped = median([str(simdaemon.BIN / "xpu"), "run", "--mode", "vxpu-quarter", "--", "true"])
    return {
        "runs": runs,
        "direct_ms": round(direct * 1e3, 1),
        "xpu_run_ms": round(wrapped * 1e3, 1),
        "overhead_ms": round((wrapped - direct) * 1e3, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="pcie-8x-l40s")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="xpu-bench-", dir="/tmp"))
    daemon = simdaemon.start(args.machine, base, "[leases]\ngrace_s = 30.0\n")
    try:
        out = {
            "machine": args.machine,
            "sequential": round_trips(base / "run", args.seconds, 1),
            "parallel": round_trips(base / "run", args.seconds, 8),
            "xpu_run": run_overhead(base / "run", args.runs),
        }
    finally:
        simdaemon.stop(daemon)
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
