"""Per-lease measurement: what a lease's processes use of what it asked for.

Pure bookkeeping over readings the hardware adapter gives (``Nvml.process_utilization``: SM % of the
whole card per process, samples newer than the last one read; ``Nvml.process_memory``: device memory per
process, per MIG instance on MIG cards). ``measure`` turns one round of those into one ``Reading`` per
lease; ``UsageBook`` keeps a short history per lease and per job class, which ``xpud.planning.sizing`` decides
from and ``xpu leases --usage`` shows.

With MIG on the driver keeps no per-process utilisation (NotSupported): such a lease's compute use is
unknown (``sm_pct`` None), it is measured by memory only and never counted as throttled.

A lease's processes are its holder's descendants (``xpu run`` execs nothing itself: the command is its
child); ``lease_pids`` reads them from /proc through psutil, so call it off the event loop.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil

CLASS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/ -]{0,63}$")


@dataclass(frozen=True)
class Reading:
    """One measurement of a lease. Percentages are of the whole card."""

    t: float  # engine clock, seconds
    sm_pct: float | None  # compute its processes used (sum); None: the card cannot say (MIG on)
    mem_bytes: int | None  # device memory its processes hold (sum); None: unknown
    cap_pct: float  # compute it may use: the slice's active-thread percentage, 100 for whole cards
    mem_cap_bytes: int  # device memory it may use
    membw_pct: float | None = None  # memory-controller busy time of its processes (sum); None: unknown

    def throttled(self, at_cap: float) -> bool:
        """Its compute use sits at its cap (at least ``at_cap`` of it), so it is waiting on the limit."""
        return self.sm_pct is not None and self.cap_pct < 100 and self.sm_pct >= at_cap * self.cap_pct


def job_class(command: str, given: str = "", words: int = 2) -> str:
    """A job's class: ``given`` (``xpu run --class NAME``) or the command's first words without paths
    (``python serve.py --port 80`` -> ``python serve.py``)."""
    if given:
        return given
    return _class_of(command[:256], words)  # the first words are at the start: never split a long command


@functools.lru_cache(maxsize=1024)
def _class_of(head: str, words: int) -> str:
    """``job_class`` of a command's head: cached (bounded: heads of at most 256 characters), as every
    grant asks it and the same commands come again and again; ``shlex.split`` is slow."""
    try:
        parts = shlex.split(head)
    except ValueError:
        parts = head.split()
    picked = [p.rsplit("/", 1)[-1] for p in parts if not p.startswith("-")][:words]
    return " ".join(picked)[:64] or "unknown"


def lease_pids(holder_pid: int | None) -> set[int]:
    """The holder and its descendants (blocking: reads /proc). Empty when the holder is gone."""
    if not holder_pid:
        return set()
    try:
        p = psutil.Process(holder_pid)
        return {holder_pid, *(c.pid for c in p.children(recursive=True))}
    except psutil.Error:
        return set()


def measure(
    t: float,
    pids: Iterable[int],
    util: list[tuple[int, int, int, int]] | None,
    memory: Mapping[int, int | None],
    cap_pct: float,
    mem_cap_bytes: int,
) -> Reading:
    """One lease's reading from one round of samples on its card. ``util``: the card's per-process
    samples [(pid, timestamp_us, sm %, mem %)] (several per pid: the newest counts), [] when the driver
    had no new sample (all idle), None when unsupported. ``memory``: {pid: bytes} on the card."""
    mine = set(pids)
    sm = bw = None
    if util is not None:
        newest: dict[int, tuple[int, int, int]] = {}
        for pid, stamp, sm_pct, mem_pct in util:
            if pid in mine and (pid not in newest or stamp > newest[pid][0]):
                newest[pid] = (stamp, sm_pct, mem_pct)
        sm = float(min(100, sum(v for _, v, _ in newest.values())))
        bw = float(min(100, sum(v for _, _, v in newest.values())))
    held = [memory[p] for p in mine if p in memory]
    mem = None if any(v is None for v in held) else sum(v or 0 for v in held)
    return Reading(t, sm, mem, float(cap_pct), int(mem_cap_bytes), bw)


@dataclass(frozen=True)
class Summary:
    """What a lease (or a class) used over its history."""

    readings: int
    sm_mean: float | None
    sm_peak: float | None  # 90th percentile of its readings: a burst is not its size
    mem_peak: int | None
    throttled_share: float  # of the readings with a compute figure


def summarize(readings: Iterable[Reading], at_cap: float) -> Summary:
    rs = list(readings)
    sms = sorted(r.sm_pct for r in rs if r.sm_pct is not None)
    mems = [r.mem_bytes for r in rs if r.mem_bytes is not None]
    if not sms:
        return Summary(len(rs), None, None, max(mems) if mems else None, 0.0)
    p90 = sms[min(len(sms) - 1, int(0.9 * len(sms)))]
    hot = sum(1 for r in rs if r.throttled(at_cap))
    return Summary(len(rs), sum(sms) / len(sms), p90, max(mems) if mems else None, hot / len(sms))


def profile(readings: Iterable[Reading]) -> tuple[float, float] | None:
    """What a lease (or class) keeps busy on its card on average: (SM %, memory-controller %), each of
    the whole card; None without readings that have both. A compute-bound job shows a high first figure
    and a low second; a memory-bound one a high second (its kernels wait on device memory)."""
    pairs = [(r.sm_pct, r.membw_pct) for r in readings if r.sm_pct is not None and r.membw_pct is not None]
    if not pairs:
        return None
    return sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)


MAX_CLASSES = 10_000  # classes kept in memory; the least recently measured goes first


class UsageBook:
    """Short histories: per lease (its readings) and per job class (readings of all its leases, so a
    class's next job starts where the last ones ended up). Lives on the daemon's loop. At most
    ``max_classes`` classes are kept (any user names a class with ``--class``): the one measured least
    recently is forgotten first."""

    def __init__(self, keep: int, max_classes: int = MAX_CLASSES):
        self.keep = keep
        self.max_classes = max_classes
        self.leases: dict[str, deque[Reading]] = {}
        self.classes: dict[str, deque[Reading]] = {}
        self.class_of: dict[str, str] = {}
        self._profiles: dict[str, tuple] = {}  # "l:<lease>"/"c:<class>" -> (newest reading, length, profile)

    def add(self, lease_id: str, cls: str, r: Reading) -> None:
        self.leases.setdefault(lease_id, deque(maxlen=self.keep)).append(r)
        self.keep_class(cls, deque(maxlen=self.keep)).append(r)
        self.class_of[lease_id] = cls

    def keep_class(self, cls: str, hist: deque[Reading]) -> deque[Reading]:
        """``cls``'s history (``hist`` when it has none yet), now the most recently measured class;
        the least recently measured one is dropped beyond ``max_classes``."""
        hist = self.classes.pop(cls, hist)
        self.classes[cls] = hist
        while len(self.classes) > self.max_classes:
            old = next(iter(self.classes))
            del self.classes[old]
            self._profiles.pop("c:" + old, None)
        return hist

    def moved(self, lease_id: str) -> None:
        """The lease changed size: its readings against the old cap no longer say how it fits."""
        self.leases.pop(lease_id, None)
        self._profiles.pop("l:" + lease_id, None)

    def end(self, lease_id: str) -> None:
        self.moved(lease_id)
        self.class_of.pop(lease_id, None)

    def history(self, lease_id: str) -> list[Reading]:
        return list(self.leases.get(lease_id, ()))

    def _profile(self, key: str, hist: deque[Reading] | None) -> tuple[float, float] | None:
        """``profile`` of a history, computed again only when a reading was added since (placement asks
        on every tie; readings come once per round)."""
        if not hist:
            return None
        got = self._profiles.get(key)
        if got is None or got[0] is not hist[-1] or got[1] != len(hist):
            got = self._profiles[key] = (hist[-1], len(hist), profile(hist))
        return got[2]

    def class_profile(self, cls: str) -> tuple[float, float] | None:
        return self._profile("c:" + cls, self.classes.get(cls))

    def lease_profile(self, lease_id: str) -> tuple[float, float] | None:
        """The lease's own profile, or its class's while it has no readings of its own (just granted,
        just moved)."""
        own = self._profile("l:" + lease_id, self.leases.get(lease_id))
        if own is not None:
            return own
        cls = self.class_of.get(lease_id)
        return None if cls is None else self.class_profile(cls)
