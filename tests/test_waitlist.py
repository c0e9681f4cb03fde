"""The waitlist alone: order, positions and the pusher, on a plain event loop."""

from __future__ import annotations

import asyncio

from xpud.engine import waitlist as wl
from xpud.engine.waitlist import Waitlist
from xpud.model import Mode, Request


def _req(priority=0, mode="xpu", uid=1000):
    return Request(Mode(mode), owner_uid=uid, priority=priority, wait_s=3600)


def test_priority_then_fifo_and_the_position_each_newcomer_hears():
    async def main():
        heard = {}
        q = Waitlist()
        ws = {}
        for name, prio in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1), ("f", 0)]:
            ws[name] = q.add(_req(prio), 0.0, lambda e, n, name=name: heard.setdefault(name, (e.position, n)))
        order = [next(k for k, v in ws.items() if v is w) for w in q]
        assert order == ["b", "d", "a", "c", "f", "e"]
        assert heard == {"a": (1, 1), "b": (1, 2), "c": (3, 3), "d": (2, 4), "e": (5, 5), "f": (5, 6)}
        q.remove(ws["b"])
        q.remove(ws["c"])
        q.remove(ws["c"])  # twice: nothing more happens
        assert [v.position for v in q.view()] == [1, 2, 3, 4] and len(q) == 4
        assert [w.ticket for w in q.in_order()] == [ws[k].ticket for k in "dafe"]
        assert q.count_of(1000) == 4 and q.whole_waiting_at(5) and not q.whole_waiting_at(6)
        q.remove(ws["d"])  # the last of priority 5
        assert not q.whole_waiting_at(1) and [w.ticket for w in q] == [ws[k].ticket for k in "afe"]
        assert q.add(_req(5), 0.0).request.priority == 5 and len(q) == 4
        for w in list(q):
            q.remove(w)
        assert len(q) == 0 and list(q) == [] and q.kinds() == {}

    asyncio.run(main())


def test_leaving_the_front_of_a_long_queue_costs_no_walk_over_those_who_left():
    """Thousands leave from the front (the oldest first), each followed by a look at the front (what a
    queue pass does): a plain dict would step over every entry deleted before it each time."""

    async def main():
        q = Waitlist()
        ws = [q.add(_req(), 0.0) for _ in range(20_000)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for w in ws[:-1]:
            q.remove(w)
            next(iter(q))
        assert list(q) == [ws[-1]]
        return loop.time() - t0

    assert asyncio.run(main()) < 2.0  # ~0.1 s; quadratic (a plain dict) took ~5 s here


def test_positions_are_not_pushed_during_a_burst_of_leavers(monkeypatch):
    """A burst of removals (thousands of cancelled waiters) longer than PUSH_MAX_REST intervals: nobody
    is sent a position while it lasts (before, the pusher told every waiter whose position moved at the
    third interval: the leavers too, each a message on a stream being cancelled); once it is over, each
    waiter still queued hears its new position once."""
    monkeypatch.setattr(wl, "PUSH_BURST", 20, raising=False)

    async def main():
        q = Waitlist(push_interval_s=0.05)
        told: dict[int, list[int]] = {}
        ws = [
            q.add(_req(), 0.0, lambda e, n, i=i: told.setdefault(i, []).append(e.position))
            for i in range(400)
        ]
        await asyncio.sleep(0.2)  # the adds' own rest ends: nobody's position moved
        told.clear()
        leaving = ws[:300]
        for k in range(0, 300, 10):  # 300 leave over ~6 intervals, ~50 per interval
            for w in leaving[k : k + 10]:
                q.remove(w)
            await asyncio.sleep(0.01)
        sent_while_leaving = sum(len(told.get(i, [])) for i in range(300))
        await asyncio.sleep(0.4)
        return sent_while_leaving, told

    sent_while_leaving, told = asyncio.run(main())
    assert sent_while_leaving == 0
    assert told == {i: [i - 299] for i in range(300, 400)}
