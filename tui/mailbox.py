"""Collapse a flood of stream updates into one UI refresh.

The stream's worker thread ``put``s every update; only the put that finds the box empty asks for a
doorbell message, so the UI thread receives at most one message per batch however fast updates come,
and ``take``s the whole batch. Nothing is dropped (sparklines and the event log need every update),
except beyond ``limit`` pending items when the UI has stopped reading, where the oldest go first.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    def __init__(self, limit: int = 1000):
        self._items: deque[T] = deque(maxlen=limit)
        self._lock = threading.Lock()
        self._rung = False
        self.dropped = 0

    def put(self, item: T) -> bool:
        """Add an item. True when the caller should ring the doorbell (no batch is awaiting pickup)."""
        with self._lock:
            if len(self._items) == self._items.maxlen:
                self.dropped += 1
            self._items.append(item)
            ring, self._rung = not self._rung, True
            return ring

    def take(self) -> list[T]:
        """Every pending item, oldest first; the next ``put`` rings again."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._rung = False
            return items
