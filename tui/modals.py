"""Modal screens: confirm an operator action, pick a card mode, the card details, and the help."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static
from xpu_tui.cardtile import holders_text, mode_text
from xpu_tui.eventlog import event_line
from xpu_tui.render import HEALTH_BADGES, gib, health_badge

from xpud.api.v1 import xpu_pb2 as pb


class ConfirmScreen(ModalScreen[bool]):
    """Ask before an operator action: ``y``/Enter confirms, ``n``/Esc cancels."""

    BINDINGS: ClassVar = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
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
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter on the default cancels: confirming takes a y

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class ModeScreen(ModalScreen[str | None]):
    """Pick a card's mode: whole, sliced, or auto (the scheduler decides again). Esc cancels."""

    BINDINGS: ClassVar = [
        Binding("w", "pick('whole')", "Whole"),
        Binding("s", "pick('sliced')", "Sliced"),
        Binding("a", "pick('auto')", "Auto"),
        Binding("escape,n", "pick('')", "Cancel"),
    ]

    def __init__(self, card: pb.Card) -> None:
        super().__init__(classes="dialog-screen")
        self.card = card

    def compose(self) -> ComposeResult:
        c = self.card
        now = (
            f"{c.mode} ({'pinned by an operator' if c.mode_pinned else 'auto: the scheduler may switch it'})"
        )
        with Vertical(classes="dialog"):
            yield Static(f"Switch the mode of card {c.index}", classes="dialog-title")
            yield Static(
                f"Card {c.index} is {now}; held by: {holders_text(c)}.\n"
                "whole/sliced pin the mode; auto lets the scheduler switch it with demand. "
                "A card that a lease holds cannot switch.",
                classes="dialog-body",
            )
            with Horizontal(classes="dialog-buttons"):
                yield Button("whole (w)", id="whole")
                yield Button("sliced (s)", id="sliced")
                yield Button("auto (a)", id="auto")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None if event.button.id == "cancel" else event.button.id)

    def action_pick(self, mode: str) -> None:
        self.dismiss(mode or None)


def card_details(card: pb.Card, events: Iterable[pb.Event], localtime: Callable = time.localtime) -> Text:
    """A card's facts, every signal of its last sample, and its recent events (with reasons)."""
    symbol, word, style = health_badge(card.health_state)
    t = Text()
    t.append(f"{card.name}  {card.uuid}\n", style="bold")
    t.append(f"pci {card.pci_bus_id or '-'}  numa {card.numa_node if card.HasField('numa_node') else '-'}")
    t.append(f"  nvlink {card.nvlink_active_links} links  mig {'on' if card.mig_enabled else 'off'}\n")
    t.append("health  ")
    t.append(f"{symbol} {word} {card.health_score}", style=style)
    t.append(f"   mode {mode_text(card)}   isolation {card.isolation or '-'}\n")
    if card.drained:
        t.append(f"drained {card.drain_reason}\n", style="yellow")
    t.append(f"held by {holders_text(card)}\n")
    if card.mode == "sliced":
        t.append(f"free    {card.free_memory_fraction * 100:.0f}% memory, {card.free_compute_pct}% compute\n")
    for s in card.slices:
        t.append(f"slice   {s.size} lease {s.lease_id}: {gib(s.memory_bytes)} GiB, {s.compute_pct}% sm")
        t.append(f"  {s.handle}\n" if s.handle else "\n")
    if card.HasField("sample"):
        t.append("\nlast sample\n", style="bold")
        fields = [(f.name, v) for f, v in card.sample.ListFields() if f.name != "timestamp"]
        width = max((len(n) for n, _ in fields), default=0)
        for name, value in fields:
            t.append(f"  {name:<{width}} {value}\n")
    recent = [e for e in events if e.card == card.index][-8:]
    if recent:
        t.append("\nrecent events\n", style="bold")
        for e in recent:
            t.append_text(event_line(e, localtime))
            t.append("\n")
    t.rstrip()
    return t


class CardScreen(ModalScreen[None]):
    BINDINGS: ClassVar = [Binding("escape,enter,q", "dismiss", "Close")]

    def __init__(self, card: pb.Card, events: Iterable[pb.Event], localtime: Callable = time.localtime):
        super().__init__(classes="dialog-screen")
        self.card, self.events, self.localtime = card, list(events), localtime

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            yield Static(f"Card {self.card.index}", classes="dialog-title")
            yield Static(card_details(self.card, self.events, self.localtime), classes="details")


HELP = """\
[b]Views[/b]
  1 host   2 leases and queue   3 events   4 cluster (with --host)
  arrows/Tab move between cards and rows; Enter shows a card's details
[b]Operators[/b] (admin socket; each action asks first)
  d drain   u undrain   m mode: whole/sliced/auto   x release a lease
[b]Cluster[/b]
  type to filter: domain, host, stale, down, degraded, unhealthy, free
  Esc clears the filter
[b]Card tiles[/b]
  ▶ selected   * mode pinned by an operator   ⊘ drained
  ! near thermal slowdown   ½:LEASE ¼:LEASE slices and their leases
  bars: now; sparklines: the last minutes (util, memory)
[b]Health[/b]  {badges}
[b]Events[/b]
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
