"""Dual-mode bookkeeping: fixed slice profiles (MIG-like) versus free-size slices (MPS-like).

A card is *whole* (one lease holds it, or it is idle) or *sliced*. Free-size slices (MPS: enforced memory
limit + active-thread percentage) take exactly the share asked for; fixed profiles (MIG) only come in a few
sizes, so a request is rounded up to the smallest profile that holds it and the difference is waste: the
card holds it, nobody uses it. Shares are in milli-cards (1000 = one card).

``Rounding`` turns a request into what the card will actually hold; the simulator reports *useful*
allocation (original requests of placed tasks) next to *occupied* share, so the cost of each profile set
is visible. ``CardSlices`` is the per-card ledger the engine can use to decide whether a new slice fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from xpud.placement.cluster import CARD_MILLI, Demand
from xpud.placement.names import PROFILE_SETS


@dataclass(frozen=True)
class Rounding:
    """Round fractional requests up to the smallest allowed profile (no-op for ``free``)."""

    name: str = "free"
    profiles: tuple[int, ...] = ()

    @classmethod
    def named(cls, name: str) -> Rounding:
        if name not in PROFILE_SETS:
            raise ValueError(f"unknown slice mode {name!r}: choose one of {', '.join(PROFILE_SETS)}")
        return cls(name, PROFILE_SETS[name])

    def size(self, milli: int) -> int:
        """The share a request of ``milli`` occupies on its card."""
        if not self.profiles or milli <= 0:
            return milli
        for p in self.profiles:
            if milli <= p:
                return p
        return CARD_MILLI

    def apply(self, d: Demand) -> Demand:
        if not d.fractional or not self.profiles:
            return d
        share = self.size(d.gpu_milli)
        return d if share == d.gpu_milli else replace(d, gpu_milli=share)

    def waste(self, d: Demand) -> int:
        """Milli-cards held but not asked for."""
        return self.apply(d).gpu_total_milli - d.gpu_total_milli


@dataclass
class CardSlices:
    """Slices on one card: which leases hold which shares, and whether another one fits.

    ``profiles`` empty = free-size (MPS); otherwise only those sizes are allowed (MIG) and a request is
    rounded up. A whole-card lease excludes slices and the other way round.
    """

    profiles: tuple[int, ...] = ()
    slices: dict[str, int] = field(default_factory=dict)  # lease id -> milli
    whole_lease: str | None = None

    @property
    def used_milli(self) -> int:
        return CARD_MILLI if self.whole_lease else sum(self.slices.values())

    @property
    def free_milli(self) -> int:
        return CARD_MILLI - self.used_milli

    @property
    def mode(self) -> str:
        return "sliced" if self.slices else "whole"

    def slice_size(self, milli: int) -> int:
        return Rounding("fixed", self.profiles).size(milli)

    def fits(self, milli: int) -> bool:
        return self.whole_lease is None and self.slice_size(milli) <= self.free_milli

    def add(self, lease: str, milli: int) -> int:
        """Add a slice; returns the share it occupies. Raises ``ValueError`` when it does not fit."""
        if lease in self.slices or lease == self.whole_lease:
            raise ValueError(f"lease {lease} already on this card")
        if milli >= CARD_MILLI:
            if self.slices or self.whole_lease:
                raise ValueError("card is not idle")
            self.whole_lease = lease
            return CARD_MILLI
        if not self.fits(milli):
            raise ValueError(f"{milli} milli does not fit: {self.free_milli} free")
        size = self.slice_size(milli)
        self.slices[lease] = size
        return size

    def remove(self, lease: str) -> None:
        if self.whole_lease == lease:
            self.whole_lease = None
        else:
            self.slices.pop(lease, None)


def round_all(demands: Sequence[Demand], rounding: Rounding) -> list[Demand]:
    return [rounding.apply(d) for d in demands]
