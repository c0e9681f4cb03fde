"""Fair share between accounts (issue #33), as pure arithmetic: decayed usage, deserved shares, the wait
queue's order and the reclaim plan. No I/O, no clock: times and the cluster view are passed in, so every
host computes the same shares from the same view and the simulator replays the same code.

Amounts are GPU-equivalents: a whole card is 1, a slice its memory fraction.

Deserved shares (``deserved``): quota first (each account up to its quota, its demand and its limit;
oversubscribed quotas are cut in proportion to the quotas, water-filling), then the capacity left is
shared max-min fairly by weight among the accounts that want more, capped by limit and demand. A parent's
share is split among its children the same way (one level of nesting).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

EPS = 1e-9
LN2 = math.log(2.0)


@dataclass(frozen=True)
class AccountSpec:
    """What fair share needs to know of an account. ``limit`` None: no limit; ``parent`` "": top level."""

    name: str
    quota: float = 0.0
    limit: float | None = None
    weight: float = 1.0
    parent: str = ""


@dataclass(frozen=True)
class HostAccounts:
    """What one host publishes of its accounts in its summary: per account the GPU-equivalents its leases
    hold (``allocated``), its decayed usage there (GPU-seconds) and what waits in its queue; and the hash of
    its accounts' config (``xpud.config.accounts.config_hash``: the same on every host that agrees)."""

    config_hash: str = ""
    allocated: Mapping[str, float] = field(default_factory=dict)
    usage: Mapping[str, float] = field(default_factory=dict)
    waiting: Mapping[str, float] = field(default_factory=dict)


def specs_from_config(named: Mapping[str, object]) -> dict[str, AccountSpec]:
    """``AccountSpec`` per account from ``Config.named_accounts`` (``xpud.config.accounts.Account``)."""
    return {
        n: AccountSpec(n, a.quota, a.limit, a.weight, a.parent)  # type: ignore[attr-defined]
        for n, a in named.items()
    }


def gpu_equivalents(whole_cards: int, slice_fractions: Iterable[float] = ()) -> float:
    """What a lease counts against its account: 1 per whole card, a slice its memory fraction."""
    return float(whole_cards) + sum(slice_fractions)


# ---- decayed usage -------------------------------------------------------------------------------------


def decayed(usage: float, elapsed_s: float, half_life_s: float) -> float:
    """``usage`` (GPU-seconds) ``elapsed_s`` later with nothing added: halves every ``half_life_s``."""
    return usage * 0.5 ** (max(elapsed_s, 0.0) / half_life_s)


def accrue(usage: float, allocated: float, elapsed_s: float, half_life_s: float) -> float:
    """Decayed usage (GPU-seconds) after ``elapsed_s`` seconds holding ``allocated`` GPU-equivalents: the
    old usage decays and what was used in between is added, itself decayed from when it was used
    (the exact integral, so the result does not depend on how often it is updated)."""
    elapsed_s = max(elapsed_s, 0.0)
    d = 0.5 ** (elapsed_s / half_life_s)
    return usage * d + allocated * half_life_s / LN2 * (1.0 - d)


# ---- deserved shares -----------------------------------------------------------------------------------


