"""``xpud doctor``'s device isolation checks (issue #32, README "Isolation").

- ``device isolation``: ``enforced`` (each lease's processes in a systemd scope that may open only the
  lease's nodes) or ``advisory (why)``, with what would enforce it.
- ``device modes``: ``/dev/nvidia*`` and the MIG capability nodes world-writable while isolation is
  advisory let any local user open any card; the fix: the driver's ``NVreg_DeviceFileMode``/``GID``, a
  udev rule, or enforcement.
- ``mps compute mode``: a card serving MPS slices (its control daemon's pipe directory has its ``control``
  socket) must be EXCLUSIVE_PROCESS, so that only the MPS server holds a context on it.
"""

from __future__ import annotations

import stat
from pathlib import Path

from xpud import config
from xpud.daemon.checks import FAIL, OK, SKIP, WARN, Check, Host
from xpud.isolation.scope import detect

NODE_GLOBS = ("dev/nvidia[0-9]*", "dev/nvidiactl", "dev/nvidia-caps/nvidia-cap*")
MODES_FIX = (
    "make the nodes 0660 for a group: options nvidia NVreg_DeviceFileUID=0 NVreg_DeviceFileGID=<gid> "
    "NVreg_DeviceFileMode=0660 in /etc/modprobe.d/nvidia.conf (then reload the driver), or a udev rule "
    'KERNEL=="nvidia*", MODE="0660", GROUP="<group>"; or enforce isolation (systemd, cgroup v2, '
    '[isolation] devices = "auto")'
)


def isolation_checks(cfg: config.Config, host: Host) -> list[Check]:
    """``device isolation`` and ``device modes``."""
    how = detect(
        cfg.isolation.devices,
        host.simulated,
        systemd_dir=host.root / "run/systemd/system",
        cgroup_root=host.root / "sys/fs/cgroup",
        euid=lambda: 0,  # the unit runs xpud as root, whoever runs the doctor
    )
    text = f"device isolation: {how.text}"
    if how.enforced:
        state = Check("device isolation", OK, text + " (a systemd scope per lease, DevicePolicy=closed)")
    elif not how.warn:
        state = Check("device isolation", SKIP, text)
    else:
        fix = (
            'set [isolation] devices = "auto"'
            if cfg.isolation.devices == "advisory"
            else "run xpud as root under systemd (PID 1) with the unified cgroup v2 hierarchy "
            "(systemd.unified_cgroup_hierarchy=1 on the kernel command line where it is not the default)"
        )
        state = Check("device isolation", WARN, text + ": any process may open any card's node", fix)
    return [state, _modes(host, how.enforced)]


def _modes(host: Host, enforced: bool) -> Check:
    if host.simulated:
        return Check("device modes", SKIP, "a simulated machine has no device nodes")
    open_to_all = []
    for pattern in NODE_GLOBS:
        for p in sorted(host.root.glob(pattern)):
            try:
                st = p.stat()
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_mode & 0o002:
                open_to_all.append(f"/{p.relative_to(host.root)}")
    if not open_to_all:
        return Check("device modes", OK, "no NVIDIA device node is world-writable")
    shown = ", ".join(open_to_all[:4]) + (f" and {len(open_to_all) - 4} more" if len(open_to_all) > 4 else "")
    if enforced:
        return Check("device modes", OK, f"{shown} world-writable, but a lease's scope allows only its own")
    return Check(
        "device modes", WARN, f"{shown} world-writable and isolation is advisory: any user can use any card",
        MODES_FIX,
    )  # fmt: skip


def mps_compute_mode(cfg: config.Config, nvml, mps_cards: list[int]) -> Check | None:
    """EXCLUSIVE_PROCESS on every card whose MPS control daemon serves (None when none serves)."""
    serving = [i for i in mps_cards if (Path(cfg.runtime_dir) / "mps" / str(i) / "pipe" / "control").exists()]
    if not serving:
        return None
    wrong = []
    for i in serving:
        try:
            mode = nvml.compute_mode(i)
        except Exception:  # the card went away since: its own line says so
            mode = None
        if mode != "EXCLUSIVE_PROCESS":
            wrong.append(f"GPU{i} ({mode or 'unknown'})")
    gpus = ",".join(f"GPU{i}" for i in serving)
    if not wrong:
        return Check("mps compute mode", OK, f"EXCLUSIVE_PROCESS on the cards serving MPS slices ({gpus})")
    return Check(
        "mps compute mode",
        FAIL,
        f"{', '.join(wrong)} serve MPS slices but are not EXCLUSIVE_PROCESS: a job could open a context of "
        "its own beside the MPS server, outside its slice's limits",
        "nvidia-smi -i <index> -c EXCLUSIVE_PROCESS (xpud sets it when it starts the MPS server; something "
        "reset it since)",
    )
