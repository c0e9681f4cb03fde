"""One card as a tile: health, mode and slices, utilisation and memory bars with sparklines, temperature
and power, and who holds it.

``tile_lines`` is the whole look of a tile as Rich text for a given width, so the widget only keeps the
data and re-renders at its current size. State is spelt out in words and symbols, not colour alone.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.widget import Widget
from xpu_cli import vocab
from xpu_tui.hoststate import CardHistory
from xpu_tui.render import bar, health_badge, short, spark

from xpud.api.v1 import xpu_pb2 as pb

TILE_WIDTH = 38  # the narrowest tile that still reads well (two fit in 80 columns)
TILE_HEIGHT = 8  # six lines and the border
COMPACT_HEIGHT = 4  # two lines and the border: eight cards in 80x24
TALL_HEIGHT = 11  # nine lines and the border, where the screen has room: power, every holder


def _level_style(pct: float | None) -> str:
    if pct is None:
        return "dim"
    return "green" if pct < 50 else ("yellow" if pct < 85 else "red")


def _field(sample: pb.Sample, name: str):
    return getattr(sample, name) if sample.HasField(name) else None


mode_text = vocab.mode  # ``whole``, ``sliced/mig``, with ``*`` when an operator pinned the mode


def holders_text(card: pb.Card) -> str:
    """Who holds the card, in the CLI's HELD BY words: ``held by 78a228d2 (whole)``, or ``idle``."""
    held = vocab.held_by(card)
    return "idle" if held == "-" else f"held by {held}"


def _head(card: pb.Card) -> Text:
    symbol, word, style = health_badge(card.health_state)
    head = Text()
    head.append(f"{symbol} {word} {card.health_score:>3}", style=style)
    head.append(f"  {mode_text(card)}")
    if card.drained:
        head.append("  ⊘ drained", style="yellow")
    return head


def compact_lines(card: pb.Card, width: int) -> list[Text]:
    """Two lines: health (symbol and score), mode and the load in numbers; then who holds it, or why it
    is out."""
    symbol, _, style = health_badge(card.health_state)
    head = Text()
    head.append(f"{symbol} {card.health_score:>3}", style=style)
    head.append(f"  {mode_text(card)}")
    sample = card.sample if card.HasField("sample") else None
    if sample is not None and sample.lost:
        head.append("  ✖ lost", style="bold red")
    elif sample is not None:
        util = _field(sample, "utilization_gpu_pct")
        used, total = _field(sample, "memory_used_bytes"), _field(sample, "memory_total_bytes")
        mem = 100.0 * used / total if used is not None and total else None
        head.append("  util ")
        head.append(f"{'-' if util is None else util}%", style=_level_style(util))
        head.append(" mem ")
        head.append(f"{'-' if mem is None else f'{mem:.0f}'}%", style=_level_style(mem))
    head.truncate(width, overflow="ellipsis")
    if card.drained:
        second = Text(short(f"⊘ {card.drain_reason or 'drained'}", width), style="yellow")
    else:
        second = Text(short(holders_text(card), width), style="bold" if card.whole_lease else "")
    return [head, second]


