"""Writing xpud.toml: a ``Config`` as TOML text (``dumps``), and one key set in the file's text in place
(``xpu config set``): the other lines, the comments, the order and the ``[[windows]]`` tables stay as the
operator wrote them.

Only the plain shape is edited: a ``[section]`` (or ``[slices.NAME]``) header and ``key = value`` lines
under it. The caller checks the result parses to what it meant (``set_key`` returns None where the file
gives the table another way: dotted keys, an inline table, a value over several lines).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from typing import Any

import tomli_w

from xpud.config import accounts as accounts_config
from xpud.config.schema import SECTIONS, Config

_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_ANY_HEADER = re.compile(r"^\s*\[")


def toml_value(value: Any) -> str:
    """``value`` as TOML text (tomli-w's spelling)."""
    return tomli_w.dumps({"v": value}).rstrip("\n")[len("v = ") :]


def _key_line(name: str) -> re.Pattern[str]:
    return re.compile(rf"^\s*(?:{re.escape(name)}|\"{re.escape(name)}\")\s*=")


def set_key(text: str, table: list[str], key: str, value: Any, expected: dict) -> str | None:
    """``text`` with ``key = value`` in ``[table]``: the key's line replaced where the table has it, else a
    line added at the table's end, else the table added at the end of the file. None where the result
    would not parse to ``expected`` (the file's data with the key set): the caller says so."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    new_line = f"{key} = {toml_value(value)}\n"
    header = ".".join(table)
    start = next(
        (i for i, line in enumerate(lines) if (m := _HEADER.match(line)) and m.group(1) == header), None
    )
    if start is None:
        gap = "\n" if lines and lines[-1].strip() else ""
        lines += [gap, f"[{header}]\n", new_line]
    else:
        end = next((j for j in range(start + 1, len(lines)) if _ANY_HEADER.match(lines[j])), len(lines))
        pattern = _key_line(key)
        at = next((j for j in range(start + 1, end) if pattern.match(lines[j])), None)
        if at is not None:
            lines[at] = new_line
        else:
            last = start  # after the table's last key line, before the blank lines and comments that follow
            for j in range(start + 1, end):
                if lines[j].strip() and not lines[j].lstrip().startswith("#"):
                    last = j
            lines.insert(last + 1, new_line)
    out = "".join(lines)
    try:
        if tomllib.loads(out) != expected:
            return None
    except tomllib.TOMLDecodeError:
        return None
    return out


def to_dict(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {
        name: {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(getattr(cfg, name)).items()
        }
        for name in SECTIONS
    }
    out["slices"] = {
        n: {"memory_fraction": s.memory_fraction, "compute_pct": s.compute_pct} for n, s in cfg.slices.items()
    }
    out["accounts"].update(accounts_config.to_dict(cfg.named_accounts))
    if cfg.windows:
        out["windows"] = [
            {"name": w.name, "cron": w.cron, "whole_share": w.whole_share}
            | ({"timezone": w.timezone} if w.timezone else {})
            for w in cfg.windows
        ]
    return out


def dumps(cfg: Config) -> str:
    """The config as TOML text (tomli-w), ``[[windows]]`` as tables, as xpud.toml writes them."""
    data = to_dict(cfg)
    windows = data.pop("windows", [])
    return tomli_w.dumps(data) + "".join("\n[[windows]]\n" + tomli_w.dumps(w) for w in windows)
