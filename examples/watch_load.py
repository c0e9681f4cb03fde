"""The same load over the Node API (WatchLease) instead of the file: a thread keeps the newest."""

import os
import threading

from xpud.api.client import Client

RUN = os.environ.get("XPUD_RUNTIME_DIR", "/run/xpud")
latest = {}  # what adaptive_batch.load() returns, kept up to date


def follow(lease_id=None):
    with Client(RUN) as c:
        for m in c.iterate(c.watch_lease(lease_id or os.environ["XPU_LEASE_ID"])):
            latest.update(
                throttled=m.throttled,
                used_pct=None if m.used_pct < 0 else m.used_pct,  # -1: not measured yet
                cap_pct=None if m.cap_pct < 0 else m.cap_pct,
                waiting_for_size=m.waiting_for_size,
            )


def start():
    threading.Thread(target=follow, daemon=True).start()  # then next_batch(batch, latest)
