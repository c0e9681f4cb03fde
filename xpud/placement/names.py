"""Names the CLI needs before any placement code runs: policies, their descriptions, slice profile sets.

Kept free of NumPy (and of every other placement module) so that ``xpu`` starts fast: ``cli/simulate.py``
reads these at import time, and the CLI registers ``simulate`` for every command.
"""

from __future__ import annotations

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
    "xpud": ("ours: FGD measure online + CPU/memory stranding + card fill look-ahead + CPU reserve", False),
    "xpud-q": ("Q-learning picks a rule per request class (trained on seeds 0-5 first)", False),
}
POLICY_NAMES: tuple[str, ...] = tuple(DESCRIPTIONS)

# The FGD paper's and its simulator's spellings (and a few obvious variants) -> our names.
ALIASES: dict[str, str] = {
    "bestfit": "best-fit",
    "best_fit": "best-fit",
    "dotprod": "dot-product",
    "dot_product": "dot-product",
    "dotproduct": "dot-product",
    "packing": "gpu-packing",
    "gpupacking": "gpu-packing",
    "clustering": "gpu-clustering",
    "gpuclustering": "gpu-clustering",
    "randomfit": "random",
    "random-fit": "random",
    "fgd-offline": "fgd",
}


def canonical_policy(name: str) -> str | None:
    """Our name for ``name`` (ours, or an alias; case-insensitive), or None."""
    key = name.strip().lower()
    return key if key in DESCRIPTIONS else ALIASES.get(key)


# What the xpud policy does with CPU-only tasks on hosts with free GPUs (``xpu simulate --cpu-reserve``).
# The learnt ratio is the CPU per GPU share of the GPU tasks that have arrived so far; a host's *reserve* is
# that ratio times its free GPU share (the CPU its free GPUs need), as Slurm sites keep GPU hosts' CPU for
# GPU work with ``MaxCPUsPerNode`` on a CPU partition.
CPU_RESERVE_MODES: dict[str, str] = {
    "off": "CPU-only tasks scored like any other task",
    "prefer": "CPU-only tasks go first where they take the least of hosts' reserves (never refused)",
    "reserve": "as prefer, and a CPU-only task that fits only by taking a reserve is refused",
}
DEFAULT_CPU_RESERVE = "reserve"

# Named profile sets: the sizes a fractional request may be rounded up to (milli-cards).
PROFILE_SETS: dict[str, tuple[int, ...]] = {
    "free": (),  # MPS: any size, no rounding
    "quarter-half": (250, 500, 1000),  # vxpu-quarter, vxpu-half, whole card
    "quarter-half-3q": (250, 500, 750, 1000),
    "whole": (1000,),  # single-mode: every GPU task takes whole cards
}
