"""xpu top driven by key presses against real daemons on simulated hardware, in this process.

Each daemon (tests/daemons.py ``InProcDaemon``) runs on its own asyncio loop in a background thread (the
same ``Daemon`` class that ``xpud --simulate`` runs), so a test can start several quickly and read their
state with the ordinary client. Assertions go through the client: the key press must have changed the
daemon, not just the screen.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

import pytest

pytest.importorskip("textual")

from textual.widgets import DataTable
from xpu_tui.app import XpuTop
from xpu_tui.cardtile import CardTile
from xpu_tui.clusterview import ClusterView
from xpu_tui.eventlog import EventLog
from xpu_tui.hostrow import HostRow
from xpu_tui.modals import CardScreen, ConfirmScreen, HelpScreen, ModeScreen
from xpu_tui.source import HostSpec, LocalHosts, RecordedSource, StaticCluster

from tests.daemons import InProcDaemon
from xpud.api.client import Client

SIZE = (120, 40)


def in_asyncio(test):
    """Run an ``async def`` test on a fresh event loop (the suite has no asyncio plugin)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


# Leases taken by the tests have no holder process: a long grace keeps them from being reclaimed.
HOLDERLESS = "[leases]\ngrace_s = 600.0\n"


@pytest.fixture
def daemons(inproc):
    """In-process daemons (tests/daemons.py) for the app to watch: ``daemons(machine, config_text)``."""

    def make(machine: str = "dgx-h100", config_text: str = HOLDERLESS) -> InProcDaemon:
        return inproc(machine, config_text)

    return make


async def until(pilot, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Let the app run until ``predicate()`` holds (the daemon and the stream take real time)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await pilot.pause(0.05)


def card(client: Client, index: int):
    return next(c for c in client.cards().cards if c.index == index)


async def select_card(pilot, app: XpuTop, index: int, walk: bool = False) -> None:
    """Select a card's tile: by walking there with the arrow keys as an operator would (``walk``), or
    by focusing it (quicker: every key press waits for the app to settle)."""
    await until(pilot, lambda: app.selected_card is not None, what="the first tile focused")
    if not walk:
        app.host_view.tiles[index].focus()
    for _ in range(30):
        if app.selected_card == index:
            return
        if walk:
            await pilot.press("right" if app.selected_card < index else "left")
        else:
            await pilot.pause(0.02)
    raise AssertionError(f"could not select card {index}")


# --------------------------------------------------------------------------------------- operator keys
@in_asyncio
async def test_d_then_y_drains_the_selected_card(daemons):
    d = daemons("dgx-h100")
    with d.client(admin=True) as c:
        app = XpuTop(c, interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await select_card(pilot, app, 3, walk=True)
            await pilot.press("d")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: card(c, 3).drained, what="card 3 drained in the daemon")
            # ... and the stream brings it back to the screen: tile and event log.
            await until(pilot, lambda: app.state.card(3).drained, what="the tile shows it")
            assert "⊘ drained" in str(app.query_one("#card-3", CardTile).render())
            await until(pilot, lambda: any(e.kind == "drain" and e.card == 3 for e in app.state.events))
            assert card(c, 2).drained is False

            await pilot.press("u")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: not card(c, 3).drained, what="card 3 back in service")
            assert app.actions_done == [(True, "card 3 drained"), (True, "card 3 back in service")]


@in_asyncio
async def test_cancelling_the_dialog_changes_nothing(daemons):
    d = daemons("pcie-8x-l40s")
    with d.client(admin=True) as c:
        app = XpuTop(c, interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await select_card(pilot, app, 1)
            await pilot.press("d")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")  # Esc is the one cancel key, in every dialog
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, ConfirmScreen)
            await pilot.press("d", "escape", "m", "escape")
            await pilot.pause(0.3)
            assert not card(c, 1).drained and card(c, 1).mode == "whole" and not card(c, 1).mode_pinned
            assert app.actions_done == []


