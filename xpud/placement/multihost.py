"""Placement across hosts: which hosts take a gang (``N`` hosts x ``G`` whole cards) or ``R`` slice replicas.
Pure: a snapshot of the cluster view in, a choice out; no clock, network or ledger.

Each host computes its own best card group locally (``placement.host.best_group``, the ring all-reduce
model) and publishes, per group size ``k``, the modelled bus bandwidth of the best free ``k``-card group
(``HostOffer.group_gbps``). A gang is then chosen, in order of precedence:

1. **Network locality**: the fewest hops between the chosen hosts: all in one ``domain`` (e.g. a rack or
   a leaf switch), else one ``block``, else one ``zone``, else anywhere. A gang's all-reduce crosses the
   slowest link between its hosts, so this comes first.
2. **Each host's own group**: the weakest host's best ``G``-card group bandwidth (the ring runs at the
   slowest member), then the sum over hosts.
3. **Health**: the weakest free-card score of the chosen hosts.
4. **Fit**: hosts whose free whole cards are closest to ``G`` (a job that fits exactly leaves bigger
   hosts whole for bigger jobs), then the shorter queue, then the name.

Within a locality level, the domain (block, zone) chosen is the one whose best ``N`` hosts score best by
2-4, and among equals the one with the fewest free cards left over (best fit at the rack level).
Replicas (``spread``) go to distinct hosts, round-robin across domains, so that no two share a rack
while another rack has room.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from xpud.errors import XpudError

LEVELS = ("domain", "block", "zone", "cluster")


@dataclass(frozen=True)
class HostOffer:
    """What one host offers now, from the cluster view (a snapshot: ``age_s`` says how old)."""

    name: str
    free_whole: int  # idle, usable whole cards
    group_gbps: tuple[float, ...] = ()  # [k-1]: bus GB/s of the best free k-card group (0: none)
    health: int = 100  # the weakest score among the free cards
    domain: str = ""
    block: str = ""
    zone: str = ""
    free_slices: dict[str, int] = field(default_factory=dict)  # size -> slices grantable now
    queue: int = 0
    alive: bool = True

    def gbps(self, k: int) -> float:
        if k < 1 or k > self.free_whole:
            return 0.0
        if k == 1:
            return self.group_gbps[0] if self.group_gbps else float("inf")
        return self.group_gbps[k - 1] if k - 1 < len(self.group_gbps) else 0.0


@dataclass(frozen=True)
class GangChoice:
    hosts: tuple[str, ...]
    level: str  # the smallest network level holding every chosen host
    where: str  # its name ("" for the whole cluster)
    min_gbps: float
    reason: str


class NoPlacement(XpudError):
    """No set of hosts fits; the message says what is short."""


class ClusterTooSmall(NoPlacement):
    """More hosts asked than the cluster has: waiting cannot help."""


def _key(o: HostOffer, gpus: int) -> tuple:
    """Sort key of one host for a gang (best first)."""
    return (-o.gbps(gpus), -o.health, o.free_whole - gpus, o.queue, o.name)


def _area(o: HostOffer, level: str) -> str:
    if level == "domain":
        return f"{o.zone}/{o.block}/{o.domain}" if o.domain else ""
    if level == "block":
        return f"{o.zone}/{o.block}" if o.block else ""
    if level == "zone":
        return o.zone
    return "*"


def place_gang(
    offers: Iterable[HostOffer],
    nodes: int,
    gpus_per_node: int,
    exclude: Sequence[str] = (),
    min_health: int = 1,
) -> GangChoice:
    """``nodes`` distinct hosts with ``gpus_per_node`` whole cards each. Raises ``NoPlacement``."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("a gang needs at least one host and one card per host")
    skip = set(exclude)
    fit = [
        o
        for o in offers
        if o.alive
        and o.name not in skip
        and o.free_whole >= gpus_per_node
        and o.health >= min_health
        and o.gbps(gpus_per_node) > 0
    ]
    if len(fit) < nodes:
        raise NoPlacement(
            f"{nodes} host(s) with {gpus_per_node} free whole card(s) asked; {len(fit)} have them now"
        )
    fit.sort(key=lambda o: _key(o, gpus_per_node))  # once: every area below keeps this order
    for level in LEVELS:
        areas: dict[str, list[HostOffer]] = {}
        spare: dict[str, int] = {}
        for o in fit:
            a = _area(o, level)
            if a:
                areas.setdefault(a, []).append(o)
                spare[a] = spare.get(a, 0) + o.free_whole
        best: tuple | None = None
        for area, hosts in areas.items():
            if len(hosts) < nodes:
                continue
            chosen = hosts[:nodes]
            weakest = min(o.gbps(gpus_per_node) for o in chosen)
            total = sum(min(o.gbps(gpus_per_node), 1e9) for o in chosen)
            left_over = spare[area] - nodes * gpus_per_node
            score = (-weakest, -total, -min(o.health for o in chosen), left_over, area)
            if best is None or score < best[0]:
                best = (score, area, chosen, weakest)
        if best is not None:
            _, area, chosen, weakest = best
            where = "" if level == "cluster" else area
            reason = (
                f"{nodes} host(s) in one {level}"
                + (f" ({where})" if where else "")
                + f"; weakest group {weakest:.1f} GB/s"
            )
            return GangChoice(tuple(o.name for o in chosen), level, where, weakest, reason)
    raise NoPlacement("no placement")  # unreachable: the cluster level holds every fitting host


def place_replicas(
    offers: Iterable[HostOffer], size: str, replicas: int, exclude: Sequence[str] = (), min_health: int = 1
) -> tuple[str, ...]:
    """``replicas`` distinct hosts each with a free ``size`` slice, spread across domains first (then
    blocks, zones): one replica per domain before a second in any. Raises ``NoPlacement``."""
    skip = set(exclude)
    fit = [
        o
        for o in offers
        if o.alive and o.name not in skip and o.free_slices.get(size, 0) > 0 and o.health >= min_health
    ]
    if len(fit) < replicas:
        raise NoPlacement(f"{replicas} host(s) with a free {size} slice asked; {len(fit)} have one now")
    by_domain: dict[str, list[HostOffer]] = {}
    for o in sorted(fit, key=lambda o: (-o.health, -o.free_slices[size], o.queue, o.name)):
        by_domain.setdefault(_area(o, "domain") or o.name, []).append(o)
    # domains with the most room first; then round-robin, one host per domain per round
    order = sorted(by_domain.values(), key=lambda hs: (-len(hs), hs[0].name))
    chosen: list[str] = []
    depth = 0
    while len(chosen) < replicas:
        for hosts in order:
            if depth < len(hosts) and len(chosen) < replicas:
                chosen.append(hosts[depth].name)
        depth += 1
    return tuple(chosen)
