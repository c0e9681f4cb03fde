"""Snapshots of xpu top (pytest-textual-snapshot; Textual is pinned because the SVGs depend on it).

The data is constructed (``xpu_tui.demo``) and played through the same source → worker → message path as
a live daemon, with a fixed clock, UTC times and fixed user names, so every run draws the same screen.
Update after an intended change with ``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at
the report before committing.
"""

from __future__ import annotations

import time

import pytest
from textual.widgets import Input

pytest.importorskip("textual")
pytest.importorskip("pytest_textual_snapshot")

from xpu_tui import demo
from xpu_tui.app import XpuTop
from xpu_tui.source import RecordedSource, StaticCluster

WIDE = (120, 40)
SMALL = (80, 24)


def dashboard(source: RecordedSource | None = None, cluster: StaticCluster | None = None) -> XpuTop:
    return XpuTop(
        source or demo.dgx_source(),
        cluster,
        clock=demo.now,
        localtime=time.gmtime,
        owner=lambda uid: f"user{uid}",
    )


def settled(*keys: str, hosts: int = 0):
    """A ``run_before`` that waits for every recorded update (and host), then presses ``keys``."""

    async def run_before(pilot) -> None:
        app: XpuTop = pilot.app
        deadline = time.monotonic() + 20
        while (
            app.state.updates < demo.SAMPLES
            or app.selected_card is None
            or len(app.cluster_view.hosts) < hosts
        ):
            assert time.monotonic() < deadline, "the recorded data did not arrive"
            await pilot.pause(0.02)
        # A filter box's cursor blinks every 0.5 s: with 1000 hosts to filter at each key, the screenshot
        # came before or after a blink depending on the machine's load (test_cluster_view_filtered_80x24
        # failed now and then). A steady cursor draws the same every time.
        for box in app.query(Input):
            box.cursor_blink = False
        for key in keys:
            await pilot.press(key)
            await pilot.pause(0.05)
        await pilot.pause(0.1)

    return run_before


def test_host_view(snap_compare):
    """Eight H100s in two NVLink/NUMA groups: whole, sliced (MIG, MPS) with their leases, drained,
    degraded and unhealthy cards, sparklines from forty samples."""
    assert snap_compare(dashboard(), terminal_size=WIDE, run_before=settled())


def test_host_view_80x24(snap_compare):
    assert snap_compare(dashboard(), terminal_size=SMALL, run_before=settled())


def test_a_card_in_each_health_state(snap_compare):
    """healthy, degraded (hot, PCIe replays), unhealthy (fallen off the bus, drained): words and symbols
    say the state, not only the colour."""
    assert snap_compare(dashboard(demo.health_source()), terminal_size=SMALL, run_before=settled())


def test_cluster_view_with_1000_hosts(snap_compare):
    app = dashboard(cluster=demo.cluster(1000))
    assert snap_compare(app, terminal_size=WIDE, run_before=settled("4", hosts=1000))


def test_cluster_view_filtered_80x24(snap_compare):
    """Typing on the table filters it: here the stale hosts (no news lately; unreachable ones are down)."""
    app = dashboard(cluster=demo.cluster(1000))
    keys = ("4", "s", "t", "a", "l", "e")
    assert snap_compare(app, terminal_size=SMALL, run_before=settled(*keys, hosts=1000))


def test_leases_and_queue_80x24(snap_compare):
    assert snap_compare(dashboard(), terminal_size=SMALL, run_before=settled("2", "down"))


def test_events_80x24(snap_compare):
    assert snap_compare(dashboard(), terminal_size=SMALL, run_before=settled("3"))


def test_drain_asks_first(snap_compare):
    app = dashboard(demo.dgx_source(admin=True))
    assert snap_compare(app, terminal_size=SMALL, run_before=settled("right", "right", "right", "d"))


LARGE = (200, 60)


def test_host_view_200x60(snap_compare):
    """A large terminal is used: the four cards of a group in one row, wide sparklines, tall tiles with a
    power line and one line per holder."""
    assert snap_compare(dashboard(), terminal_size=LARGE, run_before=settled())


def details_loaded(*keys: str):
    """``settled`` and then wait until the card dialog has its health signals."""
    before = settled(*keys)

    async def run_before(pilot) -> None:
        await before(pilot)
        deadline = time.monotonic() + 20
        while getattr(pilot.app.screen, "report", None) is None:
            assert time.monotonic() < deadline, "the health signals did not arrive"
            await pilot.pause(0.02)
        await pilot.pause(0.1)

    return run_before


def test_card_details_80x24(snap_compare):
    """Enter on a tile: the card's facts, its UUID on a line of its own, every health signal against its
    threshold (as `xpu health CARD`), a close hint, and the dialog's own footer instead of the host's."""
    assert snap_compare(dashboard(), terminal_size=SMALL, run_before=details_loaded("down", "enter"))


def test_events_filtered_80x24(snap_compare):
    """Typing on the event log filters it (here: the health events), newest selected."""
    keys = ("3", "h", "e", "a", "l", "t", "h")
    assert snap_compare(dashboard(), terminal_size=SMALL, run_before=settled(*keys))


def test_mode_refuses_before_the_choice(snap_compare):
    """m on a card a lease holds whole: sliced is offered disabled, with the reason; Esc cancels."""
    app = dashboard(demo.dgx_source(admin=True))
    assert snap_compare(app, terminal_size=SMALL, run_before=settled("right", "m"))


def test_enter_on_a_cluster_host(snap_compare):
    app = dashboard(cluster=demo.cluster(40))
    keys = ("4", "down", "down", "enter")
    assert snap_compare(app, terminal_size=SMALL, run_before=settled(*keys, hosts=40))
