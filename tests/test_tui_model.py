"""The dashboard's data side, without a screen: formatting, flood collapsing, topology groups, host
summaries, the state folded from Watch updates, and the reconnecting stream follower."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from xpu_cli.vocab import age
from xpu_tui import demo
from xpu_tui.hostrow import HostRow, from_watch, totals
from xpu_tui.hoststate import HostState
from xpu_tui.mailbox import Mailbox
from xpu_tui.render import bar, spark
from xpu_tui.source import HostSpec, RecordedSource, follow
from xpu_tui.topogroups import card_list, group_cards

from xpud.api.capacity import slices_that_fit, whole_free
from xpud.api.v1 import xpu_pb2 as pb
from xpud.config.schema import DEFAULT_SLICES
from xpud.errors import Unavailable
from xpud.topology import MULTIPLE, NODE, SINGLE, SYSTEM


# ------------------------------------------------------------------------------------------ render
@pytest.mark.parametrize(
    ("fraction", "text"),
    [(0.0, "    "), (1.0, "████"), (0.5, "██  "), (0.5 + 1 / 32, "██▏ "), (2.0, "████"), (None, "····")],
)
def test_bar_in_eighths(fraction, text):
    assert bar(fraction, 4) == text


def test_spark_keeps_the_newest_points_right_aligned():
    assert spark([0, 100], 4) == "  ▁█"
    assert spark(list(range(0, 101, 10)), 3) == "▇██"
    assert spark([], 3) == "   "


@pytest.mark.parametrize(("s", "text"), [(5, "5s"), (192, "3m12s"), (18180, "5h03m"), (187200, "2d04h")])
def test_age(s, text):
    assert age(s) == text


# ------------------------------------------------------------------------------------------ mailbox
def test_mailbox_rings_once_per_batch_and_loses_nothing():
    box: Mailbox[int] = Mailbox()
    rings = [box.put(i) for i in range(100)]
    assert rings == [True] + [False] * 99
    assert box.take() == list(range(100))
    assert box.put(100) is True  # taken: the next put rings again
    assert box.take() == [100] and box.take() == []


def test_mailbox_drops_the_oldest_beyond_its_limit():
    box: Mailbox[int] = Mailbox(limit=3)
    for i in range(5):
        box.put(i)
    assert box.take() == [2, 3, 4] and box.dropped == 2


# ------------------------------------------------------------------------------------------ topology
def _matrix(n, level):
    return [[0 if i == j else level(i, j) for j in range(n)] for i in range(n)]


def test_pcie_pairs_group_by_switch_and_numa():
    # pcie-8x-l40s: pairs behind one switch (PIX), pairs of pairs in one NUMA node, two sockets.
    levels = _matrix(8, lambda i, j: SINGLE if i // 2 == j // 2 else (NODE if i // 4 == j // 4 else SYSTEM))
    groups = group_cards(levels, [], [i // 4 for i in range(8)])
    assert [(g.label, g.cards) for g in groups] == [
        ("PCIe switch · NUMA 0 · cards 0-1", (0, 1)),
        ("PCIe switch · NUMA 0 · cards 2-3", (2, 3)),
        ("PCIe switch · NUMA 1 · cards 4-5", (4, 5)),
        ("PCIe switch · NUMA 1 · cards 6-7", (6, 7)),
    ]


def test_nvlink_island_splits_by_numa_and_loners_stand_alone():
    levels = _matrix(5, lambda i, j: SYSTEM)
    links = _matrix(5, lambda i, j: 12 if i < 4 and j < 4 else 0)
    groups = group_cards(levels, links, [0, 0, 1, 1, None], indices=[10, 11, 12, 13, 14])
    assert [g.label for g in groups] == [
        "NVLink NV12 · NUMA 0 · cards 10-11",
        "NVLink NV12 · NUMA 1 · cards 12-13",
        "PCIe · cards 14",
    ]


def test_multiple_bridges_is_still_one_island():
    levels = _matrix(2, lambda i, j: MULTIPLE)
    assert group_cards(levels, [], [0, 0])[0].label == "PCIe switches · NUMA 0 · cards 0-1"


def test_card_list():
    assert card_list([6, 0, 1, 2, 3]) == "0-3,6"


# ------------------------------------------------------------------------------------------ summaries
def _card(**kw) -> pb.Card:
    base = dict(index=0, mode="whole", health_state="healthy", free_memory_fraction=1.0, free_compute_pct=100)
    return pb.Card(**{**base, **kw})


def test_whole_free_counts_idle_usable_cards_a_whole_lease_could_take():
    assert whole_free(_card())
    assert whole_free(_card(mode="sliced"))  # empty and not pinned: the engine may switch it back
    assert not whole_free(_card(mode="sliced", mode_pinned=True))
    assert not whole_free(_card(whole_lease="abc"))
    assert not whole_free(_card(drained=True))
    assert not whole_free(_card(health_state="unhealthy"))
    assert not whole_free(_card(sample=pb.Sample(lost=True)))
    assert whole_free(_card(health_state="degraded"))


def test_slices_that_fit_take_the_tighter_of_memory_and_compute():
    spec_half, spec_quarter = DEFAULT_SLICES["vxpu-half"], DEFAULT_SLICES["vxpu-quarter"]
    card = _card(mode="sliced", free_memory_fraction=0.75, free_compute_pct=40)
    assert slices_that_fit(card, spec_half) == 1  # memory 1.5, compute 1.33
    assert slices_that_fit(card, spec_quarter) == 2  # memory 3, compute 2.67
    assert slices_that_fit(_card(free_memory_fraction=1.0), spec_half) == 0  # whole cards are not slices
    assert slices_that_fit(_card(mode="sliced", drained=True), spec_half) == 0


def test_summarize_the_demo_host():
    update = demo.dgx_source()._updates[-1]
    h = from_watch("dgx-a07", update, seen=demo.now(), domain="rack-7")
    assert (h.cards, h.healthy, h.degraded, h.unhealthy, h.drained) == (8, 6, 1, 1, 2)
    # cards 3 and 4 are idle whole cards; 5 and 7 are drained; 0 and 6 hold slices; 1, 2 a lease.
    assert h.whole_free == 2
    assert h.slices_free == {"vxpu-half": 0, "vxpu-quarter": 1}  # card 0: 25 % memory, 55 % compute left
    assert (h.leases, h.queued) == (6, 2)
    assert h.key == ("rack-7", "dgx-a07")


def test_stale_and_totals():
    fresh = HostRow("a", "r1", whole_free=2, slices_free={"vxpu-half": 1}, seen=100.0)
    old = HostRow("b", "r1", whole_free=1, degraded=1, seen=80.0)
    down = HostRow("c", "r1", unhealthy=2, seen=100.0, error="cannot reach xpud")
    assert not fresh.stale(101.0, 5.0) and old.stale(101.0, 5.0) and down.stale(101.0, 5.0)
    t = totals("r1", [fresh, old, down], now=101.0, stale_after_s=5.0)
    assert (t.hosts, t.stale, t.down, t.whole_free, t.degraded, t.unhealthy) == (3, 1, 1, 3, 1, 2)
    # one word per host, the same in its row, the domain's totals and the filter
    assert [h.reach(101.0, 5.0) for h in (fresh, old, down)] == ["live", "stale", "down"]
    assert t.slices_free == {"vxpu-half": 1}


# ------------------------------------------------------------------------------------------ host state
def test_state_keeps_a_history_per_new_sample_and_skips_repeated_events():
    source = demo.dgx_source()
    state = HostState()
    for u in source._updates:
        state.apply(u)
    state.apply(source._updates[-1])  # the daemon repeats the last sample until it takes a new one
    assert state.updates == demo.SAMPLES + 1
    assert len(state.history_of(state.card(1)).utilization_pct) == demo.SAMPLES
    assert len(state.events) == 16
    assert state.leases[0].id == "c09d5e13"  # oldest first
    assert [q.position for q in state.queue] == [1, 2]
    # After a reconnect the first update brings recent history again: nothing is logged twice.
    assert state.apply(source._updates[0]) == []
    assert len(state.events) == 16


def test_lost_cards_add_no_points():
    state = HostState()
    state.apply(demo.health_source()._updates[0])
    assert list(state.history_of(state.card(2)).utilization_pct) == []


# ------------------------------------------------------------------------------------------ sources
def test_host_spec_parse():
    assert HostSpec.parse("/run/xpud") == HostSpec(Path("/run/xpud"))
    assert HostSpec.parse("node-a=/run/a") == HostSpec(Path("/run/a"), "node-a", "")
    assert HostSpec.parse("dc1/rack-3/node-a=/run/a") == HostSpec(Path("/run/a"), "node-a", "dc1/rack-3")


class FlakySource(RecordedSource):
    """Fails to connect once, then streams two updates and ends (as a restarting daemon would)."""

    def __init__(self):
        src = demo.dgx_source()
        super().__init__(src.info(), src.topology(), src._updates[:2])
        self.connects = 0

    def info(self):
        self.connects += 1
        if self.connects == 1:
            raise Unavailable("cannot reach xpud")
        return super().info()

    def updates(self, interval_s):
        yield from self._updates  # and then the stream ends


def test_follow_reports_errors_and_reconnects_until_stopped():
    source, stop = FlakySource(), threading.Event()
    seen: list[str] = []

    def on_update(update):
        seen.append("update")
        if seen.count("update") == 4:
            stop.set()

    follow(
        source,
        0.1,
        stop,
        on_connect=lambda info, topo: seen.append(f"connect {info.hostname} {topo.size}"),
        on_update=on_update,
        on_error=lambda reason: seen.append(f"error {reason}"),
        retry_s=0.01,
    )
    assert seen == [
        "error cannot reach xpud",
        "connect dgx-a07 8",
        "update",
        "update",
        "error the daemon closed the Watch stream",
        "connect dgx-a07 8",
        "update",
        "update",
    ]
