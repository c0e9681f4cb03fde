"""What a large terminal shows under the card tiles, in the room they leave: the active leases, the queue
and the newest events, read-only (the leases view and the event log are where one acts and filters).
``HostView`` shows it when at least ``MIN_ROWS`` rows are left under the tiles (200x60: about 30).
"""

from __future__ import annotations

from collections.abc import Callable

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable
from xpu_tui.eventlog import COLUMNS as EVENT_COLUMNS
from xpu_tui.eventlog import event_cells
from xpu_tui.hoststate import HostState
from xpu_tui.leasesview import LEASE_COLUMNS, QUEUE_COLUMNS, lease_row, queue_row
from xpu_tui.tablesync import sync_rows

MIN_ROWS = 12  # a table's border, header and a few rows, beside another


class HostPanel(Horizontal):
    def __init__(self, owner: Callable[[int], str], clock: Callable[[], float], localtime, **kw) -> None:
        super().__init__(**kw)
        self.owner, self.clock, self.localtime = owner, clock, localtime
        self.state: HostState | None = None
        self._ready = False

    def compose(self) -> ComposeResult:
        with Vertical(id="panel-left"):
            yield self._table("panel-leases", "leases")
            yield self._table("panel-queue", "queue")
        yield self._table("panel-events", "recent events")

    @staticmethod
    def _table(id_: str, title: str) -> DataTable:
        table = DataTable(id=id_, cursor_type="none", zebra_stripes=True, show_cursor=False)
        table.can_focus = False  # the keys stay with the card tiles
        table.border_title = title
        return table

    def on_mount(self) -> None:
        self.query_one("#panel-leases", DataTable).add_columns(*LEASE_COLUMNS)
        self.query_one("#panel-queue", DataTable).add_columns(*QUEUE_COLUMNS)
        self.query_one("#panel-events", DataTable).add_columns(*EVENT_COLUMNS)
        self._ready = True
        if self.state is not None:
            self.show(self.state)

    def show(self, state: HostState) -> None:
        self.state = state
        if not self._ready:
            return
        now = self.clock()
        leases = self.query_one("#panel-leases", DataTable)
        sync_rows(leases, [(le.id, lease_row(le, now, self.owner, 28)) for le in state.leases])
        leases.border_title = f"leases ({len(state.leases)}) · 2: details, x release"
        queue = self.query_one("#panel-queue", DataTable)
        sync_rows(queue, [(q.ticket, queue_row(q, now, self.owner, 20)) for q in state.queue])
        queue.border_title = f"queue ({len(state.queue)} waiting)"
        events = self.query_one("#panel-events", DataTable)
        newest = list(state.events)[-100:][::-1]  # newest first: the top rows are the ones shown
        sync_rows(events, [(str(n), event_cells(e, self.localtime)) for n, e in enumerate(newest)])
        events.border_title = "recent events, newest first · 3: all, filter"
