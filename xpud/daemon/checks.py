"""The doctor's records: one check's line (``Check``), a device node, and where the checks look (``Host``).
Shared by ``doctor.py`` and ``doctor_isolation.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str  # ok, warn, fail, skip
    message: str
    fix: str = ""


@dataclass(frozen=True)
class DeviceNode:
    path: str
    major: int
    minor: int


@dataclass
class Host:
    """Where the doctor looks. ``root``: files of the system (unit, group database); ``lib``: the NVML
    library (pynvml when None, or a FakeNvml); ``tools``: the NVIDIA tool runner (its ``which``);
    ``devices``: the /dev/nvidia* nodes and the character device groups of /proc/devices (major -> names:
    a major can carry several, e.g. 195 "nvidia", "nvidiactl" and "nvidia-modeset")."""

    root: Path = Path("/")
    lib: object | None = None
    tools: object | None = None
    devices: Callable[[], tuple[list[DeviceNode], dict[int, tuple[str, ...]]]] | None = None
    group_lookup: Callable[[str], int | None] | None = None
    simulated: bool = False
