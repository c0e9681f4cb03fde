"""The MIG profile map: which GPU-instance profiles serve each slice size on a card model.

The map is data (``etc/mig-profiles.toml``, or the file ``[cards] mig_profiles_file`` names): per card
model (the NVML name), per slice size, profile names in order of preference. A model or a size the file
does not name gets a mapping derived from the card's geometry (``derive``).
"""

from __future__ import annotations

import logging
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from xpud.config.read import read_text
from xpud.errors import ConfigError
from xpud.hw.types import MigProfile
from xpud.model import SliceSpec
from xpud.placement.mig import Geometry, Profile

log = logging.getLogger("xpud.hw.mig_map")

DEFAULT_PATH = Path(__file__).resolve().parents[1].parent / "etc" / "mig-profiles.toml"

ProfileMap = dict[str, dict[str, tuple[str, ...]]]  # model name -> slice size -> profile names


def default_path() -> Path:
    """The packaged map: ``etc/`` in a checkout, ``xpud.etc`` when installed."""
    if DEFAULT_PATH.is_file():
        return DEFAULT_PATH
    import xpud.etc  # installed wheel: etc/ ships as the package xpud.etc

    return Path(xpud.etc.__file__).parent / "mig-profiles.toml"


def load(path: str | Path | None = None) -> ProfileMap:
    """Read and check a profile map. Raises ConfigError naming the file, the model and the key."""
    p = Path(path) if path else default_path()
    try:
        data = tomllib.loads(read_text(p, "the MIG profile map"))
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the MIG profile map: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{p}: nested too deeply (arrays or tables within each other)") from None
    unknown = set(data) - {"models"}
    if unknown:
        raise ConfigError(f'{p}: unknown table [{sorted(unknown)[0]}]; the map has only [models."<name>"]')
    out: ProfileMap = {}
    for model, sizes in data.get("models", {}).items():
        if not isinstance(sizes, dict):
            raise ConfigError(f"{p}: [models.{model!r}] must be a table of slice size = [profile names]")
        table = {}
        for size, names in sizes.items():
            if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
                raise ConfigError(
                    f"{p}: [models.{model!r}] {size}: expected a non-empty list of profile names, "
                    f'e.g. ["3g.40gb"]'
                )
            table[size] = tuple(names)
        out[model] = table
    return out


def geometry(profiles: Sequence[MigProfile]) -> Geometry:
    """The placement code's view of a card's MIG profiles (memory slots and compute slices inferred)."""
    ps = tuple(
        Profile(
            id=p.id,
            name=p.name,
            compute=p.slice_count,
            size=p.memory_slices,
            starts=tuple(start for start, _ in p.placements),
            max_instances=p.max_instances,
            memory_bytes=p.memory_bytes,
        )
        for p in profiles
        if p.placements
    )
    slots = max((max(p.starts) + p.size for p in ps), default=8)
    compute = max((p.compute for p in ps), default=7)
    return Geometry(ps, memory_slots=slots, compute_slices=compute)


def derive(geom: Geometry, spec: SliceSpec) -> tuple[int, ...]:
    """Profiles for a size the map does not name: the fewest memory slots that hold its memory fraction;
    among those, profiles of which enough instances fit (1 / fraction) first, then more compute."""
    need = max(1, math.ceil(spec.memory_fraction * geom.memory_slots - 1e-9))
    fitting = [p for p in geom.profiles if p.size >= need]
    if not fitting:
        return ()
    smallest = min(p.size for p in fitting)
    enough = math.floor(1 / spec.memory_fraction + 1e-9)
    ranked = sorted(
        (p for p in fitting if p.size == smallest),
        key=lambda p: (p.max_instances < enough, -p.compute, -p.max_instances, p.id),
    )
    return tuple(p.id for p in ranked)


def profiles_for(
    model: str, geom: Geometry, slices: Mapping[str, SliceSpec], table: ProfileMap
) -> dict[str, tuple[int, ...]]:
    """Slice size -> profile ids (preferred first) on a card of this model and geometry."""
    named = table.get(model, {})
    out = {}
    for size, spec in slices.items():
        ids = []
        for name in named.get(size, ()):
            p = geom.by_name(name)
            if p is None:
                log.warning("MIG profile map: %s has no profile %r (for %s); ignoring it", model, name, size)
            else:
                ids.append(p.id)
        out[size] = tuple(ids) or derive(geom, spec)
    return out


def source(model: str, size: str, table: ProfileMap) -> str:
    """Where a size's profiles come from on this model: "map" or "derived"."""
    return "map" if table.get(model, {}).get(size) else "derived"
