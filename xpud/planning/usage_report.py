"""`xpu report` (issue #33), sreport/sacct-like, as pure arithmetic over the leases and reclaims that every
host's ledger gives for a time window: GPU-hours (whole cards 1 each, a slice its memory fraction; only the
part of each lease inside the window), jobs (leases that started in it), mean and p95 wait in the queue,
and fair-share reclaims suffered and caused, per account, user or card model."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

BY = ("account", "user", "card-model")


@dataclass(frozen=True)
class Record:
    """One lease as a host's ledger has it. ``end`` None: still active."""

    host: str
    account: str
    user: str
    card_model: str
    gpus: float  # GPU-equivalents
    start: float
    end: float | None
    wait_s: float


@dataclass(frozen=True)
class Reclaim:
    at: float
    victim: str  # the account whose lease was stopped
    beneficiary: str  # the account it was stopped for


@dataclass(frozen=True)
class Row:
    key: str
    gpu_hours: float
    jobs: int
    mean_wait_s: float | None  # None: no job started in the window
    p95_wait_s: float | None
    reclaims_suffered: int
    reclaims_caused: int


def p95(values: list[float]) -> float | None:
    """The 95th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(0.95 * len(ordered)) - 1, 0)]


def _key(r: Record, by: str) -> str:
    return r.account if by == "account" else r.user if by == "user" else r.card_model


def aggregate(
    records: Iterable[Record], reclaims: Iterable[Reclaim], by: str, since: float, until: float
) -> list[Row]:
    """One row per key of ``by`` (``BY``), the most GPU-hours first. Reclaims count only ``by="account"``
    (a reclaim is between accounts; for users and card models they are 0)."""
    hours: dict[str, float] = {}
    waits: dict[str, list[float]] = {}
    for r in records:
        k = _key(r, by)
        lo, hi = max(r.start, since), min(r.end if r.end is not None else until, until)
        hours[k] = hours.get(k, 0.0) + max(hi - lo, 0.0) * r.gpus / 3600.0
        w = waits.setdefault(k, [])
        if since <= r.start < until:
            w.append(max(r.wait_s, 0.0))
    suffered: dict[str, int] = {}
    caused: dict[str, int] = {}
    if by == "account":
        for c in reclaims:
            if since <= c.at < until:
                suffered[c.victim] = suffered.get(c.victim, 0) + 1
                caused[c.beneficiary] = caused.get(c.beneficiary, 0) + 1
    keys = {*hours, *suffered, *caused}
    rows = [
        Row(
            k,
            round(hours.get(k, 0.0), 6),
            len(waits.get(k, [])),
            (sum(waits[k]) / len(waits[k])) if waits.get(k) else None,
            p95(waits.get(k, [])),
            suffered.get(k, 0),
            caused.get(k, 0),
        )
        for k in keys
    ]
    return sorted(rows, key=lambda r: (-r.gpu_hours, r.key))
