"""Where a new MIG GPU instance goes on one card: a pure choice over the card's geometry.

A MIG card divides its memory into ``memory_slots`` (8 on A100/H100/H200) and its compute into
``compute_slices`` (7). A GPU-instance profile covers ``size`` consecutive memory slots from one of its
fixed start slots and takes ``compute`` compute slices. A layout is valid when no two instances share a
memory slot, no profile has more than ``max_instances`` instances and the compute slices add up to at most
``compute_slices``. The driver enforces exactly these rules (overlap -> INSUFFICIENT_RESOURCES).

``choose`` decides how a slice size (a list of acceptable profiles) is served next to the instances that
exist: reuse an idle instance, or create one at an explicit start slot, destroying idle instances that are
in the way when that is the only way. Instances that are *busy* (a lease holds them, or processes run in
them) never move. Among all the ways that work it takes the one that leaves the most ``room``: the number
of different combinations of slice sizes (counts per size) that could still be added afterwards. So a
quarter goes where it does not spoil the place of a future half, and the chooser never refuses a request
that any arrangement of the free and idle space could serve.

No I/O, no clock: the isolation backend (``xpud.isolation.mig``) reads the card and applies the plan.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """A GPU-instance profile, as the driver describes it."""

    id: int  # the driver's profile id (what create/list take), not the NVML enum value
    name: str  # "3g.40gb"
    compute: int  # compute slices
    size: int  # memory slots an instance covers
    starts: tuple[int, ...]  # possible start slots
    max_instances: int
    memory_bytes: int = 0


@dataclass(frozen=True)
class Geometry:
    """A card model's MIG geometry: its profiles and how many memory slots and compute slices it has."""

    profiles: tuple[Profile, ...]
    memory_slots: int = 8
    compute_slices: int = 7

    @functools.cached_property
    def _by_id(self) -> dict[int, Profile]:
        return {p.id: p for p in self.profiles}

    def profile(self, profile_id: int) -> Profile:
        try:
            return self._by_id[profile_id]
        except KeyError:
            raise KeyError(f"no MIG profile id {profile_id} in this geometry") from None

    def by_name(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)


@dataclass(frozen=True)
class Instance:
    """An existing GPU instance. ``busy``: held by a lease or used by processes (it never moves)."""

    profile: int  # driver profile id
    start: int
    busy: bool = True
    key: int = -1  # the caller's name for it (the GPU instance id); not used in decisions


@dataclass(frozen=True)
class Plan:
    """How to serve one slice: reuse ``reuse``, or destroy ``destroy`` and create ``profile`` at ``start``."""

    profile: int
    start: int
    reuse: Instance | None = None
    destroy: tuple[Instance, ...] = ()
    room: int = 0  # combinations of slice sizes that still fit afterwards (see ``room``)


Placed = tuple[int, int]  # (profile id, start slot)


def valid(geom: Geometry, layout: Iterable[Placed]) -> bool:
    """Whether these instances can coexist on one card (start slots, overlap, counts, compute)."""
    used = 0  # memory slots as a bit mask
    counts: dict[int, int] = {}
    compute = 0
    for pid, start in layout:
        p = geom.profile(pid)
        if start not in p.starts or start + p.size > geom.memory_slots:
            return False
        slots = ((1 << p.size) - 1) << start
        if used & slots:
            return False
        used |= slots
        counts[pid] = counts.get(pid, 0) + 1
        if counts[pid] > p.max_instances:
            return False
        compute += p.compute
    return compute <= geom.compute_slices


def room(geom: Geometry, layout: Iterable[Placed], sizes: Sequence[Sequence[int]]) -> int:
    """How many different combinations of slice sizes could still be added to ``layout``.

    ``sizes`` lists, per slice size, the profile ids that serve it. A combination is a count per size
    (including "nothing"); it counts when some set of new instances, each of a profile of its size, fits
    beside ``layout``. More room means the free space stays more usable.
    """
    return _room(geom, frozenset(layout), tuple(tuple(s) for s in sizes))


