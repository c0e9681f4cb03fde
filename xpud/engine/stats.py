"""Counters and latency histograms the daemon keeps for ``/metrics`` (``xpud.daemon.metrics``).

Updated on the daemon's asyncio loop only (the engine, the monitor, the burst check): plain integers and
lists, no locks. ``xpud.daemon.metrics`` copies them on the loop when it builds a scrape's snapshot, so the
HTTP
thread never reads them while they change.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# Upper bounds (seconds). Placement is pure code over one host's cards: microseconds to milliseconds.
# Grants include MIG/MPS reconfiguration (up to seconds); queue waits run to hours.
DECISION_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)
GRANT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WAIT_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0)


@dataclass
class Histogram:
    """Cumulative-on-read histogram: ``counts[i]`` observations fell in ``(bounds[i-1], bounds[i]]``;
    the last count is above every bound (+Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count) pairs as Prometheus writes them, +Inf last."""
        out, running = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class Stats:
    """What happened since the daemon started: events by kind, XIDs, conversions, and three latencies."""

    events: Counter = field(default_factory=Counter)  # engine event kind -> count
    xids: Counter = field(default_factory=Counter)  # XID -> count (card faults, not application XIDs)
    app_xids: int = 0
    moves: Counter = field(default_factory=Counter)  # started (a reservation made), done, abandoned
    conversions: Counter = field(default_factory=Counter)  # (to mode, reason kind) -> count
    decision: Histogram = field(default_factory=lambda: Histogram(DECISION_BUCKETS))
    grant: Histogram = field(default_factory=lambda: Histogram(GRANT_BUCKETS))
    queue_wait: Histogram = field(default_factory=lambda: Histogram(WAIT_BUCKETS))
