"""Leases and the queue: a table of active leases, the details of the highlighted one, and the requests
waiting with their position.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Static
from xpu_cli.vocab import age, gib
from xpu_tui.hoststate import HostState
from xpu_tui.render import short, slice_glyph
from xpu_tui.tablesync import sync_rows

from xpud.api.v1 import xpu_pb2 as pb

LEASE_COLUMNS = ("LEASE", "NAME", "OWNER", "MODE", "CARDS", "AGE", "HELD", "COMMAND")
QUEUE_COLUMNS = ("POS", "TICKET", "NAME", "OWNER", "MODE", "GPUS", "PRIO", "WAITED", "GIVES UP", "COMMAND")
LABEL_WIDTH = 10  # the details' fact names, right-aligned, and a space


def held_text(le: pb.Lease) -> str:
    """HELD: ``yes`` (a Hold stream is open), the anchor's kind (``slurm``, ``pod``: the job or pod keeps
    it, no Hold stream needed, nothing to reclaim), or ``NO`` (reclaimed after the grace period)."""
    if le.held:
        return "yes"
    return le.anchor.partition(":")[0] if le.anchor else "NO"


def lease_row(le: pb.Lease, now: float, owner: Callable[[int], str], command_width: int = 60) -> list:
    return [
        le.id,
        short(le.name, 16) or "-",
        short(owner(le.owner_uid), 10),
        le.mode,
        cards_text(le),
        age(now - le.created),
        held_text(le),
        ("[!] " if le.mark else "") + short(le.command, command_width),
    ]


def queue_row(q: pb.QueueEntry, now: float, owner: Callable[[int], str], command_width: int = 50) -> list:
    return [
        q.position,
        q.ticket,
        short(q.name, 16) or "-",
        short(owner(q.owner_uid), 10),
        q.mode,
        q.gpus,
        q.priority,
        age(now - q.enqueued),
        age(q.deadline - now) if q.deadline else "-",
        short(q.command, command_width),
    ]


def cards_text(lease: pb.Lease) -> str:
    if lease.slices:
        return ",".join(f"{c}{slice_glyph(s.size)}" for c, s in zip(lease.cards, lease.slices, strict=False))
    return ",".join(map(str, lease.cards))


def holder_text(le: pb.Lease) -> str:
    if le.held:
        return f"pid {le.holder_pid or '-'}, holding"
    if le.anchor:  # no Hold stream by design: the daemon ends it when the job or pod ends, not on a timer
        return f"kept by {le.anchor} while that runs (no holder needed)"
    return f"pid {le.holder_pid or '-'}, NOT holding"


def lease_details(
    lease: pb.Lease,
    now: float,
    owner: Callable[[int], str],
    localtime: Callable = time.localtime,
    width: int | None = None,
) -> Text:
    """Everything the daemon tells about one lease, one fact a line (a card, a slice each), folded to
    ``width`` columns at spaces under the fact's value, so a UUID stays whole on one line."""
    created = time.strftime("%Y-%m-%d %H:%M:%S", localtime(lease.created))
    named = f" {lease.name}" if lease.name else ""
    # The first five lines fit the detail box of an 80x24 terminal: put what matters most there.
    rows = [
        (
            "lease",
            f"{lease.id}{named} ({lease.state or 'active'}) {lease.mode}, owner {owner(lease.owner_uid)}",
        ),
        ("command", lease.command or "-"),
        ("holder", holder_text(lease)),
    ]
    if lease.mark:
        rows.append(("attention", lease.mark))
    for i, (c, u) in enumerate(zip(lease.cards, lease.card_uuids, strict=False)):
        rows.append(("cards" if i == 0 else "", f"{c} {u}"))
    for s in lease.slices:
        rows.append(("slice", f"{s.size}: {gib(s.memory_bytes)} GiB, {s.compute_pct}% sm"))
        rows.append(("", s.handle or "(accounting)"))
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
    room = max(20, width - LABEL_WIDTH) if width else None
    for k, v in rows:
        style = "bold yellow" if k in ("attention",) or "NOT" in v else ""
        lines = textwrap.wrap(v, room, break_long_words=False, break_on_hyphens=False) if room else [v]
        for n, line in enumerate(lines or [""]):
            text.append(f"{k if n == 0 else '':>{LABEL_WIDTH - 1}} ", style="bold")
            text.append(line + "\n", style=style)
    text.rstrip()
    return text


class LeaseDetail(Static):
    """The highlighted lease's details, folded again whenever the box changes width."""

    _what: str | Callable[[int | None], Text] | None = None  # a message, or the details by width

    def show(self, what: str | Callable[[int | None], Text]) -> None:
        self._what = what
        self._draw()

    def on_resize(self) -> None:
        self._draw()

    def _draw(self) -> None:
        if isinstance(self._what, str):
            self.update(self._what)
        elif self._what is not None:
            self.update(self._what(self.content_region.width or None))


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
        detail = LeaseDetail("no lease selected", id="lease-detail")
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
        return lease_row(le, now, self.owner)

    def _queue_row(self, q: pb.QueueEntry, now: float) -> list:
        return queue_row(q, now, self.owner)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id != "lease-table":
            return
        self.selected = event.row_key.value if event.row_key else None
        self._show_detail()
        self.post_message(self.LeaseHighlighted(self.selected))

    def _show_detail(self) -> None:
        lease = self.state.lease(self.selected) if self.state and self.selected else None
        detail = self.query_one("#lease-detail", LeaseDetail)
        if lease is None:
            detail.show("no lease selected" if self.state and self.state.leases else "no active leases")
            return
        detail.show(lambda width: lease_details(lease, self.clock(), self.owner, self.localtime, width))