@functools.lru_cache(maxsize=8192)
def _room(geom: Geometry, layout: frozenset[Placed], sizes: tuple[tuple[int, ...], ...]) -> int:
    # Candidate additions, in a fixed order so each set of additions is generated once.
    serving = sorted({pid for s in sizes for pid in s})
    moves = [(pid, st) for pid in serving for st in geom.profile(pid).starts]
    size_of = {pid: [k for k, s in enumerate(sizes) if pid in s] for pid in serving}
    seen: set[tuple[int, ...]] = set()

    def walk(base: list[Placed], first: int, added: list[int]) -> None:
        # Every assignment of the added instances to the sizes they can serve is a reachable combination.
        for choice in itertools.product(*(size_of[pid] for pid in added)):
            counts = [0] * len(sizes)
            for k in choice:
                counts[k] += 1
            seen.add(tuple(counts))
        for n in range(first, len(moves)):
            trial = [*base, moves[n]]
            if valid(geom, trial):
                walk(trial, n + 1, [*added, moves[n][0]])

    walk(list(layout), 0, [])
    return len(seen)


def choose(
    geom: Geometry,
    instances: Sequence[Instance],
    wanted: Sequence[int],
    sizes: Sequence[Sequence[int]] = (),
) -> Plan | None:
    """The best way to serve a slice of one of the ``wanted`` profiles (preferred first), or None.

    Options: reuse an idle instance of a wanted profile, or create one at an explicit start slot after
    destroying some idle instances (none when possible). The plan leaving the most ``room`` for
    ``sizes`` (default: just ``wanted``) wins; then reuse over creation, fewer destroyed instances, the
    earlier wanted profile, the lower start slot. Busy instances are never touched. None only when no
    arrangement of the free and idle space can hold any wanted profile.
    """
    sizes_t = tuple(tuple(s) for s in sizes) or (tuple(wanted),)
    rank = {pid: n for n, pid in enumerate(wanted)}
    busy = [(i.profile, i.start) for i in instances if i.busy]
    idle = [i for i in instances if not i.busy]
    best: tuple[tuple, Plan] | None = None

    def offer(after: list[Placed], plan_args: dict, reuse: bool, destroyed: int, pid: int, start: int):
        nonlocal best
        r = _room(geom, frozenset(after), sizes_t)
        key = (r, reuse, -destroyed, -rank[pid], -start)
        if best is None or key > best[0]:
            best = (key, Plan(pid, start, room=r, **plan_args))

    for inst in idle:
        if inst.profile in rank:
            offer([*busy, (inst.profile, inst.start)], {"reuse": inst}, True, 0, inst.profile, inst.start)
    for pid in wanted:
        for start in geom.profile(pid).starts:
            gone = _fewest_in_the_way(geom, busy, idle, (pid, start))
            if gone is not None:
                offer([*busy, (pid, start)], {"destroy": gone}, False, len(gone), pid, start)
    return None if best is None else best[1]


def _fewest_in_the_way(
    geom: Geometry, busy: list[Placed], idle: list[Instance], new: Placed
) -> tuple[Instance, ...] | None:
    """The fewest idle instances to destroy so that ``new`` fits (None: it cannot, even with all gone)."""
    if not valid(geom, [*busy, new]):
        return None  # every rule is monotone: destroying idle instances cannot help
    p = geom.profile(new[0])
    slots = set(range(new[1], new[1] + p.size))
    overlapping = tuple(
        i for i in idle if slots & set(range(i.start, i.start + geom.profile(i.profile).size))
    )
    rest = [i for i in idle if i not in overlapping]
    # The overlapping ones must go; more only when the compute or count limits say so (rare).
    for n in range(len(rest) + 1):
        for more in itertools.combinations(rest, n):
            kept = [(i.profile, i.start) for i in rest if i not in more]
            if valid(geom, [*busy, *kept, new]):
                return overlapping + more
    return None  # unreachable: with all idle gone it is valid
