"""The cluster view: what every host offers, spread with the membership protocol. Pure.

Each host puts a compact summary of itself in its membership ``meta`` (``encode``): network location,
free whole cards, the bandwidth of its best free group per size, free slices by size, its weakest free
card's health, queue length and card count. ``membership.Swim`` spreads it with the host's incarnation, so
every peer holds the newest summary it heard, with its age. ``offers`` turns a membership table into the
``placement.multihost.HostOffer`` snapshot that multi-host placement reads.

Summaries from the wire are checked like any input: bounded size, known keys, finite numbers in range;
a summary that fails is dropped (the host then offers nothing), never trusted in part.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from xpud.config.accounts import ACCOUNT_NAME, MAX_ACCOUNTS
from xpud.errors import XpudError
from xpud.federation.membership import MAX_META, Member, State
from xpud.placement.multihost import HostOffer
from xpud.planning.fairshare import HostAccounts

MAX_CARDS = 64
MAX_SIZES = 16
_FIELD = 64  # characters of a location or size name
MAX_GPU_EQ = 1e6  # GPU-equivalents an account may hold or wait for on one host
MAX_USAGE_S = 1e13  # decayed GPU-seconds (1e6 GPUs for a year's half-life is about 4.5e13 / ln 2: ample)
_HASH = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class HostSummary:
    cards: int
    free_whole: int
    group_gbps: tuple[float, ...] = ()  # [k-1]: bus GB/s of the best free k-card group (inf for k = 1)
    free_slices: Mapping[str, int] = field(default_factory=dict)
    health: int = 100  # the weakest score among free cards (100 with none)
    queue: int = 0
    zone: str = ""
    block: str = ""
    domain: str = ""
    # [accounts] (issue #33): only with accounts configured (older peers refuse an unknown key); the
    # accounts that hold, used or wait, the busiest first, as many as fit in MAX_META
    accounts: HostAccounts | None = None


class BadSummary(XpudError, ValueError):
    pass


def encode(s: HostSummary) -> str:
    """The summary as compact JSON for ``Swim.set_meta`` (at most ``MAX_META`` bytes)."""
    doc = {
        "c": s.cards,
        "w": s.free_whole,
        "g": [None if math.isinf(x) else round(x, 1) for x in s.group_gbps[:MAX_CARDS]],
        "s": dict(list(s.free_slices.items())[:MAX_SIZES]),
        "h": s.health,
        "q": s.queue,
        "l": [s.zone, s.block, s.domain],
    }
    text = json.dumps(doc, separators=(",", ":"))
    if s.accounts is not None:
        text = _with_accounts(doc, s.accounts, s.cards)
    if len(text.encode()) > MAX_META:
        raise BadSummary(f"host summary is {len(text.encode())} bytes; at most {MAX_META}")
    return text


def _with_accounts(doc: dict, a: HostAccounts, cards: int) -> str:
    """``doc`` with ``"a": [config hash, [[name, allocated, usage GPU-s, waiting], ...]]``: the accounts that
    hold, used or wait, busiest first, as many as fit in MAX_META (the rest count as zero on every host
    alike: each host reads its own part back from what it published, ``Federation.own_accounts``). How
    many fit depends on the rest of the summary and the names' length: about 19 accounts with names of 32
    characters, 37 with 10, on a host with few free cards; fewer where its free-group bandwidths take
    the room (64 free cards). An account holds at most the host's cards."""
    names = sorted(
        {*a.allocated, *a.usage, *a.waiting},
        key=lambda n: (-(a.allocated.get(n, 0.0) + a.waiting.get(n, 0.0)), -a.usage.get(n, 0.0), n),
    )
    rows = []
    for n in names[:MAX_ACCOUNTS]:
        row = [
            n,
            round(min(a.allocated.get(n, 0.0), cards), 4),
            round(a.usage.get(n, 0.0)),
            round(a.waiting.get(n, 0.0), 4),
        ]
        if row[1] or row[2] or row[3]:
            rows.append(row)
    while True:
        text = json.dumps({**doc, "a": [a.config_hash, rows]}, separators=(",", ":"))
        if len(text.encode()) <= MAX_META or not rows:
            return text
        rows.pop()