@in_asyncio
async def test_m_switches_a_cards_mode_and_a_refusal_is_shown(daemons):
    d = daemons("dgx-h100")
    with d.client(admin=True) as c:
        app = XpuTop(c, interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await select_card(pilot, app, 5)
            await pilot.press("m")
            assert isinstance(app.screen, ModeScreen)
            await pilot.press("s")
            await until(pilot, lambda: card(c, 5).mode == "sliced", what="card 5 sliced")
            assert card(c, 5).mode_pinned

            # A card a lease holds whole cannot switch: the dialog says so before the choice, and
            # refuses the key; the daemon is not asked.
            grant = c.acquire_lease("xpu", gpus=1, command="sleep 1000")
            held = grant.lease.cards[0]
            await until(pilot, lambda: app.state.card(held).whole_lease == grant.lease.id, what="held")
            await select_card(pilot, app, held)
            await pilot.press("m")
            assert isinstance(app.screen, ModeScreen) and app.screen.query_one("#sliced").disabled
            assert f"held whole by lease {grant.lease.id}" in str(
                app.screen.query_one(".dialog-body").render()
            )
            await pilot.press("s")
            assert isinstance(app.screen, ModeScreen) and len(app.actions_done) == 1
            await pilot.press("escape")
            assert card(c, held).mode == "whole"


@in_asyncio
async def test_x_releases_the_highlighted_lease(daemons):
    d = daemons("dgx-h100")
    with d.client(admin=True) as c:
        keep = c.acquire_lease("vxpu-half", command="python serve.py").lease
        gone = c.acquire_lease("xpu", gpus=2, command="torchrun train.py").lease
        app = XpuTop(c, interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: len(app.state.leases) == 2, what="both leases on screen")
            await pilot.press("2")
            table = app.query_one("#lease-table", DataTable)
            await until(pilot, lambda: table.has_focus, what="the lease table focused")
            table.move_cursor(row=table.get_row_index(gone.id))
            await until(pilot, lambda: app.selected_lease == gone.id)
            detail = str(app.query_one("#lease-detail").render())
            assert "torchrun train.py" in detail and gone.id in detail
            await pilot.press("x")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: [le.id for le in c.leases().leases] == [keep.id], what="evicted")
            await until(pilot, lambda: table.row_count == 1, what="the table follows the stream")


