"""``HostRow``: one host as the cluster view shows it, made from a daemon's Watch snapshot or cluster host.

The cluster view is fed either by federation (``from_cluster_host``: the hosts of the daemon's
``Node.GetCluster``) or, for daemons without ``[cluster]``, from several local daemons (``xpu top --host
DIR ...``), each from its own Watch stream (``from_watch``). The free capacity is the daemon's count in
both cases (``ListCardsReply.free_whole``/``free_slices``, ``ClusterHost``): the dashboard does not
recompute it. Not ``federation.view.HostSummary``, which is what a host gossips about itself (location,
group bandwidth, weakest health); this row adds health counts, leases and staleness. No Textual here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from xpud.api.v1 import xpu_pb2 as pb


@dataclass(frozen=True)
class HostRow:
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


def from_watch(name: str, update: pb.WatchUpdate, seen: float, domain: str = "") -> HostRow:
    """The row of one host's Watch snapshot."""
    cards = list(update.cards.cards)
    states = [c.health_state for c in cards]
    return HostRow(
        name=name,
        domain=domain,
        cards=len(cards),
        whole_free=update.cards.free_whole,
        slices_free=dict(update.cards.free_slices),
        healthy=states.count("healthy"),
        degraded=states.count("degraded"),
        unhealthy=states.count("unhealthy"),
        drained=sum(c.drained for c in cards),
        leases=len(update.leases.leases),
        queued=len(update.leases.queue),
        seen=seen,
    )


def from_cluster_host(h: pb.ClusterHost, now: float) -> HostRow:
    """A federation peer as the cluster view shows it. Its summary carries the free capacity and the
    weakest free card's score, not per-card states: a score under 100 shows as one degraded card. A dead
    or departed host shows as down; a suspect one ages like any host not heard from."""
    error = "" if h.state in ("alive", "suspect") else h.state
    if not h.summary_valid and not error:
        error = "its summary failed the checks"
    return HostRow(
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


def totals(domain: str, hosts: Iterable[HostRow], now: float, stale_after_s: float) -> DomainTotals:
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
