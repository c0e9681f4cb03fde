"""Printing for the CLI: aligned tables, JSON (shaped by ``jsonshape``), human units. Formatting lives here,
not in the daemon."""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import textwrap
from collections.abc import Sequence

from xpu_cli.jsonshape import to_dict

from xpud.errors import XpudError


def fail(message: str, code: int = 1):
    """One line on stderr, exit ``code``."""
    import typer

    typer.echo(f"xpu: {message}", err=True)
    raise typer.Exit(code)


def handled(fn):
    """Turn daemon errors into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import typer

        try:
            return fn(*args, **kwargs)
        except XpudError as e:
            fail(str(e))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper


__all__ = ["fail", "handled", "to_dict"]


def print_json(obj) -> None:
    if hasattr(obj, "DESCRIPTOR"):
        obj = to_dict(obj)
    elif isinstance(obj, list):
        obj = [to_dict(o) if hasattr(o, "DESCRIPTOR") else o for o in obj]
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


class Styled(str):
    """A table cell with a style (``green``, ``yellow``, ``red``, ``bold``), shown only where colour is on."""

    style: str

    def __new__(cls, text: object, style: str) -> Styled:
        cell = super().__new__(cls, str(text))
        cell.style = style
        return cell


_SGR = {"bold": "1", "red": "31", "green": "32", "yellow": "33", "dim": "2"}
HEALTH_STYLES = {"healthy": "green", "degraded": "yellow", "unhealthy": "red"}
ELLIPSIS = "…"
GAP = 2  # spaces between columns
COMFORTABLE = 16


def colour_on(out) -> bool:
    """Colour only on a terminal, never with ``NO_COLOR`` set (https://no-color.org) or ``TERM=dumb``."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, style: str, on: bool) -> str:
    codes = ";".join(_SGR[s] for s in style.split() if s in _SGR)
    return f"\x1b[{codes}m{text}\x1b[0m" if on and codes else text


def width_for(out) -> int | None:
    """The width a table must fit: ``COLUMNS`` when set, the terminal's on a terminal, else None (a pipe or
    a file gets whole rows: cutting them would lose data a script greps for)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    isatty = getattr(out, "isatty", None)
    if isatty and isatty():
        return shutil.get_terminal_size().columns
    return None


def fit(widths: list[int], mins: list[int], width: int | None) -> list[int]:
    """Column widths that fit ``width`` (gaps included): the widest column is cut first, down to the
    next widest or its minimum, then the widest again, and so on. Widths stay as they are when they fit
    or when no width is given; a table whose minimums do not fit stays too wide."""
    widths = list(widths)
    if width is None:
        return widths
    excess = sum(widths) + GAP * (len(widths) - 1) - width
    while excess > 0:
        order = sorted((i for i, w in enumerate(widths) if w > mins[i]), key=lambda i: -widths[i])
        if not order:
            break
        i = order[0]
        floor = max(mins[i], widths[order[1]]) if len(order) > 1 else mins[i]
        step = min(excess, widths[i] - floor) or 1
        widths[i] -= step
        excess -= step
    return widths


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, an ellipsis marking a cut."""
    return text if len(text) <= width else text[: max(0, width - 1)] + ELLIPSIS


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    out=None,
    width: int | None = None,
    optional: Sequence[str] = (),
) -> None:
    """Print an aligned table that fits the terminal (see ``width_for``; ``width`` overrides it): the
    widest columns are cut with an ellipsis, so each row stays one line; where that would cut columns
    below 16 cells, the ``optional`` columns (header names, least useful first) are left out first, with
    a note saying so. ``Styled`` cells are coloured where colour is on (``colour_on``), the header bold."""
    out = out or sys.stdout
    on = colour_on(out)
    limit = width if width is not None else width_for(out)
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else str(c) for c in r] for r in rows]
    natural = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    # a column keeps its header's width (up to 8 cells) and never goes below 3 cells
    mins = [min(n, max(3, min(len(h), 8))) for n, h in zip(natural, cells[0], strict=True)]
    # a column is cut comfortably down to 16 cells (or its header); below that, optional columns go first
    comfortable = [min(n, max(COMFORTABLE, len(h))) for n, h in zip(natural, cells[0], strict=True)]
    keep = list(range(len(headers)))
    hidden = []
    for name in optional:
        if limit is None or sum(comfortable[i] for i in keep) + GAP * (len(keep) - 1) <= limit:
            break
        if name in headers:
            keep.remove(headers.index(name))
            hidden.append(name)
    cells = [[r[i] for i in keep] for r in cells]
    widths = fit([natural[i] for i in keep], [mins[i] for i in keep], limit)
    for n, r in enumerate(cells):
        parts = []
        for i, (c, w) in enumerate(zip(r, widths, strict=True)):
            text = cut(c, w)
            pad = "" if i == len(r) - 1 else " " * (w - len(text))
            style = "bold" if n == 0 else getattr(c, "style", "")
            parts.append(paint(text, style, on) + pad)
        out.write((" " * GAP).join(parts).rstrip() + "\n")
    if hidden:
        out.write(f"({', '.join(hidden)} left out to fit {limit} columns; --json has everything)\n")


def note(text: str, out=None, indent: str = "  ") -> None:
    """Print a line of prose under a table, wrapped to the table's width (continuation lines indented)."""
    out = out or sys.stdout
    limit = width_for(out)
    if limit is None or len(text) <= limit:
        out.write(text + "\n")
        return
    lead = len(text) - len(text.lstrip(" "))
    wrapped = textwrap.fill(text, limit, subsequent_indent=" " * lead + indent, break_on_hyphens=False)
    out.write(wrapped + "\n")


def cpu_ranges(cpus: Sequence[int]) -> str:
    """[0,1,2,3,8,9] -> '0-3,8-9' (as nvidia-smi prints CPU affinity)."""
    if not cpus:
        return "N/A"
    out, start, prev = [], cpus[0], cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(out)