def tile_lines(card: pb.Card, history: CardHistory, width: int, height: int = TILE_HEIGHT - 2) -> list[Text]:
    """The lines of a tile ``width`` cells wide and ``height`` lines high (inside the border): two in a
    compact tile, six in a normal one, nine in a tall one (a power line and one line per holder)."""
    width = max(width, 24)
    if height < TILE_HEIGHT - 2:
        return compact_lines(card, width)
    tall = height >= TALL_HEIGHT - 2
    lines: list[Text] = [_head(card)]

    sample = card.sample if card.HasField("sample") else None
    if sample is not None and sample.lost:
        lines.append(Text("✖ lost: the card fell off the bus", style="bold red"))
        lines.append(Text("  no utilisation, memory or power", style="dim"))
        lines.append(Text(""))
    else:
        util = _field(sample, "utilization_gpu_pct") if sample else None
        used = _field(sample, "memory_used_bytes") if sample else None
        total = (_field(sample, "memory_total_bytes") if sample else None) or card.memory_total_bytes
        mem_pct = 100.0 * used / total if used is not None and total else None
        bar_w = max(6, (width - 11) // 2)
        spark_w = max(0, width - 11 - bar_w)
        power = _field(sample, "power_w") if sample else None
        limit = _field(sample, "power_limit_w") if sample else None
        rows = [("util", util, history.utilization_pct), ("mem ", mem_pct, history.memory_pct)]
        if tall:
            power_pct = 100.0 * power / limit if power is not None and limit else None
            rows.append(("pwr ", power_pct, history.power_pct))
        for label, pct, points in rows:
            line = Text(f"{label} ")
            line.append(bar(None if pct is None else pct / 100, bar_w), style=_level_style(pct))
            line.append(f" {pct:>3.0f}%" if pct is not None else "    -")
            line.append(" " + spark(points, spark_w), style="cyan")
            lines.append(line)
        lines.append(_readings(sample, used, total))

    if tall and card.slices:
        lines.append(Text("held by", style="dim"))
        shown = card.slices[: max(1, height - len(lines) - 1)]
        for s in shown:
            lines.append(Text(short(f"  {s.lease_id} ({vocab.size_word(s.size)})", width)))
        if len(shown) < len(card.slices):
            lines[-1] = Text(f"  … and {len(card.slices) - len(shown) + 1} more", style="dim")
    else:
        lines.append(Text(short(holders_text(card), width), style="bold" if not card.slices else ""))
    lines.append(_footnote(card, width))
    return lines


def _readings(sample: pb.Sample | None, used: int | None, total: int | None) -> Text:
    if sample is None:
        return Text("no sample yet", style="dim")
    temp = _field(sample, "temperature_c")
    slow = _field(sample, "temperature_slowdown_c")
    power = _field(sample, "power_w")
    limit = _field(sample, "power_limit_w")
    pstate = _field(sample, "performance_state")
    out = Text()
    hot = temp is not None and slow is not None and temp >= slow - 5
    out.append(f"{temp}°C" if temp is not None else "-°C", style="bold red" if hot else "")
    if hot:
        out.append("!", style="bold red")  # near the slowdown threshold, visible without colour
    out.append(f"  {power:.0f}" if power is not None else "  -")
    out.append(f"/{limit:.0f}W" if limit is not None else "W")
    out.append(f"  P{pstate}" if pstate is not None else "")
    out.append(f"  {vocab.memory(used, total)}")
    return out


def _footnote(card: pb.Card, width: int) -> Text:
    if card.drained:
        return Text(short(f"⊘ {card.drain_reason or 'drained'}", width), style="yellow")
    if card.mode == "sliced" and not card.whole_lease:
        return Text(
            short(f"free {vocab.free(card)}", width),
            style="dim",
        )
    return Text("")


class CardTile(Widget, can_focus=True):
    """A focusable card tile; focusing it selects the card for the operator keys."""

    BINDINGS: ClassVar = [
        Binding("left", "move(-1)", "Previous", show=False),
        Binding("right", "move(1)", "Next", show=False),
        Binding("up", "move_row(-1)", "Up", show=False),
        Binding("down", "move_row(1)", "Down", show=False),
        Binding("enter", "details", "Details"),
    ]

    class Selected(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    class Move(Message):
        """Ask the host view to move the focus (it knows the grid)."""

        def __init__(self, tile: CardTile, step: int, by_row: bool) -> None:
            super().__init__()
            self.tile, self.step, self.by_row = tile, step, by_row

    class DetailsRequested(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, card: pb.Card, history: CardHistory, **kw) -> None:
        super().__init__(id=f"card-{card.index}", **kw)
        self.card = card
        self.history = history
        self._set_titles()

    def show(self, card: pb.Card, history: CardHistory) -> None:
        self.card, self.history = card, history
        self._set_titles()
        self.refresh()

    def _set_titles(self, focused: bool | None = None) -> None:
        name = self.card.name.removeprefix("NVIDIA ")
        # The arrow marks the selected tile on terminals without colour.
        mark = "▶ " if (self.has_focus if focused is None else focused) else ""
        self.border_title = f"{mark}GPU {self.card.index} · {name}"
        # Only on a change: every class change restyles the widget, and this runs at each update.
        for flag, name in (
            (self.card.health_state == "degraded", "-degraded"),
            (self.card.health_state == "unhealthy", "-unhealthy"),
            (self.card.drained, "-drained"),
        ):
            if flag != self.has_class(name):
                self.set_class(flag, name)

    def render(self) -> Text:
        size = self.content_size
        return Text("\n").join(tile_lines(self.card, self.history, size.width, size.height))

    def on_focus(self) -> None:
        self._set_titles(focused=True)
        self.post_message(self.Selected(self.card.index))

    def on_blur(self) -> None:
        self._set_titles(focused=False)

    def action_move(self, step: int) -> None:
        self.post_message(self.Move(self, step, by_row=False))

    def action_move_row(self, step: int) -> None:
        self.post_message(self.Move(self, step, by_row=True))

    def action_details(self) -> None:
        self.post_message(self.DetailsRequested(self.card.index))