def _amount(v, hi: float, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 <= v <= hi:
        raise BadSummary(f"{what}: {v!r} is not a number in 0..{hi:g}")
    return float(v)


def _accounts(v, cards: int) -> HostAccounts:
    """The ``"a"`` of a summary, checked: names, and numbers finite and in range (an account holds at most
    the host's ``cards``: a slice counts its memory fraction)."""
    if not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) or not isinstance(v[1], list):
        raise BadSummary("accounts: [config hash, rows]")
    digest, rows = v
    if len(digest) > 16 or not set(digest) <= _HASH:
        raise BadSummary("accounts: the config hash is up to 16 hex digits")
    if len(rows) > MAX_ACCOUNTS:
        raise BadSummary(f"accounts: at most {MAX_ACCOUNTS}")
    alloc, usage, waiting = {}, {}, {}
    for row in rows:
        if not isinstance(row, list) or len(row) != 4 or not isinstance(row[0], str):
            raise BadSummary("accounts: each row is [name, allocated, usage, waiting]")
        name = row[0]
        if not ACCOUNT_NAME.fullmatch(name) or name in alloc:
            raise BadSummary(f"accounts: {name[:40]!r} is not an account name, or twice")
        alloc[name] = _amount(row[1], float(cards), f"{name} allocated (of {cards} cards)")
        usage[name] = _amount(row[2], MAX_USAGE_S, f"{name} usage")
        waiting[name] = _amount(row[3], MAX_GPU_EQ, f"{name} waiting")
    return HostAccounts(digest, alloc, usage, waiting)


def _int(v, lo: int, hi: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadSummary(f"{what}: {v!r} is not an integer in {lo}..{hi}")
    return v


def _name(v, what: str) -> str:
    if not isinstance(v, str) or len(v) > _FIELD or not v.isprintable():
        raise BadSummary(f"{what}: not a short printable name")
    return v


def decode(text: str) -> HostSummary:
    """A summary from a peer, checked; raises ``BadSummary``."""
    if len(text.encode()) > MAX_META:
        raise BadSummary("summary too long")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise BadSummary(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) - {"a"} != {"c", "w", "g", "s", "h", "q", "l"}:
        raise BadSummary("unknown shape")
    cards = _int(doc["c"], 0, MAX_CARDS, "cards")
    free = _int(doc["w"], 0, cards, "free whole cards")
    if not isinstance(doc["g"], list) or len(doc["g"]) > cards:
        raise BadSummary("group bandwidths: a list of at most one per card")
    gbps = []
    for x in doc["g"]:
        if x is None:
            gbps.append(math.inf)
        elif isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= 1e6:
            gbps.append(float(x))
        else:
            raise BadSummary(f"group bandwidth {x!r}: give 0..1e6 GB/s")
    if not isinstance(doc["s"], dict) or len(doc["s"]) > MAX_SIZES:
        raise BadSummary("free slices: a map of at most 16 sizes")
    slices = {
        _name(k, "slice size"): _int(v, 0, 64 * MAX_CARDS, f"free {k} slices") for k, v in doc["s"].items()
    }
    loc = doc["l"]
    if not isinstance(loc, list) or len(loc) != 3:
        raise BadSummary("location: [zone, block, domain]")
    zone, block, domain = (_name(x, "location") for x in loc)
    return HostSummary(
        cards,
        free,
        tuple(gbps),
        slices,
        _int(doc["h"], 0, 100, "health"),
        _int(doc["q"], 0, 10**6, "queue"),
        zone,
        block,
        domain,
        _accounts(doc["a"], cards) if "a" in doc else None,
    )


def more_room(old: HostSummary | None, new: HostSummary | None) -> bool:
    """Whether ``new`` offers more than ``old``: more free whole cards, or more free slices of some size
    (a host with no summary before offers nothing)."""
    if new is None:
        return False
    if old is None:
        return new.free_whole > 0 or any(n > 0 for n in new.free_slices.values())
    return new.free_whole > old.free_whole or any(
        n > old.free_slices.get(size, 0) for size, n in new.free_slices.items()
    )


@dataclass(frozen=True)
class HostEntry:
    """One host as this daemon sees it: its state, summary (None: none or a bad one) and age."""

    name: str
    addr: str
    state: State
    incarnation: int
    age_s: float
    summary: HostSummary | None


def entries(members: Iterable[Member], now: float) -> list[HostEntry]:
    out = []
    for m in members:
        try:
            summary = decode(m.meta) if m.meta else None
        except BadSummary:
            summary = None
        out.append(HostEntry(m.name, m.addr, m.state, m.incarnation, max(now - m.heard, 0.0), summary))
    return sorted(out, key=lambda e: e.name)


def offers(view: Iterable[HostEntry]) -> list[HostOffer]:
    """The snapshot multi-host placement reads: alive hosts with a summary (suspect ones are left out:
    a gang must not start on a host that may be gone)."""
    return [
        HostOffer(
            e.name,
            e.summary.free_whole,
            e.summary.group_gbps,
            e.summary.health,
            e.summary.domain,
            e.summary.block,
            e.summary.zone,
            dict(e.summary.free_slices),
            e.summary.queue,
        )
        for e in view
        if e.state is State.ALIVE and e.summary is not None
    ]
