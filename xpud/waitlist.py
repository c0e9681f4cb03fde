"""Requests that did not fit yet: a priority queue, FIFO within a priority, with deadlines.

Adding or removing a waiter costs O(log n) (a sorted list). Waiters learn their position when they join
and then from a pusher that runs ``push_interval_s`` after a change (and then at most once per interval
while changes go on), telling a waiter only when its own position moved: cancelling thousands of waiters
costs each of the others at most one update per interval, not one per cancellation.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from sortedcontainers import SortedKeyList

from xpud.model import QueuedRequest, Request

PUSH_CHUNK = 256  # waiters told per loop iteration: other calls are served between chunks


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
    queued: bool = True  # False once removed
    reason: str = "Resources"  # why it waits (the engine's queue pass sets it)


def _order(w: Waiter) -> tuple[int, int]:
    return -w.request.priority, w.seq


class Waitlist:
    def __init__(self, push_interval_s: float = 1.0) -> None:
        self._waiters: SortedKeyList = SortedKeyList(key=_order)
        self._seq = itertools.count()
        self.push_interval_s = push_interval_s
        self._dirty = False
        self._pusher: asyncio.Task | None = None
        self._per_uid: dict[int, int] = {}  # owner uid -> waiters

    def __len__(self) -> int:
        return len(self._waiters)

    def count_of(self, uid: int) -> int:
        """Waiters of owner ``uid`` (O(1): [limits] checks it at every request)."""
        return self._per_uid.get(uid, 0)

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
        self._waiters.add(w)
        self._per_uid[request.owner_uid] = self._per_uid.get(request.owner_uid, 0) + 1
        if on_position:  # the newcomer hears its position at once; the others from the pusher
            self._tell(w, self._waiters.index(w) + 1, len(self._waiters))
        self._touch()
        return w

    def remove(self, w: Waiter) -> None:
        if w.queued:
            w.queued = False
            self._waiters.remove(w)
            uid = w.request.owner_uid
            if (n := self._per_uid[uid] - 1) > 0:
                self._per_uid[uid] = n
            else:
                del self._per_uid[uid]
            self._touch()

    def in_order(self) -> list[Waiter]:
        return list(self._waiters)

    def view(self) -> list[QueuedRequest]:
        return [
            QueuedRequest(w.ticket, w.request, pos, w.enqueued, w.deadline, w.reason)
            for pos, w in enumerate(self._waiters, 1)
        ]

    @staticmethod
    def _tell(w: Waiter, pos: int, length: int) -> None:
        w.last_position = pos
        w.on_position(QueuedRequest(w.ticket, w.request, pos, w.enqueued, w.deadline), length)

    def _touch(self) -> None:
        self._dirty = True
        if self._pusher is None or self._pusher.done():
            self._pusher = asyncio.get_running_loop().create_task(self._push())

    async def _push(self) -> None:
        """While positions change: rest an interval, then tell each waiter whose position moved.

        Resting first lets a burst (thousands of waiters leaving at once) end before anyone is told:
        the waiters that were leaving too are not sent positions they will never read.
        """
        while self._dirty:
            await asyncio.sleep(self.push_interval_s)
            self._dirty = False
            snapshot = list(self._waiters)
            n = len(snapshot)
            for pos, w in enumerate(snapshot, 1):
                if w.queued and w.on_position and pos != w.last_position:
                    self._tell(w, pos, n)
                if pos % PUSH_CHUNK == 0:
                    await asyncio.sleep(0)  # positions found meanwhile are corrected next round
