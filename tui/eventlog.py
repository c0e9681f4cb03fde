"""The event log: health changes, drains, mode switches, grants, releases and moves, with their reasons,
as the Watch stream delivers them (the first update brings recent history).

A DataTable rather than a text log: it is virtualised, keeps a cursor to read one event by, and draws
the same on every run (snapshot tests). It follows the newest event unless the cursor was moved up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from rich.text import Text
from textual.widgets import DataTable
from xpu_tui.hoststate import EVENT_LOG_SIZE
from xpu_tui.render import EVENT_BADGES

from xpud.api.v1 import xpu_pb2 as pb

COLUMNS = ("TIME", "EVENT", "CARD", "WHAT AND WHY")


def event_cells(e: pb.Event, localtime: Callable = time.localtime) -> list:
    symbol, style = EVENT_BADGES.get(e.kind, ("·", ""))
    message = e.message
    if e.lease_id and e.lease_id not in message:
        message += f" (lease {e.lease_id})"
    return [
        time.strftime("%H:%M:%S", localtime(e.timestamp)),
        Text(f"{symbol} {e.kind}", style=style),
        str(e.card) if e.card >= 0 else "",
        message,
    ]


def event_line(e: pb.Event, localtime: Callable = time.localtime) -> Text:
    """One event as a line of text (for the card details)."""
    when, kind, _, message = event_cells(e, localtime)
    line = Text(when + " ", style="dim")
    line.append_text(kind)
    line.append(" " + message)
    return line


class EventLog(DataTable):
    def __init__(self, localtime: Callable = time.localtime, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.localtime = localtime
        self.border_title = "events"
        self.count = 0  # events added since the start
        self._early: list[pb.Event] | None = []  # events that came before the columns did

    def on_mount(self) -> None:
        for name in COLUMNS:
            self.add_column(name, key=name)
        early, self._early = self._early or [], None
        self.add(early)

    def add(self, events: Iterable[pb.Event]) -> None:
        events = list(events)
        if self._early is not None:
            self._early += events
            return
        if not events:
            return
        following = self.row_count == 0 or self.cursor_row >= self.row_count - 1
        for e in events:
            self.add_row(*event_cells(e, self.localtime), key=str(self.count))
            self.count += 1
        while self.row_count > EVENT_LOG_SIZE:
            self.remove_row(next(iter(self.rows)))
        self.border_title = f"events ({self.count})"
        if following:
            self.move_cursor(row=self.row_count - 1)