@in_asyncio
async def test_without_the_admin_socket_keys_only_explain(daemons):
    d = daemons("pcie-8x-l40s")
    with d.client(admin=False) as c:
        app = XpuTop(c, interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await select_card(pilot, app, 0)
            assert not app.operator
            assert "read-only" in str(app.query_one("#status").render())
            await pilot.press("d", "m", "x")
            await pilot.pause(0.2)
            assert not isinstance(app.screen, (ConfirmScreen, ModeScreen))
            hints = [n.message for n in app._notifications]
            assert hints and all("admin socket" in h and "xpu top --admin" in h for h in hints)
            assert not card(c, 0).drained and app.actions_done == []


# --------------------------------------------------------------------------------------- live data
@in_asyncio
async def test_the_watch_stream_updates_every_view(daemons):
    d = daemons("pcie-8x-l40s")
    with d.client(admin=True) as c:
        app = XpuTop(c, interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: len(app.query(CardTile)) == 8, what="eight tiles")
            labels = [str(w.render()) for w in app.query(".group-label")]
            # pcie-8x-l40s: pairs behind one PCIe switch, two per NUMA node.
            assert any("PCIe switch · NUMA 0 · cards 0-1" in text for text in labels), labels
            lease = c.acquire_lease("vxpu-quarter", command="python notebook.py").lease
            await until(pilot, lambda: app.state.lease(lease.id) is not None, what="the new lease")
            slice_card = lease.cards[0]
            tile = app.query_one(f"#card-{slice_card}", CardTile)
            held = f"{lease.id} (quarter)"
            await until(pilot, lambda: held in str(tile.render()), what="the slice on its tile")
            assert any(e.kind == "grant" and e.lease_id == lease.id for e in app.state.events)
            log = app.query_one(EventLog)
            assert log.count == len(app.state.events)

            # Enter on a tile: every signal of the card's last sample and its recent events.
            tile.focus()
            await pilot.press("enter")
            assert isinstance(app.screen, CardScreen)
            details = str(app.screen.query_one(".details").render())
            assert f"{lease.id} (quarter)" in details and tile.card.uuid + "\n" in details
            screen = app.screen
            await until(pilot, lambda: screen.report is not None, what="the health signals")
            names = {s.name for s in screen.report.signals}
            assert {"temperature", "ecc_dbe_volatile"} <= names and screen.report.index == tile.card.index
            await pilot.press("escape", "question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, (CardScreen, HelpScreen))


@in_asyncio
async def test_cluster_view_follows_several_daemons(daemons):
    a, b = daemons("dgx-h100"), daemons("pcie-8x-l40s")
    with a.client(admin=True) as ca, b.client() as cb:
        hosts = [HostSpec.parse(f"rack-1/a={a.runtime_dir}"), HostSpec.parse(f"rack-2/b={b.runtime_dir}")]
        app = XpuTop(ca, LocalHosts(hosts, interval_s=0.2), interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            view = app.query_one(ClusterView)
            await until(pilot, lambda: len(view.hosts) == 2, what="both hosts")
            assert view.hosts[("rack-1", "a")].whole_free == 8
            cb.acquire_lease("xpu", gpus=2, command="train")
            cb.acquire_lease("vxpu-half", command="serve")
            await until(pilot, lambda: view.hosts[("rack-2", "b")].whole_free == 5, what="b's free cards")
            assert view.hosts[("rack-2", "b")].slices_free["vxpu-half"] == 1
            assert view.hosts[("rack-2", "b")].leases == 2

            await pilot.press("4")
            table = app.query_one("#cluster-table", DataTable)
            assert [k.value for k in table.rows] == [
                "domain:rack-1",
                "host:rack-1/a",
                "domain:rack-2",
                "host:rack-2/b",
            ]
            await pilot.press("r", "a", "c", "k", "-", "2")  # typing on the table filters it
            await until(pilot, lambda: table.row_count == 2, what="the filter")
            assert [k.value for k in table.rows] == ["domain:rack-2", "host:rack-2/b"]

            # A host whose daemon goes away is kept, marked, with its last numbers.
            b.stop()
            await until(pilot, lambda: view.hosts[("rack-2", "b")].error != "", what="b marked down")
            assert view.hosts[("rack-2", "b")].whole_free == 5
            assert "down" in str(table.get_row("host:rack-2/b")[5])


@in_asyncio
async def test_a_flood_of_updates_is_one_refresh_per_batch():
    from xpu_tui import demo

    recorded = demo.dgx_source()
    flood = [u for _ in range(10) for u in recorded._updates]
    app = XpuTop(RecordedSource(recorded.info(), recorded.topology(), flood), clock=demo.now)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.state.updates == len(flood), what="every update applied")
    # All 400 were applied (sparklines and the event log need each one), in far fewer refreshes.
    assert 1 <= app.refreshes < len(flood) / 4


@in_asyncio
async def test_a_silent_host_turns_stale_without_new_data():
    from xpu_tui import demo

    now = [demo.now()]
    cluster = StaticCluster([HostRow("a", "r1", cards=8, whole_free=8, seen=now[0])])
    app = XpuTop(demo.dgx_source(), cluster, clock=lambda: now[0])
    async with app.run_test(size=SIZE) as pilot:
        table = app.cluster_view.query_one("#cluster-table", DataTable)
        await until(pilot, lambda: table.row_count == 2, what="the host")
        assert str(table.get_row("host:r1/a")[5]) == "live"
        now[0] += 60  # nothing arrives for a minute
        await until(pilot, lambda: str(table.get_row("host:r1/a")[5]) == "stale 1m00s", what="stale")


@in_asyncio
async def test_cluster_view_counts_a_slice_size_the_config_adds(daemons):
    tiny = "[leases]\ngrace_s = 600.0\n[slices.vxpu-tiny]\nmemory_fraction = 0.125\ncompute_pct = 10\n"
    d = daemons("pcie-8x-l40s", tiny)
    with d.client() as c:
        hosts = [HostSpec.parse(f"rack-1/a={d.runtime_dir}")]
        app = XpuTop(c, LocalHosts(hosts, interval_s=0.2), interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            view = app.query_one(ClusterView)
            await until(pilot, lambda: ("rack-1", "a") in view.hosts, what="the host")
            c.acquire_lease("vxpu-tiny", command="serve")
            await until(pilot, lambda: view.hosts[("rack-1", "a")].whole_free == 7, what="the sliced card")
            free = view.hosts[("rack-1", "a")].slices_free
            assert free["vxpu-tiny"] == 7 and free["vxpu-half"] == 1  # 7 more eighths; 10 % compute each
            await pilot.press("4")
            summary = str(app.query_one("#cluster-summary").render())
            assert "free: 7 whole, 1×½, 3×¼, 7×tiny ·" in summary  # never read as 1¼


ACCOUNTS = (
    HOLDERLESS
    + """
[accounts.vision]
members = ["root"]
quota = 2
limit = 3

[accounts.nlp]
members = ["root"]
quota = 1
weight = 2
"""
)


@in_asyncio
async def test_the_leases_view_shows_each_accounts_share_allocation_and_wait(daemons):
    """xpu top reads ListAccounts (what `xpu accounts` shows): quota, limit, deserved share, allocated,
    waiting and reclaims per account, under the leases; a daemon without accounts shows no such table."""
    from xpu_tui.accountsview import AccountsTable

    d = daemons("workstation-2x", ACCOUNTS)
    with d.client() as c:
        app = XpuTop(c, interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            table = app.query_one("#accounts-table", AccountsTable)
            c.acquire_lease("xpu", account="vision")
            c.acquire_lease("vxpu-half", account="nlp")
            stream = c.acquire("xpu", account="nlp", wait_s=60)  # waits: both cards are taken
            assert next(iter(c.iterate(stream))).HasField("queued")

            def rows() -> dict[str, list]:
                return {k.value: [str(x) for x in table.get_row(k)] for k in table.rows}

            await pilot.press("2")
            want = {
                "vision": ["vision", "2", "3", "1", "1", "0", "0/0"],
                "nlp": ["nlp", "1", "-", "1", "0.5", "1", "0/0"],
                "default": ["default", "0", "-", "0", "0", "0", "0/0"],
            }
            await until(pilot, lambda: table.display and rows() == want, what=f"the accounts {want}")
            assert table.region.height > 0  # on screen, under the leases
            assert "2 GPU-equivalents in the cluster; reclaim fair-share" in str(table.border_title)
            stream.cancel()

    plain = daemons("workstation-2x")
    with plain.client() as c:
        app = XpuTop(c, interval_s=0.2)
        async with app.run_test(size=SIZE) as pilot:
            table = app.query_one("#accounts-table", AccountsTable)
            await until(pilot, lambda: table.reply is not None, what="the accounts' answer")
            assert not table.reply.enabled and not table.display and table.row_count == 0
