"""What the engine tells: each lease's Hold streams (``LeaseEvent``: held, move, resize, revoke, mark,
released), the Watch streams (a change, with its event if any), and the event log.

Invariant: an event that reports a change is committed with it (``_event_op`` then ``_committed``), or
queued right after (``event``); nobody is told before the change is committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from xpud.engine.stats import Stats
from xpud.ledger.ledger import EventRecord, Ledger, Op
from xpud.model import Lease

log = logging.getLogger("xpud.engine.engine")  # one logger for the engine's parts: its lines keep their name


@dataclass(frozen=True)
class LeaseEvent:
    kind: str  # "held", "move", "revoke", "mark", "released"
    lease: Lease
    message: str = ""
    timestamp: float = 0.0


class Streams:
    """Hold and Watch fan-out and the event log (a part of ``Engine``)."""

    ledger: Ledger
    clock: Callable[[], float]
    leases: dict[str, Lease]
    hold_count: dict[str, int]  # lease id -> open Hold streams
    unheld_since: dict[str, float]
    restored_unheld: set[str]
    stats: Stats
    _lease_streams: dict[str, set[asyncio.Queue]]
    _watchers: set[asyncio.Queue]

    def hold_opened(self, lease_id: str) -> asyncio.Queue:
        self.hold_count[lease_id] = self.hold_count.get(lease_id, 0) + 1
        self.unheld_since.pop(lease_id, None)
        self.restored_unheld.discard(lease_id)
        q: asyncio.Queue = asyncio.Queue()
        self._lease_streams.setdefault(lease_id, set()).add(q)
        self._changed()
        return q

    def hold_closed(self, lease_id: str, q: asyncio.Queue) -> None:
        self._lease_streams.get(lease_id, set()).discard(q)
        n = self.hold_count.get(lease_id, 1) - 1
        if n > 0:
            self.hold_count[lease_id] = n
            return
        self.hold_count.pop(lease_id, None)
        if lease_id in self.leases and not self.leases[lease_id].anchor:
            self.unheld_since[lease_id] = self.clock()
        self._changed()

    def notify_holder(self, lease: Lease, kind: str, message: str) -> None:
        """Tell ``lease``'s Hold streams (``kind``: held, move, resize, revoke, mark, released)."""
        streams = self._lease_streams.get(lease.id)
        if streams:  # (no Hold stream open, as for most releases: no event to make)
            ev = LeaseEvent(kind, lease, message, self.clock())
            for q in streams:
                q.put_nowait(ev)
        if kind == "released":
            self._lease_streams.pop(lease.id, None)

    def mark(self, lease_id: str, text: str) -> Lease | None:
        """Mark a lease for its holder's attention and tell the holder (a ``mark`` event); no-op if same.
        The mark is a note, not a change of placement: its ledger write is queued, not awaited."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.mark == text:
            return lease
        lease = replace(lease, mark=text)
        self.leases[lease_id] = lease
        self.ledger.submit(self.ledger.set_mark_op(lease_id, text))
        self.notify_holder(lease, "mark", text)
        self.event(
            "mark",
            f"lease {lease_id}: {text}",
            card=lease.cards[0] if len(lease.cards) == 1 else -1,
            lease_id=lease_id,
        )
        return lease

    async def reanchor(self, lease_id: str, anchor: str, also: Iterable[Op] = ()) -> Lease:
        """Give an active lease a new owner that holds it without a Hold stream (``anchor``, e.g.
        ``job:<id>``: a multi-host job's rank handed to this host's detached jobs). ``also``: ledger
        writes committed in the same transaction. Raises KeyError for a lease that is not active."""
        self.leases[lease_id]  # KeyError: not active
        await self.ledger.write(self.ledger.set_anchor_op(lease_id, anchor), *also)
        lease = self.leases[lease_id] = replace(self.leases[lease_id], anchor=anchor)
        self.unheld_since.pop(lease_id, None)
        self.restored_unheld.discard(lease_id)
        return lease

    def watch(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._watchers.add(q)
        return q

    def unwatch(self, q: asyncio.Queue) -> None:
        self._watchers.discard(q)

    def _changed(self, event: EventRecord | None = None) -> None:
        for q in self._watchers:
            q.put_nowait(event)

    def event(self, kind: str, message: str, card: int = -1, lease_id: str = "") -> EventRecord:
        log.info("%s", message)
        self.stats.events[kind] += 1
        ev = self.ledger.add_event(kind, message, card, lease_id, self.clock())
        self._changed(ev)
        return ev

    def _event_op(self, kind: str, message: str, card: int, lease_id: str = "") -> tuple[EventRecord, Op]:
        """An event to commit in the same write as the change it reports (then ``_committed``)."""
        return self.ledger.event_op(kind, message, card, lease_id, self.clock())

    def _committed(self, events: Iterable[tuple[EventRecord, Op]]) -> None:
        """Events committed with their change: logged and shown to watchers, as ``event`` does."""
        for ev, _ in events:
            log.info("%s", ev.message)
            self.stats.events[ev.kind] += 1
            self._changed(ev)
