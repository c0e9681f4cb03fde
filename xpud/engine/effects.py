"""The engine's effects: claiming cards, running blocking work off the loop, placing and freeing slices,
switching a card's mode, committing to the ledger. This is the seam ``moves``, ``standby`` and the grant
and end paths act through.

- Ledger first. A release, eviction, reclaim, move or card-state change is committed to the ledger before
  anything is freed or changed on the hardware; a failed commit changes nothing in memory or on the
  hardware.
- Isolation backend calls run in worker threads (``run_blocking``). A card with backend work in flight is
  *busy* (claimed): placement leaves it out and its backend is touched by nobody else until the work
  ends. Claims are taken right after choosing the cards, with no await in between, and undone when the
  step fails.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from pathlib import Path

from xpud.engine.books import Books, CardState
from xpud.engine.streams import Streams
from xpud.errors import Conflict, Unavailable
from xpud.isolation.base import Accounting
from xpud.ledger.ledger import LedgerUnavailable, Op
from xpud.model import CardInfo, CardMode, Mode, Slice

log = logging.getLogger("xpud.engine.engine")  # one logger for the engine's parts: its lines keep their name


class Effects(Books, Streams):
    """Claims, blocking work, slices placed and freed, mode switches, ledger writes (a part of ``Engine``)."""

    _freed: list[asyncio.Future]
    _tasks: set[asyncio.Task]
    # the queue's passes (granting.Granting): asked for when a card is free, or after a move
    _pump_soon: Callable[[], None]
    pump: Callable[[], None]

    async def _try_write(self, *ops: Op) -> bool:
        """Commit ``ops``; on failure log it and return False (for work that is retried later)."""
        try:
            await self.ledger.write(*ops)
            return True
        except LedgerUnavailable as e:
            log.error("%s", e)
            return False

    def _claim(self, cards: Iterable[int]) -> None:
        """Mark free cards busy (call right after choosing them: no await in between)."""
        cards = list(cards)
        assert not self._busy.intersection(cards), f"cards {cards} are busy"
        self._busy.update(cards)

    def _unclaim(self, cards: Iterable[int]) -> None:
        self._busy.difference_update(cards)
        waiters, self._freed = self._freed, []
        for f in waiters:
            if not f.done():
                f.set_result(None)
        self._pump_soon()

    def _card_freed(self) -> asyncio.Future:
        """A future done when some busy card is free again, listening from this call on (a coroutine
        that registered only when first run missed a card freed before that: under ``wait_for`` on
        Python 3.11 a request waiting for a switching card then slept its whole wait)."""
        f = asyncio.get_running_loop().create_future()
        self._freed.append(f)
        return f

    async def _wait_claim(self, cards: Iterable[int]) -> None:
        """Wait until none of ``cards`` is busy, then claim them."""
        cards = list(cards)
        while self._busy.intersection(cards):
            await self._card_freed()
        self._claim(cards)

    async def run_blocking(self, fn: Callable, *args, inline: bool = False):
        """Run blocking work off the loop: a backend call (the caller holds the card's claim), or a
        controller's hardware read or file write. Bookkeeping-only backends, and calls the caller knows to
        be bookkeeping (``inline``), run on the loop. A full disk is ``Unavailable`` with one line."""
        try:
            if inline or isinstance(getattr(fn, "__self__", None), Accounting):
                return fn(*args)
            return await asyncio.to_thread(fn, *args)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # As the ledger's "full": one line that says what is full; the caller undoes what it began.
            where = f" in {Path(e.filename).parent}" if e.filename else ""
            raise Unavailable(
                f"disk full: no space left{where} ({getattr(fn, '__name__', 'hardware')}); "
                "nothing granted or changed: free space there and retry"
            ) from None

    def _bookkeeping(self, index: int, op: str, lease_id: str, owner_uid: int = -1) -> bool:
        """Whether card ``index``'s backend says ``op`` ("prepare", "teardown") for ``lease_id`` (of
        ``owner_uid``, for a prepare) runs no tool now (e.g. MPS with its control daemon known to run and
        no other user's idle server to shut down): then it runs on the loop, and the card's claim is not
        held across an await (other grants do not wait for it)."""
        needs_tool = getattr(self._backends[index], "needs_tool", None)
        return needs_tool is not None and not needs_tool(op, lease_id, owner_uid)

    def _inline(self, index: int, op: str, lease_id: str, owner_uid: int = -1) -> bool:
        """Whether card ``index``'s ``op`` for ``lease_id`` runs on the loop (as ``run_blocking`` decides)."""
        return isinstance(self._backends[index], Accounting) or self._bookkeeping(
            index, op, lease_id, owner_uid
        )

    def _spawn(self, coro: Awaitable, what: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %s", what, t.exception())

        task.add_done_callback(done)
        return task

    async def _place(
        self, lease_id: str, mode: Mode, cards: tuple[int, ...], owner_uid: int
    ) -> tuple[tuple[Slice, ...], dict[str, str], list[int]]:
        """Bring claimed ``cards`` into the mode ``mode`` needs and prepare its slice, then reserve them for
        ``lease_id`` in memory (whole card marked held, or the slice added). Returns (slices, environment,
        cards whose mode was switched). On failure everything is undone and the error raised."""
        want = CardMode.WHOLE if mode is Mode.XPU else CardMode.SLICED
        switched: list[int] = []
        try:
            for i in cards:
                c = self.cards[i]
                if c.mode is not want:  # idle: MIG on/off, MPS started/stopped
                    backend = self._backends[i]
                    fresh = await self.run_blocking(
                        backend.enter_sliced if want is CardMode.SLICED else backend.leave_sliced, c.info
                    )
                    self._renumbered(c, fresh)
                    c.mode = want
                    c.switched_at = self.clock()
                    switched.append(i)
            if mode is Mode.XPU or self._inline(cards[0], "prepare", lease_id, owner_uid):
                return (*self._place_now(lease_id, mode, cards, owner_uid), switched)
            c = self.cards[cards[0]]
            spec = self.cfg.slices[mode.value]
            held = list(c.slices.values())
            s, env = await self.run_blocking(
                self._backends[c.info.index].prepare,
                *(c.info, held, spec, lease_id, owner_uid),
                inline=self._bookkeeping(c.info.index, "prepare", lease_id, owner_uid),
            )
            c.slices[lease_id] = s
            return (s,), env, switched
        except BaseException:
            await self._switch_back(switched, "after a failed placement")
            raise

    def _place_now(
        self, lease_id: str, mode: Mode, cards: tuple[int, ...], owner_uid: int
    ) -> tuple[tuple[Slice, ...], dict[str, str]]:
        """``_place`` on cards already in the mode ``mode`` needs, when the slice's prepare runs no tool
        (``_inline``): no await. Returns (slices, environment)."""
        if mode is Mode.XPU:
            env = {"CUDA_VISIBLE_DEVICES": ",".join(self.cards[i].info.uuid for i in cards)}
            for i in cards:
                self.cards[i].whole_lease = lease_id
            return (), env
        c = self.cards[cards[0]]
        spec = self.cfg.slices[mode.value]
        s, env = self._backends[c.info.index].prepare(
            c.info, list(c.slices.values()), spec, lease_id, owner_uid
        )
        c.slices[lease_id] = s
        return (s,), env

    async def _switch_back(self, switched: list[int], why: str) -> None:
        """Undo the mode switches of ``_place`` (cards claimed by the caller); idle cards only."""
        for i in switched:
            c = self.cards[i]
            if not c.idle:
                continue
            back = CardMode.WHOLE if c.mode is CardMode.SLICED else CardMode.SLICED
            backend = self._backends[i]
            try:
                fresh = await self.run_blocking(
                    backend.enter_sliced if back is CardMode.SLICED else backend.leave_sliced, c.info
                )
                self._renumbered(c, fresh)
                c.mode = back
            except Exception as e:
                log.error("card %d: switching back to %s %s failed: %s", i, back, why, e)

    async def _unplace(
        self, lease_id: str, cards: tuple[int, ...], slices: tuple[Slice, ...], switched: list[int]
    ) -> None:
        """Undo ``_place`` after a failed commit: tear the slice down, switch the cards back."""
        await self._wait_claim(cards)
        try:
            await self._free(lease_id, cards, slices)
            await self._switch_back(switched, "after a failed commit")
        finally:
            self._unclaim(cards)

    async def _free(self, lease_id: str, cards: Iterable[int], slices: tuple[Slice, ...]) -> None:
        """Tear down ``slices`` and drop ``lease_id``'s hold on ``cards`` in memory (claims held by the
        caller). A teardown failure is logged loudly, never raised: the ledger has moved on already."""
        for s in slices:
            card = self.cards[s.card_index]
            try:
                inline = self._bookkeeping(s.card_index, "teardown", lease_id)
                await self.run_blocking(self._backends[s.card_index].teardown, card.info, s, inline=inline)
            except Exception as e:
                self._teardown_failed(lease_id, s, e)
        self._drop(lease_id, cards)

    def _free_now(self, lease_id: str, cards: Iterable[int], slices: tuple[Slice, ...]) -> None:
        """``_free`` when every teardown is bookkeeping (``_inline``) and no card is busy: no await."""
        for s in slices:
            try:
                self._backends[s.card_index].teardown(self.cards[s.card_index].info, s)
            except Exception as e:
                self._teardown_failed(lease_id, s, e)
        self._drop(lease_id, cards)

    def _teardown_failed(self, lease_id: str, s: Slice, e: Exception) -> None:
        log.error("teardown of %s on card %d failed: %s", lease_id, s.card_index, e)
        self.event("error", f"teardown of lease {lease_id} failed: {e}", card=s.card_index)

    def _drop(self, lease_id: str, cards: Iterable[int]) -> None:
        for i in cards:
            c = self.cards[i]
            if c.whole_lease == lease_id:
                c.whole_lease = None
            c.slices.pop(lease_id, None)

    async def _free_claimed(self, lease_id: str, cards: Iterable[int], slices: tuple[Slice, ...]) -> None:
        """``_free`` under the cards' claims. When one of them is busy (its backend at work, perhaps hung)
        this runs in the background and returns at once: the caller (a release, the reaper) goes on, and
        what the lease held stays reserved in memory until its teardown is done."""
        cards = list(cards)

        async def free() -> None:
            await self._wait_claim(cards)
            try:
                await self._free(lease_id, cards, slices)
            finally:
                self._unclaim(cards)

        if self._busy.intersection(cards):
            self._spawn(free(), f"freeing what lease {lease_id} held")
        else:
            await free()

    def _renumbered(self, c: CardState, fresh: CardInfo | None) -> None:
        """Take a card's device-node minor as the driver reads it after a MIG mode change."""
        if fresh is not None and fresh.minor_number is not None and fresh.minor_number != c.info.minor_number:
            self.event(
                "mode",
                f"card {c.info.index}: the driver renumbered its device node /dev/nvidia{c.info.minor_number}"
                f" -> /dev/nvidia{fresh.minor_number}",
                card=c.info.index,
            )
            c.info = replace(c.info, minor_number=fresh.minor_number)

    async def _switch(self, c: CardState, want: CardMode, pinned: bool, why: str) -> None:
        """Switch a claimed card to ``want`` on the hardware, then commit (undone if the commit fails)."""
        i = c.info.index
        if want is CardMode.WHOLE and c.slices:
            raise Conflict(
                f"card {i} holds {len(c.slices)} slice(s) (lease "
                f"{', '.join(sorted(c.slices))}): release them or wait, then switch it"
            )
        if want is CardMode.SLICED and c.whole_lease:
            raise Conflict(
                f"card {i} is held whole by lease {c.whole_lease}: release it or wait, then switch it"
            )
        backend = self._backends[i]
        switched = c.mode is not want
        if switched:
            fresh = await self.run_blocking(
                backend.enter_sliced if want is CardMode.SLICED else backend.leave_sliced, c.info
            )
            self._renumbered(c, fresh)
            c.mode = want
            c.switched_at = self.clock()
        spent = self.standby.spent([i])  # pre-created slices a switch to whole destroyed
        try:
            await self.ledger.write(
                self.ledger.save_card_op(replace(c.record(), mode_pinned=pinned)),
                *self.standby.drop_ops(spent),
            )
        except BaseException:
            await self._switch_back([i] if switched else [], "after a failed commit")
            raise
        self.standby.forget(spent)
        c.pinned = pinned
        if why:
            self.event("mode", f"card {i} switched to {want}: {why}", card=i)
