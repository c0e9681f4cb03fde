"""Requests that did not fit yet: a priority queue, FIFO within a priority, with deadlines.

Adding or removing a waiter costs O(1) (O(priorities in use), a handful): one insertion-ordered queue
per priority (an ``OrderedDict``: its first entries are found in O(1) however many left before them).
Waiters learn their position when they join and then from a pusher that runs once a ``push_interval_s``
has passed without a change (while changes go on slowly: every ``PUSH_MAX_REST`` intervals), telling a
waiter only when its own position moved: cancelling thousands of waiters costs each of the others at most
one update per interval, not one per cancellation, and the leavers are not sent positions while they
leave (each update is a message on their stream). During a burst (``PUSH_BURST`` changes or more in an
interval: thousands of waiters leaving) nobody is told until it ends (at most ``PUSH_MAX_REST_BURST``
intervals), and a push stops when such a burst starts under it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from xpud.model import Mode, QueuedRequest, Request

PUSH_CHUNK = 256  # waiters told per loop iteration: other calls are served between chunks
PUSH_MAX_REST = 3  # intervals the pusher waits at most for slow changes to end
PUSH_BURST = 256  # changes in one interval that make a burst: positions are not told while it lasts
PUSH_MAX_REST_BURST = 30  # intervals the pusher waits at most for a burst to end


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
    deferred: bool = False  # before its not_before: holds no room back from others (``activate``)
    timer: asyncio.TimerHandle | None = None  # its deadline (the engine's)
    start: asyncio.TimerHandle | None = None  # a deferred one's start (the engine's ``_start_deferred``)


def kind_of(request: Request) -> tuple:
    """What placement (and the account's limit) looks at in a request: two waiters of one kind fit, or
    not, alike."""
    return request.mode, request.gpus, request.owner_uid, request.account


def _count(counts: dict, key, delta: int) -> None:
    if n := counts.get(key, 0) + delta:
        counts[key] = n
    else:
        del counts[key]


class Waitlist:
    def __init__(self, push_interval_s: float = 1.0) -> None:
        self._queues: dict[int, OrderedDict[Waiter, None]] = {}  # priority -> its waiters, FIFO
        self._order: list[int] = []  # the priorities in _queues, negated (ascending: highest first)
        self._len = 0
        self._seq = itertools.count()
        self.push_interval_s = push_interval_s
        self._dirty = False
        self._changes = 0  # adds and removals so far
        self._pusher: asyncio.Task | None = None
        self._per_uid: dict[int, int] = {}  # owner uid -> waiters
        self._kinds: dict[tuple, int] = {}  # kind_of(request) -> waiters
        self._whole_priorities: dict[int, int] = {}  # priority -> whole-card waiters

    def __len__(self) -> int:
        return self._len

    def count_of(self, uid: int) -> int:
        """Waiters of owner ``uid`` (O(1): [limits] checks it at every request)."""
        return self._per_uid.get(uid, 0)

    def add(self, request: Request, now: float, on_position=None) -> Waiter:
        w = Waiter(
            secrets.token_hex(4),
            request,
            next(self._seq),
            now,
            max(now, request.not_before) + request.wait_s,  # a deferred request waits from its start
            asyncio.get_running_loop().create_future(),
            on_position,
        )
        w.deferred = request.not_before > now
        q = self._queues.get(request.priority)
        if q is None:
            q = self._queues[request.priority] = OrderedDict()
            bisect.insort(self._order, -request.priority)
        q[w] = None
        self._len += 1
        _count(self._per_uid, request.owner_uid, 1)
        _count(self._kinds, kind_of(request), 1)
        if request.mode is Mode.XPU and not w.deferred:
            _count(self._whole_priorities, request.priority, 1)
        if on_position:  # the newcomer hears its position at once; the others from the pusher
            ahead = sum(len(self._queues[-p]) for p in self._order if -p > request.priority)
            self._tell(w, ahead + len(q), self._len)
        self._touch()
        return w

    def remove(self, w: Waiter) -> None:
        if w.queued:
            w.queued = False
            q = self._queues[w.request.priority]
            del q[w]
            if not q:
                del self._queues[w.request.priority]
                self._order.remove(-w.request.priority)
            self._len -= 1
            _count(self._per_uid, w.request.owner_uid, -1)
            _count(self._kinds, kind_of(w.request), -1)
            if w.request.mode is Mode.XPU and not w.deferred:
                _count(self._whole_priorities, w.request.priority, -1)
            self._touch()

    def activate(self, w: Waiter) -> None:
        """A deferred waiter's start has come: from now it waits as any other (a whole-card one holds
        idle whole cards back from requests behind it)."""
        if w.deferred and w.queued:
            w.deferred = False
            if w.request.mode is Mode.XPU:
                _count(self._whole_priorities, w.request.priority, 1)

    def in_order(self) -> list[Waiter]:
        return list(self)

    def __iter__(self):
        """The waiters in order, without a copy: the waitlist must not change while it is iterated."""
        for p in self._order:
            yield from self._queues[-p]

    def kinds(self) -> dict[tuple, int]:
        """``kind_of`` each waiter's request -> how many wait (a copy; O(kinds), not O(waiters))."""
        return dict(self._kinds)

    def whole_waiting_at(self, priority: int) -> bool:
        """Whether a whole-card request of at least ``priority`` waits (O(priorities))."""
        return any(p >= priority for p in self._whole_priorities)

    def view(self) -> list[QueuedRequest]:
        return [
            QueuedRequest(w.ticket, w.request, pos, w.enqueued, w.deadline, w.reason)
            for pos, w in enumerate(self, 1)
        ]

    @staticmethod
    def _tell(w: Waiter, pos: int, length: int) -> None:
        w.last_position = pos
        w.on_position(QueuedRequest(w.ticket, w.request, pos, w.enqueued, w.deadline), length)

    def _touch(self) -> None:
        self._dirty = True
        self._changes += 1
        if self._pusher is None or self._pusher.done():
            self._pusher = asyncio.get_running_loop().create_task(self._push())

    async def _push(self) -> None:
        """While positions change: rest an interval, then tell each waiter whose position moved.

        Resting first lets a burst (thousands of waiters leaving at once) end before anyone is told:
        the waiters that were leaving too are not sent positions they will never read.
        """
        while self._dirty:
            # Rest until a whole interval passes without a change (a burst of leavers is over), but
            # tell the waiters at least every PUSH_MAX_REST intervals while changes go on slowly
            # (PUSH_MAX_REST_BURST intervals during a burst).
            for rested in range(1, PUSH_MAX_REST_BURST + 1):
                seen = self._changes
                await asyncio.sleep(self.push_interval_s)
                changes = self._changes - seen
                if changes == 0 or (rested >= PUSH_MAX_REST and changes < PUSH_BURST):
                    break
            self._dirty = False
            snapshot, start = list(self), self._changes
            n = len(snapshot)
            for pos, w in enumerate(snapshot, 1):
                if w.queued and w.on_position and pos != w.last_position:
                    self._tell(w, pos, n)
                if pos % PUSH_CHUNK == 0:
                    await asyncio.sleep(0)  # positions found meanwhile are corrected next round
                    if self._changes - start >= PUSH_BURST:  # a burst began: rest until it ends
                        self._dirty = True
                        break
