"""Adapt a server's batch size to its lease's live load (docs/rightsizing.md)."""

import json
import os
import time

RUN = os.environ.get("XPUD_RUNTIME_DIR", "/run/xpud")
LOAD = os.path.join(RUN, "load", os.environ["XPU_LEASE_ID"] + ".json")


def load():
    try:
        with open(LOAD) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}  # not measured yet: keep going


def next_batch(batch, got, lo=1, hi=256):
    if got.get("throttled"):  # at the slice's compute cap: smaller batches keep latency
        return max(lo, batch // 2)
    if (got.get("used_pct") or 0) < 0.5 * (got.get("cap_pct") or 100):
        return min(hi, batch * 2)  # room left under the cap: batch more
    return batch


def serve(queue, run_batch, batch=8):
    while True:
        batch = next_batch(batch, load())
        run_batch([queue.get() for _ in range(min(batch, max(1, queue.qsize())))])
        time.sleep(0.01)
