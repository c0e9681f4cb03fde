"""Which MIG GPU instances this xpud made: the only ones it may destroy when it finds them unheld.

Other tools make MIG instances too (mig-parted, the GPU Operator, an operator with ``nvidia-smi mig``).
At start-up an instance no lease holds is destroyed only when the book says xpud made it; any other is
left alone, its space blocked, whatever ``[cards] mig_switch`` says. The book is durable (the ledger's
``mig_made`` table): a row is written before the instance is made, named with the MIG device UUID once it
is, and removed once the instance is destroyed. An instance matches a row by card, start slot and profile,
and by UUID where the row has one (a row without one: xpud stopped between making it and naming it).

``MemoryBook`` keeps the same in memory (tests, and a backend built without a ledger): a new process
then finds no instance of its own and leaves every unheld one alone.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from xpud.hw.types import MigInstance


class MigBook(Protocol):
    def made(self, card_uuid: str) -> list[tuple[int, int, str]]:
        """(start, profile id, device UUID or '') of the instances recorded on the card."""
        ...

    def record(self, card_uuid: str, start: int, profile_id: int) -> None:
        """About to make an instance (durable before the call returns)."""
        ...

    def name(self, card_uuid: str, start: int, device_uuid: str) -> None:
        """The instance at ``start`` was made and has this MIG device UUID."""
        ...

    def forget(self, card_uuid: str, start: int) -> None:
        """The instance at ``start`` is gone (or was never made)."""
        ...


def ours(book: MigBook, card_uuid: str, m: MigInstance) -> bool:
    """Whether the book says this xpud made ``m``."""
    for start, profile_id, uuid in book.made(card_uuid):
        if start == m.start and profile_id == m.profile_id:
            return not uuid or uuid in m.device_uuids
    return False


class MemoryBook:
    """The book in memory: lost with the process."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], tuple[int, str]] = {}
        self._lock = threading.Lock()

    def made(self, card_uuid: str) -> list[tuple[int, int, str]]:
        with self._lock:
            return sorted((s, p, u) for (c, s), (p, u) in self._rows.items() if c == card_uuid)

    def record(self, card_uuid: str, start: int, profile_id: int) -> None:
        with self._lock:
            self._rows[(card_uuid, start)] = (profile_id, "")

    def name(self, card_uuid: str, start: int, device_uuid: str) -> None:
        with self._lock:
            if (card_uuid, start) in self._rows:
                self._rows[(card_uuid, start)] = (self._rows[(card_uuid, start)][0], device_uuid)

    def forget(self, card_uuid: str, start: int) -> None:
        with self._lock:
            self._rows.pop((card_uuid, start), None)


class LedgerBook:
    """The book in the ledger (``mig_made``). Called off the event loop (MIG work runs in threads);
    a write the ledger refuses raises LedgerUnavailable: the instance is then not made."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def made(self, card_uuid: str) -> list[tuple[int, int, str]]:
        return self.ledger.mig_made(card_uuid)

    def record(self, card_uuid: str, start: int, profile_id: int) -> None:
        self.ledger.write_sync(self.ledger.mig_made_op(card_uuid, start, profile_id, time.time()))

    def name(self, card_uuid: str, start: int, device_uuid: str) -> None:
        self.ledger.write_sync(self.ledger.mig_named_op(card_uuid, start, device_uuid))

    def forget(self, card_uuid: str, start: int) -> None:
        self.ledger.write_sync(self.ledger.mig_gone_op(card_uuid, start))
