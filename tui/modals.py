"""Modal screens: confirm an operator action, pick a card mode, the card details, and the help."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Static
from xpu_cli import vocab
from xpu_cli.vocab import age, gib
from xpu_tui.cardtile import holders_text, mode_text
from xpu_tui.eventlog import event_line
from xpu_tui.render import HEALTH_BADGES, health_badge, slice_count

from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import XpudError

CANCEL = "Cancel (esc)"  # one cancel key in every dialog


class ConfirmScreen(ModalScreen[bool]):
    """Ask before an operator action: ``y`` confirms, Esc cancels (as in every dialog)."""

    BINDINGS: ClassVar = [
        Binding("y", "answer(True)", "Yes"),
        Binding("escape", "answer(False)", "Cancel"),
    ]

    def __init__(self, title: str, body: str, verb: str = "Yes") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.body, self.verb = title, body, verb

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.title_text, classes="dialog-title")
            yield Static(self.body, classes="dialog-body")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.verb} (y)", id="yes", variant="error")
                yield Button(CANCEL, id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter on the default cancels: confirming takes a y

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


def blocked_modes(card: pb.Card) -> dict[str, str]:
    """The modes ``card`` cannot switch to now, and why (the daemon refuses them while a lease holds it)."""
    if card.whole_lease:
        return {"sliced": f"held whole by lease {card.whole_lease}: release it first"}
    if card.slices:
        return {"whole": f"holds {len(card.slices)} slice(s): release them first"}
    return {}


class ModeScreen(ModalScreen[str | None]):
    """Pick a card's mode: whole, sliced, or auto (the scheduler decides again). Esc cancels. A mode the
    card cannot switch to while a lease holds it is offered disabled, with the reason, before the choice."""

    BINDINGS: ClassVar = [
        Binding("w", "pick('whole')", "Whole"),
        Binding("s", "pick('sliced')", "Sliced"),
        Binding("a", "pick('auto')", "Auto"),
        Binding("escape", "pick('')", "Cancel"),
    ]

    def __init__(self, card: pb.Card) -> None:
        super().__init__(classes="dialog-screen")
        self.card = card
        self.blocked = blocked_modes(card)

    def compose(self) -> ComposeResult:
        c = self.card
        now = (
            f"{c.mode} ({'pinned by an operator' if c.mode_pinned else 'auto: the scheduler may switch it'})"
        )
        with Vertical(classes="dialog"):
            yield Static(f"Switch the mode of card {c.index}", classes="dialog-title")
            why = "".join(f"\nNot {mode}: {reason}." for mode, reason in self.blocked.items())
            yield Static(
                f"Card {c.index} is {now}; {holders_text(c)}.\n"
                f"whole/sliced pin the mode; auto lets the scheduler switch it with demand.{why}",
                classes="dialog-body",
            )
            with Horizontal(classes="dialog-buttons"):
                yield Button("whole (w)", id="whole", disabled="whole" in self.blocked)
                yield Button("sliced (s)", id="sliced", disabled="sliced" in self.blocked)
                yield Button("auto (a)", id="auto")
                yield Button(CANCEL, id="cancel")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None if event.button.id == "cancel" else event.button.id)

    def action_pick(self, mode: str) -> None:
        if mode in self.blocked:
            self.notify(f"card {self.card.index}: not {mode}: {self.blocked[mode]}", severity="warning")
            return
        self.dismiss(mode or None)


STATUS_STYLES = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red", "absent": "dim"}
CLOSE_HINT = "Esc, Enter or q closes"


def card_details(card: pb.Card, events: Iterable[pb.Event], localtime: Callable = time.localtime) -> Text:
    """A card's facts, its leases and slices, and its recent events (with reasons)."""
    symbol, word, style = health_badge(card.health_state)
    t = Text()
    t.append(f"{card.name}\n", style="bold")
    t.append(f"{card.uuid}\n", style="dim")  # a line of its own: never wrapped mid-string
    t.append(f"pci {card.pci_bus_id or '-'}  numa {card.numa_node if card.HasField('numa_node') else '-'}")
    t.append(f"  nvlink {card.nvlink_active_links} links  mig {'on' if card.mig_enabled else 'off'}\n")
    t.append("health  ")
    t.append(f"{symbol} {word} {card.health_score}", style=style)
    t.append(f"   mode {mode_text(card)}\n")
    if card.drained:
        t.append(f"drained {card.drain_reason}\n", style="yellow")
    t.append(f"{holders_text(card)}\n")
    t.append(f"free    {vocab.free(card)}\n")
    for s in card.slices:
        size = vocab.size_word(s.size)
        t.append(f"slice   {s.lease_id} ({size}): {gib(s.memory_bytes)} GiB, {s.compute_pct}% sm\n")
    recent = [e for e in events if e.card == card.index][-8:]
    if recent:
        t.append("\nrecent events\n", style="bold")
        for e in recent:
            t.append_text(event_line(e, localtime))
            t.append("\n")
    t.rstrip()
    return t


def signal_table(health: pb.CardHealth) -> Table:
    """Every signal with its value, threshold and status: the table `xpu health CARD` prints."""
    table = Table(box=None, padding=(0, 2, 0, 0), show_edge=False, header_style="bold", expand=False)
    for name in ("SIGNAL", "VALUE", "THRESHOLD", "STATUS", "REASON"):
        table.add_column(name, no_wrap=name != "REASON", overflow="fold")
    for s in health.signals:
        table.add_row(
            s.name,
            vocab.signal_value(s, "value"),
            vocab.signal_value(s, "threshold"),
            Text(s.status, style=STATUS_STYLES.get(s.status, "")),
            s.reason,
        )
    return table


