"""Anchored leases: leases kept alive by a Slurm job or a pod instead of a Hold stream.

A bridge takes such a lease with ``anchor = "<kind>:<id>"`` and ends it itself (the Slurm epilog, kubelet's
pod going away). When that end never comes, the reaper asks the kind's checker which anchors are gone and
reclaims their leases. A checker that cannot tell (Slurm unreachable) says nothing: the lease stays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from xpud.model import Lease

log = logging.getLogger("xpud.bridges")

# ids of one kind -> {id: why it is gone} for those known to be gone (unknown ones are left out)
Checker = Callable[[set[str]], Awaitable[dict[str, str]]]


def split(anchor: str) -> tuple[str, str]:
    """``"slurm:42"`` -> ``("slurm", "42")``; ``""`` -> ``("", "")``."""
    kind, _, ident = anchor.partition(":")
    return kind, ident


def anchored(leases: Iterable[Lease], kind: str) -> dict[str, list[Lease]]:
    """The active leases anchored to ``kind``, by anchor id."""
    out: dict[str, list[Lease]] = {}
    for lease in leases:
        k, ident = split(lease.anchor)
        if k == kind:
            out.setdefault(ident, []).append(lease)
    return out


class AnchorReaper:
    """Reclaims anchored leases whose job or pod is gone; each kind checked at most every its interval."""

    def __init__(self, engine, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.clock = clock
        self.checkers: dict[str, tuple[Checker, float]] = {}
        self._next: dict[str, float] = {}

    def add(self, kind: str, checker: Checker, interval_s: float) -> None:
        self.checkers[kind] = (checker, interval_s)

    async def reap(self) -> list[Lease]:
        out = []
        now = self.clock()
        for kind, (checker, interval_s) in self.checkers.items():
            if now < self._next.get(kind, 0.0):
                continue
            by_id = anchored(self.engine.lease_list(), kind)
            if not by_id:
                continue
            self._next[kind] = now + interval_s
            try:
                gone = await checker(set(by_id))
            except Exception:
                log.exception("checking %s anchors failed", kind)
                continue
            for ident, why in gone.items():
                for lease in by_id.get(ident, ()):
                    ended = await self.engine.reclaim(lease.id, f"{kind} {ident} is gone: {why}")
                    if ended:
                        out.append(ended)
        return out
