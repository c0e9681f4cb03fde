"""Capacity windows: ``[[windows]]`` entries with an APScheduler (3.x) cron trigger and a whole-card share.

A window starts when its cron expression fires and lasts until another window starts (the schedule is a
step function: ``day`` at 08:00 Monday to Friday with ``whole_share = 0.8``, ``night`` at 20:00 every day
with 0.2, ...). While a window holds, the engine keeps at least ``whole_share`` of the usable cards in whole
mode: slice requests do not convert an idle whole card below it, and idle sliced cards go back to whole
until it is met (``Engine.keep_whole``). A window never evicts or moves running work. Outside every
window (none has fired within ``LOOKBACK``) the share is 0.

Pure apart from the triggers: every function takes ``now`` (an aware datetime), so tests freeze the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from xpud.config.windows import WindowSpec

# How far back the current window's start is looked for, shortest first (each step only when nothing fired
# in the shorter one): a window fires at least once a year, and few firings are walked through.
LOOKBACK = (timedelta(hours=1), timedelta(days=1), timedelta(days=8), timedelta(days=32), timedelta(days=367))


def last_start(spec: WindowSpec, now: datetime) -> datetime | None:
    """When ``spec`` last fired at or before ``now`` (within LOOKBACK), or None."""
    trigger = spec.trigger()
    for back in LOOKBACK:
        at = trigger.get_next_fire_time(None, now - back)
        if at is None or at > now:
            continue
        while True:
            nxt = trigger.get_next_fire_time(at, at + timedelta(seconds=1))
            if nxt is None or nxt > now:
                return at
            at = nxt
    return None


def next_start(spec: WindowSpec, now: datetime) -> datetime | None:
    """When ``spec`` fires next after ``now``."""
    return spec.trigger().get_next_fire_time(None, now + timedelta(microseconds=1))


@dataclass(frozen=True)
class WindowState:
    spec: WindowSpec
    started: datetime | None  # its last start (None: not within LOOKBACK)
    next: datetime | None
    current: bool


def states(specs: tuple[WindowSpec, ...], now: datetime) -> list[WindowState]:
    """Every window's last and next start; ``current`` is the one that started last (ties: the later
    entry in the file)."""
    starts = [last_start(s, now) for s in specs]
    cur = None
    for i, at in enumerate(starts):
        if at is not None and (cur is None or at >= starts[cur]):
            cur = i
    return [WindowState(s, starts[i], next_start(s, now), i == cur) for i, s in enumerate(specs)]


def current(specs: tuple[WindowSpec, ...], now: datetime) -> WindowSpec | None:
    return next((st.spec for st in states(specs, now) if st.current), None)


def whole_needed(share: float, usable_cards: int) -> int:
    """Cards to keep whole for ``share`` of ``usable_cards`` (rounded up: 0.8 of 8 is 7)."""
    return min(usable_cards, math.ceil(share * usable_cards - 1e-9))