def water_fill(amount: float, caps: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Share ``amount`` max-min fairly in proportion to ``weights``, each at most its cap: every account
    gets ``min(cap, level * weight)`` with the one level that hands out ``amount`` (or all the caps).
    Accounts of weight 0 get nothing."""
    out = {n: 0.0 for n in caps}
    live = sorted(
        (n for n in caps if caps[n] > EPS and weights.get(n, 0.0) > EPS), key=lambda n: caps[n] / weights[n]
    )
    left = max(amount, 0.0)
    wsum = sum(weights[n] for n in live)
    for i, n in enumerate(live):
        if left <= EPS or wsum <= EPS:
            break
        level = left / wsum
        if caps[n] / weights[n] <= level:  # capped: takes its cap, the rest share what is left
            out[n] = caps[n]
        else:  # no one from here on is capped: all share at this level
            for m in live[i:]:
                out[m] = level * weights[m]
            break
        left -= out[n]
        wsum -= weights[n]
    return out


def _split(capacity: float, specs: Sequence[AccountSpec], want: Mapping[str, float]) -> dict[str, float]:
    """One level: quota first (water-filled by quota where the quotas are oversubscribed), then the rest
    by weight up to ``want`` (demand capped by limit)."""
    first_caps = {s.name: min(s.quota, want[s.name]) for s in specs}
    if sum(first_caps.values()) <= capacity + EPS:
        first = dict(first_caps)
    else:
        first = water_fill(capacity, first_caps, {s.name: s.quota for s in specs})
    left = capacity - sum(first.values())
    room = {s.name: max(want[s.name] - first[s.name], 0.0) for s in specs}
    extra = water_fill(left, room, {s.name: s.weight for s in specs})
    return {n: first[n] + extra[n] for n in first}


def deserved(
    specs: Mapping[str, AccountSpec], demand: Mapping[str, float], capacity: float
) -> dict[str, float]:
    """Each account's deserved share (GPU-equivalents) of ``capacity``, given each account's ``demand``
    (what it holds plus what it waits for). Accounts in ``demand`` but not in ``specs`` count as quota 0,
    weight 1 (the ``default`` account). A parent's share is its children's sum; the result holds every
    account, parents included. Never above an account's demand or limit; the shares sum to at most
    ``capacity`` (counting leaves only)."""
    specs = dict(specs)
    for n in demand:
        if n not in specs:
            specs[n] = AccountSpec(n)
    kids: dict[str, list[AccountSpec]] = {}
    for s in specs.values():
        if s.parent:
            kids.setdefault(s.parent, []).append(s)

    def cap(s: AccountSpec, d: float) -> float:
        return min(d, s.limit) if s.limit is not None else d

    want: dict[str, float] = {}
    for s in specs.values():
        if s.name in kids:
            continue
        want[s.name] = cap(s, max(float(demand.get(s.name, 0.0)), 0.0))
    for p, children in kids.items():
        want[p] = cap(specs[p], sum(want[c.name] for c in children))
    top = [s for s in specs.values() if not s.parent]
    out = _split(max(capacity, 0.0), top, want)
    for p, children in kids.items():
        out.update(_split(out[p], children, want))
    return out


# ---- the wait queue ------------------------------------------------------------------------------------


def share_ratio(allocated: float, share: float) -> float:
    """How far an account is into its deserved share: 0 = holds nothing, 1 = holds its share. An
    account that deserves nothing is last (infinity)."""
    if share <= EPS:
        return math.inf
    return allocated / share


def queue_key(allocated: float, share: float, priority: int, created: float) -> tuple[float, int, float]:
    """Sort key of a waiting request: its account's distance below its share first (the furthest below
    first), then priority (higher first), then age (older first)."""
    return (share_ratio(allocated, share), -priority, created)


# ---- reclaim -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Running:
    """Work that holds cards: ``gpus`` GPU-equivalents (a slice: its memory fraction), started at
    ``started`` (seconds, the caller's clock)."""

    id: str
    account: str
    gpus: float
    restartable: bool
    started: float


@dataclass(frozen=True)
class Waiter:
    id: str
    account: str
    gpus: float


def floors(mode: str, specs: Mapping[str, AccountSpec], shares: Mapping[str, float]) -> dict[str, float]:
    """What reclaim never takes an account below: its deserved share (``fair-share``) or its quota
    (``quota``, KAI's behaviour)."""
    if mode == "quota":
        return {n: specs[n].quota if n in specs else 0.0 for n in shares}
    return dict(shares)


def plan_reclaim(
    waiter: Waiter,
    running: Iterable[Running],
    *,
    specs: Mapping[str, AccountSpec],
    shares: Mapping[str, float],
    allocated: Mapping[str, float],
    mode: str,
    now: float,
    protected_until: Mapping[str, float],
    fits: Callable[[Sequence[Running]], bool],
) -> list[Running]:
    """Which running work to stop so that ``waiter`` fits; [] when none may or none would be enough.

    The waiter's account must hold less than its share (``fair-share``) or its quota (``quota``), and stay
    within its limit with the waiter. The waiter may take it above its share by less than the waiter's
    size: requiring it to fit within the room left starves a task bigger than that room (an 8-card task
    of an account that holds a slice) while others backfill; on openb that cost Jain's index 0.99 -> 0.89
    (bench/fairshare.md). The excess is the reclaimer's to lose again, after the grace.

    Only restartable work of other accounts above their floor (``floors``) is taken, never taking an
    account (or, for another parent's child, its parent) below its floor; the least progress lost first
    (GPU-seconds run, then the newest). Accounts in ``protected_until`` (the time their grace after
    getting cards back ends) are spared until then. ``fits(stopped)`` says whether the waiter fits once
    ``stopped`` are gone; the plan is the first prefix that fits, with stops that turn out unneeded
    dropped again."""
    if mode == "off":
        return []
    spec_of = {n: specs.get(n, AccountSpec(n)) for n in {*shares, *allocated, waiter.account}}
    me = spec_of[waiter.account]
    held_now = allocated.get(waiter.account, 0.0)
    bound = me.quota if mode == "quota" else shares.get(waiter.account, 0.0)
    if held_now >= bound - EPS or (me.limit is not None and held_now + waiter.gpus > me.limit + EPS):
        return []
    floor = floors(mode, spec_of, {n: shares.get(n, 0.0) for n in spec_of})
    held = dict(allocated)
    for s in spec_of.values():  # parents hold their children's
        if s.parent:
            held[s.parent] = held.get(s.parent, 0.0) + allocated.get(s.name, 0.0)
    chosen: list[Running] = []
    candidates = sorted(
        (r for r in running if r.restartable and r.account != waiter.account),
        key=lambda r: (max(now - r.started, 0.0) * r.gpus, -r.started, r.id),
    )
    for r in candidates:
        if protected_until.get(r.account, -math.inf) > now:
            continue
        parent = spec_of.get(r.account, AccountSpec(r.account)).parent
        chain = [r.account]
        if parent and parent != me.parent:  # taking from another parent's child lowers that parent too
            chain.append(parent)
        if any(held.get(a, 0.0) - r.gpus < floor.get(a, 0.0) - EPS for a in chain):
            continue
        for a in chain:
            held[a] = held.get(a, 0.0) - r.gpus
        chosen.append(r)
        if fits(chosen):
            break
    else:
        return []
    for r in list(reversed(chosen)):  # drop stops the waiter turned out not to need
        rest = [x for x in chosen if x is not r]
        if fits(rest):
            chosen = rest
    return chosen