class CardScreen(ModalScreen[None]):
    """Enter on a tile: the card's facts, every health signal against its threshold (fetched from the
    daemon off the UI thread), and its recent events. Its own footer replaces the host's keys."""

    BINDINGS: ClassVar = [Binding("escape,enter,q", "dismiss", "Close")]

    def __init__(
        self,
        card: pb.Card,
        events: Iterable[pb.Event],
        localtime: Callable = time.localtime,
        health: Callable[[], pb.CardHealth] | None = None,
    ):
        super().__init__(classes="dialog-screen")
        self.card, self.events, self.localtime = card, list(events), localtime
        self.fetch_health = health
        self.report: pb.CardHealth | None = None  # once the daemon answered

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            yield Static(f"Card {self.card.index} · {CLOSE_HINT}", classes="dialog-title")
            yield Static(card_details(self.card, self.events, self.localtime), classes="details")
            yield Static("health signals: asking the daemon…", id="card-signals", classes="signals")
        yield Footer()

    def on_mount(self) -> None:
        if self.fetch_health is not None:
            self.run_worker(self._load_health, thread=True, exit_on_error=False)
        else:
            self.query_one("#card-signals", Static).update("")

    def _load_health(self) -> None:
        try:
            report = self.fetch_health()
        except XpudError as e:
            shown = Text(f"health signals: {e}", style="yellow")
        else:
            self.report = report
            shown = Group(
                Text(f"\nhealth signals ({report.state}, score {report.score})", style="bold"),
                *[Text(f"because: {r}") for r in report.reasons],
                signal_table(report),
            )
        self.app.call_from_thread(self._show_health, shown)

    def _show_health(self, shown) -> None:
        if self.is_mounted:
            self.query_one("#card-signals", Static).update(shown)


class HostScreen(ModalScreen[None]):
    """Enter on a cluster host: everything its summary knows, in words."""

    BINDINGS: ClassVar = [Binding("escape,enter,q", "dismiss", "Close")]

    def __init__(self, host, now: float, stale_after_s: float):
        super().__init__(classes="dialog-screen")
        self.host, self.now, self.stale_after_s = host, now, stale_after_s

    def compose(self) -> ComposeResult:
        h = self.host
        reach = h.reach(self.now, self.stale_after_s)
        since = f", last news {age(self.now - h.seen)} ago" if h.seen else ""
        t = Text()
        t.append(f"{h.domain or '(no domain)'} / {h.name}\n", style="bold")
        t.append(f"{reach}{since}\n", style={"live": "green", "stale": "yellow"}.get(reach, "bold red"))
        if h.error:
            t.append(f"last refresh failed: {h.error}\n", style="red")
        t.append(f"cards   {h.cards}: {h.healthy} healthy, {h.degraded} degraded, {h.unhealthy} unhealthy")
        t.append(f", {h.drained} drained\n")
        slices = ", ".join(slice_count(n, size) for size, n in sorted(h.slices_free.items())) or "none"
        t.append(f"free    {h.whole_free} whole card(s); slices that fit: {slices}\n")
        t.append(f"leases  {h.leases} active, {h.queued} queued\n")
        with VerticalScroll(classes="dialog"):
            yield Static(f"Host {h.name} · {CLOSE_HINT}", classes="dialog-title")
            yield Static(t)
        yield Footer()


HELP = """\
[b]Views[/b]
  1 host   2 leases and queue   3 events   4 cluster (with --host)
  arrows/Tab move between cards and rows; Enter: a card's signals and
  thresholds, a cluster host's summary; Esc closes and cancels everywhere
[b]Operators[/b] (admin socket; each action asks first)
  host view: d drain   u undrain   m mode: whole/sliced/auto   x release
  leases view: x release the highlighted lease
[b]Cluster[/b]
  type (or /) to filter: domain, host, stale, down, degraded, unhealthy, free
  stale: no news lately; down: unreachable
[b]Events[/b]  type (or /) to filter: kind, card N, lease, words
  In a filter box every key types: Enter goes back to the list (the filter
  stays; 1-4 switch views again), Esc clears it
[b]Card tiles[/b]
  ▶ selected   * mode pinned by an operator   ⊘ drained
  ! near thermal slowdown   held by LEASE (half), LEASE (quarter)
  bars: now; sparklines: the last minutes (util, memory)
[b]Health[/b]  {badges}
[b]Event kinds[/b]
  + grant  - release  ↺ reclaim  ⏏ evict  ⊘ drain  ⊙ undrain
  ⇄ mode  ♥ health  → move  ⚡ fault
q quits · Esc closes this help
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar = [Binding("escape,question_mark,q,enter", "dismiss", "Close")]

    def __init__(self, operator: bool) -> None:
        super().__init__(classes="dialog-screen")
        self.operator = operator

    def compose(self) -> ComposeResult:
        badges = "  ".join(f"{sym} {word}" for sym, word, _ in HEALTH_BADGES.values())
        access = (
            "You are connected to the admin socket: operator keys are enabled."
            if self.operator
            else "Read-only: operator keys need the admin socket: run `xpu top --admin` as root or a "
            "member of the admin group."
        )
        with VerticalScroll(classes="dialog wide"):
            yield Static("xpu top — keys", classes="dialog-title")
            yield Static(HELP.format(badges=badges) + "\n" + access, markup=True)
