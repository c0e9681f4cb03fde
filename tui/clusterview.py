"""The cluster view: hosts by network domain with their free whole cards and free slices, a health
summary, and stale entries marked. A virtualised DataTable (only visible rows are drawn) with a filter
that narrows it as you type; it stays responsive with thousands of hosts.
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
from textual.widgets import DataTable, Input, Static
from xpu_cli.vocab import age
from xpu_tui.eventlog import types_into_filter
from xpu_tui.hostrow import HostRow, totals
from xpu_tui.render import slice_count
from xpu_tui.tablesync import sync_rows

COLUMNS = ("HOST", "WHOLE", "½", "¼", "HEALTH", "SEEN", "CARDS", "LEASES", "QUEUE", "DRAINED")
HALF, QUARTER = "vxpu-half", "vxpu-quarter"


def health_text(healthy: int, degraded: int, unhealthy: int) -> Text:
    """``ok`` or e.g. ``✖1 ▲2``: the symbols read without colour, the counts say how many."""
    if not degraded and not unhealthy:
        return Text("● ok" if healthy else "-", style="green")
    out = Text()
    if unhealthy:
        out.append(f"✖{unhealthy} bad ", style="bold red")
    if degraded:
        out.append(f"▲{degraded} deg", style="yellow")
    out.rstrip()
    return out


def seen_text(h: HostRow, now: float, stale_after_s: float) -> Text:
    reach = h.reach(now, stale_after_s)
    if reach == "down":
        return Text(f"✖ down {age(now - h.seen)}" if h.seen else "✖ down", style="bold red")
    if reach == "stale":
        return Text(f"stale {age(now - h.seen)}", style="yellow")
    return Text("live", style="green")


def reach_totals(t) -> str:
    """``live``, or ``2 down, 1 stale``: the same words as the host rows."""
    parts = [f"{t.down} down"] * bool(t.down) + [f"{t.stale} stale"] * bool(t.stale)
    return ", ".join(parts) or "live"


def matches(h: HostRow, words: list[str], now: float, stale_after_s: float) -> bool:
    """Every filter word is part of the domain, the name, or a state word (stale, down, degraded,
    unhealthy, free)."""
    if not words:
        return True
    tags = [h.domain.lower(), h.name.lower(), h.reach(now, stale_after_s)]
    if h.degraded:
        tags.append("degraded")
    if h.unhealthy:
        tags.append("unhealthy")
    if h.whole_free:
        tags.append("free")
    return all(any(w in t for t in tags) for w in words)


class ClusterView(Vertical):
    BINDINGS = [Binding("slash", "focus_filter", "Filter")]  # noqa: RUF012

    def __init__(self, clock: Callable[[], float] = time.time, stale_after_s: float = 5.0, **kw) -> None:
        super().__init__(**kw)
        self.clock = clock
        self.stale_after_s = stale_after_s
        self.hosts: dict[tuple[str, str], HostRow] = {}
        self._ready = False  # hosts can arrive before this view has its table

    def compose(self) -> ComposeResult:
        yield Input(
            placeholder="filter: domain, host, stale, down, degraded, unhealthy, free "
            "(Enter: back to the table; Esc clears)",
            id="cluster-filter",
            select_on_focus=False,  # typing on the table moves here: keep the letter just typed
        )
        yield Static("no hosts yet", id="cluster-summary")
        yield DataTable(id="cluster-table", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one("#cluster-table", DataTable)
        for name in COLUMNS:
            table.add_column(name, key=name)
        self._ready = True
        if self.hosts:
            self.refresh_table()
        # A host that goes silent sends nothing: look again now and then so it shows as stale.
        self.set_interval(max(1.0, self.stale_after_s / 3), self.refresh_table)

    def update_hosts(self, batch: Iterable[HostRow]) -> None:
        for h in batch:
            self.hosts[h.key] = h
        self.refresh_table()

    def refresh_table(self) -> None:
        if not self._ready:
            return  # on_mount draws what has come
        now = self.clock()
        words = self.query_one("#cluster-filter", Input).value.lower().split()
        shown = sorted(
            (h for h in self.hosts.values() if matches(h, words, now, self.stale_after_s)),
            key=lambda h: h.key,
        )
        rows: list[tuple[str, list]] = []
        by_domain: dict[str, list[HostRow]] = {}
        for h in shown:
            by_domain.setdefault(h.domain, []).append(h)
        for domain, hosts in by_domain.items():
            t = totals(domain, hosts, now, self.stale_after_s)
            stale = reach_totals(t)
            rows.append(
                (
                    f"domain:{domain}",
                    [
                        Text(f"▼ {domain or '(no domain)'} · {t.hosts}", style="bold"),
                        Text(str(t.whole_free), style="bold"),
                        Text(str(t.slices_free.get(HALF, 0)), style="bold"),
                        Text(str(t.slices_free.get(QUARTER, 0)), style="bold"),
                        health_text(1, t.degraded, t.unhealthy),
                        Text(stale, style="yellow bold" if t.stale or t.down else "bold"),
                        "",
                        "",
                        "",
                        "",
                    ],
                )
            )
            for h in hosts:
                rows.append((f"host:{domain}/{h.name}", self._host_row(h, now)))
        sync_rows(self.query_one("#cluster-table", DataTable), rows)
        self._summarise(shown, now)

    def _host_row(self, h: HostRow, now: float) -> list:
        dim = "dim" if h.stale(now, self.stale_after_s) else ""
        return [
            Text(f"  {h.name}", style=dim),
            h.whole_free,
            h.slices_free.get(HALF, 0),
            h.slices_free.get(QUARTER, 0),
            health_text(h.healthy, h.degraded, h.unhealthy),
            seen_text(h, now, self.stale_after_s),
            h.cards,
            h.leases,
            h.queued,
            h.drained or "",
        ]

    def _summarise(self, shown: list[HostRow], now: float) -> None:
        every = list(self.hosts.values())
        t = totals("", every, now, self.stale_after_s)
        domains = len({h.domain for h in every})
        # ½ and ¼ have columns; other sizes a daemon's config adds are counted here only.
        others = "".join(
            f", {slice_count(n, size)}"
            for size, n in sorted(t.slices_free.items())
            if size not in (HALF, QUARTER)
        )
        text = (
            f"{t.hosts} hosts in {domains} domains · {reach_totals(t)} · free: {t.whole_free} whole, "
            f"{slice_count(t.slices_free.get(HALF, 0), HALF)}, "
            f"{slice_count(t.slices_free.get(QUARTER, 0), QUARTER)}{others} · "
            f"{t.degraded} degraded, {t.unhealthy} unhealthy cards"
        )
        if len(shown) != len(every):
            text += f" · showing {len(shown)}"
        self.query_one("#cluster-summary", Static).update(text)

    @on(DataTable.RowSelected, "#cluster-table")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a host: its summary in a dialog; on a domain: show that domain only."""
        key = str(event.row_key.value)
        kind, _, rest = key.partition(":")
        if kind == "domain":
            self.query_one("#cluster-filter", Input).value = rest
            return
        domain, _, name = rest.rpartition("/")  # domains may hold a slash (dc1/rack-01)
        host = self.hosts.get((domain, name))
        if host is not None:
            from xpu_tui.modals import HostScreen

            self.app.push_screen(HostScreen(host, self.clock(), self.stale_after_s))

    @on(Input.Changed, "#cluster-filter")
    def _filter_changed(self) -> None:
        self.refresh_table()

    @on(Input.Submitted, "#cluster-filter")
    def _filter_done(self) -> None:
        self.query_one("#cluster-table", DataTable).focus()

    def action_focus_filter(self) -> None:
        self.query_one("#cluster-filter", Input).focus()

    def on_key(self, event: Key) -> None:
        table = self.query_one("#cluster-table", DataTable)
        box = self.query_one("#cluster-filter", Input)
        if event.key == "escape" and (box.value or box.has_focus):
            box.value = ""
            table.focus()
            event.stop()
        elif table.has_focus and types_into_filter(event):
            # Typing on the table filters it: no need to find the box first.
            box.focus()
            box.insert_text_at_cursor(event.character)
            event.stop()
