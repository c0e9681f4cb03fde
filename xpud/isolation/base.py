"""What an isolation backend does for the engine, and the accounting-only backend.

A backend decides whether a slice size fits on a card next to the slices it already holds, prepares
the slice (MIG instance, MPS limits, or nothing), produces the child's environment, and tears it down.
It also switches the card between whole and sliced mode (MIG mode, the MPS control daemon), says what
would stop such a switch, and at start-up reconciles what the hardware holds with what the ledger says.
The engine picks a backend per card (``[cards] isolation``); it never talks to the hardware itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from xpud.model import CardInfo, CardMode, Slice, SliceSpec

EPS = 1e-9
STANDBY = (
    "standby:"  # lease id prefix of a pre-created slice in ``reconcile``'s ``held`` (xpud.engine.standby)
)


@dataclass(frozen=True)
class Held:
    """A slice the ledger says a lease holds (input to ``reconcile``)."""

    lease_id: str
    owner_uid: int
    slice: Slice


@dataclass
class Reconciled:
    """What ``reconcile`` found: the card's real mode, leases whose slice is gone, and what it did."""

    mode: CardMode
    lost: list[str] = field(default_factory=list)  # lease ids whose isolation is gone from the hardware
    notes: list[str] = field(default_factory=list)  # one line per adopted / destroyed / left-alone thing


class Isolation(Protocol):
    name: str  # "mig", "mps" or "none"
    reserved_bytes: int  # memory per card kept out of slices (bytes)

    def fits(self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec, owner_uid: int = -1) -> bool:
        """Whether ``spec`` for ``owner_uid`` fits on ``card`` beside ``held`` without moving anything
        (switching an idle whole card to sliced mode included)."""

    def why_not(self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec, owner_uid: int = -1) -> str:
        """Why ``fits`` says no, when the reason is not plain lack of room ("" otherwise)."""

    def serves_other_user(self, owner_uid: int) -> bool:
        """Whether the card's slices belong to another user whom ``owner_uid`` cannot share it with (one
        user per MPS server): the queue shows such a wait as "MPS user"."""

    def prepare(
        self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec, lease_id: str, owner_uid: int
    ) -> tuple[Slice, dict[str, str]]:
        """Create the slice; return it (with its handle) and the child's environment."""

    def teardown(self, card: CardInfo, s: Slice) -> None:
        """Undo ``prepare``. Must succeed (or raise) quickly; called before the release is acknowledged."""

    def enter_sliced(self, card: CardInfo) -> CardInfo | None:
        """The card switches from whole to sliced mode. Returns the card's inventory read again when the
        switch may have changed it (a MIG mode change may renumber its minor), else None."""

    def leave_sliced(self, card: CardInfo) -> CardInfo | None:
        """The card switches back to whole mode (no slices remain). Returns as ``enter_sliced`` does."""

    def switch_blocker(self, card: CardInfo, sliced: bool) -> str:
        """Why the idle card cannot switch to sliced (``sliced``) or whole mode now; "" when it can."""

    def reconcile(self, card: CardInfo, mode: CardMode, held: Sequence[Held]) -> Reconciled:
        """At start-up: compare the hardware with the ledger's ``mode`` and ``held`` slices; adopt what
        matches, clean up orphans, report the rest."""

    def tidy(self, now: float) -> list[str]:
        """Periodic upkeep (e.g. destroy idle MIG instances kept too long); returns what it did."""


def usable_memory(card: CardInfo, reserved_bytes: int) -> int:
    return max(card.memory_total_bytes - reserved_bytes, 0)


def used_shares(held: Sequence[Slice], card: CardInfo, reserved_bytes: int) -> tuple[float, int]:
    """(memory fraction, compute percent) that ``held`` slices take on ``card``."""
    usable = usable_memory(card, reserved_bytes) or 1
    return sum(s.memory_bytes for s in held) / usable, sum(s.compute_pct for s in held)


def shares_fit(held: Sequence[Slice], card: CardInfo, reserved_bytes: int, spec: SliceSpec) -> bool:
    """Whether ``spec``'s memory and compute shares fit beside ``held`` (free-size slices: none, MPS)."""
    mem, pct = used_shares(held, card, reserved_bytes)
    return mem + spec.memory_fraction <= 1 + EPS and pct + spec.compute_pct <= 100


class Accounting:
    """Isolation "none": slices are counted (memory share, compute share) but not enforced.

    The child is told its limits in ``XPU_MEMORY_LIMIT_BYTES`` and ``XPU_COMPUTE_PCT`` only.
    """

    name = "none"

    def __init__(self, reserved_bytes: int = 0):
        self.reserved_bytes = reserved_bytes

    def fits(self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec, owner_uid: int = -1) -> bool:
        return shares_fit(held, card, self.reserved_bytes, spec)

    def why_not(self, card, held, spec, owner_uid=-1) -> str:
        return ""

    def serves_other_user(self, owner_uid: int) -> bool:
        return False

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

    def switch_blocker(self, card, sliced: bool) -> str:
        return ""

    def reconcile(self, card, mode, held) -> Reconciled:
        return Reconciled(CardMode.SLICED if held else mode)

    def tidy(self, now: float) -> list[str]:
        return []
