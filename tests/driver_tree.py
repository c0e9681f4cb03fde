"""A fake of what the NVIDIA driver publishes about device nodes, in its own file format, under a temp dir
(for ``xpud.hw.devnodes.DevTree``): ``proc/devices`` with the ``nvidia-caps`` major,
``proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access`` and ``.../ci<c>/access`` files whose
lines are ``DeviceFileMinor: N``, ``DeviceFileMode: 292``, ``DeviceFileModify: 1`` (as the driver writes
them; NVIDIA's MIG user guide, "Device Nodes and Capabilities"; read by ``NVIDIA/nvidia-modprobe:
modprobe-utils/nvidia-modprobe-utils.c``), the MIG config/monitor capabilities at minors 1 and 2, and the
control nodes under ``dev/`` (plain files: no driver behind them here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CAPS_MAJOR = 237


@dataclass
class DriverTree:
    dev: Path
    proc: Path
    cap_minors: dict[str, int]  # "gpu2/mig/gi1/access" -> minor

    @property
    def caps(self) -> Path:
        return self.proc / "driver" / "nvidia" / "capabilities"


def access_file(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"


def build(root: Path, card_minors: list[int], gis: range = range(15), cis: range = range(8)) -> DriverTree:
    dev, proc = root / "dev", root / "proc"
    dev.mkdir(parents=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (dev / name).touch()
    (proc / "driver" / "nvidia" / "capabilities" / "mig").mkdir(parents=True)
    (proc / "devices").write_text(
        f"Character devices:\n  1 mem\n195 nvidia-frontend\n{CAPS_MAJOR} nvidia-caps\n510 nvidia-uvm\n\n"
        "Block devices:\n  8 sd\n"
    )
    tree = DriverTree(dev, proc, {})
    (tree.caps / "mig" / "config").write_text(access_file(1))
    (tree.caps / "mig" / "monitor").write_text(access_file(2))
    minor = 3
    for m in card_minors:
        for g in gis:
            base = f"gpu{m}/mig/gi{g}"
            files = [f"{base}/access", *(f"{base}/ci{c}/access" for c in cis)]
            for rel in files:
                (tree.caps / rel).parent.mkdir(parents=True, exist_ok=True)
                (tree.caps / rel).write_text(access_file(minor))
                tree.cap_minors[rel] = minor
                minor += 1
    return tree
