"""What an isolation backend does for the engine, and the accounting-only backend.

A backend decides whether a slice size fits on a card next to the slices it already holds, prepares
the slice (MIG instance, MPS limits, or nothing), produces the child's environment, and tears it down.
The engine picks a backend per card (``[cards] isolation``); it never talks to the hardware itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from xpud.model import CardInfo, Slice, SliceSpec

EPS = 1e-9


class Isolation(Protocol):
    name: str  # "mig", "mps" or "none"

    def fits(self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec) -> bool:
        """Whether ``spec`` fits on ``card`` beside ``held`` without moving anything."""

    def prepare(
        self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec, lease_id: str, owner_uid: int
    ) -> tuple[Slice, dict[str, str]]:
        """Create the slice; return it (with its handle) and the child's environment."""

    def teardown(self, card: CardInfo, s: Slice) -> None:
        """Undo ``prepare``. Must succeed (or raise) quickly; called before the release is acknowledged."""

    def enter_sliced(self, card: CardInfo) -> None:
        """The card switches from whole to sliced mode."""

    def leave_sliced(self, card: CardInfo) -> None:
        """The card switches back to whole mode (no slices remain)."""


def usable_memory(card: CardInfo, reserved_bytes: int) -> int:
    return max(card.memory_total_bytes - reserved_bytes, 0)


def used_shares(held: Sequence[Slice], card: CardInfo, reserved_bytes: int) -> tuple[float, int]:
    """(memory fraction, compute percent) that ``held`` slices take on ``card``."""
    usable = usable_memory(card, reserved_bytes) or 1
    return sum(s.memory_bytes for s in held) / usable, sum(s.compute_pct for s in held)


class Accounting:
    """Isolation "none": slices are counted (memory share, compute share) but not enforced.

    The child is told its limits in ``XPU_MEMORY_LIMIT_BYTES`` and ``XPU_COMPUTE_PCT`` only.
    """

    name = "none"

    def __init__(self, reserved_bytes: int = 0):
        self.reserved_bytes = reserved_bytes

    def fits(self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec) -> bool:
        mem, pct = used_shares(held, card, self.reserved_bytes)
        return mem + spec.memory_fraction <= 1 + EPS and pct + spec.compute_pct <= 100

    def prepare(self, card, held, spec, lease_id, owner_uid):
        mem = int(usable_memory(card, self.reserved_bytes) * spec.memory_fraction)
        s = Slice(card.index, spec.name, mem, spec.compute_pct, handle="")
        env = {
            "CUDA_VISIBLE_DEVICES": card.uuid,
            "XPU_MEMORY_LIMIT_BYTES": str(mem),
            "XPU_COMPUTE_PCT": str(spec.compute_pct),
        }
        return s, env

    def teardown(self, card, s) -> None:
        pass

    def enter_sliced(self, card) -> None:
        pass

    def leave_sliced(self, card) -> None:
        pass
