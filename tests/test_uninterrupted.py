"""xpud.engine.uninterrupted: a state change runs to its end when its caller goes away, and what fails then is
logged, not lost (nor a "Task exception was never retrieved" at exit)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from xpud.engine.uninterrupted import uninterrupted


def test_a_change_whose_caller_is_cancelled_runs_to_its_end_and_its_failure_is_logged(caplog):
    steps: list[str] = []

    @uninterrupted
    async def change(fail: bool) -> str:
        steps.append("written")
        await asyncio.sleep(0.05)  # the caller is cancelled here
        steps.append("applied")
        if fail:
            raise RuntimeError("the disk is full")
        return "done"

    async def main():
        assert await change(False) == "done"  # a caller that stays hears the outcome
        for fail in (False, True):
            task = asyncio.ensure_future(change(fail))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0.2)
        with pytest.raises(RuntimeError, match="disk"):
            await change(True)  # ... and its error

    with caplog.at_level(logging.WARNING, logger="xpud.engine.uninterrupted"):
        asyncio.run(main())
    assert steps.count("written") == steps.count("applied") == 4  # the two cancelled ones overlap
    assert [r.getMessage() for r in caplog.records] == [
        "test_a_change_whose_caller_is_cancelled_runs_to_its_end_and_its_failure_is_logged.<locals>.change "
        "failed after its caller went away: the disk is full"
    ]
