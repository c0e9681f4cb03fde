"""A capacity window as the config holds it: one ``[[windows]]`` entry, checked, with its cron trigger.

The cron expression is APScheduler (3.x)'s, with crontab's day-of-week numbers (0 or 7 Sunday). When the
windows start and what they mean for the cards: ``xpud.planning.windows``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a trigger is made: every `xpu` command reads the config (~70 ms)
    from apscheduler.triggers.cron import CronTrigger

MAX_WINDOWS = 64


@dataclass(frozen=True)
class WindowSpec:
    """One ``[[windows]]`` entry as the config holds it."""

    name: str
    cron: str  # five crontab fields: minute hour day-of-month month day-of-week
    whole_share: float  # 0..1 of the usable cards kept whole while it holds
    timezone: str = ""  # IANA name; empty = the host's

    def trigger(self) -> CronTrigger:
        """The APScheduler trigger, with crontab's day-of-week numbers (0 or 7 Sunday, 1 Monday).
        APScheduler 3's own ``from_crontab`` reads them as 0 = Monday, which shifts "1-5" to Tuesday to
        Saturday; the field is translated to day names first."""
        from apscheduler.triggers.cron import CronTrigger

        fields = self.cron.split()
        if len(fields) != 5:
            raise ValueError(f"Wrong number of fields; got {len(fields)}, expected 5")
        minute, hour, day, month, dow = fields
        return CronTrigger(
            minute=minute,
            hour=hour,
            day=day,
            month=month,
            day_of_week=crontab_days(dow),
            timezone=self.timezone or None,
        )


DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def crontab_days(field: str) -> str:
    """A crontab day-of-week field (numbers 0-7 with 0 and 7 Sunday, or names; ``*``, ranges, lists,
    steps) as a list of day names, which APScheduler reads the same way."""
    if field in ("*", "?"):
        return "*"
    days: set[int] = set()
    for part in field.lower().split(","):
        rng, _, step_text = part.partition("/")
        if step_text and not step_text.isdigit():
            raise ValueError(f"day of week {field!r}: step {step_text!r} is not a number")
        step = int(step_text) if step_text else 1
        if step < 1:
            raise ValueError(f"day of week {field!r}: step must be at least 1")
        if rng == "*":
            lo, hi = 0, 6
        else:
            a, _, b = rng.partition("-")
            lo, hi = _day(a, field), _day(b, field) if b else _day(a, field)
            if b and hi == 0 and b.strip() in ("7",):
                hi = 7
            if not b and step_text:
                hi = 6  # "n/step": from n to the end of the week, as cron
            if hi < lo:
                raise ValueError(f"day of week {field!r}: range {rng!r} runs backwards")
        days.update(d % 7 for d in range(lo, hi + 1, step))
    return ",".join(DAY_NAMES[d] for d in sorted(days))


def _day(text: str, field: str) -> int:
    t = text.strip()
    if t.isdigit() and 0 <= int(t) <= 7:
        return int(t)
    if t[:3] in DAY_NAMES and len(t) == 3:
        return DAY_NAMES.index(t[:3])
    raise ValueError(f"day of week {field!r}: {text!r} is not 0-7 or a day name (sun..sat)")


def check(spec: dict[str, Any]) -> WindowSpec:
    """One ``[[windows]]`` table as a WindowSpec. Raises ValueError with the reason (key named)."""
    known = {"name", "cron", "whole_share", "timezone"}
    for key in spec:
        if key not in known:
            raise ValueError(f"unknown key {key!r}; a window has {', '.join(sorted(known))}")
    name, cron, share = spec.get("name"), spec.get("cron"), spec.get("whole_share")
    tz = spec.get("timezone", "")
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.replace("-", "").isalnum():
        raise ValueError(f"name: expected 1..64 letters, digits or '-', got {name!r}")
    if not isinstance(cron, str) or len(cron) > 200:
        raise ValueError(f"cron: expected a crontab expression such as '0 8 * * 1-5', got {cron!r}")
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        raise ValueError(f"whole_share: expected a number in 0..1, got {share!r}")
    if not isinstance(tz, str) or len(tz) > 64:
        raise ValueError(f"timezone: expected an IANA name such as 'Europe/Berlin', got {tz!r}")
    out = WindowSpec(name, cron, float(share), tz)
    try:
        out.trigger()
    except (ValueError, LookupError) as e:  # bad field, bad range, unknown time zone
        raise ValueError(f"cron {cron!r}{f' in {tz}' if tz else ''}: {e}") from None
    return out
