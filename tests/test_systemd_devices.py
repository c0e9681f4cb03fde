"""The unit's device access lets the daemon open every NVIDIA device node it needs, on drivers before and
after 545, and names only device groups the driver registers.

systemd turns ``DeviceAllow=char-GLOB`` into "c MAJOR:* PERMS" for each /proc/devices entry whose name
matches GLOB (fnmatch), and nothing when none does; with ``DevicePolicy=closed`` everything else is denied.
The /proc/devices names below are the ones the NVIDIA kernel modules register (open-gpu-kernel-modules,
kernel-open/: nv.c, nv-frontend.c before 545, nvidia-uvm/uvm.c, nv-caps.c); the majors of nvidia-uvm and
nvidia-caps are dynamic, so they are examples.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest

UNIT = Path(__file__).parent.parent / "systemd" / "xpud.service"

PROC_DEVICES = {
    "550": {"nvidia": 195, "nvidiactl": 195, "nvidia-modeset": 195, "nvidia-uvm": 508, "nvidia-caps": 511},
    "535": {"nvidia-frontend": 195, "nvidia-uvm": 508, "nvidia-caps": 511},
}
# node -> (/proc/devices group it belongs to on a 545+ driver, minor, needs mknod)
NODES = {
    "/dev/nvidia0": ("nvidia", 0, False),
    "/dev/nvidia7": ("nvidia", 7, False),
    "/dev/nvidiactl": ("nvidiactl", 255, False),
    "/dev/nvidia-uvm": ("nvidia-uvm", 0, False),
    "/dev/nvidia-uvm-tools": ("nvidia-uvm", 1, False),
    "/dev/nvidia-caps/nvidia-cap1": ("nvidia-caps", 1, True),  # MIG config
    "/dev/nvidia-caps/nvidia-cap120": ("nvidia-caps", 120, True),  # a GPU instance's capability
}
DRIVER_GROUPS = {name for groups in PROC_DEVICES.values() for name in groups} | {
    "nvidia-nvswitch",
    "nvidia-caps-imex-channels",
}


def device_rules(unit: str) -> tuple[str, list[tuple[str, str]]]:
    policy = re.search(r"^DevicePolicy=(\S+)", unit, re.M)
    rules = re.findall(r"^DeviceAllow=(\S+)\s+([rwm]+)\s*$", unit, re.M)
    return (policy.group(1) if policy else "auto"), rules


def allowed(rules, proc: dict[str, int], major: int, perms: str) -> bool:
    """What systemd's device cgroup would let through for a character device of ``major``."""
    granted = set()
    for spec, p in rules:
        groups = [m for n, m in proc.items() if fnmatch.fnmatchcase(n, spec.removeprefix("char-"))]
        if spec.startswith("char-") and major in groups:
            granted |= set(p)
    return set(perms) <= granted


@pytest.mark.parametrize("driver", sorted(PROC_DEVICES))
def test_every_nvidia_node_is_allowed(driver):
    policy, rules = device_rules(UNIT.read_text())
    assert policy == "closed"
    proc = PROC_DEVICES[driver]
    for node, (group, _, mknod) in NODES.items():
        major = proc.get(group, proc.get("nvidia-frontend"))  # before 545 major 195 is one group
        assert major is not None, node
        assert allowed(rules, proc, major, "rwm" if mknod else "rw"), f"{node} is blocked on driver {driver}"


def test_only_groups_the_driver_registers_are_named():
    _, rules = device_rules(UNIT.read_text())
    for spec, _ in rules:
        assert spec.startswith("char-"), f"{spec}: name the device group (a /dev path is resolved once)"
        assert any(fnmatch.fnmatchcase(g, spec[5:]) for g in DRIVER_GROUPS), f"{spec} matches no driver group"


def test_the_real_proc_devices_if_this_host_has_nvidia_devices():
    text = Path("/proc/devices").read_text()
    chars = text.split("Block devices:")[0]
    proc = {name: int(major) for major, name in re.findall(r"^\s*(\d+)\s+(\S+)$", chars, re.M)}
    if not any(name.startswith("nvidia") for name in proc):
        pytest.skip("no NVIDIA driver loaded here")
    _, rules = device_rules(UNIT.read_text())
    nodes = [p for p in Path("/dev").glob("nvidia*") if p.is_char_device()]
    nodes += [p for p in Path("/dev/nvidia-caps").glob("nvidia-cap*") if p.is_char_device()]
    for node in nodes:
        major = os.major(node.stat().st_rdev)
        assert allowed(rules, proc, major, "rw"), f"{node} (major {major}) is blocked"
