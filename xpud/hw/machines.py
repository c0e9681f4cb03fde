"""Machine descriptions: what a simulated host looks like (cards, PCIe tree, NVLink, NUMA, MIG geometry).

A description is a TOML file in ``etc/machines/<name>.toml`` (or any ``.toml``/``.json`` path; the JSON
that ``xpud check-hardware --json`` prints is one, so a recording of a real host replays as a simulated
machine). ``load_machine`` validates it; every mistake is one line naming the file and the key.

Invariants: every number is checked against a range (``_Table.get``'s ``span``: what real hardware can
report and what the NVML surface can carry), floats must be finite, strings and lists are bounded, and a
file nested too deeply is refused (one line, not a traceback).

The format, key by key (``etc/machines/dgx-h100.toml`` is a commented example): see docs/hw.md, Machine
descriptions.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import tomllib
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xpud.errors import ConfigError
from xpud.model import MAX_CARD_MINOR
from xpud.topology import HOSTBRIDGE, INTERNAL, MULTIPLE, NODE, SINGLE, SYSTEM

ARCHITECTURES = ("kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell")
MEMORY_ERRORS = ("remap", "retire", "none")
NVLINK_MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS in nvml.h
_LEVELS = (INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM)
MAX_CARDS = 256
MAX_CPUS = 1 << 16  # CPU ids 0 .. MAX_CPUS - 1
MAX_MEMORY_MIB = 1 << 24  # 16 TiB: far above any card, far below NVML's 64-bit byte counts
MAX_STRING = 256  # characters in a name, an id or a version
MAX_LIST = 1024  # items in one list


class MachineError(ConfigError, ValueError):
    """A machine description that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class MigProfileSpec:
    profile: int  # NVML_GPU_INSTANCE_PROFILE_* enum value
    id: int  # driver's profile id
    name: str  # "3g.40gb"
    slices: int  # compute slices
    memory_mib: int
    instances: int  # max at once
    placements: tuple[int, ...]  # start slots, memory slices
    placement_size: int  # memory slices
    multiprocessors: int = 0


@dataclass(frozen=True)
class CardModel:
    key: str
    name: str
    memory_mib: int
    architecture: str = "unknown"
    power_limit_w: float = 300.0
    power_idle_w: float = 50.0
    temp_idle_c: int = 35
    temp_load_c: int = 75
    temp_slowdown_c: int | None = None
    temp_shutdown_c: int | None = None
    pcie_gen: int = 4
    pcie_width: int = 16
    nvlink_version: str | None = None
    nvlink_links: int = 0  # links the board has, wired or not (0: as many as the card has wired)
    ecc: bool = True
    memory_errors: str = "remap"
    fan: bool = False
    max_mig_devices: int = 7
    mig_profiles: tuple[MigProfileSpec, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)


@dataclass(frozen=True)
class CardSpec:
    index: int
    model: CardModel
    bus_id: str
    uuid: str
    serial: str
    numa: int | None = None
    host_bridge: str = ""
    switches: tuple[str, ...] = ()
    board: str | None = None
    nvlink_switch_links: int = 0
    nvlink_peers: tuple[int, ...] = ()
    mig_enabled: bool = False
    minor: int = 0  # /dev/nvidia<minor>; need not follow the index (nvmlDeviceGetMinorNumber)

    @property
    def nvlink_count(self) -> int:
        """Links wired to something (a peer or an NVSwitch): the links that come up."""
        return self.nvlink_switch_links + len(self.nvlink_peers)

    @property
    def nvlink_links(self) -> int:
        """Links the board has (what NVML counts), wired or not; the wired ones come first."""
        return max(self.model.nvlink_links, self.nvlink_count)


