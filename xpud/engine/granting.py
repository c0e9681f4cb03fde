"""Granting and the queue: a request is placed, its cards claimed, its slice prepared, the lease committed,
and only then is it the caller's; a request that does not fit waits in the queue (``waitlist``) and the
pump grants what fits as room appears. See docs/engine.md for the grant path and the queue's passes.

Invariants: a grant's cards are claimed before any await (interleaved requests never pick the same room);
a failed commit undoes the preparation; a grant runs to its end whatever its caller does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import time
from collections.abc import Callable

from xpud.engine.accounting import account_of, request_gpus
from xpud.engine.effects import Effects
from xpud.engine.waitlist import Waiter, kind_of
from xpud.errors import NoCapacity
from xpud.ledger import accounts as ledger_accounts
from xpud.ledger.ledger import EventRecord, LedgerUnavailable, Op
from xpud.model import CardMode, Lease, LeaseState, Mode, QueuedRequest, Request, Slice

log = logging.getLogger("xpud.engine.engine")  # one logger for the engine's parts: its lines keep their name

BUSY_WAIT_S = 10.0  # how long a request with no --wait waits for busy cards before it is refused
QUEUE_BUSY_WAIT_S = 0.5  # the same for a request that may wait in the queue (then it is queued)


class Granting(Effects):
    """Grants, the queue and its pump (a part of ``Engine``)."""

    _granting: set
    _pump_scheduled: bool
    _pumps: int
    _pump_timer: asyncio.TimerHandle | None

    def _new_id(self) -> tuple[str, str]:
        """A new lease's id (8 hex digits, in use nowhere) and its token (24 random bytes, URL-safe
        base64, as ``secrets.token_urlsafe(24)``), from one read of the system's random source."""
        taken = self.ledger.lease_ids()  # every id in the ledger and every one being inserted
        while True:
            raw = os.urandom(28)
            lid = raw[:4].hex()
            if lid not in taken and lid not in self.leases:
                return lid, base64.urlsafe_b64encode(raw[4:]).rstrip(b"=").decode()

    def _claim_for(self, req: Request, cards: tuple[int, ...]) -> None:
        """Claim ``cards`` for granting ``req`` now (no await before ``_grant`` is started): the grant
        counts against its uid's [limits] from this instant."""
        self._claim(cards)
        self._granting_uids[req.owner_uid] = self._granting_uids.get(req.owner_uid, 0) + 1
        a = account_of(req)
        self._granting_accounts[a] = self._granting_accounts.get(a, 0.0) + request_gpus(self.cfg, req)

    def _account_refusal(self, req: Request) -> str:
        """Why ``req``'s account may not have it now (its ``limit``, at the moment of the grant), or ""."""
        if self.queue_order is None:
            return ""
        return self.queue_order.refusal(req, self._granting_accounts.get(account_of(req), 0.0))

    def _grant(self, req: Request, cards: tuple[int, ...], queued_s: float | None = None) -> asyncio.Future:
        """Grant ``req`` on ``cards`` (claimed by the caller, unclaimed here): prepare, commit, then it is
        the caller's. A failed commit undoes the preparation. It runs to its end whatever its caller
        does: a plain future when nothing awaits before the commit (cards in the right mode, a prepare
        that runs no tool: the commit's completion carries on, on the loop; cancelling the future says
        the requester went away, and the lease is then ended), else a task (the caller shields it)."""
        lease_id, token = self._new_id()
        want = CardMode.WHOLE if req.mode is Mode.XPU else CardMode.SLICED
        if all(self.cards[i].mode is want for i in cards) and (
            req.mode is Mode.XPU or self._inline(cards[0], "prepare", lease_id, req.owner_uid)
        ):
            return self._grant_inline(req, cards, queued_s, lease_id, token)
        return asyncio.ensure_future(self._grant_task(req, cards, queued_s, lease_id, token))

    def _granted(self, req: Request) -> None:
        """A grant for ``req`` ended (committed or not): it no longer counts as in flight."""
        uid = req.owner_uid
        n = self._granting_uids.pop(uid, 0) - 1
        if n > 0:
            self._granting_uids[uid] = n
        a = account_of(req)
        left = self._granting_accounts.pop(a, 0.0) - request_gpus(self.cfg, req)
        if left > 1e-9:
            self._granting_accounts[a] = left

    async def _grant_task(
        self, req: Request, cards: tuple[int, ...], queued_s: float | None, lease_id: str, token: str
    ) -> tuple[Lease, str]:
        try:
            return await self._grant_now(req, cards, queued_s, lease_id, token)
        finally:
            self._granted(req)

    def _grant_inline(
        self, req: Request, cards: tuple[int, ...], queued_s: float | None, lease_id: str, token: str
    ) -> asyncio.Future:
        out, t0 = asyncio.get_running_loop().create_future(), time.perf_counter()

        def committed(error: BaseException | None) -> None:  # on the loop
            self._granted(req)
            if error is not None:
                undo = self._spawn(self._unplace(lease_id, cards, slices, []), f"undoing lease {lease_id}")
                undo.add_done_callback(lambda _: None if out.done() else out.set_exception(error))
                return
            self.standby.forget(spent)
            self._grant_done(lease, events, t0)
            if out.done():  # its requester went away (cancelled): end what was made
                why = "its requester went away before the grant"
                self._spawn(self.reclaim(lease.id, why), f"reclaiming lease {lease.id}")
                return
            out.set_result((lease, token))

        try:
            slices, env = self._place_now(lease_id, req.mode, cards, req.owner_uid)
            spent = self.standby.spent(cards) if self.standby.slices else []  # pre-created, taken by it
            lease, ops, events = self._grant_record(
                req, cards, lease_id, token, slices, env, [], queued_s, spent
            )
            # committed before anyone is told
            self.ledger.submit_then(committed, *ops, *(o for _, o in events))
        except BaseException:
            self._granted(req)
            raise
        finally:
            self._unclaim(cards)
        return out

    def _converted(
        self, i: int, lease_id: str, req: Request, queued_s: float | None
    ) -> tuple[EventRecord, Op]:
        """The event (committed with the grant) and counter of a card switched to serve a request, with
        the reason."""
        mode = self.cards[i].mode
        if req.mode is Mode.XPU:
            why = f"a {req.gpus}-card request found too few idle whole cards"
        else:
            why = f"a {req.mode} request found no room on a sliced card"
        if queued_s is not None:
            why += f" (queued {queued_s:.2f} s, {len(self.waitlist)} still waiting)"
        self.stats.conversions[(mode.value, "demand")] += 1
        return self._event_op("mode", f"card {i} switched to {mode} for lease {lease_id}: {why}", i)

    async def _grant_now(
        self, req: Request, cards: tuple[int, ...], queued_s: float | None, lease_id: str, token: str
    ) -> tuple[Lease, str]:
        t0 = time.perf_counter()
        try:
            slices, env, switched = await self._place(lease_id, req.mode, cards, req.owner_uid)
            spent = self.standby.spent(cards) if self.standby.slices else []  # taken or undone by it
        finally:
            self._unclaim(cards)
        lease, ops, events = self._grant_record(
            req, cards, lease_id, token, slices, env, switched, queued_s, spent
        )
        try:
            await self.ledger.write(*ops, *(o for _, o in events))  # committed before anyone is told
        except BaseException:
            await self._unplace(lease_id, cards, slices, switched)
            raise
        self.standby.forget(spent)
        self._grant_done(lease, events, t0)
        return lease, token

    def _grant_record(
        self,
        req: Request,
        cards: tuple[int, ...],
        lease_id: str,
        token: str,
        slices: tuple[Slice, ...],
        env: dict[str, str],
        switched: list[int],
        queued_s: float | None,
        spent: list[str],
    ) -> tuple[Lease, list[Op], list[tuple[EventRecord, Op]]]:
        """The lease placed on ``cards``, its ledger writes (with the removal of the ``spent`` pre-created
        slices' records: taken by it, or undone for its room) and its events (committed together)."""
        infos = [self.cards[i].info for i in cards]
        base_env = {
            "XPU_LEASE_ID": lease_id,
            "XPU_MODE": req.mode.value,
            "XPU_RESTART_COUNT": "0",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
        lease = Lease(
            id=lease_id,
            mode=req.mode,
            owner_uid=req.owner_uid,
            cards=cards,
            card_uuids=tuple(c.uuid for c in infos),
            slices=slices,
            env={**env, **base_env},
            priority=req.priority,
            restartable=req.restartable,
            holder_pid=req.holder_pid,
            command=req.command[:500],
            name=req.name,
            created=self.clock(),
            anchor=req.anchor,
            account=account_of(req),
        )
        ops = [self.ledger.insert_lease_op(lease, token), *self.standby.drop_ops(spent)]
        if queued_s:
            ops.append(ledger_accounts.set_lease_wait_op(lease_id, queued_s))
        ops += [self.ledger.save_card_op(self.cards[i].record()) for i in switched]
        where = ",".join(map(str, cards))
        events = [
            *(self._converted(i, lease_id, req, queued_s) for i in switched),
            self._event_op(
                "grant",
                f"lease {lease_id} ({req.mode}) on card {where} to uid {req.owner_uid}"
                f" (account {lease.account})",
                cards[0] if len(cards) == 1 else -1,
                lease_id,
            ),
        ]
        return lease, ops, events

    def _grant_done(self, lease: Lease, events: list[tuple[EventRecord, Op]], t0: float) -> None:
        """A committed grant in memory."""
        self.leases[lease.id] = lease
        self.stats.grant.observe(time.perf_counter() - t0)
        if not lease.anchor:
            self.unheld_since[lease.id] = self.clock()  # the holder must open Hold within the grace period
        self._committed(events)

    async def try_grant(self, req: Request, wait_busy_s: float = BUSY_WAIT_S) -> tuple[Lease, str] | None:
        """Grant now if the request fits without jumping the queue; None otherwise. While some cards are
        busy, a request that fits on none of the others, or only by switching a card's mode, waits up to
        ``wait_busy_s`` for them first (the busy card may be the one it belongs on: packing and
        hysteresis stay as they are when requests come one at a time)."""
        self.validate(req)
        deadline = time.monotonic() + wait_busy_s
        uid = req.owner_uid
        self._arriving_uids[uid] = self._arriving_uids.get(uid, 0) + 1  # counts against [limits] meanwhile
        arriving = True
        try:
            while True:
                blocked_whole = self.waitlist.whole_waiting_at(req.priority)
                cards = self._fit(req, reserve_whole=blocked_whole)
                left = deadline - time.monotonic()
                if cards is not None and self._account_refusal(req):
                    return None  # its account is at its limit: it queues (or is refused) with the reason
                if cards is not None and (left <= 0 or not self._busy or not self._switches(req, cards)):
                    arriving = self._arrived(uid)
                    self._check_limits(req, queueing=False)  # again at the grant: others came meanwhile
                    self._claim_for(req, cards)
                    grant = self._grant(req, cards)
                    if not isinstance(grant, asyncio.Task):
                        return await grant  # cancelled: the grant ends the lease it makes (see _grant)
                    try:
                        return await asyncio.shield(grant)
                    except asyncio.CancelledError:  # the requester went away: the grant runs to its end
                        grant.add_done_callback(self._orphaned)
                        raise
                if not self._busy or left <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._card_freed(), left)
        finally:
            if arriving:  # not granted: its caller queues it (no await before) or refuses it
                self._arrived(uid)

    def _arrived(self, uid: int) -> bool:
        """A request of ``uid`` in ``try_grant`` is granted, or leaves it: it no longer counts as on its
        way (the grant counts in ``_granting_uids``, a queued request in the waitlist). Returns False."""
        n = self._arriving_uids.pop(uid, 0) - 1
        if n > 0:
            self._arriving_uids[uid] = n
        return False

    def _orphaned(self, grant: asyncio.Future) -> None:
        """A grant whose requester went away: end the lease it made."""
        if not grant.cancelled() and grant.exception() is None:
            lease = grant.result()[0]
            why = "its requester went away before the grant"
            self._spawn(self.reclaim(lease.id, why), f"reclaiming lease {lease.id}")

    async def grant_or_queue(
        self, req: Request, on_position: Callable[[QueuedRequest, int], None] | None = None
    ) -> tuple[Lease, str] | Waiter:
        """``acquire``'s first step: the grant if the request fits now (after the brief wait for busy
        cards), else its place in the queue (``on_position`` hears its positions), taken in the same
        step as the last try: no task, no await between. Raises NoCapacity when it may not queue. The
        caller then awaits ``queued(w)``, or calls ``leave(w)`` itself when it goes away."""
        self._check_limits(req, queueing=False)
        # A request that may queue waits for busy cards only briefly: beyond that it shows in the queue.
        busy_wait = BUSY_WAIT_S if req.wait_s <= 0 else min(QUEUE_BUSY_WAIT_S, req.wait_s)
        pumps = self._pumps
        deferred = req.not_before > self.clock()  # queued until its start (a green hour), room or not
        granted = None if deferred else await self.try_grant(req, busy_wait)
        if granted:
            return granted
        refusal = "" if deferred else self._account_refusal(req)
        if req.wait_s <= 0 and not deferred:
            why = refusal or self.why_not(req)
            raise NoCapacity(why + "; add --wait 10m (any duration, or inf) to queue for it")
        self._check_limits(req, queueing=True)
        # try_grant found no room in this very state (no await since): the queue needs a pass only if
        # one ran while it waited for busy cards, before this request was in it. (One pass per queued
        # request made queueing quadratic: 6,000 requests took minutes and gRPC cancelled the last.)
        reason = (
            "BeginTime"
            if deferred
            else self._pending_reason(req, reserved=self.waitlist.whole_waiting_at(req.priority))
        )
        w = self.waitlist.add(req, self.clock(), on_position)
        w.reason = refusal or self._order_reason(req, reason)  # a queue pass keeps it current
        # Its deadline is a timer, not a wait_for around its future: a waiter that leaves (thousands
        # cancelled at once) costs one synchronous `leave`, no task, shield or timeout wrapper.
        w.timer = asyncio.get_running_loop().call_later(max(w.deadline - self.clock(), 0), self._expire, w)
        self._changed()
        if deferred:
            self._start_deferred(w)
        elif self._pumps != pumps:
            self._pump_soon()
        return w

    def _start_deferred(self, w: Waiter) -> None:
        """A deferred request's own timer: at its start it waits as any other, and the queue gets a pass
        (its own timer, not the pump's: a pass that stops early, every kind ahead having failed, never
        reaches it to ask for one)."""
        w.start = None
        if not w.queued or w.future.done():
            return
        left = w.request.not_before - self.clock()
        if left > 0:
            w.start = asyncio.get_running_loop().call_later(left, self._start_deferred, w)
            return
        self.waitlist.activate(w)
        reserved = self.waitlist.whole_waiting_at(w.request.priority)
        w.reason = self._pending_reason(w.request, reserved=reserved)  # a pass may stop before it
        self._changed()
        self._pump_soon()

    def _expire(self, w: Waiter) -> None:
        """A queued request's wait ran out: it fails with the reason, unless its grant is under way (it
        then gets the grant) or it has its answer already."""
        if w.future.done() or w in self._granting:
            return
        w.future.set_exception(NoCapacity(f"waited {w.request.wait_s:g} s: {self.why_not(w.request)}"))

    async def queued(self, w: Waiter) -> tuple[Lease, str]:
        """Wait for a queued request's grant (NoCapacity when its wait runs out); it leaves the queue
        however this ends (its caller cancelled too)."""
        try:
            return await w.future
        finally:
            self.leave(w)

    def leave(self, w: Waiter) -> None:
        """Take a request out of the queue (granted, expired, or its caller gone: a grant under way for it
        is then ended by ``_grant_waiter``)."""
        if w.timer is not None:
            w.timer.cancel()
        if w.start is not None:
            w.start.cancel()
        # a whole-card request that leaves unserved held idle whole cards back from those behind it
        unserved = w.request.mode is Mode.XPU and (not w.future.done() or w.future.cancelled())
        if not w.future.done():
            w.future.cancel()
        if w.queued:
            self.waitlist.remove(w)
        self._changed()
        if unserved:
            self._pump_soon()

    async def acquire(
        self, req: Request, on_position: Callable[[QueuedRequest, int], None] | None = None
    ) -> tuple[Lease, str]:
        """Grant the request, waiting in the queue up to ``req.wait_s``. Raises NoCapacity on expiry or
        when the caller is at a [limits] cap."""
        got = await self.grant_or_queue(req, on_position)
        return got if isinstance(got, tuple) else await self.queued(got)

    def _pump_soon(self) -> None:
        """Pump the queue at the loop's next turn (once, however many ask)."""
        if self._pump_scheduled or not len(self.waitlist):
            return
        self._pump_scheduled = True

        def run() -> None:
            self._pump_scheduled = False
            self.pump()

        asyncio.get_running_loop().call_soon(run)

    def pump(self) -> None:
        """Grant waiting requests that now fit, in priority order (FIFO within a priority).

        A whole-card request that does not fit reserves the idle whole cards: requests behind it may
        still use free room on sliced cards, so small work flows without starving large work. The grants
        run as tasks (their cards claimed now, so the next waiter's placement already leaves them out).
        """
        self._pumps += 1
        reserve = False
        # What did not fit in this pass (and why): an equal request behind it does not fit either (grants
        # only take room), so a long queue costs one placement per kind of request, not one per waiter,
        # and the pass ends once every kind still waiting has failed (it need not walk the rest).
        failed: dict[tuple, str] = {}  # (kind, reserve) -> the pending reason
        unseen = self.waitlist.kinds()  # kind -> waiters not yet looked at
        granted: list[tuple[Waiter, tuple[int, ...]]] = []
        retry: float | None = None
        now = self.clock()
        order = self.queue_order
        waiters = (
            self.waitlist
            if order is None
            else sorted(self.waitlist, key=lambda w: order.key(w.request, w.enqueued))
        )
        for w in waiters:
            kind = kind_of(w.request)
            unseen[kind] -= 1
            if w.future.done():
                continue
            if w.deferred:  # waiting for its (green) start: its own timer brings a pass then
                if w.request.not_before > now:
                    w.reason = "BeginTime"
                    continue
                self.waitlist.activate(w)
            if (kind, reserve) in failed:
                w.reason = failed[(kind, reserve)]
                continue
            refusal = self._account_refusal(w.request)
            if refusal:  # its account is at its limit: it holds no room back from others
                w.reason = failed[(kind, reserve)] = refusal
                continue
            cards = self._fit(w.request, reserve_whole=reserve)
            switches = cards is not None and self._busy and self._switches(w.request, cards)
            left = w.enqueued + self.cfg.bursts.convert_within_s - self.clock()
            if switches and left > 0:
                # A busy card may be where it belongs (its new room): look again when it is free, or
                # switch this one's card once it has waited convert_within_s (a burst: in parallel).
                cards = None
                retry = left if retry is None else min(retry, left)
                failed[(kind, reserve)] = "Busy"
            if cards is None:
                key = (kind, reserve)
                if key not in failed:
                    failed[key] = self._order_reason(w.request, self._pending_reason(w.request, reserve))
                w.reason = failed[key]
                if w.request.mode is Mode.XPU:
                    reserve = True
                if all(n == 0 or (k, reserve) in failed for k, n in unseen.items()):
                    break  # every waiter left is of a kind that did not fit
                continue
            self._claim_for(w.request, cards)
            granted.append((w, cards))
        for w, cards in granted:  # not removed while the waitlist was being walked
            self.waitlist.remove(w)
            self._granting.add(w)
            self._spawn(self._grant_waiter(w, cards), f"granting queued request {w.ticket}")
        if retry is not None:
            self._pump_later(retry)

    def _order_reason(self, req: Request, reason: str) -> str:
        """The queue order's reason for a request that waits for cards ("Fairshare: nlp over its share"),
        else the engine's own ``reason``."""
        if self.queue_order is None or reason != "Resources":
            return reason
        return self.queue_order.reason(req) or reason

    def _pump_later(self, delay_s: float) -> None:
        """Pump again in ``delay_s`` (one timer: the earliest asked for wins)."""
        loop = asyncio.get_running_loop()
        at = loop.time() + delay_s + 0.001
        if self._pump_timer is not None and not self._pump_timer.cancelled():
            if self._pump_timer.when() <= at:
                return
            self._pump_timer.cancel()

        def fire() -> None:
            self._pump_timer = None
            self.pump()

        self._pump_timer = loop.call_at(at, fire)

    async def _grant_waiter(self, w, cards: tuple[int, ...]) -> None:
        try:
            got = await self._grant(w.request, cards, self.clock() - w.enqueued)
        except Exception as e:  # the caller gets the error; the queue goes on
            if not w.future.done():
                w.future.set_exception(e)
            return
        finally:
            self._granting.discard(w)
        if w.future.done():  # the requester went away while it was being granted
            try:
                await self._end(got[0], LeaseState.RECLAIMED, "its requester went away before the grant")
            except LedgerUnavailable as e:  # not held: the reaper takes it after the grace period
                log.error("lease %s: %s", got[0].id, e)
            return
        self.stats.queue_wait.observe(self.clock() - w.enqueued)
        w.future.set_result(got)
