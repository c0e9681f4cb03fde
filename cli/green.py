"""`xpu run --when-green --deadline T`: the deadline T for the request; the daemon queues the request until
the greenest hour of its carbon signal before T (``xpud.planning.green.plan``). Pure."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from xpud.errors import BadRequest
from xpud.planning.green import MAX_DEFER

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


def green_deadline(when_green: bool, deadline: str | None, now: datetime | None = None) -> float:
    """`xpu run`'s --when-green/--deadline as the request's green deadline (seconds since the epoch; 0
    without them). The daemon plans the start from its carbon signal. Raises BadRequest."""
    if not (when_green or deadline):
        return 0.0
    if not (when_green and deadline):
        raise BadRequest("--when-green and --deadline go together: xpu run --when-green --deadline +6h ...")
    return parse_deadline(deadline, now or datetime.now().astimezone()).timestamp()
