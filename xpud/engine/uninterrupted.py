"""State changes that run to their end when their caller goes away."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_running: set[asyncio.Task] = set()  # strong references: the loop alone keeps none


def uninterrupted(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Run ``fn`` to its end even when its caller goes away (a cancelled gRPC call, a cancelled job): cut
    short between a ledger write and what memory or the hardware holds, the two would disagree. A caller
    that left does not hear the outcome; a failure then is logged."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kw: P.kwargs) -> T:
        task = asyncio.ensure_future(fn(*args, **kw))
        _running.add(task)
        task.add_done_callback(_running.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(functools.partial(_after_caller_left, fn.__qualname__))
            raise

    return wrapper


def _after_caller_left(name: str, task: asyncio.Task) -> None:
    if not task.cancelled() and (e := task.exception()) is not None:
        log.warning("%s failed after its caller went away: %s", name, e)
