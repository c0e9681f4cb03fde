"""Reading ``xpud.toml`` (and the ``XPUD_*`` environment) into a checked ``Config``.

A bad file is refused with the file, the line, the key and the reason; unknown keys are errors (with a
suggestion). Every number is checked: finite, in range; every string and list bounded in size.

Precedence: command-line flags > ``XPUD_*`` environment variables > the file > defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import ipaddress
import math
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from xpud.config import accounts as accounts_config
from xpud.config.schema import (
    DEFAULT_PATH,
    DEFAULT_SLICES,
    ENVIRONMENT,
    MAX_SEEDS,
    SECTIONS,
    SLICE_KEYS,
    ClusterSection,
    Config,
    device_entry_problem,
)
from xpud.config.windows import MAX_WINDOWS, WindowSpec
from xpud.config.windows import check as check_window
from xpud.errors import ConfigError
from xpud.model import SLICE_NAME, SliceSpec


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


MAX_STRING = 4096  # characters in one string value (paths, names)
MAX_LIST = 256  # items in one list value


def _check_value(src: _Source, table: str, f: dataclasses.Field, kind: Any, value: Any) -> Any:
    """``value`` checked against the key's type and rules: finite, in range, bounded in size."""
    rules = f.metadata
    span = f"{rules['min']!r}..{rules['max']!r}" if "min" in rules and "max" in rules else ""
    if typing.get_origin(kind) is tuple:  # a TOML array of one type, kept as a tuple (immutable)
        item = typing.get_args(kind)[0]
        if not isinstance(value, list) or not all(
            isinstance(v, item) and not isinstance(v, bool) for v in value
        ):
            raise src.error(
                table,
                f.name,
                f"expected a list of {item.__name__}s, got {value!r}; default is {list(f.default)!r}",
            )
        if len(value) > MAX_LIST:
            raise src.error(table, f.name, f"{len(value)} items; at most {MAX_LIST}")
        for v in value:
            if span and not rules["min"] <= v <= rules["max"]:
                raise src.error(table, f.name, f"item {v!r} is outside {span}")
            if isinstance(v, str) and not 0 < len(v) <= MAX_STRING:
                raise src.error(table, f.name, f"item of {len(v)} characters; expected 1..{MAX_STRING}")
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    expected = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(kind, "?")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise src.error(table, f.name, f"expected {expected}, got {value!r}; default is {f.default!r}")
    if kind is float and not math.isfinite(value):
        raise src.error(table, f.name, f"{value!r} is not a finite number; use a number in {span}")
    if kind is str and len(value) > MAX_STRING:
        raise src.error(table, f.name, f"{len(value)} characters; at most {MAX_STRING}")
    if "check" in rules and (reason := rules["check"](value)):
        raise src.error(table, f.name, reason)
    if "choices" in rules and value not in rules["choices"]:
        raise src.error(table, f.name, f"{value!r} is not one of {', '.join(rules['choices'])}")
    if "min" in rules and value < rules["min"]:
        raise src.error(table, f.name, f"{value!r} is below the minimum {rules['min']!r} (range {span})")
    if "max" in rules and value > rules["max"]:
        raise src.error(table, f.name, f"{value!r} is above the maximum {rules['max']!r} (range {span})")
    return value


class _Origin(_Source):
    """A value from a flag or an environment variable, for error messages."""

    def __init__(self, origin: str):
        self.origin = origin

    def error(self, table: str, key: str | None, reason: str) -> ConfigError:
        return ConfigError(f"{self.origin}: [{table}] {key}: {reason}")


def checked(cfg: Config, section: str, key: str, value: Any, origin: str) -> Config:
    """``cfg`` with one key set from a flag or an environment variable (``origin``, e.g. "--seed" or
    "XPUD_LOG_LEVEL"), checked like a file's value. Text is parsed as the key's type. Raises ConfigError."""
    cls = SECTIONS[section]
    f = next(x for x in dataclasses.fields(cls) if x.name == key)
    kind = typing.get_type_hints(cls)[key]
    if isinstance(value, str) and kind in (int, float):
        with contextlib.suppress(ValueError):  # else _check_value names the type it expected
            value = kind(value)
    return cfg.replace(section, **{key: _check_value(_Origin(origin), section, f, kind, value)})


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
        if not SLICE_NAME.fullmatch(name):
            reason = "a slice size is named vxpu-<word> (lowercase, digits, '-'; 45 characters at most)"
            raise src.error(table, None, reason)
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


