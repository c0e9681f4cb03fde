"""Moving a lease to another placement: reserve it, tell the holder, commit when the holder acknowledges.

The health monitor, the defragmenter and right-sizing move restartable jobs; all call ``Engine.move`` (or
``Moves.start`` with ``mode``); the client side is ``xpu run --restartable``. See docs/engine.md for the
protocol (start, ack, timeout).

Invariants: until the acknowledgement the ledger holds the old placement and the lease holds both;
``ack`` commits the new placement before the old one is torn down (a failed commit leaves the lease where
it was, its move still pending); the reservation is prepared through the engine's effects (off the loop,
the card busy meanwhile); a move never targets the cards the lease holds now; a daemon that dies
mid-move restarts with the committed (old) placement.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from xpud.errors import BadRequest, Conflict, Forbidden, NoCapacity
from xpud.model import CardMode, Lease, Mode, Request, Slice

if TYPE_CHECKING:
    from xpud.engine.effects import Effects

log = logging.getLogger("xpud.engine.moves")


@dataclass(frozen=True)
class PendingMove:
    old: Lease  # the committed placement
    new: Lease  # the reserved one, as the holder was told
    reason: str
    started: float  # engine clock, seconds
    deadline: float
    ready: bool = True  # False while the reservation is being prepared
    switched: tuple[int, ...] = ()  # target cards whose mode the reservation switched


def _where(lease: Lease) -> str:
    return ",".join(map(str, lease.cards))


class Moves:
    """The moves in flight, keyed by lease id. Lives inside the engine, on the daemon's loop."""

    def __init__(self, engine: Effects):
        self.engine = engine
        self.pending: dict[str, PendingMove] = {}
        self.timed_out: set[str] = set()  # leases whose holder did not acknowledge a move
        self._committing: set[str] = set()  # acknowledged moves being committed: not to expire

    # ------------------------------------------------------------------ 1. reserve and tell
    async def start(
        self,
        lease_id: str,
        reason: str,
        *,
        avoid: Collection[int] = (),
        to: Collection[int] | None = None,
        timeout_s: float | None = None,
        mode: Mode | None = None,
    ) -> Lease:
        """Reserve a new placement for a restartable lease and send it a ``move`` event. Returns the
        lease as it will be after the move. ``timeout_s`` defaults to ``[health] move_ack_timeout_s``.
        ``mode``: move it to another size (right-sizing, ``xpud.controllers.rightsizer``); a single card
        then."""
        e = self.engine
        lease = e.leases.get(lease_id) or e.resolve_lease(lease_id)
        if mode is not None and Mode(mode) != lease.mode:
            if len(lease.cards) != 1:
                raise Conflict(
                    f"lease {lease.id} holds {len(lease.cards)} cards: only one-card leases resize"
                )
            lease = replace(lease, mode=Mode(mode))  # the lease as the target size sees it
        if lease.id in self.pending:
            raise Conflict(f"lease {lease.id} is already moving to card {_where(self.pending[lease.id].new)}")
        if not lease.restartable:
            raise Conflict(
                f"lease {lease.id} is not restartable: its holder cannot be moved (run it with --restartable)"
            )
        if not e.is_held(lease.id):
            raise Conflict(f"lease {lease.id} has no holder connected to restart its command elsewhere")
        if lease.mode.is_slice and lease.mode.value not in e.cfg.slices:  # restored; size since removed
            raise Conflict(f"lease {lease.id} is a {lease.mode} slice, a size the config no longer has")
        exclude = frozenset(lease.cards) | frozenset(avoid)
        if to is not None:
            cards = tuple(to)
            self._check_target(lease, cards, exclude)
        else:
            req = Request(
                lease.mode,
                gpus=len(lease.cards),
                priority=lease.priority,
                restartable=True,
                owner_uid=lease.owner_uid,
                command=lease.command,  # its class, for co-location on MPS cards
                job_class=e.rightsizer.class_of(lease.id) if e.rightsizer is not None else "",
            )
            found = e._fit(req, exclude=exclude)
            if found is None:
                kind = (
                    f"{len(lease.cards)} whole card(s)" if lease.mode is Mode.XPU else f"a {lease.mode} slice"
                )
                raise NoCapacity(f"no healthy card is free for {kind} to move lease {lease.id} to")
            cards = found
        e._claim(cards)
        now = e.clock()
        timeout = e.cfg.health.move_ack_timeout_s if timeout_s is None else timeout_s
        placeholder = replace(lease, cards=cards, slices=())
        self.pending[lease.id] = pm = PendingMove(lease, placeholder, reason, now, now + timeout, ready=False)
        try:
            slices, env, switched = await e._place(lease.id, lease.mode, cards, lease.owner_uid)
        except BaseException:
            self.pending.pop(lease.id, None)
            raise
        finally:
            e._unclaim(cards)
        new = self._moved(lease, cards, slices, env)
        lease = e.leases.get(lease.id, lease)  # the committed lease (its old size) stays the old one
        if self.pending.get(lease.id) is not pm:  # the lease ended while the reservation was made
            await e._unplace(lease.id, cards, slices, switched)
            raise Conflict(f"lease {lease.id} ended while its move was being prepared")
        if switched:  # the target's new mode is recorded; the lease's placement only on the ack
            try:
                await e.ledger.write(*(e.ledger.save_card_op(e.cards[i].record()) for i in switched))
            except BaseException:
                self.pending.pop(lease.id, None)
                await e._unplace(lease.id, cards, slices, switched)
                raise
            for i in switched:
                e.event("mode", f"card {i} switched to {e.cards[i].mode} for lease {lease.id}", card=i)
        now = e.clock()
        self.pending[lease.id] = PendingMove(lease, new, reason, now, now + timeout, True, tuple(switched))
        e.notify_holder(new, "move", f"moving from card {_where(lease)} to card {_where(new)}: {reason}")
        e.stats.moves["started"] += 1
        e.event(
            "move",
            f"lease {lease.id} moving from card {_where(lease)} to card {_where(new)}: {reason}",
            card=lease.cards[0] if len(lease.cards) == 1 else -1,
            lease_id=lease.id,
        )
        return new

    def _check_target(self, lease: Lease, cards: tuple[int, ...], exclude: frozenset[int]) -> None:
        e = self.engine
        want = len(lease.cards)
        if len(cards) != want or len(set(cards)) != want:
            raise BadRequest(f"lease {lease.id} needs {want} distinct card(s) to move to, got {list(cards)}")
        for i in cards:
            c = e.cards.get(i)
            if c is None:
                raise BadRequest(f"no card {i} to move lease {lease.id} to")
            if i in exclude:
                raise BadRequest(f"lease {lease.id} cannot move to card {i}: it holds it or must avoid it")
            if not c.usable:
                raise Conflict(f"card {i} is drained or unhealthy: lease {lease.id} cannot move there")
            if i in e.busy_cards():
                raise Conflict(f"card {i} is busy being reconfigured: move lease {lease.id} there later")
            if lease.mode is Mode.XPU:
                ok = c.idle and not (c.mode is CardMode.SLICED and c.pinned)
            else:
                spec = e.cfg.slices[lease.mode.value]
                ok = (c.mode is CardMode.SLICED or (c.idle and not c.pinned)) and e._backends[i].fits(
                    c.info, list(c.slices.values()), spec, lease.owner_uid
                )
            if not ok:
                raise NoCapacity(f"card {i} has no room for lease {lease.id} ({lease.mode})")

    def _moved(
        self, lease: Lease, cards: tuple[int, ...], slices: tuple[Slice, ...], placement_env: dict[str, str]
    ) -> Lease:
        """The lease as it will be on its new placement."""
        e = self.engine
        # Keep the lease's own variables (XPU_*, CUDA_DEVICE_ORDER); the placement's come new, so nothing
        # of the old isolation (e.g. MPS pipe directories) leaks into the restarted command.
        kept = {k: v for k, v in lease.env.items() if k.startswith("XPU_") or k == "CUDA_DEVICE_ORDER"}
        if kept.get("XPU_MODE", lease.mode.value) != lease.mode.value:  # a move to another size: its
            for k in ("XPU_MEMORY_LIMIT_BYTES", "XPU_COMPUTE_PCT", "XPU_MIG_PROFILE"):  # limits come new
                kept.pop(k, None)
            kept["XPU_MODE"] = lease.mode.value
        count = lease.restart_count + 1
        return replace(
            lease,
            cards=cards,
            card_uuids=tuple(e.cards[i].info.uuid for i in cards),
            slices=slices,
            env={**kept, **placement_env, "XPU_RESTART_COUNT": str(count)},
            restart_count=count,
            mark="",
        )

    # ------------------------------------------------------------------ 2. commit on the holder's ack
    async def ack(self, lease_id: str, token: str | None, anchor: str = "") -> Lease:
        """The holder stopped its command: commit the new placement, free the old one, return the lease.
        The holder proves itself by the lease's ``token``, or (``token`` None: the daemon itself, for the
        leases it holds on its jobs' behalf) by the lease's ``anchor``, which no request can name."""
        e = self.engine
        pm = self.pending.get(lease_id)
        if pm is None:
            late = " (it was abandoned: no acknowledgement in time)" if lease_id in self.timed_out else ""
            raise Conflict(f"no move is pending for lease {lease_id}{late}")
        if token is None:
            if not anchor or pm.old.anchor != anchor:
                raise Forbidden(f"lease {lease_id} is not anchored to {anchor!r}: its holder acknowledges")
        elif not e.ledger.token_matches(lease_id, token):
            raise Forbidden(f"wrong token for lease {lease_id}: AckMove needs the lease's token")
        if not pm.ready:
            raise Conflict(f"the move of lease {lease_id} is still being prepared")
        self._committing.add(lease_id)
        try:
            await e.ledger.write(e.ledger.update_placement_op(pm.new))  # committed before the reply
        finally:
            self._committing.discard(lease_id)
        if self.pending.get(lease_id) is not pm:  # abandoned or ended while the commit ran
            raise Conflict(f"the move of lease {lease_id} was abandoned")
        del self.pending[lease_id]
        if lease_id in e.leases:
            e.leases[lease_id] = pm.new
        old = [i for i in pm.old.cards if i not in pm.new.cards]
        await e._free_claimed(lease_id, old, pm.old.slices)
        took = e.clock() - pm.started
        e.stats.moves["done"] += 1
        e.event(
            "move",
            f"lease {lease_id} moved from card {_where(pm.old)} to card {_where(pm.new)} "
            f"({took:.2f} s after the move was asked): {pm.reason}",
            card=pm.new.cards[0] if len(pm.new.cards) == 1 else -1,
            lease_id=lease_id,
        )
        e.pump()
        return pm.new

    # ------------------------------------------------------------------ 3. give up
    async def cancel(self, lease_id: str, pump: bool = True) -> PendingMove | None:
        """Free a move's reservation (the lease ends, or its holder did not acknowledge in time). A move
        still being prepared is dropped here and freed by ``start`` when its preparation ends."""
        pm = self.pending.pop(lease_id, None)
        if pm is not None and pm.ready:
            e = self.engine
            cards = [i for i in pm.new.cards if i not in pm.old.cards]
            await e._free_claimed(lease_id, cards, pm.new.slices)
            if pump:
                e.pump()
        return pm

    async def expire(self, now: float) -> list[PendingMove]:
        """Abandon the moves whose holder did not acknowledge in time: the lease stays and is marked."""
        e = self.engine
        out = []
        for lease_id, pm in list(self.pending.items()):
            if now < pm.deadline or not pm.ready or lease_id in self._committing:
                continue
            await self.cancel(lease_id)
            self.timed_out.add(lease_id)
            waited = pm.deadline - pm.started
            e.stats.moves["abandoned"] += 1
            e.event(
                "move",
                f"lease {lease_id}: move to card {_where(pm.new)} abandoned: no ack in {waited:g} s",
                lease_id=lease_id,
            )
            if lease_id in e.leases:
                e.mark(
                    lease_id,
                    f"not moved: the holder did not acknowledge the move to card {_where(pm.new)} within "
                    f"{waited:g} s ({pm.reason}); the lease stays on card {_where(pm.old)}",
                )
            out.append(pm)
        return out

    def forget_at_once(self, lease_id: str) -> bool:
        """``forget`` when no move is in flight for the lease (no reservation to free): done, True; else
        False (the caller awaits ``forget``)."""
        if lease_id in self.pending:
            return False
        self.timed_out.discard(lease_id)
        return True

    async def forget(self, lease_id: str) -> None:
        """The lease ended: drop what is known about its moves (the caller pumps the queue)."""
        self.timed_out.discard(lease_id)
        await self.cancel(lease_id, pump=False)
