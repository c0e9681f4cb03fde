"""Health polling cost: the daemon's CPU while it polls eight cards at 1 Hz.

Two measurements on simulated hardware (``xpud --simulate dgx-h100``: 8 cards, NVLink, ECC, row
remapping, so every signal is read):

1. **Daemon process**: a real daemon with ``[health] poll_interval_s = 1.0``, idle otherwise (no leases;
   the event thread waits, the lease reaper runs at 4 Hz as always). After a warm-up, the process's CPU
   time (user + system, all threads, psutil) over ``--seconds`` divided by the wall time, as a share of
   one core. The same with polling effectively off (``poll_interval_s = 3600``) gives the baseline, so
   the difference is what polling costs. A check that polls really happened: every card's last sample
   must be under two intervals old at the end.
2. **One sweep in process**: the CPU time of one poll of 8 cards (adapter ``sample`` of each card over
   the fake, then ``HealthMonitor.on_samples``: judging, scoring, the engine update), averaged over many.

The fake answers NVML calls from Python, so the adapter's part includes the fake's own cost; on real
hardware each of the ~19 calls per card is a driver call instead (not measured here).

    python bench/health_poll.py [--seconds 60] [--machine dgx-h100] [--json bench/health_poll.json]

On a GPU host, ``--real`` measures the in-process sweep over the real driver instead (read-only: the
adapter's ``sample`` and the monitor's judging; no daemon is started, nothing on the cards is changed);
``scripts/device-check.sh`` runs it. ``--sweep-only`` skips the two daemon measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import simdaemon

from xpud.api.client import Client
from xpud.config.schema import Config
from xpud.controllers.health import HealthMonitor
from xpud.engine.engine import Engine
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.ledger.ledger import Ledger

WARMUP_S = 5.0


def daemon_cpu(machine: str, interval: float, seconds: float) -> dict:
    base = Path(tempfile.mkdtemp(prefix="xpu-bench-", dir="/tmp"))
    runtime = base / "run"
    proc = simdaemon.start(machine, base, f"[health]\npoll_interval_s = {interval}\n")
    try:
        time.sleep(WARMUP_S)
        p = psutil.Process(proc.pid)
        c0, t0 = p.cpu_times(), time.monotonic()
        time.sleep(seconds)
        c1, t1 = p.cpu_times(), time.monotonic()
        with Client(runtime) as c:
            ages = [time.time() - card.sample.timestamp for card in c.cards().cards]
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        return {
            "poll_interval_s": interval,
            "seconds": round(t1 - t0, 2),
            "cpu_s": round(cpu, 3),
            "pct_of_one_core": round(100 * cpu / (t1 - t0), 3),
            "oldest_sample_age_s": round(max(ages), 2),
            "rss_mib": round(p.memory_info().rss / (1 << 20), 1),
        }
    finally:
        simdaemon.stop(proc)
        shutil.rmtree(base, ignore_errors=True)


def sweep_cost(machine: str | None, sweeps: int = 300) -> dict:
    """CPU per poll of every card, in process; ``machine`` None: the real driver (pynvml)."""
    base = Path(tempfile.mkdtemp(prefix="xpu-bench-", dir="/tmp"))
    try:
        hw = Nvml(FakeNvml(machine)) if machine else Nvml()
        hw.open()
        engine = Engine(hw.cards(), hw.topology(), Config(), Ledger(base / "l.sqlite"))
        monitor = HealthMonitor(engine, hw, engine.cfg)
        indices = sorted(engine.cards)

        for _ in range(20):
            monitor.on_samples({i: hw.sample(i) for i in indices})
        t = time.process_time()
        sweeps_read = [{i: hw.sample(i) for i in indices} for _ in range(sweeps)]
        hw_t = time.process_time() - t
        t = time.process_time()
        for samples in sweeps_read:
            monitor.on_samples(samples)
        judge_t = time.process_time() - t
        hw.close()
        return {
            "driver": "real NVML" if machine is None else f"fake ({machine})",
            "cards": len(indices),
            "sweep_ms": round(1000 * (hw_t + judge_t) / sweeps, 3),
            "adapter_ms": round(1000 * hw_t / sweeps, 3),
            "judge_ms": round(1000 * judge_t / sweeps, 3),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--machine", default="dgx-h100")
    ap.add_argument("--json", default="bench/health_poll.json")
    ap.add_argument("--real", action="store_true", help="sweep over the real driver (implies --sweep-only)")
    ap.add_argument("--sweep-only", action="store_true", help="skip the daemon measurements")
    ap.add_argument("--sweeps", type=int, default=300)
    args = ap.parse_args()
    if not 1 <= args.sweeps <= 100_000:
        raise SystemExit("--sweeps: use 1 to 100000")
    sweep = sweep_cost(None if args.real else args.machine, args.sweeps)
    print(
        f"one sweep of {sweep['cards']} cards: {sweep['sweep_ms']:.2f} ms CPU "
        f"(adapter over {sweep['driver']} {sweep['adapter_ms']:.2f}, judging {sweep['judge_ms']:.2f})",
        flush=True,
    )
    if args.real or args.sweep_only:
        at_1hz = round(sweep["sweep_ms"] / 10, 3)  # ms per s -> % of one core
        print(f"polling at 1 Hz: about {at_1hz:.2f} % of one core (sweep only)")
        out = {"sweep": sweep, "polling_1hz_pct_of_one_core_estimate": at_1hz, "cpu_count": os.cpu_count()}
        out["command"] = "python bench/health_poll.py " + (
            "--real" if args.real else f"--machine {args.machine}"
        )
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return
    polling = daemon_cpu(args.machine, 1.0, args.seconds)
    print(f"daemon polling at 1 Hz: {polling['pct_of_one_core']:.2f} % of one core", flush=True)
    baseline = daemon_cpu(args.machine, 3600.0, args.seconds)
    print(f"daemon without polling: {baseline['pct_of_one_core']:.2f} % of one core", flush=True)
    cost = round(polling["pct_of_one_core"] - baseline["pct_of_one_core"], 3)
    print(f"polling 8 cards at 1 Hz costs {cost:.2f} % of one core (target < 2 %)")
    out = {
        "machine": args.machine,
        "sweep": sweep,
        "polling_1hz": polling,
        "baseline_no_polling": baseline,
        "polling_cost_pct_of_one_core": cost,
        "target_pct": 2.0,
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "command": f"python bench/health_poll.py --seconds {args.seconds:g} --machine {args.machine}",
    }
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
