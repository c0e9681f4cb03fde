"""``HostSummary``: one host as the cluster view shows it, and how to make one from a Watch snapshot.

The cluster view is fed either by federation (``from_cluster_host``: the hosts of the daemon's
``Node.GetCluster``) or, for daemons without ``[cluster]``, from several local daemons (``xpu top --host
DIR ...``), each summarised from its own Watch stream. No Textual here, and nothing but the protocol
messages and the default slice sizes, so the daemon side can build these too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from xpud.api.v1 import xpu_pb2 as pb
from xpud.config.schema import DEFAULT_SLICES
from xpud.model import SliceSpec


@dataclass(frozen=True)
class HostSummary:
    """Free capacity and health of one host. Times are seconds since the epoch."""

    name: str
    domain: str = ""  # network location ("rack-3"); "" when the host does not say
    cards: int = 0
    whole_free: int = 0  # idle usable cards a whole-card lease could take now
    slices_free: Mapping[str, int] = field(default_factory=dict)  # slice size -> slices that fit now
    healthy: int = 0
    degraded: int = 0
    unhealthy: int = 0
    drained: int = 0
    leases: int = 0
    queued: int = 0
    seen: float = 0.0  # when this data was current
    error: str = ""  # why the last refresh failed ("" when it did not)

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.name)

    def stale(self, now: float, after_s: float) -> bool:
        """Old data (not refreshed for ``after_s`` seconds) or a failed last refresh."""
        return bool(self.error) or now - self.seen > after_s

    def reach(self, now: float, after_s: float) -> str:
        """One word for a host everywhere in the cluster view: ``down`` (its last refresh failed: the
        daemon cannot be reached), ``stale`` (no news for ``after_s`` seconds) or ``live``."""
        if self.error:
            return "down"
        return "stale" if now - self.seen > after_s else "live"


def _usable(card: pb.Card) -> bool:
    lost = card.HasField("sample") and card.sample.lost
    return not card.drained and card.health_state != "unhealthy" and not lost


def slices_that_fit(card: pb.Card, spec: SliceSpec) -> int:
    """Slices of ``spec`` that fit in a sliced card's free memory and compute (MPS arithmetic).

    A MIG card's geometry may allow fewer; this is the summary's estimate, not a placement.
    """
    if not _usable(card) or card.mode != "sliced" or card.whole_lease:
        return 0
    by_memory = card.free_memory_fraction / spec.memory_fraction
    by_compute = card.free_compute_pct / spec.compute_pct
    return max(0, math.floor(min(by_memory, by_compute) + 1e-9))


def whole_free(card: pb.Card) -> bool:
    """An idle usable card a whole-card lease could take: whole, or sliced but empty and not pinned."""
    if not _usable(card) or card.whole_lease or card.slices:
        return False
    return card.mode == "whole" or not card.mode_pinned


def slice_sizes(info: pb.InfoReply) -> dict[str, SliceSpec]:
    """The daemon's slice sizes (its config's [slices]), or the defaults from a daemon that does not say."""
    sizes = {s.name: SliceSpec(s.name, s.memory_fraction, s.compute_pct) for s in info.slice_sizes}
    return sizes or dict(DEFAULT_SLICES)


def summarize(
    name: str,
    update: pb.WatchUpdate,
    seen: float,
    domain: str = "",
    slices: Mapping[str, SliceSpec] = DEFAULT_SLICES,
) -> HostSummary:
    """The summary of one host's Watch snapshot."""
    cards = list(update.cards.cards)
    states = [c.health_state for c in cards]
    return HostSummary(
        name=name,
        domain=domain,
        cards=len(cards),
        whole_free=sum(whole_free(c) for c in cards),
        slices_free={size: sum(slices_that_fit(c, spec) for c in cards) for size, spec in slices.items()},
        healthy=states.count("healthy"),
        degraded=states.count("degraded"),
        unhealthy=states.count("unhealthy"),
        drained=sum(c.drained for c in cards),
        leases=len(update.leases.leases),
        queued=len(update.leases.queue),
        seen=seen,
    )


def from_cluster_host(h: pb.ClusterHost, now: float) -> HostSummary:
    """A federation peer as the cluster view shows it. Its summary carries the free capacity and the
    weakest free card's score, not per-card states: a score under 100 shows as one degraded card. A dead
    or departed host shows as down; a suspect one ages like any host not heard from."""
    error = "" if h.state in ("alive", "suspect") else h.state
    if not h.summary_valid and not error:
        error = "its summary failed the checks"
    return HostSummary(
        name=h.name,
        domain=h.domain,
        cards=h.cards,
        whole_free=h.free_whole,
        slices_free=dict(h.free_slices),
        healthy=h.cards - (h.health < 100),
        degraded=int(h.health < 100),
        queued=h.queue,
        seen=now - h.age_s,
        error=error,
    )


@dataclass(frozen=True)
class DomainTotals:
    """The sum over a domain's hosts, for its header row."""

    domain: str
    hosts: int
    stale: int  # no news, but not known to be down
    down: int  # the last refresh failed
    whole_free: int
    slices_free: Mapping[str, int]
    degraded: int
    unhealthy: int


def totals(domain: str, hosts: Iterable[HostSummary], now: float, stale_after_s: float) -> DomainTotals:
    hosts = list(hosts)
    sizes: dict[str, int] = {}
    for h in hosts:
        for size, n in h.slices_free.items():
            sizes[size] = sizes.get(size, 0) + n
    return DomainTotals(
        domain=domain,
        hosts=len(hosts),
        stale=sum(h.reach(now, stale_after_s) == "stale" for h in hosts),
        down=sum(h.reach(now, stale_after_s) == "down" for h in hosts),
        whole_free=sum(h.whole_free for h in hosts),
        slices_free=sizes,
        degraded=sum(h.degraded for h in hosts),
        unhealthy=sum(h.unhealthy for h in hosts),
    )
