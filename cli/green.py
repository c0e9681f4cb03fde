"""`xpu run --when-green --deadline T`: wait for the greenest hour before T (the daemon's carbon signal),
then go on with the run. Pure apart from reading the signal file and sleeping."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from xpud import carbon
from xpud.errors import BadRequest

MAX_DEFER = timedelta(days=31)
_RELATIVE = re.compile(r"\+(\d{1,6})([mhd])")


def parse_deadline(text: str, now: datetime) -> datetime:
    """``+90m``, ``+6h``, ``+2d``, ``HH:MM`` (the next one) or an ISO 8601 time; in the future, within
    31 days. Raises BadRequest with the accepted forms."""
    forms = "give +90m, +6h, +2d, HH:MM or an ISO 8601 time (2026-12-04T06:00)"
    m = _RELATIVE.fullmatch(text.strip())
    if m:
        n, unit = int(m.group(1)), m.group(2)
        at = now + {"m": timedelta(minutes=n), "h": timedelta(hours=n), "d": timedelta(days=n)}[unit]
    elif re.fullmatch(r"\d{1,2}:\d{2}", text.strip()):
        h, mi = map(int, text.split(":"))
        if h > 23 or mi > 59:
            raise BadRequest(f"--deadline {text!r}: not a time of day; {forms}")
        at = now.replace(hour=h, minute=mi, second=0, microsecond=0)
        if at <= now:
            at += timedelta(days=1)
    else:
        try:
            at = datetime.fromisoformat(text.strip())
        except ValueError:
            raise BadRequest(f"--deadline {text[:40]!r}: {forms}") from None
        at = at if at.tzinfo else at.astimezone()
    if at <= now:
        raise BadRequest(f"--deadline {text!r} is in the past")
    if at - now > MAX_DEFER:
        raise BadRequest(f"--deadline {text!r} is more than {MAX_DEFER.days} days away")
    return at


def signal_hours(runtime_dir: Path) -> list[carbon.Hour]:
    """The signal the daemon published (``carbon.json`` in its runtime directory)."""
    path = runtime_dir / carbon.FILE_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadRequest(
            f"{path}: no carbon signal published; the daemon needs [carbon] signal or command in xpud.toml"
        ) from None
    return carbon.parse(text if text.strip() else json.dumps([]), str(path))


def wait_for_green(
    runtime_dir: Path,
    deadline_text: str,
    say: Callable[[str], None],
    now: Callable[[], datetime] = lambda: datetime.now().astimezone(),
    sleep: Callable[[float], None] = time.sleep,
) -> datetime:
    """Sleep until the greenest start before the deadline; returns that start."""
    t = now()
    deadline = parse_deadline(deadline_text, t)
    hours = signal_hours(runtime_dir)
    start, hour = carbon.greenest_start(hours, t, deadline)
    current = next((h.value for h in hours if h.start <= t < h.start + carbon.HOUR), None)
    if hour is None:
        say(f"the carbon signal covers no hour before {deadline:%Y-%m-%d %H:%M}: starting now")
        return start
    now_part = f"; now {current:g}" if current is not None else ""
    if start <= t:
        say(f"this hour is the greenest before {deadline:%Y-%m-%d %H:%M} ({hour.value:g}): starting now")
        return start
    say(
        f"waiting until {start.isoformat(timespec='minutes')}, the greenest hour before "
        f"{deadline:%Y-%m-%d %H:%M} ({hour.value:g}{now_part})"
    )
    while (left := (start - now()).total_seconds()) > 0:
        sleep(min(left, 60.0))
    return start


def before_run(
    runtime_dir: str | None, when_green: bool, deadline: str | None, say: Callable[[str], None]
) -> None:
    """`xpu run`'s --when-green/--deadline (both paths: Typer's and the fast one). Raises BadRequest."""
    if not (when_green or deadline):
        return
    if not (when_green and deadline):
        raise BadRequest("--when-green and --deadline go together: xpu run --when-green --deadline +6h ...")
    from xpud.api.client import runtime_dir as resolve

    wait_for_green(resolve(runtime_dir), deadline, say)
