"""Load and validate ``xpud.toml``; write it back.

Every key lives in one dataclass field below, with its default and its documentation (``doc``). A bad
file is refused with the file, the line, the key and the reason; unknown keys are errors (with a
suggestion). ``etc/xpud.toml`` documents every key, and a test checks that it lists exactly these keys
with these defaults.

Precedence: command-line flags > ``XPUD_*`` environment variables > the file > defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from xpud.errors import ConfigError
from xpud.model import SliceSpec

DEFAULT_PATH = Path("/etc/xpud/xpud.toml")


def _key(default: Any, doc: str, **rules: Any) -> Any:
    """A config key: default, one-line documentation, and rules (choices, min, max)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc, **rules})
    return field(default=default, metadata={"doc": doc, **rules})


@dataclass(frozen=True)
class DaemonSection:
    runtime_dir: str = _key("/run/xpud", "Sockets live here: xpud.sock (users), admin.sock, cred.sock.")
    state_dir: str = _key("/var/lib/xpud", "The lease ledger (ledger.sqlite) lives here.")
    log_level: str = _key("info", "Log verbosity.", choices=("debug", "info", "warning", "error"))
    admin_group: str = _key("xpud-admin", "Members of this group (and root) may use admin.sock.")


@dataclass(frozen=True)
class DevicesSection:
    backend: str = _key(
        "nvml",
        "Where cards come from: the NVIDIA driver, or a simulated machine.",
        choices=("nvml", "simulated"),
    )
    machine: str = _key("dgx-h100", "Simulated machine: a name in etc/machines/ or a path to a description.")
    seed: int = _key(0, "Seed of the simulated machine's varying values.", min=0)


@dataclass(frozen=True)
class CardsSection:
    isolation: str = _key(
        "auto",
        "How slices are isolated: auto = MIG where the card has it, else MPS; "
        "none = counted only (no enforcement).",
        choices=("auto", "mig", "mps", "none"),
    )
    reserved_memory_mib: int = _key(
        0,
        "Memory per card kept out of slices for the driver and context (MiB); 0 = the backend's estimate.",
        min=0,
    )
    mig_switch: str = _key(
        "idle",
        "Whether xpud switches MIG on and off: idle = on idle cards as slice and whole-card demand move "
        "(with a GPU reset where the driver needs one); never = the operator sets MIG modes.",
        choices=("idle", "never"),
    )
    mig_idle_keep_s: float = _key(
        30.0,
        "Seconds a released, empty MIG instance is kept for reuse by a slice of its size; 0 = destroy.",
        min=0.0,
    )
    mig_profiles_file: str = _key(
        "", "Which MIG profiles serve each slice size, per card model; empty = xpud's etc/mig-profiles.toml."
    )


@dataclass(frozen=True)
class LeasesSection:
    grace_s: float = _key(10.0, "Seconds a lease survives after its holder's Hold stream breaks.", min=0.0)
    max_wait_s: float = _key(86400.0, "Longest --wait a request may ask for (seconds).", min=0.0)
    credential_ttl_s: float = _key(
        300.0, "Lifetime of a peer credential issued on cred.sock (seconds).", min=1.0
    )
    history_days: int = _key(30, "Ended leases are kept in the ledger this many days.", min=0)
    max_priority: int = _key(100, "Highest priority a request may ask for; negative down to -max.", min=0)


SECTIONS: dict[str, type] = {
    "daemon": DaemonSection,
    "devices": DevicesSection,
    "cards": CardsSection,
    "leases": LeasesSection,
}

DEFAULT_SLICES: dict[str, SliceSpec] = {
    "vxpu-half": SliceSpec("vxpu-half", 0.5, 30),
    "vxpu-quarter": SliceSpec("vxpu-quarter", 0.25, 15),
}
SLICE_KEYS = {
    "memory_fraction": "Share of the card's memory (0 < f <= 1).",
    "compute_pct": "Share of the card's compute, as an MPS active-thread percentage (1..100).",
}


@dataclass(frozen=True)
class Config:
    daemon: DaemonSection = field(default_factory=DaemonSection)
    devices: DevicesSection = field(default_factory=DevicesSection)
    cards: CardsSection = field(default_factory=CardsSection)
    leases: LeasesSection = field(default_factory=LeasesSection)
    slices: dict[str, SliceSpec] = field(default_factory=lambda: dict(DEFAULT_SLICES))
    path: str = ""  # the file it came from ("" = defaults only)

    @property
    def runtime_dir(self) -> Path:
        return Path(self.daemon.runtime_dir)

    @property
    def state_dir(self) -> Path:
        return Path(self.daemon.state_dir)

    def replace(self, section: str, **values: Any) -> Config:
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **values)})


# Environment variables that override file values: name -> (section, key).
ENVIRONMENT = {
    "XPUD_RUNTIME_DIR": ("daemon", "runtime_dir"),
    "XPUD_STATE_DIR": ("daemon", "state_dir"),
    "XPUD_LOG_LEVEL": ("daemon", "log_level"),
    "XPUD_SIMULATE": ("devices", "machine"),
}


def _line_of(text: str, table: str, key: str | None) -> int | None:
    """The 1-based line of ``key`` in ``[table]`` (or of the table header when key is None)."""
    current = ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        m = re.match(r"^\[\s*([^\[\]]+?)\s*\]", line)
        if m:
            current = ".".join(p.strip().strip('"').strip("'") for p in m.group(1).split("."))
            if key is None and current == table:
                return n
            continue
        if key is not None and current == table:
            m = re.match(r"""^["']?([A-Za-z0-9_\-]+)["']?\s*=""", line)
            if m and m.group(1) == key:
                return n
    return None


