"""What ``xpu simulate`` needs before it replays anything: protocol defaults, seed lists, where the openb
files are, and the error a bad file raises. No NumPy here (the CLI imports this module at start-up)."""

from __future__ import annotations

import os
from pathlib import Path

from xpud.errors import XpudError

DEFAULT_RATIO = 1.3
DEFAULT_SEEDS = tuple(range(42, 52))

DEFAULT_CLUSTER = "openb_node_list_gpu_node.csv"
DEFAULT_TRACE = "openb_pod_list_default.csv"
OPENB_ENV = "XPUD_OPENB_DIR"


class TraceError(XpudError):
    """A cluster or trace file that cannot be used; the message says why and how to fix it."""


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"42-51"``, ``"42,43,50"`` or ``"7"`` -> seeds. Raises ``ValueError`` with a readable message."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if a < 0 or b < a:
                raise ValueError
            seeds.extend(range(a, b + 1))
        except ValueError:
            raise ValueError(f"bad seed list {text!r}: use e.g. 42-51 or 42,43,44") from None
    if not seeds:
        raise ValueError(f"bad seed list {text!r}: use e.g. 42-51 or 42,43,44")
    return tuple(dict.fromkeys(seeds))


PACKAGED_OPENB = Path(__file__).resolve().parent / "data" / "openb"  # node list + default trace


def openb_dir() -> Path | None:
    """Where the openb CSVs are: ``$XPUD_OPENB_DIR``, else ``shared/data/openb`` or ``../shared/data/openb``
    from the current directory or from this checkout (the layout of the xpud repository, which also holds
    the trace variants), else the copy shipped in the package (node list and default trace only)."""
    env = os.environ.get(OPENB_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), repo):
        for rel in ("shared/data/openb", "../shared/data/openb"):
            cand = (base / rel).resolve()
            if (cand / DEFAULT_CLUSTER).is_file():
                return cand
    if (PACKAGED_OPENB / DEFAULT_CLUSTER).is_file():
        return PACKAGED_OPENB
    return None


def default_path(filename: str) -> Path:
    d = openb_dir()
    return (d if d is not None else PACKAGED_OPENB) / filename
