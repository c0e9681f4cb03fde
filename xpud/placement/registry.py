"""Policies by name, as ``xpu simulate --policy`` and the engine ask for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xpud.placement.cluster import Demand
from xpud.placement.frag import WorkloadMix
from xpud.placement.fragaware import FragAware
from xpud.placement.names import (  # noqa: F401  (re-exported)
    DEFAULT_CPU_RESERVE,
    DEFAULT_POLICY,
    DESCRIPTIONS,
    POLICY_NAMES,
)
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


def make_policy(
    name: str, trace: Sequence[Demand] = (), qtable=None, *, cpu_reserve: str = DEFAULT_CPU_RESERVE
) -> Policy:
    """A fresh policy. ``trace``: the whole task list, read only by policies that know the mix in advance;
    ``cpu_reserve``: what ``xpud`` does with CPU-only tasks (``names.CPU_RESERVE_MODES``)."""
    makers: dict[str, Callable[[], Policy]] = {
        "random": RandomFit,
        "best-fit": BestFit,
        "dot-product": DotProduct,
        "gpu-packing": GpuPacking,
        "gpu-clustering": GpuClustering,
        "fgd": lambda: FGD(WorkloadMix(trace)),
        "fgd-online": lambda: _named(FGD(None), "fgd-online"),
        "whole-only": lambda: _named(BestFit(), "whole-only"),
        "xpud": lambda: FragAware(cpu_reserve=cpu_reserve),
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
