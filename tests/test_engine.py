"""The engine's state machine, driven directly (the daemon tests drive it over gRPC)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.syncengine import sync_engine
from xpud.config.schema import Config
from xpud.engine.waitlist import Waiter
from xpud.errors import BadRequest, Conflict, Forbidden, NoCapacity, NotFound
from xpud.ledger.ledger import Ledger
from xpud.model import Caller, CardInfo, CardMode, HealthState, LeaseState, Mode, Request
from xpud.topology import NODE, SINGLE, SYSTEM, Topology

GIB = 1 << 30


def pcie_box() -> Topology:
    """2 sockets x 2 switches x 2 cards."""

    def level(i, j):
        if i // 2 == j // 2:
            return SINGLE
        return NODE if i // 4 == j // 4 else SYSTEM

    return Topology(levels=tuple(tuple(0 if i == j else level(i, j) for j in range(8)) for i in range(8)))


def cards(n=8):
    return [CardInfo(i, f"GPU-{i:04d}", "Fake", 48 * GIB, f"0000:{i:02x}:00.0") for i in range(n)]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def engine(tmp_path):
    return sync_engine(cards(), pcie_box(), Config(), Ledger(tmp_path / "l.sqlite"), clock=Clock())


def req(mode, gpus=1, **kw):
    return Request(Mode(mode), gpus=gpus, owner_uid=kw.pop("uid", 1000), **kw)


def test_whole_group_prefers_best_connected(engine):
    lease, _ = engine.try_grant(req("xpu", 2))
    assert lease.cards in {(0, 1), (2, 3), (4, 5), (6, 7)}
    lease4, _ = engine.try_grant(req("xpu", 4))
    assert {c // 4 for c in lease4.cards} == {1 - lease.cards[0] // 4}  # the other, untouched socket


def test_slices_fill_sliced_cards_before_converting_whole_ones(engine):
    got = [engine.try_grant(req("vxpu-quarter"))[0] for _ in range(4)]
    assert {g.cards for g in got} == {(got[0].cards[0],)}  # four quarters share one card
    view = engine.card_views()[got[0].cards[0]]
    assert view.mode is CardMode.SLICED and view.free_memory_fraction == pytest.approx(0)
    assert view.free_compute_pct == 40
    fifth = engine.try_grant(req("vxpu-quarter"))[0]
    assert fifth.cards != got[0].cards
    assert got[0].env["CUDA_VISIBLE_DEVICES"] == f"GPU-{got[0].cards[0]:04d}"
    assert got[0].env["XPU_MODE"] == "vxpu-quarter" and got[0].env["XPU_LEASE_ID"] == got[0].id


def test_capacity_is_never_exceeded_and_mode_switches_back(engine):
    leases = []
    while (g := engine.try_grant(req("vxpu-half"))) is not None:
        leases.append(g[0])
    assert len(leases) == 16  # 8 cards x 2 halves
    assert engine.try_grant(req("xpu", 1)) is None
    for lease in leases[:2]:
        engine.release(lease.id, Caller(1000))
    freed = leases[0].cards[0]
    if leases[1].cards[0] == freed:  # the card is empty again: a whole-card request may take it
        whole, _ = engine.try_grant(req("xpu", 1))
        assert whole.cards == (freed,)
        assert engine.card_views()[freed].mode is CardMode.WHOLE


def test_mode_switch_refused_while_held(engine):
    lease, _ = engine.try_grant(req("vxpu-half"))
    with pytest.raises(Conflict, match="holds 1 slice"):
        engine.set_mode(str(lease.cards[0]), "whole")
    engine.set_mode("7", "sliced")
    assert engine.card_views()[7].mode_pinned
    with pytest.raises(BadRequest):
        engine.set_mode("7", "diced")


def test_wrong_token_and_foreign_release(engine):
    lease, token = engine.try_grant(req("xpu", 1))
    with pytest.raises(Forbidden, match="wrong token"):
        engine.release(lease.id, Caller(1000), "not-the-token")
    with pytest.raises(Forbidden, match="belongs to uid 1000"):
        engine.release(lease.id, Caller(1001))
    assert lease.id in engine.leases
    engine.release(lease.id[:5], Caller(1001), token)  # the token is enough, a prefix names it
    assert lease.id not in engine.leases


def test_bad_requests(engine):
    with pytest.raises(BadRequest, match="this host has 8"):
        engine.try_grant(req("xpu", 9))
    with pytest.raises(BadRequest, match="part of one card"):
        engine.try_grant(req("vxpu-half", 2))
    with pytest.raises(BadRequest, match="priority"):
        engine.try_grant(req("xpu", 1, priority=1000))


def test_drained_and_unhealthy_cards_get_nothing(engine):
    for i in range(7):
        engine.drain(str(i), "maintenance")
    engine.set_health(7, HealthState.UNHEALTHY, 10)
    assert engine.try_grant(req("xpu", 1)) is None
    engine.set_health(7, HealthState.DEGRADED, 60)
    assert engine.try_grant(req("xpu", 1))[0].cards == (7,)  # degraded: used when nothing else fits


def test_queue_priority_fifo_and_reservation(engine):
    async def scenario():
        big = (await engine.try_grant(req("xpu", 8)))[0]
        order = []

        async def ask(name, r):
            lease, _ = await engine.acquire(r)
            order.append(name)
            return lease

        t1 = asyncio.create_task(ask("low", req("xpu", 4, wait_s=30)))
        await asyncio.sleep(0)
        t2 = asyncio.create_task(ask("high", req("xpu", 4, wait_s=30, priority=5, exempt=True)))
        t3 = asyncio.create_task(ask("low2", req("xpu", 4, wait_s=30)))
        await asyncio.sleep(0)
        assert [q.request.priority for q in engine.queue_view()] == [5, 0, 0]
        await engine.release(big.id, Caller(1000))
        await asyncio.gather(t1, t2)
        assert order == ["high", "low"]
        assert not t3.done() and len(engine.queue_view()) == 1
        t3.cancel()

    asyncio.run(scenario())
    assert engine.queue_view() == []


def test_wait_expires_with_a_reason(engine):
    async def scenario():
        await engine.try_grant(req("xpu", 8))
        with pytest.raises(NoCapacity, match=r"waited 0\.05 s"):
            await engine.acquire(req("xpu", 1, wait_s=0.05))
        with pytest.raises(NoCapacity, match="--wait"):
            await engine.acquire(req("xpu", 1))

    asyncio.run(scenario())


def test_reaper_reclaims_after_grace(engine):
    async def scenario():
        lease, _ = await engine.try_grant(req("xpu", 1))
        q = engine.hold_opened(lease.id)
        engine.clock.t += 100
        assert await engine.reap() == []  # held: never reclaimed
        engine.hold_closed(lease.id, q)
        engine.clock.t += engine.cfg.leases.grace_s - 0.1
        assert await engine.reap() == []
        engine.clock.t += 0.2
        assert [x.id for x in await engine.reap()] == [lease.id]
        assert engine.ledger.recent_leases()[0].state is LeaseState.RECLAIMED

    asyncio.run(scenario())


def test_restore_rebuilds_state_from_the_ledger(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    e1 = sync_engine(cards(), pcie_box(), Config(), led, clock=Clock())
    a = e1.try_grant(req("xpu", 2))[0]
    b = e1.try_grant(req("vxpu-half"))[0]
    e1.drain("6", "fan")
    led.close()
    e2 = sync_engine(cards(), pcie_box(), Config(), Ledger(tmp_path / "l.sqlite"), clock=Clock())
    restored = e2.restore()
    assert {x.id for x in restored} == {a.id, b.id}
    views = e2.card_views()
    assert all(views[i].whole_lease == a.id for i in a.cards)
    assert views[b.cards[0]].slices[0][0] == b.id and views[b.cards[0]].mode is CardMode.SLICED
    assert views[6].drained and views[6].drain_reason == "fan"
    # nothing is granted twice: the remaining capacity accounts for the restored leases
    taken = set(a.cards)
    free = set(range(8)) - taken - {b.cards[0], 6}
    for _ in range(len(free)):
        g = e2.try_grant(req("xpu", 1))
        assert g and not (set(g[0].cards) & taken)
        taken |= set(g[0].cards)
    assert taken == set(a.cards) | free
    assert e2.try_grant(req("xpu", 1)) is None  # card 6 drained, b's card sliced


def limited(tmp_path, **limits):
    cfg = Config().replace("limits", **limits)
    return sync_engine(cards(), pcie_box(), cfg, Ledger(tmp_path / "l.sqlite"), clock=Clock())


def test_users_may_not_ask_for_a_priority_above_the_limit(tmp_path):
    engine = limited(tmp_path, max_user_priority=10)
    with pytest.raises(
        Forbidden, match=r"priority 11: uid 1000 may ask for 10 at most \(\[limits\] max_user_priority"
    ):
        engine.try_grant(req("xpu", 1, priority=11))
    assert engine.try_grant(req("xpu", 1, priority=10)) is not None
    assert engine.try_grant(req("xpu", 1, priority=-100)) is not None  # lowering one's own is fine
    assert engine.try_grant(req("xpu", 1, priority=100, exempt=True)) is not None  # operators


def test_per_uid_caps_on_leases_and_queued_requests(tmp_path):
    engine = limited(tmp_path, max_leases_per_uid=3, max_queued_per_uid=1)

    async def scenario():
        mine = [await engine.acquire(req("xpu", 3)) for _ in range(2)]
        # only 2 cards left; at priority -1 it does not hold them back from others
        waiting = asyncio.create_task(engine.acquire(req("xpu", 3, wait_s=30, priority=-1)))
        await asyncio.sleep(0)
        assert len(engine.queue_view()) == 1
        with pytest.raises(NoCapacity) as e:  # 2 leases + 1 queued = the cap of 3
            await engine.acquire(req("vxpu-quarter"))
        assert str(e.value) == (
            "uid 1000 has 2 lease(s) and 1 queued request(s), the most [limits] max_leases_per_uid (3) "
            "allows: release a lease first"
        )
        await engine.acquire(req("vxpu-quarter", uid=1001))  # another user is not held back
        queued = asyncio.create_task(engine.acquire(req("xpu", 8, uid=1001, wait_s=30)))
        await asyncio.sleep(0)
        with pytest.raises(
            NoCapacity, match=r"uid 1001 has 1 request\(s\) in the queue, the most \[limits\] "
        ):
            await engine.acquire(req("xpu", 8, uid=1001, wait_s=30))
        op = req("xpu", 1, uid=0, exempt=True, priority=1)  # operators: no caps, any priority
        assert (await engine.acquire(op))[0].owner_uid == 0
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        await engine.release(mine[0][0].id, Caller(1000))
        assert (await waiting)[0].owner_uid == 1000

    asyncio.run(scenario())


def test_concurrent_requests_cannot_pass_a_per_uid_cap_together(tmp_path):
    engine = limited(tmp_path, max_leases_per_uid=1)

    async def scenario():
        both = [engine.grant_or_queue(req("xpu", 1)), engine.acquire(req("xpu", 1))]
        got = await asyncio.gather(*both, return_exceptions=True)
        assert sorted(type(g).__name__ for g in got) == ["NoCapacity", "tuple"]

    asyncio.run(scenario())


def test_a_request_that_does_not_fit_at_once_queues_then_is_granted(engine):
    """Acquire's two steps: ``grant_or_queue`` queues the request (no room) in the same step as its
    last try, ``queued`` waits for the grant, which comes with the next release."""

    async def scenario():
        held = (await engine.try_grant(req("xpu", 8)))[0]
        w = await engine.grant_or_queue(req("xpu", 1, wait_s=30))
        assert isinstance(w, Waiter) and len(engine.queue_view()) == 1
        waiting = asyncio.create_task(engine.queued(w))
        await asyncio.sleep(0.05)
        await engine.release(held.id, Caller(held.owner_uid))
        lease, _ = await asyncio.wait_for(waiting, 2.0)
        assert len(lease.cards) == 1 and len(engine.queue_view()) == 0

    asyncio.run(scenario())


def test_a_queued_request_left_by_its_caller_leaves_the_queue_and_its_timer(engine):
    """A waiter whose caller goes away (the servicer's ``finally``) is out of the queue at once, and its
    deadline timer is cancelled (no task, no wait_for: ``leave`` is synchronous)."""

    async def scenario():
        held = (await engine.try_grant(req("xpu", 8)))[0]
        w = await engine.grant_or_queue(req("xpu", 1, wait_s=30))
        waiting = asyncio.create_task(engine.queued(w))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert engine.queue_view() == [] and w.timer.cancelled() and w.future.cancelled()
        await engine.release(held.id, Caller(held.owner_uid))
        assert engine.leases == {}  # nothing was granted to the request that left

    asyncio.run(scenario())


@pytest.mark.parametrize("path", ["acquire", "grant_or_queue"])
def test_a_grant_whose_requester_goes_away_is_reclaimed_not_lost(engine, path):
    """``grant_or_queue`` is Acquire's path without a helper task: the servicer's own coroutine is the one
    cancelled when the caller goes away."""

    async def scenario():
        asking = asyncio.create_task(getattr(engine, path)(req("xpu", 1)))
        await asyncio.sleep(0)  # placed and committing
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        for _ in range(200):
            ended = engine.ledger.recent_leases(1)
            if ended and ended[0].state is not LeaseState.ACTIVE and not engine._tasks:
                break
            await asyncio.sleep(0.01)
        assert engine.leases == {} and engine.ledger.active_leases() == []
        [ended] = engine.ledger.recent_leases(1)
        assert ended.state is LeaseState.RECLAIMED
        assert all(c.whole_lease is None for c in engine.cards.values())

    asyncio.run(scenario())


def test_a_cancelled_whole_card_request_lets_the_requests_behind_it_through(engine):
    """A waiting whole-card request holds the idle whole cards back from requests behind it; when it
    leaves the queue (cancelled or timed out), those requests are granted at once, not at the next
    release."""

    async def scenario():
        held = (await engine.try_grant(req("xpu", 6)))[0]  # 2 idle whole cards left
        big = asyncio.create_task(engine.acquire(req("xpu", 4, wait_s=30)))
        await asyncio.sleep(0.05)
        small = asyncio.create_task(engine.acquire(req("vxpu-quarter", wait_s=30)))
        await asyncio.sleep(0.6)  # past the short wait for busy cards of a request that may queue
        assert not small.done() and len(engine.queue_view()) == 2  # the idle cards are held back
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)
        lease, _ = await asyncio.wait_for(small, 2.0)
        assert lease.cards[0] not in held.cards

    asyncio.run(scenario())


def test_queueing_and_leaving_a_long_queue_costs_linear_work(engine):
    """Each request queued used to walk the whole queue once (a placement pass per arrival): 6,000
    requests took minutes and gRPC cancelled the last ones unread. Count the waiters the passes look at."""
    looked = [0]
    waitlist = engine.waitlist
    original_iter = getattr(type(waitlist), "__iter__", lambda self: iter(self._waiters))
    original_in_order = type(waitlist).in_order

    class Counting(type(waitlist)):
        def __iter__(self):
            for w in original_iter(self):
                looked[0] += 1
                yield w

        def in_order(self):
            got = original_in_order(self)
            looked[0] += len(got)
            return got

    waitlist.__class__ = Counting
    n = 300

    async def scenario():
        await engine.try_grant(req("xpu", 8))
        tasks = []
        for i in range(n):
            r = req("xpu", 1 + i % 2, wait_s=60, exempt=True)  # past [limits]' 64 per uid
            tasks.append(asyncio.create_task(engine.acquire(r)))
            await asyncio.sleep(0)
        for _ in range(500):
            if len(engine.queue_view()) == n or any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        assert len(engine.queue_view()) == n
        queued = looked[0]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)  # the passes the cancellations asked for
        return queued, looked[0] - queued

    queued, left = asyncio.run(scenario())
    assert engine.queue_view() == []
    assert queued < 5 * n and left < 5 * n, (queued, left)


@pytest.mark.parametrize("tail", ["at_once", "in_a_task"])
def test_a_release_whose_caller_goes_away_still_ends_the_lease(engine, tail):
    """A release runs to its end when its caller goes away mid-commit (a cancelled gRPC call): the
    lease ends in the ledger and in memory and its room is free, whether what follows the commit runs
    at once on the loop (bookkeeping teardowns) or in a task (a teardown that runs a tool)."""

    async def scenario():
        if tail == "in_a_task":
            engine._inline = lambda *_: False  # every teardown as if it ran a tool
        lease, token = await engine.acquire(req("vxpu-quarter"))
        releasing = asyncio.create_task(engine.release(lease.id, Caller(1000), token))
        await asyncio.sleep(0)  # committed by the writer thread meanwhile
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        for _ in range(200):
            if not engine.leases and not engine._tasks and not engine.ledger.active_leases():
                break
            await asyncio.sleep(0.01)
        [ended] = engine.ledger.recent_leases(1)
        assert ended.id == lease.id and ended.state is LeaseState.RELEASED
        assert engine.leases == {} and not engine._ending
        assert all(not c.slices and c.whole_lease is None for c in engine.cards.values())
        with pytest.raises(NotFound, match="no active lease"):
            await engine.release(lease.id, Caller(1000), token)

    asyncio.run(scenario())


def test_a_cards_capacity_is_kept_until_what_it_depends_on_changes(engine):
    """Placement asks every card's capacity at every slice grant: it is computed again only when the
    card's slices, mode, health, drain or pin changed, and is then what a fresh computation gives."""
    e = engine.engine
    c = e.cards[0]
    first = e._capacity(c)
    assert e._capacity(c) is first  # nothing changed: the same object
    lease, _ = engine.try_grant(req("vxpu-quarter"))
    card = e.cards[lease.cards[0]]
    held, pct = e._capacity(card), e.cfg.slices["vxpu-quarter"].compute_pct
    assert held.sliced and not held.idle and held.free_compute_pct == 100 - pct
    engine.try_grant(req("vxpu-quarter"))
    assert e._capacity(card).free_compute_pct == 100 - 2 * pct  # a second slice on it
    engine.release(lease.id, Caller(1000))
    assert e._capacity(card) == held
    card.drained = True
    assert not e._capacity(card).usable
    card.drained = False
    card.health_state = HealthState.DEGRADED
    assert e._capacity(card).avoid and e._capacity(card, usable=False).usable is False
    card.health_state = HealthState.HEALTHY
    kept = e._capacity(card)
    e._capacities.clear()
    assert e._capacity(card) == kept == held


@pytest.mark.parametrize("wait_s", [0.0, 30.0])
def test_max_leases_per_uid_holds_against_racing_requests(tmp_path, wait_s):
    """issue #28 item 3: 20 acquires at once by one uid, limit 2, on a fresh host (the first grant switches
    a card's mode, the others wait for it): 7 were granted. The limit counts requests on their way to a
    grant and is checked again at the grant. The one that waited for the switching card also slept its
    whole BUSY_WAIT_S (10 s): the card was freed before its wait began to listen."""
    cfg = Config().replace("limits", max_leases_per_uid=2)
    engine = sync_engine(cards(), pcie_box(), cfg, Ledger(tmp_path / "l.sqlite"), clock=Clock())

    async def scenario():
        asks = [engine.acquire(req("vxpu-quarter", wait_s=wait_s)) for _ in range(20)]
        t0 = time.monotonic()
        got = await asyncio.gather(*asks, return_exceptions=True)
        assert time.monotonic() - t0 < 5.0
        granted = [g for g in got if isinstance(g, tuple)]
        refused = [g for g in got if isinstance(g, NoCapacity)]
        assert len(granted) == 2 and len(refused) == 18, got
        assert all("max_leases_per_uid (2)" in str(e) for e in refused)

    asyncio.run(scenario())
    assert len(engine.leases) == 2
