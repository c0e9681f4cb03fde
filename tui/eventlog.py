"""The event log: health changes, drains, mode switches, grants, releases and moves, with their reasons,
as the Watch stream delivers them (the first update brings recent history).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from rich.text import Text
from textual.widgets import RichLog
from xpu_tui.hoststate import EVENT_LOG_SIZE
from xpu_tui.render import EVENT_BADGES

from xpud.api.v1 import xpu_pb2 as pb


def event_line(e: pb.Event, localtime: Callable = time.localtime) -> Text:
    symbol, style = EVENT_BADGES.get(e.kind, ("·", ""))
    line = Text(time.strftime("%H:%M:%S", localtime(e.timestamp)) + " ", style="dim")
    line.append(f"{symbol} {e.kind:<8}", style=style)
    line.append(" " + e.message)
    if e.lease_id and e.lease_id not in e.message:
        line.append(f" (lease {e.lease_id})", style="dim")
    return line


class EventLog(RichLog):
    def __init__(self, localtime: Callable = time.localtime, **kw) -> None:
        super().__init__(max_lines=EVENT_LOG_SIZE, wrap=True, markup=False, **kw)
        self.localtime = localtime
        self.border_title = "events"
        self.count = 0

    def add(self, events: Iterable[pb.Event]) -> None:
        for e in events:
            self.write(event_line(e, self.localtime))
            self.count += 1
        self.border_title = f"events ({self.count})"
