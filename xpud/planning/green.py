"""The carbon (or PUE) signal: a value per hour, lower is greener; and the greenest start before a deadline.

The signal comes from ``[carbon] signal`` (a CSV or JSON file) or ``[carbon] command`` (its standard
output, in the same formats). The daemon reads it every ``[carbon] refresh_s`` (off its loop), keeps it
(``Signal``) and publishes the checked hours as ``carbon.json`` in its runtime directory, readable by every
user. ``xpu run --when-green --deadline T`` sends T with its request; the daemon ``plan``s the start in
the greenest hour before T and keeps the request in its queue until then (reason ``BeginTime``).

Formats (hour starts in ISO 8601; without a UTC offset they are the host's local time):
- CSV: ``start,value`` per line; a first line that is not a time (a header) is skipped.
- JSON: ``[{"start": "...", "value": 123.0}, ...]`` or ``{"2026-12-03T01:00+00:00": 123.0, ...}``.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from xpud.errors import XpudError
from xpud.planning.runfiles import publish_json

MAX_HOURS = 24 * 31  # a month of hours at most
MAX_BYTES = 1 << 20
MAX_VALUE = 1e6  # gCO2/kWh stay below ~2,000; PUE below ~3: anything larger is a unit mistake
COMMAND_TIMEOUT_S = 30.0
FILE_NAME = "carbon.json"
HOUR = timedelta(hours=1)
MAX_DEFER = timedelta(days=31)  # a deferrable request's deadline is at most this far ahead


class SignalError(XpudError, ValueError):
    """A signal that cannot be used, with the reason (where, what, how to fix)."""


@dataclass(frozen=True)
class Hour:
    start: datetime  # aware
    value: float  # lower is greener


def _time(text: str, where: str) -> datetime:
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise SignalError(
            f"{where}: {text[:40]!r} is not an ISO 8601 time (e.g. 2026-12-03T01:00+00:00)"
        ) from None
    return t if t.tzinfo else t.astimezone()


def _value(v, where: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise SignalError(f"{where}: {str(v)[:40]!r} is not a number") from None
    if isinstance(v, bool) or not math.isfinite(x) or not 0 <= x <= MAX_VALUE:
        raise SignalError(f"{where}: {x!r} is outside 0..{MAX_VALUE:g}")
    return x


def parse(text: str, source: str) -> list[Hour]:
    """The hours in ``text`` (CSV or JSON), sorted and checked. Raises SignalError naming ``source``."""
    if len(text) > MAX_BYTES:
        raise SignalError(f"{source}: {len(text)} bytes; at most {MAX_BYTES}")
    pairs: list[tuple[str, object, str]] = []
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SignalError(f"{source}: not valid JSON: {e}") from None
        if isinstance(data, dict):
            pairs = [(k, v, f"{source}: {k[:40]!r}") for k, v in data.items()]
        elif isinstance(data, list) and all(isinstance(x, dict) for x in data):
            for n, x in enumerate(data, 1):
                if not isinstance(x.get("start"), str) or "value" not in x:
                    raise SignalError(f'{source}: item {n}: expected {{"start": TIME, "value": NUMBER}}')
                pairs.append((x["start"], x["value"], f"{source}: item {n}"))
        else:
            raise SignalError(f"{source}: expected a list of {{start, value}} or an object of time: value")
    else:
        first = True
        for n, row in enumerate(csv.reader(io.StringIO(text)), 1):
            if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                continue
            if len(row) != 2:
                raise SignalError(f"{source}:{n}: expected start,value; got {len(row)} field(s)")
            header, first = first and not row[0].strip()[:1].isdigit(), False
            if header:
                continue
            pairs.append((row[0], row[1], f"{source}:{n}"))
    if len(pairs) > MAX_HOURS:
        raise SignalError(f"{source}: {len(pairs)} hours; at most {MAX_HOURS}")
    hours = sorted((Hour(_time(t, w), _value(v, w)) for t, v, w in pairs), key=lambda h: h.start)
    for a, b in itertools.pairwise(hours):
        if a.start == b.start:
            raise SignalError(f"{source}: hour {a.start.isoformat()} is given twice")
    return hours


def read(signal: str, command: str) -> list[Hour]:
    """Read the configured signal (a file, or a command's output). Blocking: call it off the loop."""
    if command:
        try:
            r = subprocess.run(
                command, shell=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise SignalError(f"[carbon] command: no answer in {COMMAND_TIMEOUT_S:g} s") from None
        if r.returncode != 0:
            raise SignalError(f"[carbon] command exited {r.returncode}: {r.stderr.strip()[-200:]}")
        return parse(r.stdout, "[carbon] command")
    try:
        with open(signal, encoding="utf-8") as f:
            text = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise SignalError(f"[carbon] signal {signal}: {e.strerror}") from None
    return parse(text, signal)


def publish(hours: list[Hour], runtime_dir: Path) -> Path:
    """Publish the checked hours as ``carbon.json`` in ``runtime_dir`` for ``xpu run --when-green``."""
    return publish_json(
        [{"start": h.start.isoformat(), "value": h.value} for h in hours], runtime_dir, FILE_NAME
    )


def greenest_start(hours: list[Hour], now: datetime, deadline: datetime) -> tuple[datetime, Hour | None]:
    """When to start so as to start in the greenest hour from ``now`` until ``deadline``: the start of that
    hour (or ``now`` within the current one). Ties go to the earliest. Hours the signal does not cover
    are not chosen; with no covered hour before the deadline, (now, None)."""
    best: tuple[float, datetime, Hour] | None = None
    for h in hours:
        end = h.start + HOUR
        if end <= now or h.start >= deadline:
            continue
        start = max(h.start, now)
        if best is None or (h.value, start) < (best[0], best[1]):
            best = (h.value, start, h)
    return (now, None) if best is None else (best[1], best[2])


@dataclass
class Signal:
    """The signal the daemon read last (its jobs refresh it; Acquire plans green starts from it)."""

    hours: list[Hour] = field(default_factory=list)
    configured: bool = False  # [carbon] signal or command is set


def plan(hours: list[Hour], now: datetime, deadline: datetime) -> tuple[datetime, str]:
    """The start of a deferrable request (``greenest_start``) and why, in one line."""
    start, hour = greenest_start(hours, now, deadline)
    by = f"{deadline:%Y-%m-%d %H:%M}"
    if hour is None:
        return start, f"the carbon signal covers no hour before {by}: starting now"
    if start <= now:
        return start, f"this hour is the greenest before {by} ({hour.value:g}): starting now"
    current = next((h.value for h in hours if h.start <= now < h.start + HOUR), None)
    now_part = f"; now {current:g}" if current is not None else ""
    return start, f"the greenest hour before {by} ({hour.value:g}{now_part})"
