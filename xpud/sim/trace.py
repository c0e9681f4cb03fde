"""Reading openb-format CSVs: the cluster (hosts) and the trace (tasks).

Cluster columns: ``sn, cpu_milli, memory_mib, gpu, model``. Trace columns: ``name, cpu_milli, memory_mib,
num_gpu, gpu_milli`` and optionally ``gpu_spec`` (allowed models separated by ``|``; empty = any). Other
columns are ignored. Every problem is a :class:`TraceError` whose message names the file, the line and how
to fix it.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from xpud.placement.cluster import CARD_MILLI, Demand, Host
from xpud.sim.defaults import (  # noqa: F401  (re-exported: callers import them from here)
    DEFAULT_CLUSTER,
    DEFAULT_TRACE,
    OPENB_ENV,
    TraceError,
    default_path,
    openb_dir,
)

CLUSTER_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
TRACE_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


@dataclass(frozen=True)
class Task:
    name: str
    demand: Demand


def _rows(path: Path, required: tuple[str, ...], what: str):
    if not path.is_file():
        raise TraceError(
            f"{what} file not found: {path} (pass --{what} FILE, or set {OPENB_ENV} to the folder holding "
            f"the openb CSVs)"
        )
    try:
        f = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read {what} file {path}: {e.strerror}") from e
    with f:
        reader = csv.DictReader(f)
        try:
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(
                    f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(required)}"
                )
            yield from ((reader.line_num, row) for row in reader)
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{path}:{max(reader.line_num, 1)}: not a UTF-8 CSV file ({e})") from e


INT_MAX = 10**12  # above any count or size of a host or task (cpu_milli, memory_mib, gpus)


def _int(path: Path, line: int, row: dict, col: str) -> int:
    raw = (row.get(col) or "").strip()
    try:
        value = int(float(raw)) if raw else None
    except (ValueError, OverflowError):  # nan, inf, text
        value = None
    if value is None or not 0 <= value <= INT_MAX:
        raise TraceError(
            f"{path}:{line}: column {col} must be an integer from 0 to {INT_MAX:g}, got {raw[:40]!r}"
        )
    return value


def load_cluster(path: str | Path) -> list[Host]:
    """Hosts from an openb node list."""
    path = Path(path)
    hosts = []
    for line, row in _rows(path, CLUSTER_COLUMNS, "cluster"):
        cards = _int(path, line, row, "gpu")
        hosts.append(
            Host(
                name=(row.get("sn") or f"host-{line}").strip(),
                cpu_milli=_int(path, line, row, "cpu_milli"),
                memory_mib=_int(path, line, row, "memory_mib"),
                cards=cards,
                model=(row.get("model") or "").strip(),
            )
        )
    if not hosts:
        raise TraceError(f"{path}: no hosts")
    if not any(h.cards for h in hosts):
        raise TraceError(f"{path}: no host has a GPU")
    return hosts


def load_trace(path: str | Path) -> list[Task]:
    """Tasks from an openb pod list, in file order."""
    path = Path(path)
    tasks = []
    for line, row in _rows(path, TRACE_COLUMNS, "trace"):
        gpus = _int(path, line, row, "num_gpu")
        milli = _int(path, line, row, "gpu_milli")
        if gpus == 0:
            milli = 0
        elif not 0 < milli <= CARD_MILLI:
            raise TraceError(f"{path}:{line}: gpu_milli must be 1..{CARD_MILLI} for a GPU task, got {milli}")
        elif gpus > 1 and milli != CARD_MILLI:
            raise TraceError(f"{path}:{line}: a task on {gpus} cards must take whole cards (gpu_milli 1000)")
        spec = tuple(sorted(m for m in (row.get("gpu_spec") or "").split("|") if m.strip()))
        demand = Demand(
            cpu_milli=_int(path, line, row, "cpu_milli"),
            memory_mib=_int(path, line, row, "memory_mib"),
            gpus=gpus,
            gpu_milli=milli,
            models=spec if gpus else (),
        )
        tasks.append(Task((row.get("name") or f"task-{line}").strip(), demand))
    if not tasks:
        raise TraceError(f"{path}: no tasks")
    if not any(t.demand.gpus for t in tasks):
        raise TraceError(f"{path}: no task asks for a GPU, so there is no GPU workload to replay")
    return tasks
