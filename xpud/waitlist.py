"""Requests that did not fit yet: a priority queue, FIFO within a priority, with deadlines."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from xpud.model import QueuedRequest, Request


@dataclass(eq=False)
class Waiter:
    ticket: str
    request: Request
    seq: int
    enqueued: float
    deadline: float
    future: asyncio.Future
    on_position: Callable[[QueuedRequest, int], None] | None = None  # (entry, queue length)
    last_position: int = field(default=0)


class Waitlist:
    def __init__(self) -> None:
        self._waiters: list[Waiter] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def add(self, request: Request, now: float, on_position=None) -> Waiter:
        w = Waiter(
            secrets.token_hex(4),
            request,
            next(self._seq),
            now,
            now + request.wait_s,
            asyncio.get_running_loop().create_future(),
            on_position,
        )
        self._waiters.append(w)
        self._sort()
        self.notify_positions()
        return w

    def _sort(self) -> None:
        self._waiters.sort(key=lambda w: (-w.request.priority, w.seq))

    def remove(self, w: Waiter) -> None:
        if w in self._waiters:
            self._waiters.remove(w)
            self.notify_positions()

    def in_order(self) -> list[Waiter]:
        return list(self._waiters)

    def expired(self, now: float) -> list[Waiter]:
        return [w for w in self._waiters if w.deadline <= now]

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self._waiters), default=None)

    def notify_positions(self) -> None:
        n = len(self._waiters)
        for pos, w in enumerate(self._waiters, 1):
            if w.on_position and pos != w.last_position:
                w.last_position = pos
                w.on_position(QueuedRequest(w.ticket, w.request, pos, w.enqueued, w.deadline), n)

    def view(self) -> list[QueuedRequest]:
        return [
            QueuedRequest(w.ticket, w.request, pos, w.enqueued, w.deadline)
            for pos, w in enumerate(self._waiters, 1)
        ]
