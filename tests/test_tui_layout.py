"""`xpu top` as a newcomer meets it (issue 18, item 11), on constructed data: every card on an 80x24
screen, the space of a 200x60 one used, the event log at its newest and filterable, operator keys only in
the views they act in, an action's result on the status line (not a toast over the tiles), `--demo` not
called live."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("textual")

from textual.widgets import DataTable
from xpu_tui import demo
from xpu_tui.cardtile import COMPACT_HEIGHT, TALL_HEIGHT, TILE_HEIGHT, CardTile
from xpu_tui.eventlog import EventLog
from xpu_tui.modals import ConfirmScreen

from tests.test_tui_pilot import in_asyncio, until
from tests.test_tui_snapshots import dashboard, settled
from xpud.api.v1 import xpu_pb2 as pb


async def _tiles_shown(pilot) -> list[int]:
    """The cards whose whole tile lies inside the host view's visible region."""
    app = pilot.app
    view = app.host_view.region
    return [i for i, t in app.host_view.tiles.items() if view.contains_region(t.region)]


@pytest.mark.parametrize(
    ("size", "height", "columns"),
    [((80, 24), COMPACT_HEIGHT, 2), ((120, 40), TILE_HEIGHT, 2), ((200, 60), TALL_HEIGHT, 4)],
)
@in_asyncio
async def test_tiles_fit_the_screen(size, height, columns):
    app = dashboard()
    async with app.run_test(size=size) as pilot:
        await settled()(pilot)
        await until(pilot, lambda: app.host_view.tile_height == height, what=f"tiles {height} high")
        assert app.host_view.columns() == columns
        assert sorted(await _tiles_shown(pilot)) == list(range(8)), "every card visible at once"


@in_asyncio
async def test_demo_data_is_not_called_live_and_keys_are_offered_where_they_act():
    app = dashboard(demo.dgx_source(admin=True))
    async with app.run_test(size=(120, 40)) as pilot:
        await settled()(pilot)
        status = str(app.status.render())
        assert " · demo · " in status and "live" not in status
        offered = {}
        for view in ("host", "leases", "events"):
            app.action_view(view)
            await until(pilot, lambda v=view: app.tabs.active == v, what=f"the {view} view")
            offered[view] = {a for a in ("drain", "undrain", "mode", "release") if app.check_action(a, ())}
        assert offered == {
            "host": {"drain", "undrain", "mode", "release"},
            "leases": {"release"},
            "events": set(),
        }


@in_asyncio
async def test_an_actions_result_is_on_the_status_line_not_a_toast():
    app = dashboard(demo.dgx_source(admin=True))
    async with app.run_test(size=(80, 24)) as pilot:
        await settled("right", "right", "right", "d")(pilot)
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: app.actions_done == [(True, "card 3 drained")], what="the action")
        await pilot.pause(0.1)
        assert str(app.status.render()).startswith("✔ card 3 drained · dgx-a07")
        assert list(app._notifications) == []


def _many_events(n: int) -> list[pb.Event]:
    return [
        pb.Event(timestamp=demo.T0 + i, kind="fault" if i % 10 == 0 else "grant", card=i % 8, message=f"e{i}")
        for i in range(n)
    ]


@in_asyncio
async def test_events_open_at_the_newest_and_filter_as_you_type():
    source = demo.dgx_source()
    source._updates[0].events.extend(_many_events(120))
    app = dashboard(source)
    async with app.run_test(size=(80, 24)) as pilot:
        await settled("3")(pilot)
        log = app.query_one(EventLog)
        await until(pilot, lambda: log.has_focus, what="the log focused")
        assert log.cursor_row == log.row_count - 1 and log.scroll_y == log.max_scroll_y > 0
        for key in "fault":
            await pilot.press(key)
        await pilot.pause(0.1)
        assert log.row_count == 12 + 1  # every tenth constructed event, and the demo's own fault
        assert log.cursor_row == log.row_count - 1 and "filter: fault" in str(log.border_title)
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert log.row_count == len(app.state.events) and time.monotonic()


