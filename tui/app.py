"""``xpu top``: the live dashboard of one xpud host, and of several hosts when given.

The app takes its backend in the constructor: an ``xpud.api.client.Client`` or any ``HostSource``
(tests and screenshots pass recorded data). A worker thread follows the daemon's Watch stream; updates go
through a ``Mailbox`` so a flood becomes one refresh; the UI reacts to typed messages. Operator actions
run in worker threads after a confirmation dialog, and only on the admin socket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Footer, Static, TabbedContent, TabPane
from xpu_cli.vocab import user_name
from xpu_tui.accountsview import AccountsTable
from xpu_tui.cardtile import CardTile
from xpu_tui.clusterview import ClusterView
from xpu_tui.eventlog import EventLog, EventsView
from xpu_tui.hostpanel import HostPanel
from xpu_tui.hostrow import HostRow
from xpu_tui.hoststate import HostState
from xpu_tui.hostview import HostView
from xpu_tui.leasesview import LeasesView
from xpu_tui.mailbox import Mailbox
from xpu_tui.modals import CardScreen, ConfirmScreen, HelpScreen, ModeScreen
from xpu_tui.source import ClientSource, ClusterFeed, HostSource, follow, poll_accounts
from xpu_tui.topogroups import groups_from_topology

from xpud.api.client import Client
from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import XpudError

OPERATOR_ACTIONS = ("drain", "undrain", "mode", "release")
# The views each operator key acts in: it is offered (in the footer) and works there only.
ACTION_VIEWS = {"drain": {"host"}, "undrain": {"host"}, "mode": {"host"}, "release": {"host", "leases"}}
RESULT_S = 8.0  # how long an operator action's result stays on the status line
ACCOUNTS_S = 2.0  # the accounts (one ListAccounts) are asked this often, or every Watch interval if longer
ADMIN_HINT = "run `xpu top --admin` as root or a member of the admin group"


owner_name = user_name  # a uid as a user name, as the CLI shows it


class XpuTop(App[None]):
    TITLE = "xpu top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #status { height: 1; padding: 0 1; background: $boost; text-wrap: nowrap; text-overflow: ellipsis; }
    TabbedContent { height: 1fr; }
    TabPane { padding: 0; }
    .card-group { height: auto; }
    .group-label { height: 1; color: $text-muted; text-style: bold; padding: 0 1; }
    .card-grid { height: auto; grid-size: 2; grid-rows: 8; grid-gutter: 0 1; padding: 0 1; }
    CardTile { height: 8; border: round $primary-darken-2; padding: 0 1; }
    CardTile:focus { border: heavy $accent; }
    CardTile.-degraded { border: round $warning; }
    CardTile.-unhealthy { border: round $error; }
    CardTile.-drained { border: dashed $warning; }
    CardTile:focus.-degraded, CardTile:focus.-unhealthy, CardTile:focus.-drained { border: heavy $accent; }
    #host-empty { padding: 1 2; color: $text-muted; }
    #host { height: 1fr; }
    HostPanel { height: 1fr; display: none; }
    #panel-left { width: 1fr; }
    #panel-leases { height: 1fr; border: round $primary-darken-2; }
    #panel-queue { height: auto; max-height: 8; border: round $primary-darken-2; }
    #panel-events { width: 1fr; height: 1fr; border: round $primary-darken-2; }
    LeasesView { height: 1fr; }
    #lease-table { height: 1fr; min-height: 6; border: round $primary-darken-2; }
    #lease-detail { height: auto; max-height: 7; border: round $primary-darken-2; padding: 0 1; }
    #queue-table { height: auto; max-height: 6; border: round $primary-darken-2; }
    #accounts-table { height: auto; max-height: 10; border: round $primary-darken-2; }
    LeasesView.-wide #lease-detail { dock: right; width: 64; height: 1fr; max-height: 100%; }
    EventsView { height: 1fr; }
    #event-filter { height: 3; }
    EventLog { height: 1fr; border: round $primary-darken-2; }
    ClusterView { height: 1fr; }
    #cluster-filter { height: 3; }
    #cluster-summary { height: auto; padding: 0 1; color: $text-muted; }
    #cluster-table { height: 1fr; }
    .dialog-screen { align: center middle; }
    .dialog { width: 72; max-width: 100%; height: auto; max-height: 90%; border: thick $accent;
              background: $surface; padding: 1 2; }
    .dialog.wide { width: 100; }
    .dialog-title { text-style: bold; margin-bottom: 1; }
    .dialog-buttons { height: auto; margin-top: 1; align-horizontal: right; }
    .dialog-buttons Button { margin-left: 1; min-width: 10; }
    """
    BINDINGS: ClassVar = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("1", "view('host')", "Host", show=False),
        Binding("2", "view('leases')", "Leases", show=False),
        Binding("3", "view('events')", "Events", show=False),
        Binding("4", "view('cluster')", "Cluster", show=False),
        Binding("d", "drain", "Drain"),
        Binding("u", "undrain", "Undrain"),
        Binding("m", "mode", "Mode"),
        Binding("x", "release", "Release"),
    ]

    # ------------------------------------------------------------------ typed messages from the workers
    class Connected(Message):
        def __init__(self, info: pb.InfoReply, topology: pb.TopologyReply | None) -> None:
            super().__init__()
            self.info, self.topology = info, topology

    class UpdatesReady(Message):
        """Updates wait in the mailbox (one message per batch, however many arrived)."""

    class Disconnected(Message):
        def __init__(self, reason: str) -> None:
            super().__init__()
            self.reason = reason

    class ClusterReady(Message):
        """Host summaries wait in the cluster mailbox."""

    class AccountsReady(Message):
        def __init__(self, reply: pb.AccountsReply) -> None:
            super().__init__()
            self.reply = reply

    class ActionFinished(Message):
        def __init__(self, ok: bool, text: str) -> None:
            super().__init__()
            self.ok, self.text = ok, text

    def __init__(
        self,
        source: HostSource | Client,
        cluster: ClusterFeed | None = None,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        localtime: Callable = time.localtime,
        owner: Callable[[int], str] = owner_name,
    ) -> None:
        super().__init__()
        self.source: HostSource = ClientSource(source) if isinstance(source, Client) else source
        self.cluster = cluster
        self.interval_s = interval_s
        self.clock, self.localtime, self.owner = clock, localtime, owner
        self.state = HostState()
        self.info: pb.InfoReply | None = None
        self.connection = "connecting…"
        self.selected_card: int | None = None
        self.selected_lease: str | None = None
        self.actions_done: list[tuple[bool, str]] = []  # (ok, message) of finished operator actions
        self.live_word = getattr(self.source, "label", "live")  # "demo" for constructed data
        self._result: tuple[bool, str, float] | None = None  # the last action's result, shown until then
        self._mailbox: Mailbox[pb.WatchUpdate] = Mailbox()
        self._cluster_box: Mailbox[HostRow] = Mailbox(limit=100_000)
        self._stop = threading.Event()
        self._placed_focus = False
        self.refreshes = 0  # batches of updates applied (one screen refresh each)

    @property
    def operator(self) -> bool:
        """Connected through the admin socket, as someone the daemon calls an operator."""
        return self.source.admin and (self.info is None or self.info.caller_is_admin)

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        # The views are kept as attributes: ``query_one`` searches the active screen, a dialog at times.
        self.status = Static(id="status")
        self.tabs = TabbedContent(initial="host")
        self.host_panel = HostPanel(self.owner, self.clock, self.localtime, id="host-panel")
        self.host_view = HostView(self.host_panel, id="host-view")
        self.leases_view = LeasesView(self.owner, self.clock, self.localtime, id="leases-view")
        self.event_log = EventLog(self.localtime, id="event-log")
        self.cluster_view = ClusterView(self.clock, max(5.0, 3 * self.interval_s), id="cluster-view")
        self.accounts_table = AccountsTable(id="accounts-table")
        yield self.status
        with self.tabs:
            with TabPane("1 Host", id="host"):
                yield self.host_view
                yield self.host_panel
            with TabPane("2 Leases", id="leases"):
                yield self.leases_view
                yield self.accounts_table
            with TabPane("3 Events", id="events"):
                yield EventsView(self.event_log, id="events-view")
            if self.cluster is not None:
                with TabPane("4 Cluster", id="cluster"):
                    yield self.cluster_view
        yield Footer()

    def on_ready(self) -> None:
        # Start the streams once the screen is mounted: their first message builds the tiles.
        self._show_status()
        self._follow_host()
        self._follow_accounts()
        if self.cluster is not None:
            self._follow_cluster()

    def on_unmount(self) -> None:
        # The worker threads block on the streams: end them, or the process cannot exit.
        self._stop.set()
        self.source.close()

    # ------------------------------------------------------------------ workers (threads; no UI calls)
    @work(thread=True, group="host", exit_on_error=False)
    def _follow_host(self) -> None:
        def on_update(update: pb.WatchUpdate) -> None:
            if self._mailbox.put(update):
                self.post_message(self.UpdatesReady())

        follow(
            self.source,
            self.interval_s,
            self._stop,
            on_connect=lambda info, topo: self.post_message(self.Connected(info, topo)),
            on_update=on_update,
            on_error=lambda reason: self.post_message(self.Disconnected(reason)),
        )

    @work(thread=True, group="accounts", exit_on_error=False)
    def _follow_accounts(self) -> None:
        if not hasattr(self.source, "accounts"):
            return  # a source that knows no accounts: the table stays hidden
        every = max(ACCOUNTS_S, self.interval_s)
        poll_accounts(self.source, every, self._stop, lambda r: self.post_message(self.AccountsReady(r)))

    @work(thread=True, group="cluster", exit_on_error=False)
    def _follow_cluster(self) -> None:
        def publish(batch: list[HostRow]) -> None:
            ring = False
            for h in batch:
                ring = self._cluster_box.put(h) or ring
            if ring:
                self.post_message(self.ClusterReady())

        assert self.cluster is not None
        self.cluster.run(publish, self._stop)

    @work(thread=True, group="actions", exit_on_error=False)
    def _act(self, done: str, verb: Callable, *args) -> None:
        try:
            verb(*args)
        except XpudError as e:
            self.post_message(self.ActionFinished(False, str(e)))
        else:
            self.post_message(self.ActionFinished(True, done))

    # ------------------------------------------------------------------ message handlers (UI thread)
    def on_xpu_top_connected(self, message: Connected) -> None:
        if not self.is_running:
            return
        self.info = message.info
        self.connection = self.live_word
        groups = groups_from_topology(message.topology) if message.topology else None
        self.host_view.set_topology(groups)
        self._show_status()
        self.refresh_bindings()

    def on_xpu_top_disconnected(self, message: Disconnected) -> None:
        if not self.is_running:
            return
        self.connection = f"reconnecting: {message.reason}"
        self._show_status()

    def on_xpu_top_updates_ready(self, message: UpdatesReady) -> None:
        batch = self._mailbox.take()
        if not batch or not self.is_running:
            return  # nothing new, or shutting down (the views are being taken apart)
        added = []
        for update in batch:
            added += self.state.apply(update)
        self.refreshes += 1
        self.connection = self.live_word
        self.host_view.show(self.state)
        self.host_panel.show(self.state)
        self.leases_view.show(self.state)
        self.event_log.add(added)
        self._show_status()
        if not self._placed_focus and self.tabs.active == "host":
            # Start on the first card tile (not the tab bar) so the card keys work at once.
            self._placed_focus = True
            self.call_after_refresh(self._initial_focus)

    def on_xpu_top_cluster_ready(self, message: ClusterReady) -> None:
        batch = self._cluster_box.take()
        if self.is_running:
            self.cluster_view.update_hosts(batch)

    def on_xpu_top_accounts_ready(self, message: AccountsReady) -> None:
        if self.is_running:
            self.accounts_table.show(message.reply)

    def on_xpu_top_action_finished(self, message: ActionFinished) -> None:
        # On the status line, not as a toast: a toast would cover the tiles (often the one acted on).
        self.actions_done.append((message.ok, message.text))
        self._result = (message.ok, message.text, time.monotonic() + RESULT_S)
        self._show_status()
        self.set_timer(RESULT_S + 0.1, self._show_status)

    def on_card_tile_selected(self, message: CardTile.Selected) -> None:
        self.selected_card = message.index

    def on_card_tile_details_requested(self, message: CardTile.DetailsRequested) -> None:
        card = self.state.card(message.index)
        if card is not None:
            health = lambda: self.source.health(str(card.index))  # noqa: E731
            self.push_screen(CardScreen(card, self.state.events, self.localtime, health))

    def on_leases_view_lease_highlighted(self, message: LeasesView.LeaseHighlighted) -> None:
        self.selected_lease = message.lease_id

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        # Focus the view's main widget once its pane is shown, so its keys work at once.
        self.call_after_refresh(self._focus_view, event.pane.id)
        if self.screen_stack:  # not while quitting: a late tab switch must not raise on the way out
            self.refresh_bindings()

    # ------------------------------------------------------------------ status line
    def _show_status(self) -> None:
        # Most important first: a narrow terminal cuts the end of the line.
        s = self.state
        text = Text()
        if self._result is not None and time.monotonic() < self._result[2]:
            ok, result, _ = self._result
            text.append(f"{'✔' if ok else '✖'} {result}", style="bold green" if ok else "bold red")
            text.append(" · ")
        text.append(s.hostname or (self.info.hostname if self.info else "?"), style="bold")
        text.append(" · ")
        live = {"live": "green", "demo": "cyan"}.get(self.connection, "bold yellow")
        text.append(self.connection, style=live)
        text.append(" · ")
        text.append("operator" if self.operator else "read-only", style="bold" if self.operator else "dim")
        states = [c.health_state for c in s.cards]
        text.append(f" · {len(s.cards)} GPUs ")
        text.append(f"●{states.count('healthy')}", style="green")
        if states.count("degraded"):
            text.append(f" ▲{states.count('degraded')}", style="yellow")
        if states.count("unhealthy"):
            text.append(f" ✖{states.count('unhealthy')}", style="red")
        drained = sum(c.drained for c in s.cards)
        if drained:
            text.append(f" ⊘{drained}", style="yellow")
        text.append(f" · {len(s.leases)} lease{'s' if len(s.leases) != 1 else ''} · {len(s.queue)} queued")
        if self.info:
            text.append(f" · {self.info.backend}", style="dim")
        self.status.update(text)

    # ------------------------------------------------------------------ navigation
    def action_view(self, name: str) -> None:
        tabs = self.tabs
        if name == "cluster" and self.cluster is None:
            self.notify(
                "no cluster view: configure [cluster] (federation), or start with `xpu top --host DIR ...`",
                severity="warning",
            )
            return
        if tabs.active == name:
            return
        # Let go of the focus first: when a focused widget is hidden Textual focuses its neighbour,
        # which (in the pane being hidden) would switch the tabs straight back.
        self.set_focus(None)
        tabs.active = name  # TabActivated then moves the focus into the view

    def _initial_focus(self) -> None:
        self._focus_view("host")

    def _focus_view(self, name: str) -> None:
        # Only into the view on show: focusing a widget of a hidden pane switches the tabs to it, and two
        # late calls would then switch back and forth for ever.
        if self.tabs.active != name:
            return
        if name == "host":
            tile = None
            if self.selected_card is not None:
                tile = self.host_view.tiles.get(self.selected_card)
            tile = tile or self.host_view.first_tile()
            if tile:
                tile.focus()
        elif name == "leases":
            self.leases_view.query_one("#lease-table", DataTable).focus()
        elif name == "events":
            self.event_log.focus()
            self.event_log.show_newest()  # opens at the newest event
        elif name == "cluster":
            self.cluster_view.query_one("#cluster-table", DataTable).focus()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.operator))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # An operator key is offered, and acts, only in the views where it has something to act on: the
        # card keys in the host view, release there and in the leases view (in the event and cluster
        # views letters filter instead).
        if action in ACTION_VIEWS:
            return self.tabs.active in ACTION_VIEWS[action]
        return True

    # ------------------------------------------------------------------ operator actions
    def _may_operate(self, what: str) -> bool:
        if self.operator:
            return True
        self.notify(f"{what} needs the admin socket: {ADMIN_HINT}", title="read-only", severity="warning")
        return False

    def _card_for_action(self) -> pb.Card | None:
        card = self.state.card(self.selected_card) if self.selected_card is not None else None
        if card is None:
            self.notify("select a card first: view 1, arrows or Tab", severity="warning")
        return card

    def action_drain(self) -> None:
        if not self._may_operate("draining a card") or (card := self._card_for_action()) is None:
            return
        if card.drained:
            self.notify(f"card {card.index} is already drained ({card.drain_reason}); u puts it back")
            return
        i = card.index

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._act(f"card {i} drained", self.source.drain, str(i), "drained from xpu top")

        self.push_screen(
            ConfirmScreen(
                f"Drain card {i}?",
                f"No new lease will be placed on card {i}; its running leases continue.",
                "Drain",
            ),
            confirmed,
        )

    def action_undrain(self) -> None:
        if not self._may_operate("undraining a card") or (card := self._card_for_action()) is None:
            return
        if not card.drained:
            self.notify(f"card {card.index} is not drained")
            return
        i = card.index
        note = " It is unhealthy: the scheduler still avoids it." if card.health_state == "unhealthy" else ""

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._act(f"card {i} back in service", self.source.undrain, str(i))

        self.push_screen(
            ConfirmScreen(
                f"Undrain card {i}?",
                f"Card {i} ({card.drain_reason}) takes new leases again.{note}",
                "Undrain",
            ),
            confirmed,
        )

    def action_mode(self) -> None:
        if not self._may_operate("switching a card's mode") or (card := self._card_for_action()) is None:
            return
        i = card.index

        def picked(mode: str | None) -> None:
            if mode:
                self._act(f"card {i} set to {mode}", self.source.set_mode, str(i), mode)

        self.push_screen(ModeScreen(card), picked)

    def action_release(self) -> None:
        if not self._may_operate("releasing someone's lease"):
            return
        lease = self._lease_for_action()
        if lease is None:
            return
        cards = ",".join(map(str, lease.cards))

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._act(f"lease {lease.id} released", self.source.evict, lease.id, "released from xpu top")

        self.push_screen(
            ConfirmScreen(
                f"Release lease {lease.id}?",
                f"{lease.mode} on card(s) {cards}, owner {self.owner(lease.owner_uid)}: "
                f"{lease.command or '(no command)'}\nIts holder is told and stops its command.",
                "Release",
            ),
            confirmed,
        )

    def _lease_for_action(self) -> pb.Lease | None:
        tab = self.tabs.active
        if tab == "leases":
            lease = self.state.lease(self.selected_lease) if self.selected_lease else None
            if lease is None:
                self.notify("no lease selected", severity="warning")
            return lease
        card = self.state.card(self.selected_card) if self.selected_card is not None else None
        ids = ([card.whole_lease] if card.whole_lease else [s.lease_id for s in card.slices]) if card else []
        if len(ids) == 1 and (lease := self.state.lease(ids[0])):
            return lease
        why = (
            f"card {card.index} holds {len(ids)} leases" if card and ids else "no lease on the selected card"
        )
        self.notify(f"{why}: pick one in view 2 (leases), then x", severity="warning")
        return None
