"""How a lease ends: released by its holder, evicted by an operator, reclaimed by the daemon (the reaper,
start-up, a multi-host job's end). The end is committed first, then the holder told, then what the lease
held freed (its slices torn down); and the reaper's isolation upkeep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from xpud.engine.effects import Effects
from xpud.errors import Forbidden, NotFound
from xpud.isolation.base import Accounting
from xpud.ledger.ledger import EventRecord, LedgerUnavailable, Op
from xpud.model import Caller, CommandEnd, Lease, LeaseState

log = logging.getLogger("xpud.engine.engine")  # one logger for the engine's parts: its lines keep their name

TIDY_INTERVAL_S = 1.0  # isolation upkeep (MIG instances, MPS servers kept idle past their grace)


class Endings(Effects):
    """Releases, evictions, reclaims and the reaper (a part of ``Engine``)."""

    _ending: set[str]
    unheld_since: dict[str, float]
    restored_unheld: set[str]
    _next_tidy: float
    on_ended: list[Callable[[Lease], None]]

    def check_authority(self, lease: Lease, caller: Caller, token: str) -> None:
        """Token, ownership or operator rights; a wrong token is refused even for the owner."""
        if token:
            if not self.ledger.token_matches(lease.id, token):
                raise Forbidden(f"wrong token for lease {lease.id}")
            return
        if caller.admin or caller.uid == lease.owner_uid:
            return
        raise Forbidden(
            f"lease {lease.id} belongs to uid {lease.owner_uid}: only its holder (with its "
            "token), that user or an operator may act on it"
        )

    async def release(
        self, lease_id: str, caller: Caller, token: str = "", end: CommandEnd | None = None
    ) -> Lease:
        """End a lease for its holder, owner or an operator; ``end``: how its command ended (recorded;
        a start time outside the lease's life is clamped into it)."""
        lease = self.resolve_lease(lease_id)
        self.check_authority(lease, caller, token)
        if end is not None and end.started is not None:
            end = replace(end, started=min(max(end.started, lease.created), self.clock()))
        return await self._end(lease, LeaseState.RELEASED, f"released by uid {caller.uid}", end=end)

    async def evict(self, lease_id: str, reason: str = "") -> Lease:
        lease = self.resolve_lease(lease_id)
        why = f"evicted by an operator: {reason or 'no reason given'}"
        return await self._end(lease, LeaseState.EVICTED, reason or "evicted by an operator", revoke=why)

    async def reclaim(
        self,
        lease_id: str,
        reason: str,
        state: LeaseState = LeaseState.RECLAIMED,
        also: tuple[Op, ...] = (),
    ) -> Lease | None:
        """End a lease on the daemon's own authority (reaper, start-up, a multi-host job's end: ``state``
        RELEASED). ``also``: ledger writes committed in the same transaction as the lease's end."""
        lease = self.leases.get(lease_id)
        if lease is None or lease_id in self._ending:
            return None
        return await self._end(lease, state, reason, also=also)

    def _end(
        self,
        lease: Lease,
        state: LeaseState,
        reason: str,
        revoke: str = "",
        end: CommandEnd | None = None,
        also: tuple[Op, ...] = (),
    ) -> asyncio.Future:
        """End a lease: commit it, then tell its holder, then free its cards (tear slices down); the
        future answers the ended lease. It runs to its end whatever its caller does (a cancelled gRPC
        call), without a task or shield around it: the commit's completion carries on, on the loop, and
        only a tail that must await (a teardown that runs a tool, a busy card, a move's reservation)
        continues in a task."""
        if lease.id in self._ending:
            raise NotFound(f"lease {lease.id} is being released already")
        now, end = self.clock(), end or CommandEnd()
        card = lease.cards[0] if len(lease.cards) == 1 else -1
        how = ""
        if end.exit_signal is not None:
            how = f" (its command ended by signal {end.exit_signal})"
        elif end.exit_code is not None:
            how = f" (its command exited {end.exit_code})"
        message = f"lease {lease.id} {state.value}: {reason}{how}"
        event = self._event_op(_EVENT_KIND[state], message, card, lease.id)
        out = asyncio.get_running_loop().create_future()

        def answer(result: Lease | None, error: BaseException | None = None) -> None:
            if out.done():  # its caller went away: nobody reads it
                if error is not None:
                    log.error("ending lease %s: %s", lease.id, error)
            elif error is not None:
                out.set_exception(error)
            else:
                out.set_result(result)

        def committed(error: BaseException | None) -> None:  # on the loop
            self._ending.discard(lease.id)
            if error is not None:
                return answer(None, error)
            # Committed: the lease is over. What it held is freed below, after its teardown.
            try:
                ended = self._ended(lease, state, reason, now, end, revoke, event)
                if not self._frees_at_once(lease):
                    tail = self._spawn(self._end_tail(lease), f"freeing what lease {lease.id} held")
                    tail.add_done_callback(lambda t: answer(ended, None if t.cancelled() else t.exception()))
                    return
                self._free_now(lease.id, lease.cards, lease.slices)
                self.pump()
            except Exception as e:
                return answer(None, e)
            answer(ended)

        self._ending.add(lease.id)
        try:
            self.ledger.submit_then(
                committed, self.ledger.end_lease_op(lease.id, state, reason, now, end), event[1], *also
            )
        except BaseException:
            self._ending.discard(lease.id)
            raise
        return out

    def _ended(
        self,
        lease: Lease,
        state: LeaseState,
        reason: str,
        now: float,
        end: CommandEnd,
        revoke: str,
        event: tuple[EventRecord, Op],
    ) -> Lease:
        """A committed end in memory: the lease is gone, its holder told; the ended lease."""
        self.leases.pop(lease.id, None)
        self.unheld_since.pop(lease.id, None)
        # ``dataclasses.replace`` without its per-field getattr and __init__ (a release's largest step
        # in memory): the copy of a frozen, validated Lease with the end's fields
        ended = object.__new__(Lease)
        ended.__dict__.update(
            lease.__dict__,
            state=state,
            mark="",
            ended=now,
            end_reason=reason,
            started=end.started,
            exit_code=end.exit_code,
            exit_signal=end.exit_signal,
        )
        if revoke:
            self.notify_holder(lease, "revoke", revoke)
        self.notify_holder(ended, "released", reason)
        self._committed([event])
        for hook in self.on_ended:  # every end passes here: release, eviction, reclaim (reaper, health, ...)
            try:
                hook(ended)
            except Exception:
                log.exception("after the end of lease %s", lease.id)
        return ended

    def _frees_at_once(self, lease: Lease) -> bool:
        """Whether what ``lease`` held can be freed without an await: no move in flight for it, none of
        its cards busy, every teardown bookkeeping (no tool to run)."""
        return (
            self.moves.forget_at_once(lease.id)
            and not self._busy.intersection(lease.cards)
            and all(self._inline(s.card_index, "teardown", lease.id) for s in lease.slices)
        )

    async def _end_tail(self, lease: Lease) -> None:
        await self.moves.forget(lease.id)  # a move in flight: free what it reserved
        await self._free_claimed(lease.id, lease.cards, lease.slices)
        self.pump()

    async def reap(self) -> list[Lease]:
        """Reclaim leases whose holder has been gone longer than the grace period; expire waiters."""
        now, leases = self.clock(), self.cfg.leases
        await self.moves.expire(now)
        out = []
        for lid, since in list(self.unheld_since.items()):
            # A holder cut off by a daemon restart reconnects with backoff: it gets the longer grace.
            grace = (
                max(leases.grace_s, leases.restore_grace_s) if lid in self.restored_unheld else leases.grace_s
            )
            if now - since >= grace and lid in self.leases:
                try:
                    out.append(
                        await self.reclaim(lid, f"holder gone for {now - since:.1f} s (grace {grace:g} s)")
                    )
                except LedgerUnavailable as e:  # tried again at the next run
                    log.error("reclaiming lease %s: %s", lid, e)
        self._tidy_isolation()
        return [x for x in out if x]

    def _tidy_isolation(self) -> None:
        """Backend upkeep (idle MIG instances and MPS servers kept too long, instances freed by their
        processes), off the loop, on the cards that are not busy, at most once a TIDY_INTERVAL_S."""
        now = time.monotonic()
        if now < self._next_tidy:
            return
        self._next_tidy = now + TIDY_INTERVAL_S
        for i in sorted(self._backends):
            due = getattr(self._backends[i], "tidy_due", None)
            if i in self._busy or isinstance(self._backends[i], Accounting) or (due and not due(now)):
                continue  # (claiming a card for nothing would hold up the grants that want it)
            self._claim([i])
            self._spawn(self._tidy(i), f"isolation upkeep on card {i}")

    async def _tidy(self, i: int) -> None:
        try:
            notes = await self.run_blocking(self._backends[i].tidy, time.monotonic())
        except Exception:
            log.exception("isolation upkeep on card %d failed", i)
            notes = []
        finally:
            self._unclaim([i])
        for note in notes:
            log.info("%s", note)
        if notes:
            self.pump()


_EVENT_KIND = {
    LeaseState.RELEASED: "release",
    LeaseState.RECLAIMED: "reclaim",
    LeaseState.EVICTED: "evict",
    LeaseState.ACTIVE: "grant",
}
