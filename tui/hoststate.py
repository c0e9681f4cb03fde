"""What the dashboard knows about one host, folded from the daemon's Watch stream.

Each ``WatchUpdate`` carries a full snapshot (cards with their last sample, leases, queue) plus the
events since the previous one. The snapshot replaces the previous one; samples are appended to a short
per-card history (for sparklines; the daemon keeps none), and events to a bounded log. No Textual here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from xpud.api.v1 import xpu_pb2 as pb

HISTORY_POINTS = 120  # per card: ten minutes at the daemon's 5 s sampling
EVENT_LOG_SIZE = 2000


@dataclass
class CardHistory:
    """Recent samples of one card, oldest first, for sparklines (percent 0..100)."""

    utilization_pct: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    memory_pct: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    power_pct: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))  # of the limit
    last_timestamp: float = 0.0

    def add(self, sample: pb.Sample) -> None:
        # The daemon samples every few seconds but Watch repeats the last sample every update:
        # only a new timestamp is a new point.
        if sample.timestamp <= self.last_timestamp or sample.lost:
            return
        self.last_timestamp = sample.timestamp
        if sample.HasField("utilization_gpu_pct"):
            self.utilization_pct.append(float(sample.utilization_gpu_pct))
        if sample.HasField("memory_used_bytes") and sample.memory_total_bytes:
            self.memory_pct.append(100.0 * sample.memory_used_bytes / sample.memory_total_bytes)
        if sample.HasField("power_w") and sample.power_limit_w:
            self.power_pct.append(100.0 * sample.power_w / sample.power_limit_w)


def event_key(e: pb.Event) -> tuple:
    return (e.timestamp, e.kind, e.card, e.lease_id, e.message)


class HostState:
    def __init__(self) -> None:
        self.hostname = ""
        self.cards: list[pb.Card] = []
        self.leases: list[pb.Lease] = []
        self.queue: list[pb.QueueEntry] = []
        self.events: deque[pb.Event] = deque(maxlen=EVENT_LOG_SIZE)
        self.history: dict[str, CardHistory] = {}  # card UUID -> history
        self.updates = 0  # updates applied so far
        self._seen: deque[tuple] = deque(maxlen=EVENT_LOG_SIZE)
        self._seen_set: set[tuple] = set()

    def apply(self, update: pb.WatchUpdate) -> list[pb.Event]:
        """Fold one update in. Returns the events it added (repeats after a reconnect are skipped)."""
        self.updates += 1
        self.hostname = update.cards.hostname or self.hostname
        self.cards = sorted(update.cards.cards, key=lambda c: c.index)
        self.leases = sorted(update.leases.leases, key=lambda le: (le.created, le.id))
        self.queue = sorted(update.leases.queue, key=lambda q: q.position)
        for card in self.cards:
            if card.HasField("sample"):
                self.history.setdefault(card.uuid, CardHistory()).add(card.sample)
        added = []
        for e in update.events:
            key = event_key(e)
            if key in self._seen_set:
                continue  # the first update after a reconnect repeats recent history
            if len(self._seen) == self._seen.maxlen:
                self._seen_set.discard(self._seen[0])
            self._seen.append(key)
            self._seen_set.add(key)
            self.events.append(e)
            added.append(e)
        return added

    def card(self, index: int) -> pb.Card | None:
        return next((c for c in self.cards if c.index == index), None)

    def lease(self, lease_id: str) -> pb.Lease | None:
        return next((le for le in self.leases if le.id == lease_id), None)

    def history_of(self, card: pb.Card) -> CardHistory:
        return self.history.get(card.uuid) or CardHistory()
