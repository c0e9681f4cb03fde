"""``Room``: news that more capacity may be free, for the coordinator's queued multi-host jobs.

A sequence number and its waiters. Whoever sees more room (the federation when a host's summary offers
more, this host's engine when nothing federates) calls ``notify``; a queued job reads ``seq`` before it
plans and, when the plan fails, ``wait``s for a number past it, so news that arrives while it plans is
never missed. ``wait`` gives up after its time-out (the caller's bounded fallback). Waiters wake in the
order they began to wait.
"""

from __future__ import annotations

import asyncio
import contextlib


class Room:
    def __init__(self) -> None:
        self.seq = 0
        self._waiters: dict[asyncio.Future, None] = {}  # in the order they began to wait

    def notify(self) -> None:
        self.seq += 1
        waiters, self._waiters = self._waiters, {}
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def wait(self, seen: int, timeout_s: float) -> bool:
        """Until ``seq`` passes ``seen`` (True at once if it has), or ``timeout_s`` (False)."""
        if self.seq != seen:
            return True
        f = asyncio.get_running_loop().create_future()
        self._waiters[f] = None
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(f, max(timeout_s, 0.0))
        finally:
            self._waiters.pop(f, None)
            f.cancel()
        return self.seq != seen