def _windows(src: _Source, data: Any) -> tuple[WindowSpec, ...]:
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise src.error("windows", None, "expected [[windows]] tables (name, cron, whole_share)")
    if len(data) > MAX_WINDOWS:
        raise src.error("windows", None, f"{len(data)} windows; at most {MAX_WINDOWS}")
    out = []
    for n, spec in enumerate(data, 1):
        try:
            out.append(check_window(spec))
        except ValueError as e:
            line = _nth_line(src.text, "[[windows]]", n)
            raise ConfigError(f"{src.path}:{line or '?'}: [[windows]] #{n}: {e}") from None
    names = [w.name for w in out]
    dup = next((x for x in names if names.count(x) > 1), None)
    if dup:
        raise src.error("windows", None, f"two windows are named {dup!r}; give each its own name")
    return tuple(out)


def _nth_line(text: str, header: str, n: int) -> int | None:
    seen = 0
    for i, raw in enumerate(text.splitlines(), 1):
        if raw.strip().startswith(header):
            seen += 1
            if seen == n:
                return i
    return None


def parse(text: str, path: str = "<string>", environ: typing.Mapping[str, str] | None = None) -> Config:
    """Validate TOML text into a Config, with ``environ``'s ``XPUD_*`` overrides (``ENVIRONMENT``) applied
    before the checks across keys (a DaemonSet's ConfigMap names seeds, each node's environment its
    listen address). Raises ConfigError naming the file, line and key (or the variable)."""
    src = _Source(path, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply (arrays or tables within each other)") from None
    kwargs: dict[str, Any] = {"path": path}
    for table, value in data.items():
        if table == "slices":
            kwargs["slices"] = _slices(src, value)
        elif table == "windows":
            kwargs["windows"] = _windows(src, value)
        elif table == "accounts" and isinstance(value, dict):
            kwargs["accounts"] = _section(src, table, SECTIONS[table], accounts_config.section_data(value))
            kwargs["named_accounts"] = accounts_config.accounts(src, value)
        elif table in SECTIONS:
            kwargs[table] = _section(src, table, SECTIONS[table], value)
        else:
            raise src.error(table, None, f"unknown table{_hint(table, [*SECTIONS, 'slices', 'windows'])}")
    cfg = _environment(Config(**kwargs), environ or {})
    if cfg.leases.default_wait_s > cfg.leases.max_wait_s:
        raise src.error(
            "leases",
            "default_wait_s",
            f"{cfg.leases.default_wait_s:g} is above max_wait_s ({cfg.leases.max_wait_s:g}); "
            "lower it or raise max_wait_s",
        )
    if cfg.carbon.signal and cfg.carbon.command:
        raise src.error("carbon", "command", "give signal (a file) or command, not both")
    if cfg.health.fragmentation_slice not in cfg.slices:
        raise src.error(
            "health",
            "fragmentation_slice",
            f"{cfg.health.fragmentation_slice!r} is not a slice size; use one of {', '.join(cfg.slices)}",
        )
    if cfg.auto.first != "xpu" and cfg.auto.first not in cfg.slices:
        raise src.error(
            "auto", "first", f"{cfg.auto.first!r} is not a mode; use xpu or one of {', '.join(cfg.slices)}"
        )
    _check_cluster(src, cfg.cluster)
    for entry in cfg.isolation.extra_devices:
        if why := device_entry_problem(entry):
            raise src.error("isolation", "extra_devices", why)
    accounts_config.check_refs(src, cfg.accounts, cfg.named_accounts)
    for name in cfg.kubelet.resources:
        domain, _, kind = name.partition("/")
        if not (_RESOURCE_DOMAIN.fullmatch(domain) and (kind == "gpu" or kind in cfg.slices)):
            raise src.error(
                "kubelet",
                "resources",
                f"{name!r}: use <domain>/gpu or <domain>/<slice size> ({', '.join(cfg.slices)}), "
                "e.g. xpu.dev/gpu",
            )
        if len(kind) > _SLOT_NAME_CHARS:  # kubelet takes device ids of 63 characters at most
            raise src.error(
                "kubelet",
                "resources",
                f"{name!r}: device ids are <card uuid>_{kind}_<n>, over kubelet's 63 characters; "
                f"serve slice sizes named in {_SLOT_NAME_CHARS} characters or fewer",
            )
    if len({n.partition("/")[2] for n in cfg.kubelet.resources}) != len(cfg.kubelet.resources):
        raise src.error("kubelet", "resources", "each kind (gpu or a slice size) may be served once")
    return cfg


_SLOT_NAME_CHARS = 63 - len("GPU-00000000-0000-0000-0000-000000000000") - len("__99")
_RESOURCE_DOMAIN = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)+")