class _Source:
    """Where values come from, for error messages."""

    def __init__(self, path: str, text: str):
        self.path, self.text = path, text

    def error(self, table: str, key: str | None, reason: str) -> ConfigError:
        line = _line_of(self.text, table, key)
        where = f"{self.path}:{line}" if line else self.path
        name = f"[{table}] {key}" if key else f"[{table}]"
        return ConfigError(f"{where}: {name}: {reason}")


def _hint(name: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_value(src: _Source, table: str, f: dataclasses.Field, kind: Any, value: Any) -> Any:
    rules = f.metadata
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    expected = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(kind, "?")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise src.error(table, f.name, f"expected {expected}, got {value!r}; default is {f.default!r}")
    if "choices" in rules and value not in rules["choices"]:
        raise src.error(table, f.name, f"{value!r} is not one of {', '.join(rules['choices'])}")
    if "min" in rules and value < rules["min"]:
        raise src.error(table, f.name, f"{value!r} is below the minimum {rules['min']!r}")
    if "max" in rules and value > rules["max"]:
        raise src.error(table, f.name, f"{value!r} is above the maximum {rules['max']!r}")
    return value


def _section(src: _Source, table: str, cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise src.error(table, None, "expected a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        if key not in fields:
            raise src.error(table, key, f"unknown key{_hint(key, fields)}; etc/xpud.toml lists every key")
        values[key] = _check_value(src, table, fields[key], hints[key], value)
    return cls(**values)


def _slices(src: _Source, data: Any) -> dict[str, SliceSpec]:
    if not isinstance(data, dict):
        raise src.error("slices", None, "expected a table of slice sizes, e.g. [slices.vxpu-half]")
    out = dict(DEFAULT_SLICES)
    for name, spec in data.items():
        table = f"slices.{name}"
        if not re.fullmatch(r"vxpu-[a-z0-9][a-z0-9-]*", name):
            raise src.error(table, None, "a slice size is named vxpu-<word> (lowercase, digits, '-')")
        if not isinstance(spec, dict):
            raise src.error(table, None, "expected a table with memory_fraction and compute_pct")
        for key in spec:
            if key not in SLICE_KEYS:
                raise src.error(
                    table,
                    key,
                    f"unknown key{_hint(key, SLICE_KEYS)}; a slice has memory_fraction and compute_pct",
                )
        base = out.get(name)
        mem = spec.get("memory_fraction", base.memory_fraction if base else None)
        pct = spec.get("compute_pct", base.compute_pct if base else None)
        if mem is None or pct is None:
            raise src.error(table, None, "a new slice size needs both memory_fraction and compute_pct")
        if isinstance(mem, bool) or not isinstance(mem, int | float) or not 0 < mem <= 1:
            raise src.error(table, "memory_fraction", f"expected a number in (0, 1], got {mem!r}")
        if isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 100:
            raise src.error(table, "compute_pct", f"expected an integer 1..100, got {pct!r}")
        out[name] = SliceSpec(name, float(mem), pct)
    return out


def parse(text: str, path: str = "<string>") -> Config:
    """Validate TOML text into a Config. Raises ConfigError naming the file, line and key."""
    src = _Source(path, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    kwargs: dict[str, Any] = {"path": path}
    for table, value in data.items():
        if table == "slices":
            kwargs["slices"] = _slices(src, value)
        elif table in SECTIONS:
            kwargs[table] = _section(src, table, SECTIONS[table], value)
        else:
            raise src.error(table, None, f"unknown table{_hint(table, [*SECTIONS, 'slices'])}")
    return Config(**kwargs)


def load(path: str | Path | None = None, environ: typing.Mapping[str, str] | None = None) -> Config:
    """Load the config: ``path`` (or ``$XPUD_CONFIG``, or /etc/xpud/xpud.toml if present), then the
    environment overrides. A missing explicit path is an error; a missing default file means defaults."""
    environ = os.environ if environ is None else environ
    explicit = path or environ.get("XPUD_CONFIG")
    if explicit:
        p = Path(explicit)
        try:
            cfg = parse(p.read_text(), str(p))
        except OSError as e:
            raise ConfigError(
                f"{p}: cannot read the config file: {e.strerror}; pass --config with a readable file"
            ) from None
    elif DEFAULT_PATH.is_file():
        cfg = parse(DEFAULT_PATH.read_text(), str(DEFAULT_PATH))
    else:
        cfg = Config()
    for name, (section, key) in ENVIRONMENT.items():
        if environ.get(name):
            cfg = cfg.replace(section, **{key: environ[name]})
            if name == "XPUD_SIMULATE":
                cfg = cfg.replace("devices", backend="simulated")
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}
    out["slices"] = {
        n: {"memory_fraction": s.memory_fraction, "compute_pct": s.compute_pct} for n, s in cfg.slices.items()
    }
    return out


def dumps(cfg: Config) -> str:
    """The config as TOML text (tomli-w)."""
    return tomli_w.dumps(to_dict(cfg))


def documented_keys() -> dict[str, dict[str, tuple[Any, str]]]:
    """Every key with its default and documentation: {section: {key: (default, doc)}}."""
    out = {}
    for name, cls in SECTIONS.items():
        out[name] = {
            f.name: (
                f.default if f.default is not dataclasses.MISSING else f.default_factory(),
                f.metadata["doc"],
            )
            for f in dataclasses.fields(cls)
        }
    return out
