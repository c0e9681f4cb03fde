"""Burst conversion: how long slice requests that arrive at once wait for idle whole cards to become sliced.

    .venv/bin/python bench/bursts.py --out bench/bursts.json

On each machine (dgx-h100: MIG; pcie-8x-l40s: MPS) a real simulated daemon starts with every card whole.
Card 0 is filled with slices first (two vxpu-half), so it has no room left; then ``--burst`` vxpu-half
requests (``--wait 60``, one client thread each) are sent at the same instant. Measured from the send:
the first grant on a card that was whole (conversion time), and the last grant. Every figure is the median
of ``--reps`` runs, each on a fresh daemon. The simulated driver switches MIG and starts MPS at once, so this
is the daemon's own delay (queueing, busy-card waits, the ledger); a real MIG mode switch adds the driver's
time (seconds, REFERENCE.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import simdaemon

from xpud.api.client import Client

MACHINES = {"mig": "dgx-h100", "mps": "pcie-8x-l40s"}


def one_run(machine: str, burst: int, config: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="xpub-", dir="/tmp") as tmp:
        base = Path(tmp)
        proc = simdaemon.start(machine, base, "[leases]\ngrace_s = 120.0\n" + config)
        try:
            runtime = base / "run"
            holder = Client(runtime)
            for _ in range(2):
                holder.acquire_lease("vxpu-half")
            sliced_before = {c.index for c in holder.cards().cards if c.mode == "sliced"}  # card 0, full
            clients = [Client(runtime) for _ in range(burst)]
            for c in clients:
                c.info()  # connected and authenticated before the clock starts
            grants: list[tuple[float, int]] = []
            lock = threading.Lock()
            start = threading.Barrier(burst + 1)

            def ask(c: Client) -> None:
                start.wait()
                g = c.acquire_lease("vxpu-half", wait_s=60.0)
                with lock:
                    grants.append((time.monotonic(), g.lease.cards[0]))

            threads = [threading.Thread(target=ask, args=(c,)) for c in clients]
            for t in threads:
                t.start()
            start.wait()
            t0 = time.monotonic()
            for t in threads:
                t.join(90)
            converted = [t - t0 for t, card in grants if card not in sliced_before]
            return {
                "first_on_converted_s": round(min(converted), 4),
                "all_granted_s": round(max(t for t, _ in grants) - t0, 4),
                "granted": len(grants),
                "cards_converted": len({card for _, card in grants} - sliced_before),
            }
        finally:
            simdaemon.stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=8, help="slice requests sent at once (vxpu-half)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--config", default="", help="extra xpud.toml text for the daemon")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {"burst": args.burst, "reps": args.reps, "config": args.config, "isolation": {}}
    for isolation, machine in MACHINES.items():
        runs = [one_run(machine, args.burst, args.config) for _ in range(args.reps)]
        summary = {
            k: statistics.median(r[k] for r in runs) for k in ("first_on_converted_s", "all_granted_s")
        }
        result["isolation"][isolation] = {"machine": machine, "median": summary, "runs": runs}
        print(f"{isolation} ({machine}): {summary}", file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