_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # as `xpu certs issue NAME` accepts
_LOCATION_CHARS = 64  # as xpud.federation.view accepts from peers


def split_host_port(text: str) -> tuple[str, int]:
    """``"10.0.0.2:7443"`` / ``"[::1]:7443"`` / ``"node-a:7443"`` -> (host, port). Raises ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text[:80]!r} is not HOST:PORT (port 1..65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _check_cluster(src: _Source, c: ClusterSection) -> None:

    if c.name and not _HOST_NAME.match(c.name):
        raise src.error("cluster", "name", "use letters, digits, '.', '_' or '-' (at most 63)")
    for key in ("zone", "block", "domain"):
        v = getattr(c, key)
        if len(v) > _LOCATION_CHARS or not v.isprintable():
            raise src.error("cluster", key, f"at most {_LOCATION_CHARS} printable characters")
    if len(c.seeds) > MAX_SEEDS:
        raise src.error("cluster", "seeds", f"{len(c.seeds)} seeds; at most {MAX_SEEDS}")
    for seed in c.seeds:
        try:
            split_host_port(seed)
        except ValueError as e:
            raise src.error("cluster", "seeds", f'{e}, e.g. "10.0.0.2:7443"') from None
    if not c.listen:
        if c.seeds:
            raise src.error("cluster", "seeds", "set listen too: without it federation is off")
        return
    try:
        host, _ = split_host_port(c.listen)
        if ipaddress.ip_address(host).is_unspecified:
            raise ValueError(f"{host} is every address; peers reach this host at the address given here")
    except ValueError as e:
        raise src.error(
            "cluster", "listen", f'{e}; give IP:PORT of this host, e.g. "10.0.0.2:7443"'
        ) from None
    for key in ("ca", "cert", "key"):
        if not getattr(c, key):
            raise src.error(
                "cluster", key, "needed with listen: the paths `xpu certs init` and `xpu certs issue` wrote"
            )


def read_text(path: Path, what: str = "the config file") -> str:
    """``path``'s text: TOML is UTF-8; other bytes are a ConfigError naming where (OSError passes)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: {what} is not UTF-8 (byte {e.start}); save it as UTF-8") from None


def load(path: str | Path | None = None, environ: typing.Mapping[str, str] | None = None) -> Config:
    """Load the config: ``path`` (or ``$XPUD_CONFIG``, or /etc/xpud/xpud.toml if present), then the
    environment overrides. A missing explicit path is an error; a missing default file means defaults."""
    environ = os.environ if environ is None else environ
    explicit = path or environ.get("XPUD_CONFIG")
    if explicit:
        p = Path(explicit)
        try:
            cfg = parse(read_text(p), str(p), environ)
        except OSError as e:
            raise ConfigError(
                f"{p}: cannot read the config file: {e.strerror}; pass --config with a readable file"
            ) from None
    elif DEFAULT_PATH.is_file():
        cfg = parse(read_text(DEFAULT_PATH), str(DEFAULT_PATH), environ)
    else:
        cfg = parse("", "<defaults>", environ)
    return cfg


def _environment(cfg: Config, environ: typing.Mapping[str, str]) -> Config:
    for name, (section, key) in ENVIRONMENT.items():
        if environ.get(name):
            cfg = checked(cfg, section, key, environ[name], f"environment variable {name}")
            if name == "XPUD_SIMULATE":
                cfg = cfg.replace("devices", backend="simulated")
    return cfg
