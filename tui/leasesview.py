"""Leases and the queue: a table of active leases, the details of the highlighted one, and the requests
waiting with their position.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Static
from xpu_tui.hoststate import HostState
from xpu_tui.render import age, gib, short, slice_glyph
from xpu_tui.tablesync import sync_rows

from xpud.api.v1 import xpu_pb2 as pb

LEASE_COLUMNS = ("LEASE", "OWNER", "MODE", "CARDS", "AGE", "HELD", "COMMAND")
QUEUE_COLUMNS = ("POS", "TICKET", "OWNER", "MODE", "GPUS", "PRIO", "WAITED", "GIVES UP", "COMMAND")


def cards_text(lease: pb.Lease) -> str:
    if lease.slices:
        return ",".join(f"{c}{slice_glyph(s.size)}" for c, s in zip(lease.cards, lease.slices, strict=False))
    return ",".join(map(str, lease.cards))


def lease_details(
    lease: pb.Lease, now: float, owner: Callable[[int], str], localtime: Callable = time.localtime
) -> Text:
    """Everything the daemon tells about one lease, one fact a line."""
    created = time.strftime("%Y-%m-%d %H:%M:%S", localtime(lease.created))
    # The first five lines fit the detail box of an 80x24 terminal: put what matters most there.
    rows = [
        ("lease", f"{lease.id} ({lease.state or 'active'}) {lease.mode}, owner {owner(lease.owner_uid)}"),
        ("command", lease.command or "-"),
        ("holder", f"pid {lease.holder_pid or '-'}, " + ("holding" if lease.held else "NOT holding")),
    ]
    if lease.mark:
        rows.append(("attention", lease.mark))
    rows.append(("cards", ", ".join(f"{c} {u}" for c, u in zip(lease.cards, lease.card_uuids, strict=False))))
    for s in lease.slices:
        rows.append(
            (
                "slice",
                f"{s.size}: {gib(s.memory_bytes)} GiB, {s.compute_pct}% sm  {s.handle or '(accounting)'}",
            )
        )
    rows += [
        ("created", f"{created} ({age(now - lease.created)} ago)"),
        (
            "flags",
            ("restartable" if lease.restartable else "not restartable")
            + (f", restarted {lease.restart_count}x" if lease.restart_count else "")
            + (f", priority {lease.priority}" if lease.priority else ""),
        ),
    ]
    if lease.env:
        rows.append(("env", " ".join(f"{k}={v}" for k, v in sorted(lease.env.items()))))
    text = Text()
    for k, v in rows:
        text.append(f"{k:>9} ", style="bold")
        text.append(v + "\n", style="bold yellow" if k in ("attention",) or "NOT" in v else "")
    text.rstrip()
    return text


class LeasesView(Vertical):
    class LeaseHighlighted(Message):
        def __init__(self, lease_id: str | None) -> None:
            super().__init__()
            self.lease_id = lease_id

    def __init__(self, owner: Callable[[int], str], clock: Callable[[], float], localtime, **kw) -> None:
        super().__init__(**kw)
        self.owner, self.clock, self.localtime = owner, clock, localtime
        self.state: HostState | None = None
        self.selected: str | None = None
        self._ready = False  # the first update can come before this view has its tables

    def compose(self) -> ComposeResult:
        leases = DataTable(id="lease-table", cursor_type="row", zebra_stripes=True)
        leases.border_title = "leases"
        yield leases
        detail = Static("no lease selected", id="lease-detail")
        detail.border_title = "details"
        yield detail
        queue = DataTable(id="queue-table", cursor_type="row", show_cursor=False)
        queue.can_focus = False  # read-only: the focus belongs to the lease table
        queue.border_title = "queue"
        yield queue

    def on_resize(self) -> None:
        # Wide terminals show the details beside the tables instead of between them.
        wide = self.size.width >= 150
        if wide != self.has_class("-wide"):
            self.set_class(wide, "-wide")

    def on_mount(self) -> None:
        self.query_one("#lease-table", DataTable).add_columns(*LEASE_COLUMNS)
        self.query_one("#queue-table", DataTable).add_columns(*QUEUE_COLUMNS)
        self._ready = True
        if self.state is not None:
            self.show(self.state)

    def show(self, state: HostState) -> None:
        self.state = state
        if not self._ready:
            return  # on_mount shows it
        now = self.clock()
        table = self.query_one("#lease-table", DataTable)
        sync_rows(
            table,
            [(le.id, self._lease_row(le, now)) for le in state.leases],
        )
        table.border_title = f"leases ({len(state.leases)})"
        queue = self.query_one("#queue-table", DataTable)
        sync_rows(queue, [(q.ticket, self._queue_row(q, now)) for q in state.queue])
        queue.border_title = f"queue ({len(state.queue)} waiting)"
        self._show_detail()

    def _lease_row(self, le: pb.Lease, now: float) -> list:
        return [
            le.id,
            short(self.owner(le.owner_uid), 10),
            le.mode,
            cards_text(le),
            age(now - le.created),
            "yes" if le.held else "NO",
            ("[!] " if le.mark else "") + short(le.command, 60),
        ]

    def _queue_row(self, q: pb.QueueEntry, now: float) -> list:
        return [
            q.position,
            q.ticket,
            short(self.owner(q.owner_uid), 10),
            q.mode,
            q.gpus,
            q.priority,
            age(now - q.enqueued),
            age(q.deadline - now) if q.deadline else "-",
            short(q.command, 50),
        ]

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id != "lease-table":
            return
        self.selected = event.row_key.value if event.row_key else None
        self._show_detail()
        self.post_message(self.LeaseHighlighted(self.selected))

    def _show_detail(self) -> None:
        lease = self.state.lease(self.selected) if self.state and self.selected else None
        detail = self.query_one("#lease-detail", Static)
        if lease is None:
            detail.update("no lease selected" if self.state and self.state.leases else "no active leases")
            return
        detail.update(lease_details(lease, self.clock(), self.owner, self.localtime))
