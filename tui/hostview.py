"""The host view: every card as a tile, grouped by how the cards are connected (NVLink island, PCIe
switch, NUMA node). The grid's column count follows the terminal width (never more columns than the
largest group has cards: the tiles widen instead, and so do their sparklines), and the tiles' height
follows its height: compact two-line tiles when the normal ones would not all show (eight cards in
80x24), tall ones with a power line and every holder where there is room.
"""

from __future__ import annotations

import math

from textual.app import ComposeResult
from textual.containers import Grid, Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Static
from xpu_tui.cardtile import COMPACT_HEIGHT, TALL_HEIGHT, TILE_HEIGHT, TILE_WIDTH, CardTile
from xpu_tui.hostpanel import MIN_ROWS
from xpu_tui.hoststate import HostState
from xpu_tui.topogroups import CardGroup, single_group

from xpud.api.v1 import xpu_pb2 as pb


class CardGroupBox(Vertical):
    """One topology group: a header line and a grid of tiles."""

    def __init__(self, group: CardGroup, tiles: list[CardTile]) -> None:
        super().__init__(classes="card-group")
        self.group = group
        self.tiles = tiles

    def compose(self) -> ComposeResult:
        yield Static(f"▌ {self.group.label}", classes="group-label")
        with Grid(classes="card-grid"):
            yield from self.tiles


class HostView(VerticalScroll):
    """Tiles of every card; call ``show`` after each batch of updates."""

    def __init__(self, panel: Widget | None = None, **kw) -> None:
        super().__init__(**kw)
        self.panel = panel  # shown under the tiles where they leave room (xpu_tui.hostpanel)
        self.groups: list[CardGroup] | None = None  # from the topology, once known
        self.tiles: dict[int, CardTile] = {}
        self.shown_groups: list[CardGroup] = []
        self.tile_height = TILE_HEIGHT
        self._layout_key: tuple = ()
        self._state: HostState | None = None
        self._ready = False  # the first update can come before this view is mounted

    def compose(self) -> ComposeResult:
        yield Static("waiting for the daemon's first update…", id="host-empty")

    def set_topology(self, groups: list[CardGroup] | None) -> None:
        self.groups = groups
        self._layout_key = ()  # regroup at the next show

    def on_mount(self) -> None:
        self._ready = True
        if self._state is not None:
            self.show(self._state)

    def show(self, state: HostState) -> None:
        self._state = state
        if not self._ready:
            return  # on_mount shows it
        cards = {c.index: c for c in state.cards}
        groups = [g for g in (self.groups or []) if all(i in cards for i in g.cards)]
        if not groups or sorted(i for g in groups for i in g.cards) != sorted(cards):
            groups = single_group(list(cards))  # topology unknown or out of date
        key = tuple((g.label, g.cards) for g in groups)
        if key != self._layout_key:
            self._rebuild(groups, cards, state)
            self._layout_key = key
            return
        for index, card in cards.items():
            self.tiles[index].show(card, state.history_of(card))

    def _rebuild(self, groups: list[CardGroup], cards: dict[int, pb.Card], state: HostState) -> None:
        focused = next((i for i, t in self.tiles.items() if t.has_focus), None)
        self.remove_children()
        self.shown_groups = groups
        self.tiles = {i: CardTile(c, state.history_of(c)) for i, c in cards.items()}
        boxes = [CardGroupBox(g, [self.tiles[i] for i in g.cards]) for g in groups]
        if not boxes:
            boxes = [Static("this daemon has no cards", id="host-empty")]
        self.mount_all(boxes)
        self.call_after_refresh(self._fit_columns)
        if focused is not None and focused in self.tiles:
            self.call_after_refresh(self.tiles[focused].focus)

    def on_resize(self) -> None:
        self._fit_columns()

    def columns(self) -> int:
        fit = max(1, (self.scrollable_content_region.width or self.size.width) // TILE_WIDTH)
        biggest = max((len(g.cards) for g in self.shown_groups), default=fit)
        # as few columns as give the same number of rows: 4 cards in 3 columns take 2 rows, so do 2
        # columns with wider tiles (and no lone tile on the second row)
        return max(1, math.ceil(biggest / math.ceil(biggest / fit)))

    def room(self) -> int:
        """The rows the host pane has: for the tiles, and for the panel under them when they leave some."""
        parent = self.parent
        if self.panel is not None and isinstance(parent, Widget):
            return parent.size.height
        return self.size.height

    def tiles_height(self, cols: int, tile_h: int) -> int:
        return sum(1 + math.ceil(len(g.cards) / cols) * tile_h for g in self.shown_groups)

    def pick_tile_height(self, cols: int) -> int:
        """Tall tiles when all fit tall, normal ones when all fit, else compact ones."""
        rows = sum(math.ceil(len(g.cards) / cols) for g in self.shown_groups)
        labels = len(self.shown_groups)
        height = self.room()
        for tile_h in (TALL_HEIGHT, TILE_HEIGHT):
            if rows * tile_h + labels <= height:
                return tile_h
        return COMPACT_HEIGHT

    def _fit_columns(self) -> None:
        cols = self.columns()
        tile_h = self.pick_tile_height(cols)
        self.tile_height = tile_h
        for grid in self.query(".card-grid").results(Grid):
            grid.styles.grid_size_columns = cols
            grid.set_styles(f"grid-rows: {tile_h};")
        for tile in self.tiles.values():
            tile.styles.height = tile_h
        self._fit_panel(self.tiles_height(cols, tile_h))

    def _fit_panel(self, tiles_h: int) -> None:
        # A large terminal leaves rows under the tiles: the panel (leases, queue, recent events) takes
        # them; otherwise the tiles have the whole pane.
        if self.panel is None:
            return
        show = bool(self.tiles) and self.room() - tiles_h >= MIN_ROWS
        self.styles.height = tiles_h if show else "1fr"
        self.panel.display = show

    def on_card_tile_move(self, message: CardTile.Move) -> None:
        message.stop()
        order = [t for t in self.query(CardTile)]  # document order: group by group
        if message.tile not in order:
            return
        step = message.step * (self.columns() if message.by_row else 1)
        target = order[max(0, min(len(order) - 1, order.index(message.tile) + step))]
        target.focus()
        target.scroll_visible()

    def first_tile(self) -> CardTile | None:
        tiles = list(self.query(CardTile))
        return tiles[0] if tiles else None
