"""Policies by name, as ``xpu simulate --policy`` and the engine ask for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xpud.placement.cluster import Demand
from xpud.placement.frag import WorkloadMix
from xpud.placement.fragaware import FragAware
from xpud.placement.policies import (
    FGD,
    BestFit,
    DotProduct,
    GpuClustering,
    GpuPacking,
    Policy,
    RandomFit,
)
from xpud.placement.qlearn import QRule

DEFAULT_POLICY = "xpud"

# name -> (one-line description, whether it reads the whole trace's task mix in advance)
DESCRIPTIONS: dict[str, tuple[str, bool]] = {
    "random": ("any host that fits, random card", False),
    "best-fit": ("least CPU+GPU left after placing", False),
    "dot-product": ("smallest dot product of free and requested (Tetris)", False),
    "gpu-packing": ("shared cards, then idle cards on used hosts, then idle hosts", False),
    "gpu-clustering": ("hosts already running the same kind of task", False),
    "fgd": ("FGD as published: trace mix known in advance", True),
    "fgd-online": ("FGD with the mix learned from arrivals", False),
    "whole-only": ("every GPU task takes whole cards (single-mode), best-fit", False),
    "xpud": ("ours: FGD measure online + CPU/memory stranding + card fill look-ahead", False),
    "xpud-q": ("Q-learning picks a rule per request class (trained on seeds 0-5 first)", False),
}
POLICY_NAMES: tuple[str, ...] = tuple(DESCRIPTIONS)


def make_policy(name: str, trace: Sequence[Demand] = (), qtable=None) -> Policy:
    """A fresh policy. ``trace``: the whole task list, read only by policies that know the mix in advance."""
    makers: dict[str, Callable[[], Policy]] = {
        "random": RandomFit,
        "best-fit": BestFit,
        "dot-product": DotProduct,
        "gpu-packing": GpuPacking,
        "gpu-clustering": GpuClustering,
        "fgd": lambda: FGD(WorkloadMix(trace)),
        "fgd-online": lambda: _named(FGD(None), "fgd-online"),
        "whole-only": lambda: _named(BestFit(), "whole-only"),
        "xpud": FragAware,
        "xpud-q": lambda: QRule(qtable),
    }
    if name not in makers:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICY_NAMES)} or all")
    return makers[name]()


def forced_slices(name: str) -> str | None:
    """The slice mode a policy implies (``whole-only`` rounds every GPU task up to whole cards)."""
    return "whole" if name == "whole-only" else None


def _named(p: Policy, name: str) -> Policy:
    p.name = name
    return p