@dataclass(frozen=True)
class Machine:
    name: str
    cards: tuple[CardSpec, ...]
    numa_cpus: tuple[tuple[int, ...], ...]
    description: str = ""
    driver_version: str = "550.90.07"
    cuda_version: str = "12.4"
    nvswitch_count: int = 4
    levels: tuple[tuple[int, ...], ...] | None = None  # explicit matrix, else derived from the PCIe tree
    source: str = ""

    @property
    def cpu_count(self) -> int:
        return max((c for node in self.numa_cpus for c in node), default=-1) + 1

    def level(self, i: int, j: int) -> int:
        """NVML common-ancestor level between cards i and j (i != j)."""
        if self.levels is not None:
            return self.levels[i][j]
        a, b = self.cards[i], self.cards[j]
        if a.board is not None and a.board == b.board:
            return INTERNAL
        common = 0
        for x, y in zip(a.switches, b.switches, strict=False):
            if x != y:
                break
            common += 1
        if common and common == len(a.switches) == len(b.switches):
            return SINGLE
        if common:
            return MULTIPLE
        if a.host_bridge == b.host_bridge:
            return HOSTBRIDGE
        if a.numa is not None and a.numa == b.numa:
            return NODE
        return SYSTEM


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` → ``(0, 1, 2, 3, 8)`` (the Linux cpulist format)."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if not 0 <= first <= last < MAX_CPUS:
            raise ValueError(f"CPU range {part!r}: expected ids 0..{MAX_CPUS - 1}, low to high")
        cpus.extend(range(first, last + 1))
    return tuple(cpus)


def format_cpulist(cpus: tuple[int, ...] | list[int]) -> str:
    """``(0, 1, 2, 3, 8)`` → ``"0-3,8"``."""
    out: list[str] = []
    s = sorted(set(cpus))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def machines_dir() -> Path:
    """Where named descriptions live: ``etc/machines`` in the source tree, ``xpud/etc/machines`` installed."""
    return Path(str(importlib.resources.files("xpud.etc") / "machines"))


def list_machines() -> list[str]:
    """Names of the machine descriptions that ship with xpud."""
    return sorted(p.stem for p in machines_dir().glob("*.toml"))


def load_machine(name_or_path: str | Path) -> Machine:
    """Load a description by name (``"dgx-h100"``) or by path (``.toml`` or ``.json``)."""
    text = str(name_or_path)
    path = Path(text)
    if not (path.suffix in (".toml", ".json") or "/" in text):
        path = machines_dir() / f"{text}.toml"
        if not path.is_file():
            raise MachineError(
                f"unknown machine {text!r}: choose one of {', '.join(list_machines())}, or a path"
            )
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise MachineError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise MachineError(f"{path}: not valid {path.suffix[1:].upper()}: {e}") from None
    except RecursionError:
        raise MachineError(f"{path}: nested too deeply (arrays or tables within each other)") from None
    return parse_machine(data, source=str(path))


# ----------------------------------------------------------------------------------------------- parsing

_REQUIRED = object()


class _Table:
    """Take typed keys out of one table; complain about missing, mistyped and unknown keys."""

    def __init__(self, data: Any, where: str, source: str):
        if not isinstance(data, dict):
            raise MachineError(f"{source}: {where}: expected a table")
        self.data, self.where, self.source, self.seen = data, where, source, set()

    def error(self, key: str, why: str) -> MachineError:
        return MachineError(f"{self.source}: {self.where + '.' if self.where else ''}{key}: {why}")

    def get(
        self,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = _REQUIRED,
        span: tuple[float, float] | None = None,
    ) -> Any:
        """The value of ``key``, of type ``kind``; numbers within ``span`` (inclusive), floats finite,
        strings and lists bounded in size."""
        self.seen.add(key)
        if key not in self.data or self.data[key] is None:
            if default is _REQUIRED:
                raise self.error(key, "required")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.error(key, f"expected {names}, got {_short(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.error(key, f"{value!r} is not a finite number")
        if span is not None and isinstance(value, int | float) and not span[0] <= value <= span[1]:
            raise self.error(key, f"{value!r} is outside {span[0]!r}..{span[1]!r}")
        if isinstance(value, str) and len(value) > MAX_STRING:
            raise self.error(key, f"{len(value)} characters; at most {MAX_STRING}")
        if isinstance(value, list) and len(value) > MAX_LIST:
            raise self.error(key, f"{len(value)} items; at most {MAX_LIST}")
        return value

    def ints(
        self, key: str, default: tuple[int, ...] = (), span: tuple[int, int] = (0, 255)
    ) -> tuple[int, ...]:
        values = self.get(key, list, list(default))
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise self.error(key, f"expected a list of integers, got {_short(values)}")
        if not all(span[0] <= v <= span[1] for v in values):
            raise self.error(key, f"expected integers in {span[0]}..{span[1]}, got {_short(values)}")
        return tuple(values)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise self.error(unknown[0], "unknown key")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_machine(data: dict, source: str = "<machine>") -> Machine:
    """Validate a decoded description (TOML or JSON) into a ``Machine``."""
    top = _Table(data, "", source)
    name = top.get("name", str)
    numa_texts = top.get("numa_cpus", list, [])
    try:
        numa_cpus = tuple(parse_cpulist(t) for t in numa_texts)
    except (ValueError, AttributeError, TypeError):
        raise top.error(
            "numa_cpus",
            f"expected cpulist strings like '0-55,112-167' (ids 0..{MAX_CPUS - 1}), got {_short(numa_texts)}",
        ) from None
    models_table = _Table(top.get("models", dict), "models", source)
    models = {key: _parse_model(key, models_table.get(key, dict), source) for key in list(models_table.data)}
    models_table.done()
    raw_cards = top.get("cards", list)
    if not raw_cards:
        raise top.error("cards", "at least one card is required")
    if len(raw_cards) > MAX_CARDS:
        raise top.error("cards", f"{len(raw_cards)} cards; at most {MAX_CARDS}")
    cards = tuple(_parse_card(i, c, models, name, source) for i, c in enumerate(raw_cards))
    levels = None
    topo = top.get("topology", dict, None)
    if topo is not None:
        t = _Table(topo, "topology", source)
        rows = t.get("levels", list, None)
        if rows is not None:
            levels = _parse_levels(rows, len(cards), t)
        t.done()
    top.get("recording", dict, None)  # what check-hardware measured; informational
    machine = Machine(
        name=name,
        cards=cards,
        numa_cpus=numa_cpus,
        description=top.get("description", str, ""),
        driver_version=top.get("driver_version", str, "550.90.07"),
        cuda_version=top.get("cuda_version", str, "12.4"),
        nvswitch_count=top.get("nvswitch_count", int, 4, span=(0, 64)),
        levels=levels,
        source=source,
    )
    top.done()
    _check_consistency(machine, source)
    return machine


def _parse_model(key: str, data: dict, source: str) -> CardModel:
    t = _Table(data, f"models.{key}", source)
    limit = t.get("power_limit_w", float, 300.0, span=(1.0, 10000.0))
    temp = (-50, 200)  # degrees C
    model = CardModel(
        key=key,
        name=t.get("name", str),
        memory_mib=t.get("memory_mib", int, span=(1, MAX_MEMORY_MIB)),
        architecture=t.get("architecture", str, "unknown"),
        power_limit_w=limit,
        power_idle_w=t.get("power_idle_w", float, round(limit * 0.15, 1), span=(0.0, limit)),
        temp_idle_c=t.get("temp_idle_c", int, 35, span=temp),
        temp_load_c=t.get("temp_load_c", int, 75, span=temp),
        temp_slowdown_c=t.get("temp_slowdown_c", int, None, span=temp),
        temp_shutdown_c=t.get("temp_shutdown_c", int, None, span=temp),
        pcie_gen=t.get("pcie_gen", int, 4, span=(1, 7)),
        pcie_width=t.get("pcie_width", int, 16, span=(1, 32)),
        nvlink_version=t.get("nvlink_version", str, None),
        nvlink_links=t.get("nvlink_links", int, 0),
        ecc=t.get("ecc", bool, True),
        memory_errors=t.get("memory_errors", str, "remap"),
        fan=t.get("fan", bool, False),
        max_mig_devices=t.get("max_mig_devices", int, 7, span=(0, 64)),
        mig_profiles=tuple(
            _parse_profile(p, f"models.{key}.mig_profiles[{i}]", source)
            for i, p in enumerate(t.get("mig_profiles", list, []))
        ),
    )
    t.done()
    if model.architecture not in (*ARCHITECTURES, "unknown"):
        raise t.error(
            "architecture", f"expected one of {', '.join(ARCHITECTURES)}, got {model.architecture!r}"
        )
    if model.memory_errors not in MEMORY_ERRORS:
        raise t.error("memory_errors", f"expected one of {', '.join(MEMORY_ERRORS)}")
    if not 0 <= model.nvlink_links <= NVLINK_MAX_LINKS:
        raise t.error("nvlink_links", f"expected 0 to {NVLINK_MAX_LINKS} (NVML_NVLINK_MAX_LINKS)")
    if model.nvlink_links and not model.nvlink_version:
        raise t.error("nvlink_links", "needs nvlink_version")
    return model


def _parse_profile(data: dict, where: str, source: str) -> MigProfileSpec:
    t = _Table(data, where, source)
    p = MigProfileSpec(
        profile=t.get("profile", int, span=(0, 63)),
        id=t.get("id", int, span=(0, 1023)),
        name=t.get("name", str),
        slices=t.get("slices", int, span=(1, 8)),
        memory_mib=t.get("memory_mib", int, span=(1, MAX_MEMORY_MIB)),
        instances=t.get("instances", int, span=(1, 8)),
        placements=t.ints("placements", span=(0, 7)),
        placement_size=t.get("placement_size", int, span=(1, 8)),
        multiprocessors=t.get("multiprocessors", int, 0, span=(0, 4096)),
    )
    t.done()
    if not p.placements or any(s < 0 or s + p.placement_size > 8 for s in p.placements):
        raise t.error("placements", "expected start slots with start + placement_size <= 8")
    return p


def _parse_card(index: int, data: dict, models: dict[str, CardModel], machine: str, source: str) -> CardSpec:
    t = _Table(data, f"cards[{index}]", source)
    key = t.get("model", str)
    if key not in models:
        raise t.error("model", f"no model {key!r} in [models] ({', '.join(models) or 'none defined'})")
    switches = t.get("switches", list, [])
    if not all(isinstance(s, str) for s in switches):
        raise t.error("switches", "expected a list of switch names")
    card = CardSpec(
        index=index,
        model=models[key],
        bus_id=t.get("bus_id", str),
        uuid=t.get("uuid", str, _derived_uuid("GPU", machine, index)),
        serial=t.get("serial", str, f"{1650000000000 + _stable_int(machine, index) % 10**10}"),
        numa=t.get("numa", int, None, span=(0, 1023)),
        host_bridge=t.get("host_bridge", str, f"rc-card{index}"),
        switches=tuple(switches),
        board=t.get("board", str, None),
        nvlink_switch_links=t.get("nvlink_switch_links", int, 0, span=(0, 64)),
        nvlink_peers=t.ints("nvlink_peers", span=(0, MAX_CARDS - 1)),
        mig_enabled=t.get("mig_enabled", bool, False),
        minor=t.get("minor", int, index, span=(0, MAX_CARD_MINOR)),
    )
    t.done()
    if card.mig_enabled and not card.model.mig_capable:
        raise t.error("mig_enabled", f"model {key!r} has no mig_profiles")
    if card.nvlink_count and not card.model.nvlink_version:
        raise t.error("nvlink_switch_links", f"model {key!r} has no nvlink_version")
    if card.model.nvlink_links and card.nvlink_count > card.model.nvlink_links:
        raise t.error(
            "nvlink_peers", f"{card.nvlink_count} links wired but model {key!r} has {card.model.nvlink_links}"
        )
    return card


def _parse_levels(rows: list, n: int, t: _Table) -> tuple[tuple[int, ...], ...]:
    if len(rows) != n or not all(isinstance(r, list) and len(r) == n for r in rows):
        raise t.error("levels", f"expected a {n}x{n} matrix (one row per card)")
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            if i != j and v not in _LEVELS:
                raise t.error("levels", f"row {i} column {j}: {v!r} is not an NVML level {_LEVELS}")
            if rows[j][i] != v:
                raise t.error("levels", f"not symmetric at ({i}, {j})")
    return tuple(tuple(r) for r in rows)


def _check_consistency(m: Machine, source: str) -> None:
    n = len(m.cards)
    for c in m.cards:
        where = f"{source}: cards[{c.index}]"
        if c.numa is not None and not 0 <= c.numa < max(len(m.numa_cpus), 1):
            raise MachineError(f"{where}.numa: node {c.numa} has no entry in numa_cpus")
        for p in c.nvlink_peers:
            if not 0 <= p < n or p == c.index:
                raise MachineError(f"{where}.nvlink_peers: {p} is not another card's index")
            if m.cards[p].nvlink_peers.count(c.index) != c.nvlink_peers.count(p):
                raise MachineError(
                    f"{where}.nvlink_peers: links to card {p} are not listed the same on both ends"
                )
    seen: dict[str, str] = {}
    for c in m.cards:
        for sw in c.switches:
            if seen.setdefault(sw, c.host_bridge) != c.host_bridge:
                raise MachineError(f"{source}: cards[{c.index}].switches: {sw!r} sits under two host bridges")
    minors = [c.minor for c in m.cards]
    if len(set(minors)) != n:
        raise MachineError(f"{source}: cards: two cards share a minor number")
    bus_ids = [c.bus_id.upper() for c in m.cards]
    if len(set(bus_ids)) != n:
        raise MachineError(f"{source}: cards: two cards share a bus_id")


def _stable_int(*parts: object) -> int:
    return uuidlib.uuid5(uuidlib.NAMESPACE_URL, "xpud-sim/" + "/".join(map(str, parts))).int


def _derived_uuid(prefix: str, *parts: object) -> str:
    return f"{prefix}-{uuidlib.UUID(int=_stable_int(*parts))}"
