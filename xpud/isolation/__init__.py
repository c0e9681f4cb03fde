"""Slice isolation backends (MIG, MPS, accounting only) and the choice of one per card.

``[cards] isolation``: "auto" gives MIG to cards that have it (and may use it: MIG on already, or
``mig_switch = "idle"``) and MPS to the others; "mig" gives MIG to every card (a card without MIG then
serves no slices); "mps" MPS to every card; "none" counts slices without enforcing them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from xpud.config.schema import Config
from xpud.hw import mig_map
from xpud.isolation.base import Accounting, Isolation
from xpud.isolation.mig import MigIsolation
from xpud.isolation.mig_book import MemoryBook, MigBook
from xpud.isolation.mps import MpsIsolation
from xpud.isolation.runner import CommandRunner, Runner
from xpud.model import CardInfo

log = logging.getLogger("xpud.isolation")


def kind_for(cfg: Config, hw, card: CardInfo) -> str:
    """ "mig", "mps" or "none" for this card under ``[cards] isolation``."""
    wanted = cfg.cards.isolation
    if wanted != "auto":
        return wanted
    mode = hw.mig_mode(card.index)  # None: the card has no MIG
    if mode is None:
        return "mps"
    return "mig" if cfg.cards.mig_switch == "idle" or mode[0] == 1 else "mps"


def backend_for(
    cfg: Config, hw, runner: Runner | None = None, mig_book: MigBook | None = None
) -> Callable[[CardInfo], Isolation]:
    """The isolation backend for each card, from ``[cards] isolation``. ``runner`` runs the NVIDIA tools
    (default: the real ones); ``mig_book`` records the MIG instances xpud makes (the daemon's: the
    ledger; default: in memory, so that a restart destroys no instance it finds unheld)."""
    runner = runner or CommandRunner()
    reserved = cfg.cards.reserved_memory_mib << 20
    shared = Accounting(reserved)
    table: mig_map.ProfileMap | None = None
    book = MemoryBook() if mig_book is None else mig_book

    def make(card: CardInfo) -> Isolation:
        nonlocal table
        kind = kind_for(cfg, hw, card)
        if kind == "mig":
            if table is None:
                table = mig_map.load(cfg.cards.mig_profiles_file or None)
            if hw.mig_mode(card.index) is None:
                log.warning("card %d (%s) has no MIG: it serves no slices", card.index, card.name)
            return MigIsolation(
                card,
                hw,
                runner,
                table,
                cfg.slices,
                switch=cfg.cards.mig_switch,
                idle_keep_s=cfg.cards.mig_idle_keep_s,
                book=book,
            )
        if kind == "mps":
            return MpsIsolation(
                card,
                hw,
                runner,
                cfg.runtime_dir,
                reserved,
                idle_keep_s=cfg.cards.mps_idle_keep_s,
                keeper=cfg.cards.mps_keeper,
            )
        return shared

    return make
