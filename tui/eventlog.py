"""The event log: health changes, drains, mode switches, grants, releases and moves, with their reasons,
as the Watch stream delivers them (the first update brings recent history).

A DataTable rather than a text log: it is virtualised, keeps a cursor to read one event by, and draws
the same on every run (snapshot tests). It follows the newest event unless the cursor was moved up, and
opens at the newest. ``EventsView`` puts a filter box above it: typing on the log filters it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.events import Key
from textual.widgets import DataTable, Input
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


def matches(e: pb.Event, words: list[str]) -> bool:
    """Every filter word is part of the event's kind, ``card N``, its lease or its message."""
    tags = [e.kind, f"card {e.card}" if e.card >= 0 else "", e.lease_id, e.message.lower()]
    return all(any(w in t for t in tags) for w in words)


class EventLog(DataTable):
    def __init__(self, localtime: Callable = time.localtime, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.localtime = localtime
        self.border_title = "events"
        self.count = 0  # events added since the start
        self.kept: list[tuple[int, pb.Event]] = []  # the last EVENT_LOG_SIZE events, with their number
        self.words: list[str] = []  # the filter
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
            self.kept.append((self.count, e))
            if matches(e, self.words):
                self.add_row(*event_cells(e, self.localtime), key=str(self.count))
            self.count += 1
        del self.kept[:-EVENT_LOG_SIZE]
        while self.row_count > EVENT_LOG_SIZE:
            self.remove_row(next(iter(self.rows)))
        self._title()
        if following:
            self.show_newest()

    def _title(self) -> None:
        shown = f"{self.count}"
        if self.words:
            shown = f"{self.row_count} of {self.count}, filter: {' '.join(self.words)}"
        self.border_title = f"events ({shown})"

    def set_filter(self, text: str) -> None:
        """Show only the events every word of ``text`` matches (``matches``), newest selected."""
        self.words = text.lower().split()
        self.clear()
        for n, e in self.kept:
            if matches(e, self.words):
                self.add_row(*event_cells(e, self.localtime), key=str(n))
        self._title()
        self.show_newest()

    def show_newest(self) -> None:
        if self.row_count:
            self.move_cursor(row=self.row_count - 1, animate=False)
            self.scroll_end(animate=False)


class EventsView(Vertical):
    """The event log under a filter box; letters typed on the log go to the box, Esc clears it."""

    BINDINGS = [Binding("slash", "focus_filter", "Filter")]  # noqa: RUF012

    def __init__(self, log: EventLog, **kw) -> None:
        super().__init__(**kw)
        self.log_table = log

    def compose(self) -> ComposeResult:
        yield Input(
            placeholder="filter: kind, card N, lease, words (type; Enter: back to the log; Esc clears)",
            id="event-filter",
            select_on_focus=False,  # the first letter typed on the log is kept, not selected and replaced
        )
        yield self.log_table

    @on(Input.Changed, "#event-filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.log_table.set_filter(event.value)

    @on(Input.Submitted, "#event-filter")
    def _filter_done(self) -> None:
        self.log_table.focus()

    def action_focus_filter(self) -> None:
        self.query_one("#event-filter", Input).focus()

    def on_key(self, event: Key) -> None:
        box = self.query_one("#event-filter", Input)
        if event.key == "escape" and (box.value or box.has_focus):
            box.value = ""
            self.log_table.focus()
            event.stop()
        elif self.log_table.has_focus and types_into_filter(event):
            box.focus()
            box.insert_text_at_cursor(event.character)
            event.stop()


def types_into_filter(event: Key) -> bool:
    """A key pressed on a filtered list that starts the filter: a printable one, except the app's own
    keys (the view digits, ``?`` help, ``q`` quit, ``/`` the filter box), which keep their meaning there.
    Once in the box every key types; Enter or Esc goes back to the list."""
    return event.is_printable and bool(event.character) and event.character not in APP_KEYS


APP_KEYS = "1234?q/"
