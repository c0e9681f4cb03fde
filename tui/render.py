"""Text for the dashboard: bars, sparklines, sizes, ages and state badges.

Human formatting lives only here (the data side keeps bytes, percents and epoch seconds). Every state has
a word and a symbol as well as a colour, so the screen stays meaningful on a monochrome terminal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_EIGHTHS = " ▏▎▍▌▋▊▉█"
_SPARK = "▁▂▃▄▅▆▇█"

# state -> (symbol, word, Rich style)
HEALTH_BADGES = {
    "healthy": ("●", "healthy", "green"),
    "degraded": ("▲", "degraded", "yellow"),
    "unhealthy": ("✖", "unhealthy", "bold red"),
}
UNKNOWN_BADGE = ("?", "unknown", "dim")

# event kind -> (symbol, Rich style)
EVENT_BADGES = {
    "grant": ("+", "green"),
    "release": ("-", "cyan"),
    "reclaim": ("↺", "yellow"),
    "evict": ("⏏", "magenta"),
    "drain": ("⊘", "yellow"),
    "undrain": ("⊙", "green"),
    "mode": ("⇄", "blue"),
    "health": ("♥", "red"),
    "move": ("→", "magenta"),
    "fault": ("⚡", "bold red"),
    "error": ("!", "bold red"),
    "restore": ("⟲", "cyan"),
}

SLICE_GLYPHS = {"vxpu-half": "½", "vxpu-quarter": "¼"}


def health_badge(state: str) -> tuple[str, str, str]:
    return HEALTH_BADGES.get(state, UNKNOWN_BADGE)


def slice_glyph(size: str) -> str:
    """Short name of a slice size: ½ and ¼ for the standard ones, else the name without ``vxpu-``."""
    return SLICE_GLYPHS.get(size, size.removeprefix("vxpu-"))


def slice_count(n: int, size: str) -> str:
    """``3×½``: a count of slices that cannot be misread as a mixed number (``1¼``)."""
    return f"{n}×{slice_glyph(size)}"


def bar(fraction: float | None, width: int) -> str:
    """A horizontal bar ``width`` cells wide, in eighths of a cell; blank-dotted when unknown."""
    if fraction is None or math.isnan(fraction):
        return "·" * width
    eighths = round(min(max(fraction, 0.0), 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (_EIGHTHS[part] if part else "")
    return text.ljust(width)


def spark(values: Sequence[float], width: int, high: float = 100.0) -> str:
    """The last ``width`` values as a sparkline (0..high), right-aligned; blank where there is no data."""
    tail = list(values)[-width:]
    cells = []
    for v in tail:
        level = min(max(v / high, 0.0), 1.0) if high > 0 else 0.0
        cells.append(_SPARK[min(len(_SPARK) - 1, int(level * len(_SPARK)))])
    return "".join(cells).rjust(width)


def short(text: str, width: int) -> str:
    """Cut ``text`` to ``width`` cells with an ellipsis."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"
