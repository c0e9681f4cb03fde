"""The cluster view (xpud.federation.view): host summaries ride the membership meta to every peer, are
checked on the way in, and become the multi-host placement's snapshot."""

from __future__ import annotations

import math

import pytest

from xpud.federation.membership import MAX_META, State, SwimConfig
from xpud.federation.simnet import SimNet
from xpud.federation.view import BadSummary, HostSummary, decode, encode, entries, offers
from xpud.placement.multihost import place_gang


def summary(free=8, domain="r1", **kw) -> HostSummary:
    return HostSummary(8, free, (math.inf, *[300.0] * 7), {"vxpu-half": 2}, 100, 0, "z1", "b1", domain, **kw)


def test_a_summary_round_trips_within_the_meta_bound():
    s = summary()
    text = encode(s)
    assert len(text.encode()) <= MAX_META and decode(text) == s


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[" * 5000,
        '{"c":8,"w":9,"g":[],"s":{},"h":100,"q":0,"l":["","",""]}',  # more free cards than cards
        '{"c":8,"w":1,"g":[1e400],"s":{},"h":100,"q":0,"l":["","",""]}',  # not finite
        '{"c":8,"w":1,"g":[],"s":{"x":-1},"h":100,"q":0,"l":["","",""]}',
        '{"c":8,"w":1,"g":[],"s":{},"h":101,"q":0,"l":["","",""]}',
        '{"c":8,"w":1,"g":[],"s":{},"h":100,"q":0,"l":["","",""],"extra":1}',
        '{"c":true,"w":0,"g":[],"s":{},"h":100,"q":0,"l":["","",""]}',
    ],
)
def test_bad_summaries_from_the_wire_are_refused_whole(text):
    with pytest.raises(BadSummary):
        decode(text)


def test_summaries_reach_every_peer_and_feed_multi_host_placement():
    net = SimNet(12, seed=3, cfg=SwimConfig(push_pull_interval_s=5.0))
    for i, host in enumerate(net.hosts.values()):
        host.set_meta(encode(summary(free=8 if i % 3 else 2, domain=f"r{i // 4}")))
    net.run(10)
    assert net.converged()
    view = entries(net.hosts["h5"].members.values(), net.now)
    assert len(view) == 12 and all(e.summary is not None for e in view)
    got = place_gang(offers(view), nodes=3, gpus_per_node=4)
    assert got.level == "domain" and len({net.hosts[h].name for h in got.hosts}) == 3
    # a host whose capacity changes publishes a newer summary; peers see it within a few gossip rounds
    net.hosts["h1"].set_meta(encode(summary(free=0)))
    net.run(2)
    seen = {e.name: e for e in entries(net.hosts["h9"].members.values(), net.now)}
    assert seen["h1"].summary.free_whole == 0 and seen["h1"].age_s < 2
    net.crash("h2")
    net.run(15)
    names = {o.name for o in offers(entries(net.hosts["h0"].members.values(), net.now))}
    assert "h2" not in names and "h0" in names
    assert net.state_of("h0", "h2") is State.DEAD


def test_more_room_is_more_whole_cards_or_more_slices_of_some_size():
    from xpud.federation.view import more_room

    assert more_room(summary(free=2), summary(free=3)) and not more_room(summary(free=3), summary(free=2))
    two, three = summary(), HostSummary(8, 8, (), {"vxpu-half": 3}, 100, 0)
    assert more_room(two, three) and not more_room(three, two) and not more_room(two, two)
    assert more_room(None, summary(free=1)) and not more_room(None, HostSummary(8, 0))
    assert not more_room(summary(), None)  # gone: no room


def test_news_of_room_wakes_waiters_in_order_and_is_never_missed():
    import asyncio

    from xpud.federation.room import Room

    async def main():
        room, woke = Room(), []
        seen = room.seq
        room.notify()  # news while planning: the wait that follows returns at once
        assert await room.wait(seen, 10.0)
        assert not await room.wait(room.seq, 0.01)  # no news: the fallback time-out

        async def waiter(name):
            await room.wait(room.seq, 10.0)
            woke.append(name)

        tasks = [asyncio.ensure_future(waiter(n)) for n in "abc"]
        await asyncio.sleep(0)
        room.notify()
        await asyncio.gather(*tasks)
        assert woke == ["a", "b", "c"] and not room._waiters

    asyncio.run(main())
