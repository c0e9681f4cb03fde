"""The device nodes a process needs to reach NVIDIA cards: a card's node by its minor number, the control
nodes, and a MIG instance's capability nodes. Shared by the kubelet and Slurm bridges and by cgroup
device isolation, so that all of them hand out the same nodes.

Facts (NVIDIA driver; ``NVIDIA/nvidia-modprobe: modprobe-utils/nvidia-modprobe-utils.c``; NVIDIA's MIG
user guide, "Device Nodes and Capabilities"):

- A card is ``/dev/nvidia<minor>`` (major 195), its minor from ``nvmlDeviceGetMinorNumber``: not the NVML
  index, and it may change with a MIG mode change.
- Every process needs ``/dev/nvidiactl``, ``/dev/nvidia-uvm`` and ``/dev/nvidia-uvm-tools``.
- A MIG instance is reached through its parent card's node plus two capability nodes. The driver
  publishes each capability as a file ``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access``
  (and ``.../gi<g>/ci<c>/access``) holding lines ``DeviceFileMinor: N``, ``DeviceFileMode: 292``,
  ``DeviceFileModify: 1``; its node is ``/dev/nvidia-caps/nvidia-cap<N>``, a character device of the major
  that ``/proc/devices`` lists as ``nvidia-caps``. When the node is missing and ``DeviceFileModify`` is 1,
  ``nvidia-modprobe -f <file>`` creates it with that mode; ``create_cap_node`` does the same.
- Never hand out the whole ``/dev/nvidia-caps`` directory: it also holds the MIG config and monitor
  capabilities (``mig/config``, ``mig/monitor``), which let a process re-partition or watch every card.

The roots are injectable (``DevTree``) so tests build a tree in the driver's format under a temp dir.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from xpud.errors import XpudError

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
CAPS_DIR = "nvidia-caps"  # under /dev
MAX_MINOR = (1 << 20) - 1  # Linux minor numbers are 20 bits


class DevNodeError(XpudError, OSError):
    """A node cannot be found or made; one line that says which and why."""


@dataclass(frozen=True)
class Capability:
    """One driver capability file, as read."""

    path: str  # the file under the capabilities root, e.g. "gpu3/mig/gi1/access"
    minor: int
    mode: int  # permission bits for the node (292 = 0o444)
    modify: bool  # whether a missing node may be created (nvidia-modprobe's rule)


def parse_capability(text: str, where: str) -> Capability:
    """A capability file's ``Key: value`` lines; DevNodeError when the minor is missing or out of range."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    try:
        minor = int(fields["DeviceFileMinor"])
        mode = int(fields.get("DeviceFileMode", "292"))
        modify = int(fields.get("DeviceFileModify", "0")) == 1
    except (KeyError, ValueError):
        raise DevNodeError(f"{where}: no DeviceFileMinor/DeviceFileMode line the driver writes") from None
    if not 0 <= minor <= MAX_MINOR or not 0 <= mode <= 0o777:
        raise DevNodeError(f"{where}: DeviceFileMinor {minor} / DeviceFileMode {mode} out of range")
    return Capability(where, minor, mode, modify)


@dataclass(frozen=True)
class DevTree:
    """Where the nodes and the driver's capability files live (the real ones by default)."""

    dev: Path = Path("/dev")
    caps: Path = Path("/proc/driver/nvidia/capabilities")
    proc_devices: Path = Path("/proc/devices")

    # --------------------------------------------------------------------------------- names
    # Names are relative to /dev: "nvidia3", "nvidia-caps/nvidia-cap21". The host path is under
    # ``self.dev``; inside a container or a job it is always /dev/<name>.
    def host(self, name: str) -> str:
        return str(self.dev / name)

    @staticmethod
    def card(minor: int) -> str:
        if not isinstance(minor, int) or not 0 <= minor <= 254:  # 255 is nvidiactl
            raise DevNodeError(f"card minor number {minor!r}: expected 0..254 (nvmlDeviceGetMinorNumber)")
        return f"nvidia{minor}"

    @staticmethod
    def control() -> list[str]:
        return list(CONTROL_NODES)

    # --------------------------------------------------------------------------------- MIG
    def capability(self, rel: str) -> Capability:
        path = self.caps / rel
        try:
            text = path.read_text()
        except OSError as e:
            raise DevNodeError(
                f"{path}: {e.strerror or e} (is the instance there, the driver loaded?)"
            ) from None
        return parse_capability(text, rel)

    def mig_capabilities(self, parent_minor: int, gi: int, ci: int) -> list[Capability]:
        """The GPU-instance and compute-instance capabilities of MIG instance ``gi``/``ci`` on the card
        whose minor is ``parent_minor``."""
        base = f"gpu{parent_minor}/mig/gi{gi}"
        return [self.capability(f"{base}/access"), self.capability(f"{base}/ci{ci}/access")]

    def mig_nodes(self, parent_minor: int, gi: int, ci: int, create: bool = True) -> list[str]:
        """The nodes MIG instance ``gi``/``ci`` needs beyond the control nodes: its parent card and its two
        capability nodes (created when missing, as ``nvidia-modprobe -f`` does, if ``create``)."""
        names = [self.card(parent_minor)]
        for cap in self.mig_capabilities(parent_minor, gi, ci):
            names.append(self.create_cap_node(cap) if create else cap_node(cap.minor))
        return names

    def caps_major(self) -> int:
        """The major number /proc/devices lists for ``nvidia-caps``."""
        try:
            lines = self.proc_devices.read_text().splitlines()
        except OSError as e:
            raise DevNodeError(f"{self.proc_devices}: {e.strerror or e}") from None
        for line in lines:
            number, _, name = line.strip().partition(" ")
            if name.strip() == CAPS_DIR and number.isdigit():
                return int(number)
        raise DevNodeError(f"{self.proc_devices} lists no {CAPS_DIR} (is the NVIDIA driver loaded?)")

    def create_cap_node(self, cap: Capability) -> str:
        """``nvidia-caps/nvidia-cap<minor>``, made when missing (a character device, the capability's
        mode, the directory 0755) and left alone when it is there and right."""
        name = cap_node(cap.minor)
        path = self.dev / name
        major = self.caps_major()
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is not None:
            if (
                stat.S_ISCHR(st.st_mode)
                and os.major(st.st_rdev) == major
                and os.minor(st.st_rdev) == cap.minor
            ):
                return name
            raise DevNodeError(f"{path} exists but is not character device {major}:{cap.minor}: remove it")
        if not cap.modify:
            raise DevNodeError(f"{path} is missing and the driver says not to make it ({cap.path})")
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            os.mknod(path, stat.S_IFCHR | cap.mode, os.makedev(major, cap.minor))
            os.chmod(path, cap.mode)  # mknod's mode passes through the umask
        except FileExistsError:
            pass  # made meanwhile by another caller
        except OSError as e:
            raise DevNodeError(f"making {path} ({major}:{cap.minor}): {e.strerror or e}") from None
        return name


def cap_node(minor: int) -> str:
    return f"{CAPS_DIR}/nvidia-cap{minor}"
