"""Pre-created slices: MIG instances made ahead of a forecast peak, held by no lease until a request of
their size takes one (``xpud.controllers.provisioner`` decides how many; this module keeps them and their
records).

Ledger first, as a grant: the instance is created through the card's isolation backend (the same choice
and creation code as a grant's ``prepare``), then its record is committed (``standby`` table), and only
then is it offered; a failed commit destroys it again. A crash between the two leaves an instance with no
record, which the next start destroys as an orphan. Dropping one commits the record's removal first, then
destroys the instance (one that cannot be destroyed is left to the backend's ``tidy``).

At start-up the records are handed to the backend's ``reconcile`` beside the leases' slices (lease id
``standby:<handle>``): instances still on the card are adopted as pre-created, records whose instance is gone
are removed. A request of the size takes a pre-created instance instead of creating one (the engine prefers
cards holding one; the backend hands it over), and the grant's commit removes its record in the same
transaction, so a restart never offers it twice. Whatever else removes a pre-created instance from the card
(a mode switch, a grant that needed its room) removes its record in the commit of that change too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from xpud.isolation.base import STANDBY, Held
from xpud.ledger.ledger import LedgerUnavailable, Op
from xpud.model import Slice

if TYPE_CHECKING:
    from xpud.engine.effects import Effects

log = logging.getLogger("xpud.engine.standby")


class Standby:
    """The pre-created slices of one engine's cards (handle -> slice), as the ledger records them."""

    def __init__(self, engine: Effects):
        self.engine = engine
        self.slices: dict[str, Slice] = {}  # MIG device UUID -> the slice it is
        self.warming: set[str] = set()  # handles whose warm_command runs (not handed out meanwhile)

    # ---------------------------------------------------------------- reading
    def supported(self, index: int) -> bool:
        """Whether card ``index``'s backend can pre-create slices (MIG)."""
        return hasattr(self.engine._backends[index], "precreate")

    def on(self, index: int) -> list[Slice]:
        return [s for s in self.slices.values() if s.card_index == index]

    def count(self, size: str) -> int:
        return sum(s.size == size for s in self.slices.values())

    def ready(self, size: str) -> set[int]:
        """Usable cards holding a pre-created ``size`` slice that can be handed out now."""
        cards = self.engine.cards
        return {
            s.card_index
            for h, s in self.slices.items()
            if s.size == size and h not in self.warming and cards[s.card_index].usable
        }

    def helds(self, index: int) -> list[Held]:
        """Card ``index``'s records, as ``reconcile`` takes them."""
        return [Held(STANDBY + s.handle, -1, s) for s in self.on(index)]

    # ---------------------------------------------------------------- restore
    def load(self, rows: Iterable[tuple[str, Slice, float]], index_of: dict[str, int]) -> list[Op]:
        """Take the ledger's records (card uuid, slice, created); returns the removal of those whose card
        is gone or no longer pre-creates slices (its isolation changed)."""
        drop = []
        for uuid, s, _created in rows:
            i = index_of.get(uuid)
            if i is not None and self.supported(i):
                self.slices[s.handle] = replace(s, card_index=i)  # indices can change across reboots
            else:
                drop.append(self.engine.ledger.drop_standby_op(s.handle))
        return drop

    # ---------------------------------------------------------------- commits of other changes
    def spent(self, cards: Iterable[int]) -> list[str]:
        """Records on ``cards`` whose instance is no longer pre-created on the card (a grant took it, a
        grant needed its room, the card left sliced mode). Call while holding the cards' claims."""
        out = []
        for i in set(cards):
            if not self.supported(i):
                continue
            still = self.engine._backends[i].standby()
            out += [s.handle for s in self.on(i) if s.handle not in still]
        return out

    def drop_ops(self, handles: Iterable[str]) -> list[Op]:
        return [self.engine.ledger.drop_standby_op(h) for h in handles]

    def forget(self, handles: Iterable[str]) -> None:
        """After the commit that removed their records."""
        for h in handles:
            self.slices.pop(h, None)
            self.warming.discard(h)

    # ---------------------------------------------------------------- create and drop
    async def create(self, index: int, size: str, reason: str) -> tuple[Slice, dict[str, str]] | None:
        """Pre-create one ``size`` slice on sliced card ``index``; (slice, environment) or None when the
        card has no room for it now (or is busy). Raises LedgerUnavailable when the record cannot be
        committed (the instance is destroyed again)."""
        e = self.engine
        c = e.cards[index]
        if index in e._busy or not self.supported(index) or not c.usable:
            return None
        backend, spec = e._backends[index], e.cfg.slices[size]
        e._claim([index])
        try:
            try:
                s, env = await e.run_blocking(backend.precreate, c.info, spec)
            except Exception as err:  # no room (NoCapacity), MIG off, the driver refused: not this card
                log.info("card %d: no %s pre-created: %s", index, size, err)
                return None
            spent = self.spent([index])  # idle instances the creation destroyed
            ev, ev_op = e._event_op(
                "forecast", f"card {index}: {size} pre-created ({s.handle}): {reason}", index
            )
            try:
                await e.ledger.write(
                    e.ledger.save_standby_op(c.info.uuid, s, e.clock()), ev_op, *self.drop_ops(spent)
                )
            except BaseException:
                await e.run_blocking(backend.drop_standby, s.handle)
                raise
        finally:
            e._unclaim([index])
        self.forget(spent)
        self.slices[s.handle] = s
        e._committed([(ev, ev_op)])
        return s, env

    async def drop(self, handle: str, reason: str) -> bool:
        """Remove a pre-created slice no lease took: the record first, then the instance."""
        e = self.engine
        s = self.slices.get(handle)
        if s is None or handle in self.warming or s.card_index in e._busy:
            return False
        ev, ev_op = e._event_op(
            "forecast",
            f"card {s.card_index}: pre-created {s.size} ({handle}) destroyed: {reason}",
            s.card_index,
        )
        e._claim([s.card_index])
        try:
            try:
                await e.ledger.write(e.ledger.drop_standby_op(handle), ev_op)
            except LedgerUnavailable as err:
                log.error("%s", err)
                return False
            self.forget([handle])
            await e.run_blocking(e._backends[s.card_index].drop_standby, handle)
        finally:
            e._unclaim([s.card_index])
        e._committed([(ev, ev_op)])
        return True

    async def sync(self) -> list[str]:
        """Remove the records of pre-created instances that are gone from the cards by a change whose
        commit did not carry it (e.g. a failed commit undone). Returns the handles removed."""
        e = self.engine
        gone = [
            h for h in self.spent(i for i in {s.card_index for s in self.slices.values()} if i not in e._busy)
        ]
        if gone and await e._try_write(*self.drop_ops(gone)):
            self.forget(gone)
            return gone
        return []

    def set_warming(self, handle: str, on: bool) -> None:
        s = self.slices.get(handle)
        if s is None:
            return
        (self.warming.add if on else self.warming.discard)(handle)
        self.engine._backends[s.card_index].set_warming(handle, on)
