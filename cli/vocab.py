"""The words every view uses for a card, a lease and a user: `xpu ls`, `xpu leases`, `xpu health` and the
dashboard (``xpu_tui``) all say "held by", "free", memory and owners the same way.

- MODE: ``whole`` or ``sliced/ISOLATION`` (``sliced/mig``, ``sliced/mps``), ``*`` when an operator pinned it.
- HELD BY: ``-``, or one ``LEASE (SIZE)`` per holder, SIZE ``whole``, ``half``, ``quarter`` or a
  configured slice's name: ``78a228d2 (whole)``, ``1f2e3d4c (half), 9a8b7c6d (quarter)``.
- FREE: ``drained`` when nothing may be placed on the card, else what a new lease could still have of it,
  as ``MEM% mem SM% sm`` (an idle card: ``100% mem 100% sm``; a whole-card lease: ``0% mem 0% sm``).
- MEMORY: ``USED/TOTAL GiB`` with one decimal: ``0.5/79.6 GiB``; ``-`` for what a card cannot report.
- Users: names, as this machine knows them, else ``uid N``.
- Durations: two units at most (``age``: ``3m12s``); times: ``timestamp`` (``2026-12-07 08:20:10 UTC``).
- A lease's end: ``status`` (``running``, ``done``, ``exit 3``, ``signal TERM``, ``released``...),
  ``exit_status`` (as a shell's ``$?``), ``run_time``.
"""

from __future__ import annotations

import pwd
import re
import signal
import time
from functools import lru_cache


@lru_cache(maxsize=4096)
def user_name(uid: int) -> str:
    """A uid as a user name when this machine knows it, else ``uid N``."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


_UID = re.compile(r"\buid (\d+)\b")


def with_user_names(text: str) -> str:
    """``text`` (an event's message) with each ``uid N`` the machine knows as its user name, as the tables
    show owners: ``released by uid 0`` -> ``released by root``."""
    return _UID.sub(lambda m: user_name(int(m.group(1))), text)


def size_word(size: str) -> str:
    """A slice size as a word: ``half``, ``quarter``, or a configured name without ``vxpu-``."""
    return size.removeprefix("vxpu-")


def held_by(card) -> str:
    """Who holds ``card`` (a ``pb.Card``), in the HELD BY vocabulary."""
    if card.whole_lease:
        return f"{card.whole_lease} (whole)"
    if card.slices:
        return ", ".join(f"{s.lease_id} ({size_word(s.size)})" for s in card.slices)
    return "-"


def mode(card) -> str:
    """``whole``, ``sliced/mig``, with ``*`` when an operator pinned the mode."""
    text = card.mode + (f"/{card.isolation}" if card.mode == "sliced" and card.isolation != "none" else "")
    return text + ("*" if card.mode_pinned else "")


def card_name(card) -> str:
    """The card's model without the vendor: ``H100 80GB HBM3``."""
    return card.name.removeprefix("NVIDIA ")


def free(card) -> str:
    """What is free on ``card`` (a ``pb.Card``), in the FREE vocabulary."""
    if card.drained:
        return "drained"
    return f"{card.free_memory_fraction * 100:.0f}% mem {card.free_compute_pct}% sm"


def gib(nbytes: int | float | None) -> str:
    """Bytes as GiB with one decimal (``79.6``); ``-`` when unknown."""
    return "-" if nbytes is None else f"{nbytes / (1 << 30):.1f}"


def age(seconds: float) -> str:
    """A duration in two units at most: ``42s``, ``3m12s``, ``5h03m``, ``2d04h`` (negative: ``0s``)."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def timestamp(ts: float) -> str:
    """A local date and time with its zone: ``2026-12-07 08:20:10 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(ts))


def memory(used: int | None, total: int | None) -> str:
    """``0.5/79.6 GiB``: used and total memory, ``-`` for either when unknown."""
    return f"{gib(used)}/{gib(total)} GiB"


def signal_value(sig, name: str) -> str:
    """A signal's value or threshold in human units (the daemon sends raw numbers and a unit)."""
    if not sig.HasField(name):
        return "-"
    v = getattr(sig, name)
    unit = sig.unit
    if unit == "bytes":
        return f"{gib(v)} GiB"
    if unit == "mask":
        return f"0x{int(v):x}"
    if unit == "ratio":
        return f"{v * 100:.0f}%"
    if unit == "P":
        return f"P{int(v)}"
    if sig.name in ("lost", "inforom") and name == "value":
        return {"lost": ("no", "yes"), "inforom": ("invalid", "valid")}[sig.name][int(v)]
    text = f"{v:g}"
    return f"{text} {unit}" if unit and unit != "%" else text + unit


# --------------------------------------------------------------------------- a lease's end
def signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name.removeprefix("SIG")
    except ValueError:
        return str(n)


def status(le) -> str:
    """A lease's state in one word or two: running / unheld while active (held by its wrapper, or kept by
    its anchor: a Slurm job, a pod, a detached job; or neither);
    once ended, how the command ended when its wrapper said (done, exit N, signal NAME), else the lease's
    own end (released, reclaimed, evicted)."""
    if le.state == "active":
        return "running" if le.held or le.anchor else "unheld"
    if le.HasField("exit_signal"):
        return f"signal {signal_name(le.exit_signal)}"
    if le.HasField("exit_code"):
        return "done" if le.exit_code == 0 else f"exit {le.exit_code}"
    return le.state


def exit_status(le) -> int:
    """The lease's command's end as a shell's `$?` (128 + n for signal n; 0 when not reported)."""
    if le.HasField("exit_signal"):
        return 128 + le.exit_signal
    return le.exit_code if le.HasField("exit_code") else 0


def run_time(le, now: float) -> float:
    """Seconds the command ran (or has run so far): from its start (or the grant) to the lease's end."""
    start = le.started if le.HasField("started") else le.created
    end = le.ended if le.HasField("ended") else now
    return max(0.0, end - start)
