"""The engine driven from plain (synchronous) tests: each call runs on a private event loop until it and
the tasks it started are done. Inside a running loop (an async test) calls go to the engine unchanged."""

from __future__ import annotations

import asyncio
import inspect

from xpud.engine.engine import Engine


class SyncEngine:
    def __init__(self, engine: Engine):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_loop", asyncio.new_event_loop())

    @property
    def engine(self) -> Engine:
        """The ``Engine`` this drives (for the parts built over one: controllers, the provisioner)."""
        return self._engine

    def run(self, coro):
        """Run a coroutine on this engine's loop to completion and return its result (the tasks it started
        may still be pending: the engine's own methods, called through this, wait for those too)."""
        return self._loop.run_until_complete(coro)

    def __getattr__(self, name: str):
        attr = getattr(self._engine, name)
        if not callable(attr) or not inspect.ismethod(attr):
            return attr

        def call(*args, **kw):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return self._loop.run_until_complete(self._settled(attr, args, kw))
            return attr(*args, **kw)

        return call

    def __setattr__(self, name: str, value) -> None:
        setattr(self._engine, name, value)

    async def _settled(self, fn, args, kw):
        result = fn(*args, **kw)
        if inspect.isawaitable(result):
            result = await result
        while self._engine._tasks:  # grants of queued requests, isolation upkeep
            await asyncio.gather(*list(self._engine._tasks), return_exceptions=True)
        return result


def sync_engine(*args, **kw) -> SyncEngine:
    return SyncEngine(Engine(*args, **kw))