@in_asyncio
async def test_the_view_digits_switch_views_from_the_events_and_cluster_views():
    """#28 item 11: in the event and cluster views every key went to the filter box, so 1-4 could not
    switch views. On the list the digits switch; in the box every key types (`card 3`, `rack-2`), and
    Enter or Esc (even on an empty box) goes back to the list, where the digits switch again."""
    app = dashboard(cluster=demo.cluster(40))
    async with app.run_test(size=(120, 40)) as pilot:
        await settled("3")(pilot)
        log = app.query_one(EventLog)
        await until(pilot, lambda: log.has_focus, what="the log focused")
        await pilot.press("2")
        await until(pilot, lambda: app.tabs.active == "leases", what="2 on the event log: the leases")
        await pilot.press("3")
        await until(pilot, lambda: log.has_focus, what="back on the log")
        await pilot.press("c", "a", "r", "d", "space", "3")  # a digit in the box types
        box = app.query_one("#event-filter")
        assert box.value == "card 3" and app.tabs.active == "events"
        await pilot.press("enter", "1")
        await until(pilot, lambda: app.tabs.active == "host", what="Enter, then 1: the host view")
        assert log.words == ["card", "3"]  # the filter stays

        await pilot.press("4")
        table = app.cluster_view.query_one("#cluster-table")
        await until(pilot, lambda: table.has_focus, what="the cluster table focused")
        await pilot.press("slash")
        cbox = app.query_one("#cluster-filter")
        assert cbox.has_focus
        await pilot.press("escape")  # an empty box: Esc goes back to the table
        assert table.has_focus
        await pilot.press("r", "a", "c", "k", "-", "0", "2", "escape", "3")
        await until(pilot, lambda: app.tabs.active == "events", what="Esc, then 3: the events")
        assert cbox.value == ""


@in_asyncio
async def test_leases_show_job_names_slurm_leases_and_whole_uuids():
    """#28 item 11 and 13: the job's name (`xpu run --name`) in the lease and queue tables and the
    details; a Slurm job's lease (no Hold stream by design) not shown as NOT holding; each card's UUID
    whole on the line of its card number, and wrapped lines under the value, not at column 0."""
    app = dashboard()
    async with app.run_test(size=(160, 40)) as pilot:
        await settled("2")(pilot)
        table = app.query_one("#lease-table", DataTable)
        await until(pilot, lambda: table.has_focus, what="the lease table focused")
        names = [str(c.label) for c in table.columns.values()]
        assert names[:2] == ["LEASE", "NAME"]
        row = [str(v) for v in table.get_row("c09d5e13")]
        assert row[1] == "gpt-small" and row[names.index("HELD")] == "slurm"
        assert [str(v) for v in table.get_row("b41e0d77")][1] == "-"  # no name
        queue = app.query_one("#queue-table", DataTable)
        assert [str(v) for v in queue.get_row("q-51d0")][2] == "finetune-4"

        table.move_cursor(row=table.get_row_index("c09d5e13"))
        await until(pilot, lambda: app.selected_lease == "c09d5e13")
        await pilot.pause(0.1)
        detail = app.query_one("#lease-detail")
        lines = str(detail.render()).splitlines()
        width = detail.content_region.width
        assert lines[0].split() == ["lease", "c09d5e13", "gpt-small", "(active)", "xpu,", "owner", "user1002"]
        holder = next(line for line in lines if line.split()[0] == "holder")
        assert "kept by slurm:48213" in holder and "NOT" not in "".join(lines)
        for card in (1, 2):
            assert any(line.split()[-2:] == [str(card), demo.dgx_uuid(card)] for line in lines), lines
        assert all(len(line) <= width for line in lines), "\n".join(lines)
        assert all(line.startswith(" " * 9) or line.split()[0].isalpha() for line in lines), "\n".join(lines)

        table.move_cursor(row=table.get_row_index("7f3a91c2"))
        await until(pilot, lambda: app.selected_lease == "7f3a91c2")
        await pilot.pause(0.1)
        lines = str(detail.render()).splitlines()
        mig = "MIG-0a1b2c3d-4e5f-5a6b-8c7d-9e0f1a2b3c4d"
        assert any(line.split() == [mig] for line in lines), lines


@pytest.mark.parametrize(("size", "panel"), [((200, 60), True), ((120, 40), False), ((80, 24), False)])
@in_asyncio
async def test_a_large_terminal_shows_leases_queue_and_events_under_the_tiles(size, panel):
    """#28 item 11: at 200x60 half the screen stayed empty under the tiles. The rows the tiles leave
    now hold the leases, the queue and the newest events (read-only: the keys stay on the tiles)."""
    app = dashboard()
    async with app.run_test(size=size) as pilot:
        await settled()(pilot)
        await until(pilot, lambda: app.host_panel.display == panel, what=f"the panel shown: {panel}")
        await pilot.pause(0.1)
        assert sorted(await _tiles_shown(pilot)) == list(range(8)), "every card still visible at once"
        if not panel:
            return
        shown = app.host_panel.region
        assert shown.y >= app.host_view.region.bottom and shown.bottom >= size[1] - 2  # down to the footer
        tables = {t.id: t for t in app.host_panel.query(DataTable)}
        assert tables["panel-leases"].row_count == 6 and tables["panel-queue"].row_count == 2
        events = tables["panel-events"]
        assert events.row_count == len(app.state.events)
        assert str(events.get_row_at(0)[3]) == app.state.events[-1].message  # newest first
        assert str(tables["panel-leases"].get_row("c09d5e13")[1]) == "gpt-small"
        assert not any(t.can_focus for t in tables.values()) and isinstance(app.focused, CardTile)
