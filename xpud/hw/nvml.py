"""The hardware adapter: the only module that calls NVML (the ``pynvml`` module of nvidia-ml-py).

``Nvml(lib)`` reads inventory, topology and health samples, drives MIG and compute modes, and waits
for hardware events. ``lib`` is the real ``pynvml`` module or a ``FakeNvml`` (same surface).

Every NVML call goes through ``Nvml._call``: "not supported" (and a function missing from an old
binding) becomes ``None``; bytes become str; a lost card raises ``NvmlGpuLost`` (which ``sample`` turns
into a lost sample); any other NVML error either raises a one-line ``NvmlError`` (``strict=True``: calls
whose failure the caller must know about) or is recorded in ``Nvml.errors`` and read as ``None``.

Units: bytes, watts, degrees Celsius, GB/s; times are seconds since the epoch.

Closing: ``close`` waits (up to ``CLOSE_WAIT_S``) for calls other threads are making to return before it
shuts NVML down, and a closed adapter never re-opens by itself (only an explicit ``open`` does): calls
after ``close`` raise NvmlUnavailable.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import threading
import time
from collections import deque
from pathlib import Path

import pynvml

from xpud.hw.types import (
    HwEvent,
    MigInstance,
    MigProfile,
    NvLink,
    NvmlError,
    NvmlGpuLost,
    NvmlInsufficientResources,
    NvmlInUse,
    NvmlNoPermission,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlUnavailable,
)
from xpud.model import MAX_CARD_MINOR, CardInfo, CardSample
from xpud.topology import SYSTEM, Topology

__all__ = [
    "EventWaiter",
    "HwEvent",
    "MigInstance",
    "MigProfile",
    "NvLink",
    "Nvml",
    "NvmlError",
    "NvmlGpuLost",
    "NvmlInUse",
    "NvmlInsufficientResources",
    "NvmlNoPermission",
    "NvmlNotFound",
    "NvmlNotSupported",
    "NvmlUnavailable",
    "norm_bus_id",
]

log = logging.getLogger("xpud.hw.nvml")

MIB = 1 << 20
CLOSE_WAIT_S = 5.0  # how long close waits for other threads' NVML calls to return
NO_ID = 0xFFFFFFFF  # instance id meaning "the whole card" in events and process lists
ARCHITECTURES = {
    getattr(pynvml, n): n.removeprefix("NVML_DEVICE_ARCH_").lower()
    for n in dir(pynvml)
    if n.startswith("NVML_DEVICE_ARCH_") and n != "NVML_DEVICE_ARCH_UNKNOWN"
}
COMPUTE_MODES = {"DEFAULT": 0, "EXCLUSIVE_THREAD": 1, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}
_CODE_NAMES = {getattr(pynvml, n): n for n in dir(pynvml) if n.startswith("NVML_ERROR_")}
# One-direction GB/s of one NVLink link by NVML_NVLINK_VERSION_* (P100 20, V100..H100 25, B200 50).
_NVLINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0}
# Raw GB/s per PCIe lane by generation; a link delivers about 80 % of it (Gen4 x16 ~ 25 GB/s).
_PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
_EVENT_KINDS = {
    pynvml.nvmlEventTypeXidCriticalError: "xid",
    pynvml.nvmlEventTypeSingleBitEccError: "ecc-sbe",
    pynvml.nvmlEventTypeDoubleBitEccError: "ecc-dbe",
    pynvml.nvmlEventTypePState: "pstate",
    pynvml.nvmlEventTypeClock: "clock",
    pynvml.nvmlEventTypePowerSourceChange: "power-source",
}
_EVENT_MASK = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
)
_NVLINK_TOTALS = (  # CardSample field, NVML field id (summed over links), per-link counter (fallback)
    (
        "nvlink_replay_errors",
        pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
        pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    ),
    (
        "nvlink_recovery_errors",
        pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
        pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
    ),
    (
        "nvlink_crc_flit_errors",
        pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
        pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    ),
    (
        "nvlink_crc_data_errors",
        pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
        pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
    ),
)


_TYPED = {
    pynvml.NVML_ERROR_GPU_IS_LOST: (NvmlGpuLost, ""),
    pynvml.NVML_ERROR_NOT_SUPPORTED: (NvmlNotSupported, ""),
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: (NvmlNotSupported, ": the driver is older than the binding"),
    pynvml.NVML_ERROR_IN_USE: (NvmlInUse, ": processes or instances still use it"),
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: (NvmlInsufficientResources, ""),
    pynvml.NVML_ERROR_NO_PERMISSION: (NvmlNoPermission, ": run as root"),
    pynvml.NVML_ERROR_NOT_FOUND: (NvmlNotFound, ""),
}
_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
_NONE = object()  # "not supported", where the caller must tell it from a failed read
_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
_SKIP = (pynvml.NVML_ERROR_INVALID_ARGUMENT,)  # a profile enum the driver does not offer: the next one


def _error(name: str, card: int | None, e: pynvml.NVMLError) -> NvmlError:
    code = getattr(e, "value", None)
    code_name = _CODE_NAMES.get(code, f"NVML error {code}")
    cls, hint = _TYPED.get(code, (NvmlError, ""))
    where = f" on card {card}" if card is not None else ""
    reason = code_name.removeprefix("NVML_ERROR_").replace("_", " ").lower()
    return cls(f"{name}{where}: {reason}{hint} ({code_name})", code)


def _unavailable(e: BaseException) -> NvmlUnavailable:
    code = getattr(e, "value", None)
    why = {
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "NVML not found (libnvidia-ml.so.1): install the NVIDIA driver",
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "NVIDIA driver not loaded: load it (`modprobe nvidia`)",
        pynvml.NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA devices (/dev/nvidia*)",
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "NVML and kernel driver versions differ: reboot",
    }.get(code, f"NVML failed to start ({_CODE_NAMES.get(code, e)})")
    return NvmlUnavailable(f"{why}, or run `xpud --simulate dgx-h100`", code)


def _decode(value):
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def norm_bus_id(bus_id: str) -> str:
    """NVML bus id with an 8-digit domain, upper case: ``0000:1b:00.0`` -> ``00000000:1B:00.0``."""
    domain, _, rest = bus_id.strip().rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("0", "", domain)
    return f"{int(domain or '0', 16):08X}:{bus.upper()}:{rest.upper()}"


def _field(fv) -> int | float | None:
    """Value of one nvmlFieldValue_t, or None when NVML could not read it."""
    if fv.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    member = {
        pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(fv.valueType, "ullVal")
    return getattr(fv.value, member)


# NVML_FI_DEV_NVLINK_GET_STATE -> trained or not. ACTIVE_TRAFFIC_DISABLED (newer drivers) is trained;
# traffic on it is held back by the fabric manager, not lost.
_LINK_STATES = {
    getattr(pynvml, name): up
    for name, up in (
        ("NVML_NVLINK_STATE_INACTIVE", False),
        ("NVML_NVLINK_STATE_ACTIVE", True),
        ("NVML_NVLINK_STATE_SLEEP", True),
        ("NVML_NVLINK_STATE_ACTIVE_TRAFFIC_DISABLED", True),
    )
    if hasattr(pynvml, name)
}


def _active(state) -> bool | None:
    """nvmlDeviceGetNvLinkState's answer (NVML_FEATURE_ENABLED: active) as trained or not."""
    return None if state is None else state == pynvml.NVML_FEATURE_ENABLED


def _bits(words) -> tuple[int, ...]:
    """Set bits of an array of 64-bit words (CPU or NUMA masks), lowest first."""
    return tuple(w * 64 + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1)


def _handle_key(handle) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return id(handle)


# ------------------------------------------------------------------------------------------ adapter


class Nvml:
    """NVML for one host. ``lib``: the ``pynvml`` module (default) or a ``FakeNvml``.

    ``sysfs`` is where NUMA nodes of PCI devices are looked up when NVML cannot say; it defaults to
    ``/sys`` for the real library and to nothing for a fake (whose machine is not this host).
    """

    def __init__(self, lib=None, *, sysfs: str | None = "default"):
        self._lib = pynvml if lib is None else lib
        self._sysfs = ("/sys" if lib is None else None) if sysfs == "default" else sysfs
        self._lock = threading.Lock()
        self._open = False
        self._count = 0
        self._handles: dict[int, object] = {}
        self._info: dict[int, CardInfo] = {}
        self._link_count: dict[int, int] = {}
        self._links_seen_up: dict[int, set[int]] = {}  # card -> links seen trained since start-up
        self._link_peer: dict[tuple[int, int], str] = {}  # (card, link) -> far end's bus id
        self._bus: dict[int, str] = {}  # card -> its bus id (kept when _info is dropped)
        self._thresholds: dict[int, tuple[int | None, int | None]] = {}
        self._no_link_counters: set[tuple[int, str]] = set()  # (card, signal) neither way can read
        self._profiles: dict[int, list[MigProfile]] = {}
        self._idle = threading.Condition()  # guards the three below
        self._busy = 0  # NVML calls in progress, on any thread
        self._shut = False  # closed: no call may re-open NVML
        self._released: set[int] = set()  # cards let go of for a MIG mode change (``card_released``)
        self._waiters: list[EventWaiter] = []
        self._missing: set[str] = set()
        self._logged: set[tuple] = set()
        self.errors: deque[str] = deque(maxlen=200)  # NVML errors read as None, newest last

    # ------------------------------------------------------------------------------- calls

    def _call(
        self,
        name: str | tuple[str, ...],
        *args,
        card: int | None = None,
        strict: bool = False,
        absent: tuple[int, ...] = (),
        unsupported=None,
    ):
        """Call ``lib.<name>(*args)`` (the first of several names the binding has).

        NotSupported, FunctionNotFound and a missing function give ``unsupported`` (None); with ``strict``
        they raise NvmlNotSupported. The codes in ``absent`` give None. GPU_IS_LOST raises NvmlGpuLost.
        Other errors raise with ``strict``; otherwise they are recorded in ``errors`` and give None.
        """
        names = (name,) if isinstance(name, str) else name
        fn = next((f for f in (getattr(self._lib, n, None) for n in names) if callable(f)), None)
        if fn is None:
            if names[0] not in self._missing:
                self._missing.add(names[0])
                log.info("%s is not in this NVML binding; reading it as unsupported", names[0])
            if strict:
                raise NvmlNotSupported(f"{names[0]}: not in this NVML binding (upgrade nvidia-ml-py)")
            return unsupported
        with self._idle:
            if self._shut:
                raise NvmlUnavailable(f"{names[0]}: NVML is closed (xpud is stopping)")
            self._busy += 1
        try:
            return _decode(fn(*args))
        except pynvml.NVMLError as e:
            code = getattr(e, "value", None)
            if code in absent:
                return None
            if code in _ABSENT and not strict:
                return unsupported
            err = _error(names[0], card, e)
            if strict or isinstance(err, NvmlGpuLost):
                raise err from None
            self._record(err, names[0], card)
            return None
        finally:
            with self._idle:
                self._busy -= 1
                if not self._busy:
                    self._idle.notify_all()

    def _record(self, err: NvmlError, name: str, card: int | None) -> None:
        self.errors.append(str(err))
        if (name, card, err.nvml_code) not in self._logged:  # once per call, card and code (samples: 1 Hz)
            self._logged.add((name, card, err.nvml_code))
            log.warning("%s", err)

    def _handle(self, index: int):
        h = self._handles.get(index)
        if h is None:
            self._ensure_open()
            if not 0 <= index < self._count:
                raise NvmlError(f"no card {index}: this host has {self._count}")
            h = self._call("nvmlDeviceGetHandleByIndex", index, card=index, strict=True)
            self._handles[index] = h
        return h

    # ---------------------------------------------------------------------------- lifecycle

    def open(self) -> None:
        """Start NVML. Raises NvmlUnavailable, with what to do, when there is no driver or library."""
        with self._lock:
            if self._open:
                return
            with self._idle:
                self._shut = False
            try:
                self._lib.nvmlInit()  # not through _call: its failures get their own message
            except pynvml.NVMLError as e:
                raise _unavailable(e) from None
            except OSError as e:  # a broken libnvidia-ml.so
                raise NvmlUnavailable(
                    f"NVML could not be loaded ({e}): reinstall the NVIDIA driver, "
                    "or run `xpud --simulate dgx-h100`"
                ) from None
            try:
                self._count = self._call("nvmlDeviceGetCount", strict=True)
            except NvmlError:
                self._call("nvmlShutdown")
                raise
            self._open = True

    def _ensure_open(self) -> None:
        if not self._open:
            if self._shut:
                raise NvmlUnavailable("NVML is closed (xpud is stopping); it is not opened again")
            self.open()

    def close(self) -> None:
        """Shut NVML down once the calls other threads are making have returned (``CLOSE_WAIT_S`` at
        most: after that NVML is left open, never pulled from under a call). No call re-opens it."""
        with self._lock:
            if not self._open:
                return
            with self._idle:
                self._shut = True
                drained = self._idle.wait_for(lambda: self._busy == 0, CLOSE_WAIT_S)
            self._open = False
            self._handles.clear()
            if not drained:
                log.warning("NVML calls still running after %g s: leaving NVML initialised", CLOSE_WAIT_S)
                return
            with contextlib.suppress(pynvml.NVMLError):
                self._lib.nvmlShutdown()

    def __enter__(self) -> Nvml:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def driver_version(self) -> str | None:
        """The kernel driver version, e.g. "550.90.07"."""
        self._ensure_open()
        return self._call("nvmlSystemGetDriverVersion")

    def cuda_version(self) -> str | None:
        """The CUDA version the driver supports, e.g. "12.4"."""
        self._ensure_open()
        v = self._call(("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"))
        return None if v is None else f"{v // 1000}.{v % 1000 // 10}"

    def card_count(self) -> int:
        self._ensure_open()
        return self._count

    # ---------------------------------------------------------------------------- inventory

    def cards(self) -> list[CardInfo]:
        """Inventory of every card, in NVML index order."""
        return [self.card_info(i) for i in range(self.card_count())]

    def card_info(self, index: int) -> CardInfo:
        """One card's inventory. A card lost before it was ever read shows as name "(lost)"."""
        try:
            h = self._handle(index)
            uuid = self._call("nvmlDeviceGetUUID", h, card=index, strict=True)
            name = self._call("nvmlDeviceGetName", h, card=index, strict=True)
            memory = self._call("nvmlDeviceGetMemoryInfo", h, card=index, strict=True)
            bus_id = norm_bus_id(
                _decode(self._call("nvmlDeviceGetPciInfo", h, card=index, strict=True).busId)
            )
            cpus = self._cpu_affinity(index, h)
            mig = self._call("nvmlDeviceGetMigMode", h, card=index)
            links = self._nvlink_count(index, h)
            states = [self._call("nvmlDeviceGetNvLinkState", h, link, card=index) for link in range(links)]
            self._bus[index] = bus_id
            self._saw_links(index, [_active(s) for s in states], h)
            arch = self._call("nvmlDeviceGetArchitecture", h, card=index)
            info = CardInfo(
                index=index,
                uuid=uuid,
                name=name,
                memory_total_bytes=int(memory.total),
                pci_bus_id=bus_id,
                numa_node=self._numa(index, h, bus_id, cpus),
                cpu_affinity=cpus,
                mig_capable=mig is not None,
                mig_enabled=bool(mig and mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE),
                nvlink_active_links=sum(s == pynvml.NVML_FEATURE_ENABLED for s in states),
                serial=self._call("nvmlDeviceGetSerial", h, card=index),
                architecture=None if arch is None else ARCHITECTURES.get(arch, "unknown"),
                minor_number=self._minor(index, h),
            )
        except NvmlGpuLost:
            return self._info.get(index) or CardInfo(index, "", "(lost)", 0, "")
        self._info[index] = info
        return info

    def _minor(self, index: int, h) -> int | None:
        # Re-read with the rest of the inventory (after every MIG mode change too): the driver may renumber.
        minor = self._call("nvmlDeviceGetMinorNumber", h, card=index)
        return minor if isinstance(minor, int) and 0 <= minor <= MAX_CARD_MINOR else None

    def _cpu_affinity(self, index: int, h) -> tuple[int, ...]:
        # ceil(ncpu/64) words; ask for at least 1024 CPUs' worth: a container or a simulated machine may
        # see fewer CPUs than the machine has, and extra words cost nothing.
        words = math.ceil(max(os.cpu_count() or 1, 1024) / 64)
        mask = self._call("nvmlDeviceGetCpuAffinity", h, words, card=index)
        return () if mask is None else _bits(mask)

    def _numa(self, index: int, h, bus_id: str, cpus: tuple[int, ...]) -> int | None:
        """NUMA node: NVML's memory affinity, else sysfs for the PCI device, else the node of its CPUs."""
        mask = self._call("nvmlDeviceGetMemoryAffinity", h, 1, pynvml.NVML_AFFINITY_SCOPE_NODE, card=index)
        nodes = _bits(mask) if mask is not None else ()
        if len(nodes) == 1:
            return nodes[0]
        if self._sysfs is None:
            return None
        domain, rest = bus_id.split(":", 1)
        node_file = Path(self._sysfs, "bus/pci/devices", f"{int(domain, 16):04x}:{rest.lower()}", "numa_node")
        try:
            node = int(node_file.read_text())
            if node >= 0:
                return node
        except (OSError, ValueError):
            pass
        from xpud.hw.machines import parse_cpulist  # only on real hosts without NUMA info in NVML

        for path in sorted(Path(self._sysfs, "devices/system/node").glob("node[0-9]*")):
            try:
                if cpus and set(cpus) <= set(parse_cpulist((path / "cpulist").read_text())):
                    return int(path.name[4:])
            except (OSError, ValueError):
                continue
        return None

    # ----------------------------------------------------------------------------- topology

    def _nvlink_count(self, index: int, h) -> int:
        """Links the card has (active or not); 0 without NVLink."""
        if index in self._link_count:
            return self._link_count[index]
        fv = self._call("nvmlDeviceGetFieldValues", h, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT], card=index)
        n = _field(fv[0]) if fv is not None else None
        if n is None:  # older drivers: probe links until NVML says there is no such link
            n = 0
            while (
                n < pynvml.NVML_NVLINK_MAX_LINKS
                and self._call(
                    "nvmlDeviceGetNvLinkState", h, n, card=index, absent=(pynvml.NVML_ERROR_INVALID_ARGUMENT,)
                )
                is not None
            ):
                n += 1
        self._link_count[index] = int(n)
        return int(n)

    def nvlinks(self, index: int) -> list[NvLink]:
        """Every NVLink link of a card: state, what is at the far end, version."""
        h = self._handle(index)
        if not self._info:
            self.cards()  # to recognise our own cards at the far end of a link
        by_bus = {info.pci_bus_id: info.index for info in self._info.values()}
        out = []
        for link in range(self._nvlink_count(index, h)):
            state = self._call("nvmlDeviceGetNvLinkState", h, link, card=index)
            kind = self._call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, card=index)
            pci = self._call("nvmlDeviceGetNvLinkRemotePciInfo", h, link, card=index)
            bus = norm_bus_id(_decode(pci.busId)) if pci is not None else None
            remote = {
                pynvml.NVML_NVLINK_DEVICE_TYPE_GPU: "gpu",
                pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH: "switch",
                pynvml.NVML_NVLINK_DEVICE_TYPE_IBMNPU: "npu",
            }.get(kind, "unknown")
            if kind is None and bus in by_bus:
                remote = "gpu"  # old drivers cannot say; a bus id of one of our cards can
            out.append(
                NvLink(
                    link,
                    None if state is None else state == pynvml.NVML_FEATURE_ENABLED,
                    remote,
                    bus,
                    by_bus.get(bus) if remote == "gpu" else None,
                    self._call("nvmlDeviceGetNvLinkVersion", h, link, card=index),
                )
            )
        return out

    def pcie_link(self, index: int) -> tuple[int | None, int | None]:
        """Maximum PCIe generation and width of the card's link (what it trains to under load)."""
        h = self._handle(index)
        return (
            self._call("nvmlDeviceGetMaxPcieLinkGeneration", h, card=index),
            self._call("nvmlDeviceGetMaxPcieLinkWidth", h, card=index),
        )

    def topology(self) -> Topology:
        """Levels, NVLink link counts (direct, and through NVSwitch), NUMA nodes, link speeds."""
        infos = self.cards()
        n = len(infos)
        levels = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                try:
                    level = self._call(
                        "nvmlDeviceGetTopologyCommonAncestor", self._handle(i), self._handle(j), card=i
                    )
                except NvmlGpuLost:
                    level = None
                levels[i][j] = levels[j][i] = SYSTEM if level is None else level  # unknown: assume the worst
        direct = [[0] * n for _ in range(n)]
        switch_links = [0] * n
        versions: list[int] = []
        pcie: list[float] = []
        for i in range(n):
            try:
                links = self.nvlinks(i)
            except NvmlGpuLost:
                continue
            for link in links:
                if link.active and link.remote_index is not None:
                    direct[i][link.remote_index] += 1
                elif link.active and link.remote == "switch":
                    switch_links[i] += 1
                if link.active and link.version:
                    versions.append(link.version)
            gen, width = self.pcie_link(i)
            if gen in _PCIE_LANE_GBPS and width:
                pcie.append(round(_PCIE_LANE_GBPS[gen] * width * 0.8, 1))
        nvlinks = [
            [
                0 if i == j else max(direct[i][j], direct[j][i]) + min(switch_links[i], switch_links[j])
                for j in range(n)
            ]
            for i in range(n)
        ]
        return Topology(
            levels=tuple(map(tuple, levels)),
            nvlinks=tuple(map(tuple, nvlinks)) if any(map(any, nvlinks)) else (),
            numa=tuple(info.numa_node for info in infos),
            nvlink_gbps_per_link=_NVLINK_GBPS.get(min(versions), 25.0) if versions else 25.0,
            pcie_gbps=min(pcie) if pcie else 25.0,
        )

    # ------------------------------------------------------------------------------- health

    def sample(self, index: int) -> CardSample:
        """Live values and raw health signals of one card; a lost card gives ``CardSample(lost=True)``."""
        now = time.time()
        try:
            return self._sample(index, now)
        except NvmlGpuLost:
            return CardSample(timestamp=now, lost=True)

    def _sample(self, index: int, now: float) -> CardSample:
        h = self._handle(index)

        def q(name, *args):
            return self._call(name, *args, card=index)

        util = q("nvmlDeviceGetUtilizationRates", h)
        mem = q("nvmlDeviceGetMemoryInfo", h)
        power, limit = q("nvmlDeviceGetPowerUsage", h), q("nvmlDeviceGetEnforcedPowerLimit", h)
        pstate = q("nvmlDeviceGetPerformanceState", h)
        if None in self._thresholds.get(index, (None,)):  # fixed per board: read until known
            self._thresholds[index] = (
                q("nvmlDeviceGetTemperatureThreshold", h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                q("nvmlDeviceGetTemperatureThreshold", h, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            )
        slowdown, shutdown = self._thresholds[index]
        corrected, uncorrected = (
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        )
        sbe_pages = q(
            "nvmlDeviceGetRetiredPages", h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        )
        dbe_pages = q("nvmlDeviceGetRetiredPages", h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pages_pending = q("nvmlDeviceGetRetiredPagesPendingStatus", h)
        rows = q("nvmlDeviceGetRemappedRows", h) or (None, None, None, None)
        fabric = self._fabric(index, h)
        return CardSample(
            timestamp=now,
            utilization_gpu_pct=None if util is None else int(util.gpu),
            utilization_memory_pct=None if util is None else int(util.memory),
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            temperature_c=q("nvmlDeviceGetTemperature", h, pynvml.NVML_TEMPERATURE_GPU),
            temperature_slowdown_c=slowdown,
            temperature_shutdown_c=shutdown,
            power_w=None if power is None else power / 1000.0,
            power_limit_w=None if limit is None else limit / 1000.0,
            performance_state=None if pstate is None or pstate > 15 else pstate,
            fan_pct=q("nvmlDeviceGetFanSpeed", h),
            ecc_sbe_volatile=q("nvmlDeviceGetTotalEccErrors", h, corrected, pynvml.NVML_VOLATILE_ECC),
            ecc_dbe_volatile=q("nvmlDeviceGetTotalEccErrors", h, uncorrected, pynvml.NVML_VOLATILE_ECC),
            ecc_sbe_aggregate=q("nvmlDeviceGetTotalEccErrors", h, corrected, pynvml.NVML_AGGREGATE_ECC),
            ecc_dbe_aggregate=q("nvmlDeviceGetTotalEccErrors", h, uncorrected, pynvml.NVML_AGGREGATE_ECC),
            retired_pages_sbe=None if sbe_pages is None else len(sbe_pages),
            retired_pages_dbe=None if dbe_pages is None else len(dbe_pages),
            retired_pages_pending=None if pages_pending is None else bool(pages_pending),
            remapped_rows_corrected=rows[0],
            remapped_rows_uncorrected=rows[1],
            remapped_rows_pending=None if rows[2] is None else bool(rows[2]),
            remapped_rows_failure=None if rows[3] is None else bool(rows[3]),
            clock_event_reasons=q(
                ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h
            ),
            pcie_replay_counter=q("nvmlDeviceGetPcieReplayCounter", h),
            inforom_valid=self._inforom_valid(index, h),
            fabric_state=None if fabric is None else fabric[0],
            fabric_status=None if fabric is None else fabric[1],
            recovery_action=self._recovery_action(index, h),
            **self._nvlink_health(index, h),
        )

    def fabric(self, index: int) -> tuple[int, int] | None:
        """The card's NVSwitch fabric: (NVML_GPU_FABRIC_STATE_*, the NVML return code of its training),
        e.g. (COMPLETED, SUCCESS) once the Fabric Manager trained it; None where there is no fabric to
        train (no NVSwitch, a card before Hopper, or a driver without nvmlDeviceGetGpuFabricInfoV)."""
        return self._fabric(index, self._handle(index))

    def _fabric(self, index: int, h) -> tuple[int, int] | None:
        info = pynvml.c_nvmlGpuFabricInfoV_t()  # its constructor sets the version (v2) NVML checks
        if self._call("nvmlDeviceGetGpuFabricInfoV", h, ctypes.byref(info), card=index) is None:
            return None
        if info.state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
            return None
        return int(info.state), int(info.status)

    def _recovery_action(self, index: int, h) -> int | None:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (NVML_GPU_RECOVERY_ACTION_*: what the driver says the card
        needs, e.g. a GPU reset after a fail-class XID); None where the driver has no such field."""
        fv = self._call(
            "nvmlDeviceGetFieldValues", h, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION], card=index
        )
        value = _field(fv[0]) if fv is not None else None
        return None if value is None else int(value)

    def _inforom_valid(self, index: int, h) -> bool | None:
        try:
            self._call("nvmlDeviceValidateInforom", h, card=index, strict=True)
            return True
        except NvmlNotSupported:
            return None
        except NvmlGpuLost:
            raise
        except NvmlError as e:
            if e.nvml_code == pynvml.NVML_ERROR_CORRUPTED_INFOROM:
                return False
            self._record(e, "nvmlDeviceValidateInforom", index)
            return None

    def _nvlink_health(self, index: int, h) -> dict:
        """NVLink error totals and links down, in one NVML call when the driver has the fields."""
        links = self._nvlink_count(index, h)
        if not links:
            return {}
        ids = [fid for _, fid, _ in _NVLINK_TOTALS] + [
            (pynvml.NVML_FI_DEV_NVLINK_GET_STATE, k) for k in range(links)
        ]
        fv = self._call("nvmlDeviceGetFieldValues", h, ids, card=index)
        values = [_field(v) for v in fv] if fv is not None else [None] * len(ids)
        out = {}
        for (key, _, counter), total in zip(_NVLINK_TOTALS, values, strict=False):
            if total is None and (index, key) not in self._no_link_counters:
                # Sum the per-link counters instead: a call per link, so remember when they cannot be read.
                per_link = [
                    self._call(
                        "nvmlDeviceGetNvLinkErrorCounter", h, k, counter, card=index, unsupported=_NONE
                    )
                    for k in range(links)
                ]
                if _NONE in per_link:
                    self._no_link_counters.add((index, key))
                total = None if None in per_link or _NONE in per_link else sum(per_link)
            out[key] = None if total is None else int(total)
        states = [_LINK_STATES.get(v) for v in values[len(_NVLINK_TOTALS) :]]
        if None in states:  # no field: nvmlDeviceGetNvLinkState says active (ENABLED) or not
            states = [_active(self._call("nvmlDeviceGetNvLinkState", h, k, card=index)) for k in range(links)]
        out["nvlink_links_down"] = None if None in states else self._links_down(index, h, states)
        return out

    def _saw_links(self, index: int, up: list[bool | None], h) -> None:
        """Remember the links seen trained (active or asleep), and the card at each one's far end."""
        seen = self._links_seen_up.setdefault(index, set())
        for k, is_up in enumerate(up):
            if is_up and k not in seen:
                seen.add(k)
                pci = self._call("nvmlDeviceGetNvLinkRemotePciInfo", h, k, card=index)
                if pci is not None:
                    self._link_peer[(index, k)] = norm_bus_id(_decode(pci.busId))

    def _links_down(self, index: int, h, up: list[bool]) -> int | None:
        """Links that were trained since start-up and are inactive now; None if the card never had one up.

        Only those count: a PCIe board without its NVLink bridge reports every link inactive, and that is
        how it is built. A sleeping link (NVML_NVLINK_STATE_SLEEP, low power) is trained. A card in MIG
        mode has its links down, and so do links to a MIG card (DCGM's health watch skips both: "NVML
        reports links to MIG enabled GPUs as down"): those do not count either.
        """
        self._saw_links(index, up, h)
        seen = self._links_seen_up.get(index, set())
        if not seen:
            return None
        if self._read_mig_on(index, h):
            return 0
        card_at = {bus: i for i, bus in self._bus.items() if i != index}
        down = 0
        for k in sorted(seen):
            if k >= len(up) or up[k]:
                continue
            peer = card_at.get(self._link_peer.get((index, k), ""))
            if peer is not None and self._read_mig_on(peer):  # read now: it may have just switched
                continue
            down += 1
        return down

    def _read_mig_on(self, index: int, h=None) -> bool:
        """Whether a card is in MIG mode now, read from the driver (False when it cannot say)."""
        try:
            mode = self._call("nvmlDeviceGetMigMode", h or self._handle(index), card=index)
        except NvmlError:  # lost or unreadable: its links count as down
            return False
        return bool(mode and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE)

    # ------------------------------------------------------------------- processes, compute mode

    def processes(self, index: int) -> list[tuple[int, int | None]]:
        """Compute processes on a card: (pid, used device memory in bytes or None). [] if unsupported."""
        procs = self._call("nvmlDeviceGetComputeRunningProcesses", self._handle(index), card=index)
        return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs or ()]

    def process_utilization(self, index: int, since_us: int = 0) -> list[tuple[int, int, int, int]] | None:
        """Per-process samples newer than ``since_us`` (the driver's CPU timestamp, microseconds):
        [(pid, timestamp_us, sm %, memory-controller %)], each % of the whole card. [] when the driver has
        no new sample (NVML_ERROR_NOT_FOUND: the processes were idle, or nothing ran); None when the card
        cannot say (NotSupported: MIG on, or an old card). Pass the largest timestamp seen to read on."""
        got = self._call(
            "nvmlDeviceGetProcessUtilization",
            self._handle(index),
            int(since_us),
            card=index,
            absent=(pynvml.NVML_ERROR_NOT_FOUND,),
            unsupported=False,
        )
        if got is False:
            return None
        return [(int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil)) for s in got or ()]

    def process_memory(self, index: int) -> dict[int, int | None]:
        """Device memory per compute process {pid: bytes or None}; on a MIG card read through each MIG
        device (per instance, as NVML documents for MIG) so that every process is counted once."""
        mig = self.mig_mode(index)
        if not mig or mig[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return {pid: used for pid, used in self.processes(index)}
        h = self._handle(index)
        out: dict[int, int | None] = {}
        for k in range(self._call("nvmlDeviceGetMaxMigDeviceCount", h, card=index) or 0):
            mh = self._call(
                "nvmlDeviceGetMigDeviceHandleByIndex", h, k, card=index, absent=(pynvml.NVML_ERROR_NOT_FOUND,)
            )
            if mh is None:
                continue
            for p in self._call("nvmlDeviceGetComputeRunningProcesses", mh, card=index) or ():
                out[int(p.pid)] = None if p.usedGpuMemory is None else int(p.usedGpuMemory)
        return out

    def compute_mode(self, index: int) -> str | None:
        """ "DEFAULT", "EXCLUSIVE_PROCESS", "PROHIBITED" (or "EXCLUSIVE_THREAD"); None if unknown."""
        mode = self._call("nvmlDeviceGetComputeMode", self._handle(index), card=index)
        return next((k for k, v in COMPUTE_MODES.items() if v == mode), None)

    def set_compute_mode(self, index: int, mode: str | int) -> None:
        """Set the compute mode by name ("EXCLUSIVE_PROCESS", "DEFAULT") or NVML value. Needs root."""
        value = COMPUTE_MODES[mode.upper()] if isinstance(mode, str) else int(mode)
        self._call("nvmlDeviceSetComputeMode", self._handle(index), value, card=index, strict=True)

    def persistence_mode(self, index: int) -> bool | None:
        """Whether the driver stays loaded with no client (persistence mode); None if unknown."""
        mode = self._call("nvmlDeviceGetPersistenceMode", self._handle(index), card=index)
        return None if mode is None else mode == pynvml.NVML_FEATURE_ENABLED

    # -------------------------------------------------------------------------------------- MIG

    def mig_mode(self, index: int) -> tuple[int, int] | None:
        """(current, pending) MIG mode, 1 = enabled; None for a card without MIG."""
        mode = self._call("nvmlDeviceGetMigMode", self._handle(index), card=index)
        return None if mode is None else (int(mode[0]), int(mode[1]))

    def _profile_info(self, name: str, index: int, *args):
        """One profile enum's info, or None when the card does not offer it: NOT_SUPPORTED, or
        INVALID_ARGUMENT (an enum this driver does not know, or one it refuses for this board: not
        necessarily the last). Either skips this enum and goes on, as NVIDIA's go-nvlib and mig-parted do
        (``continue``); the enumeration is bounded by the binding's profile COUNT, never ended early."""
        try:
            return self._call(name, *args, card=index, strict=True)
        except NvmlNotSupported:
            return None
        except NvmlGpuLost:
            raise
        except NvmlError as e:
            if e.nvml_code not in _SKIP:
                self._record(e, name, index)
            return None

    def mig_profiles(self, index: int) -> list[MigProfile]:
        """The GPU-instance profiles the card offers, with their placements. None while MIG is off: the
        driver answers profile calls only with MIG on (``etc/mig-profiles.toml`` names them by model)."""
        if index in self._profiles:
            return self._profiles[index]
        h = self._handle(index)
        out = []
        for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            info = self._profile_info("nvmlDeviceGetGpuInstanceProfileInfo", index, h, enum)
            if info is None:
                continue
            count = ctypes.c_uint(0)
            self._call(
                "nvmlDeviceGetGpuInstancePossiblePlacements",
                h,
                info.id,
                None,
                ctypes.pointer(count),
                card=index,
            )
            slots = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
            ok = self._call(
                "nvmlDeviceGetGpuInstancePossiblePlacements",
                h,
                info.id,
                slots,
                ctypes.pointer(count),
                card=index,
            )
            placements = tuple((p.start, p.size) for p in slots[: count.value]) if ok is not None else ()
            name = _decode(getattr(info, "name", "")) or f"profile-{info.id}"
            out.append(
                MigProfile(
                    profile=enum,
                    id=int(info.id),
                    name=name.removeprefix("MIG "),
                    slice_count=int(info.sliceCount),
                    memory_slices=placements[0][1] if placements else 0,
                    memory_bytes=int(info.memorySizeMB) * MIB,
                    max_instances=int(info.instanceCount),
                    multiprocessors=int(info.multiprocessorCount),
                    placements=placements,
                )
            )
        if out:  # profiles are fixed per board; an empty answer may be transient
            self._profiles[index] = out
        return out

    def mig_instances(self, index: int) -> list[MigInstance]:
        """The card's GPU instances (by start slot) with compute instances and MIG device UUIDs."""
        mode = self.mig_mode(index)
        if not mode or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return []
        h = self._handle(index)
        devices: dict[int, list[tuple[int, str]]] = {}  # gi id -> [(ci id, MIG uuid)]
        for k in range(self._call("nvmlDeviceGetMaxMigDeviceCount", h, card=index) or 0):
            mh = self._call(
                "nvmlDeviceGetMigDeviceHandleByIndex", h, k, card=index, absent=(pynvml.NVML_ERROR_NOT_FOUND,)
            )  # holes: skip, do not stop
            if mh is None:
                continue
            gi = self._call("nvmlDeviceGetGpuInstanceId", mh, card=index)
            ci = self._call("nvmlDeviceGetComputeInstanceId", mh, card=index)
            uuid = self._call("nvmlDeviceGetUUID", mh, card=index)
            if None not in (gi, ci, uuid):
                devices.setdefault(gi, []).append((ci, uuid))
        out = []
        for prof in self.mig_profiles(index):
            count = ctypes.c_uint(0)
            handles = (pynvml.c_nvmlGpuInstance_t * max(prof.max_instances, 1))()
            if (
                self._call(
                    "nvmlDeviceGetGpuInstances", h, prof.id, handles, ctypes.pointer(count), card=index
                )
                is None
            ):
                continue
            for gih in handles[: count.value]:
                info = self._call("nvmlGpuInstanceGetInfo", gih, card=index)
                if info is not None:
                    cis = sorted(devices.get(info.id, []))
                    out.append(
                        MigInstance(
                            index,
                            int(info.id),
                            int(info.profileId),
                            prof.name,
                            int(info.placement.start),
                            int(info.placement.size),
                            prof.memory_bytes,
                            tuple(c for c, _ in cis),
                            tuple(u for _, u in cis),
                        )
                    )
        return sorted(out, key=lambda m: (m.start, m.gpu_instance_id))

    def mig_processes(self, index: int) -> dict[int, list[int]]:
        """Compute processes per GPU instance on a MIG-enabled card: {GPU instance id: [pid, ...]}, read
        through each MIG device (what NVML documents for MIG). {} when MIG is off. Raises NvmlError when a
        list cannot be read: the caller must not take an unreadable instance for an empty one."""
        mode = self.mig_mode(index)
        if not mode or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return {}
        h = self._handle(index)
        out: dict[int, list[int]] = {}
        for k in range(self._call("nvmlDeviceGetMaxMigDeviceCount", h, card=index) or 0):
            mh = self._call(
                "nvmlDeviceGetMigDeviceHandleByIndex", h, k, card=index, absent=(pynvml.NVML_ERROR_NOT_FOUND,)
            )
            if mh is None:
                continue
            gi = self._call("nvmlDeviceGetGpuInstanceId", mh, card=index, strict=True)
            procs = self._call("nvmlDeviceGetComputeRunningProcesses", mh, card=index, strict=True)
            out.setdefault(int(gi), []).extend(int(p.pid) for p in procs or ())
        return out

    def create_mig_instance(self, index: int, profile_id: int, start: int) -> MigInstance:
        """Create a GPU instance of driver profile ``profile_id`` at slot ``start``, and one compute instance
        over all of it. Raises NvmlInsufficientResources (overlap, no room), NvmlNotSupported (MIG off),
        NvmlNoPermission (not root) or NvmlError."""
        h = self._handle(index)
        prof = next((p for p in self.mig_profiles(index) if p.id == profile_id), None)
        if prof is None:
            mode = self.mig_mode(index)
            if mode is not None and mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
                raise NvmlNotSupported(f"card {index}: MIG is off (no profiles until it is on)")
            raise NvmlNotSupported(f"card {index} has no MIG profile id {profile_id}")
        size = next((s for st, s in prof.placements if st == start), None)
        if size is None:
            where = ", ".join(str(st) for st, _ in prof.placements)
            raise NvmlError(
                f"card {index}: profile {prof.name} cannot start at slot {start} (possible: {where})"
            )
        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
        gi = self._call(
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            h,
            profile_id,
            ctypes.pointer(placement),
            card=index,
            strict=True,
        )
        try:
            ci_profile = self._full_ci_profile(index, gi, prof.slice_count)
            self._call("nvmlGpuInstanceCreateComputeInstance", gi, ci_profile, card=index, strict=True)
        except NvmlError:
            self._call("nvmlGpuInstanceDestroy", gi, card=index)  # do not leave a half-made instance
            raise
        gi_id = self._call("nvmlGpuInstanceGetInfo", gi, card=index, strict=True).id
        return next(m for m in self.mig_instances(index) if m.gpu_instance_id == gi_id)

    def _ci_profile_info(self, index: int, gi, enum: int):
        shared = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        return self._profile_info("nvmlGpuInstanceGetComputeInstanceProfileInfo", index, gi, enum, shared)

    def _full_ci_profile(self, index: int, gi, slices: int) -> int:
        """Driver id of the compute-instance profile that spans the whole GPU instance."""
        for enum in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            info = self._ci_profile_info(index, gi, enum)
            if info is not None and info.sliceCount == slices:
                return int(info.id)
        raise NvmlNotSupported(f"card {index}: no compute-instance profile spans {slices} slices")

    def destroy_mig_instance(self, index: int, gpu_instance_id: int) -> None:
        """Destroy a GPU instance and its compute instances (those first). Raises NvmlInUse while
        processes use it, NvmlNotFound when there is no such instance."""
        h = self._handle(index)
        gi = self._call("nvmlDeviceGetGpuInstanceById", h, gpu_instance_id, card=index, strict=True)
        for enum in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            info = self._ci_profile_info(index, gi, enum)
            if info is None:
                continue
            count = ctypes.c_uint(0)
            cis = (pynvml.c_nvmlComputeInstance_t * max(int(info.instanceCount), 1))()
            self._call(
                "nvmlGpuInstanceGetComputeInstances",
                gi,
                info.id,
                cis,
                ctypes.pointer(count),
                card=index,
                strict=True,
            )
            for ci in cis[: count.value]:
                self._call("nvmlComputeInstanceDestroy", ci, card=index, strict=True)
        self._call("nvmlGpuInstanceDestroy", gi, card=index, strict=True)

    def set_mig_mode(self, index: int, enabled: bool) -> str:
        """Ask the driver for MIG on or off (root; no GPU instances may exist). The driver makes the mode
        pending and then tries to activate it by resetting the card itself. Returns how that went:

        - "done": the mode is current;
        - "in-use": the driver could not reset the card because something holds it (a process, another
          NVML client such as DCGM, or an event registration of this process: see ``card_released``);
          the mode stays pending, and any later reset would apply it (``cancel_pending_mig_mode``);
        - "reset": the driver cannot reset the card here (e.g. a VM): pending until a GPU reset.

        Raises NvmlError when the request itself is refused. Only the MIG isolation backend calls this,
        on an idle card, inside ``card_released`` (``[cards] mig_switch = "idle"``).
        """
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        status = self._call("nvmlDeviceSetMigMode", self._handle(index), mode, card=index, strict=True)
        self._forget(index)  # the driver may have reset the card: handles and attributes change
        if status in (None, pynvml.NVML_SUCCESS):
            return "done"
        if status == pynvml.NVML_ERROR_IN_USE:
            return "in-use"
        if status == pynvml.NVML_ERROR_RESET_REQUIRED:
            return "reset"
        name = _CODE_NAMES.get(status, f"NVML error {status}")
        raise NvmlError(f"nvmlDeviceSetMigMode on card {index}: activation failed ({name})", status)

    def cancel_pending_mig_mode(self, index: int) -> bool:
        """Ask for the current MIG mode again, so that a pending change that did not take effect is
        dropped (else the next GPU reset, anyone's, would apply it). True when one was pending."""
        mode = self.mig_mode(index)
        if mode is None or mode[0] == mode[1]:
            return False
        self._call("nvmlDeviceSetMigMode", self._handle(index), mode[0], card=index, strict=True)
        self._forget(index)
        return True

    def _forget(self, index: int) -> None:
        """Drop what is cached about a card whose driver state changes (a MIG mode change, a reset)."""
        self._handles.pop(index, None)
        self._info.pop(index, None)
        self._profiles.pop(index, None)

    @contextlib.contextmanager
    def card_released(self, index: int):
        """Let go of what this process holds on a card while the block runs, so that the driver can reset
        it: the card leaves every event set (NVML cannot unregister one card, so each set is made again
        without it, between two waits) and its cached handle is dropped. Afterwards the card's events are
        registered again (a new handle, as after a reset)."""
        with self._idle:
            self._released.add(index)
            waiters = list(self._waiters)
        # The waits stay out for the whole block: a wait started between the two rebuilds would hold
        # the second one (and the switch) for a whole wait timeout.
        with contextlib.ExitStack() as kept:
            for w in waiters:
                kept.enter_context(w.kept())
            try:
                self._rebuild(waiters, index, "left")
                self._forget(index)
                yield
            finally:
                with self._idle:
                    self._released.discard(index)
                self._forget(index)
                self._rebuild(waiters, index, "registered again")

    @staticmethod
    def _rebuild(waiters: list[EventWaiter], index: int, what: str) -> None:
        for w in waiters:
            try:
                w.rebuild()
            except NvmlError as e:  # the set is gone (it is made again by its thread): nothing holds the card
                log.warning("card %d: event set not %s: %s", index, what, e)

    # ----------------------------------------------------------------------------------- events

    def event_waiter(self, indices: list[int] | None = None) -> EventWaiter:
        """Register XID and ECC events of the given cards (default: all) on a new event set."""
        return EventWaiter(self, list(range(self.card_count())) if indices is None else list(indices))


class EventWaiter:
    """Blocks for hardware events of some cards. ``wait`` on one thread; ``close`` and ``rebuild`` from
    any: they never free the event set under a waiting thread (NVML does not say that is safe), they
    take their turn between two waits (so they wait at most one wait's timeout).

    A card that is lost makes NVML's wait answer GPU_IS_LOST for the whole set: ``wait`` then finds the
    lost card(s), makes the set again without them, and returns a "lost" event for each, so the other
    cards' events keep coming. Cards let go of by ``Nvml.card_released`` are left out while released.
    """

    def __init__(self, nvml: Nvml, indices: list[int]):
        self._nvml = nvml
        self._indices = list(indices)
        self._cond = threading.Condition()
        self._waiting = False  # a thread is inside wait()
        self._turns = 0  # threads waiting for their turn to change the set
        self._closed = False
        self._set = None
        self._lost: set[int] = set()
        self.registered: dict[int, list[str]] = {}  # card -> event kinds it will report
        self.unregistered: dict[int, NvmlError] = {}  # card -> why not (NvmlNotSupported: cannot)
        self._by_handle: dict[int | None, int] = {}
        nvml._ensure_open()
        self._build()
        with nvml._idle:
            nvml._waiters.append(self)

    def _build(self) -> None:
        """(Re)make the event set and register the cards. Only with the set to ourselves."""
        nvml = self._nvml
        self._free()
        self.registered, self.unregistered, self._by_handle = {}, {}, {}
        self._set = nvml._call("nvmlEventSetCreate", strict=True)
        with nvml._idle:
            released = set(nvml._released)
        for index in self._indices:
            if index in released:
                continue
            try:
                if index in self._lost:
                    raise NvmlGpuLost(f"card {index}: lost (fallen off the bus)", _LOST)
                h = nvml._handle(index)
                supported = nvml._call("nvmlDeviceGetSupportedEventTypes", h, card=index, strict=True)
                mask = _EVENT_MASK & supported
                if not mask:
                    raise NvmlNotSupported("no XID or ECC events on this card")
                nvml._call("nvmlDeviceRegisterEvents", h, mask, self._set, card=index, strict=True)
            except NvmlError as e:
                self.unregistered[index] = e
                continue
            self._by_handle[_handle_key(h)] = index
            self.registered[index] = [k for t, k in _EVENT_KINDS.items() if mask & t]

    def _free(self) -> None:
        if self._set is not None:
            es, self._set = self._set, None
            with contextlib.suppress(NvmlError):
                self._nvml._call("nvmlEventSetFree", es)

    @contextlib.contextmanager
    def _turn(self):
        """The set to ourselves: after the running wait returns, before the next one starts."""
        with self._cond:
            self._turns += 1
            try:
                self._cond.wait_for(lambda: not self._waiting)
            finally:
                self._turns -= 1
            try:
                yield
            finally:
                self._cond.notify_all()

    @contextlib.contextmanager
    def kept(self):
        """No wait starts while the block runs (the running one is let finish first)."""
        with self._cond:
            self._turns += 1
            try:
                self._cond.wait_for(lambda: not self._waiting)
            except BaseException:
                self._turns -= 1
                raise
        try:
            yield
        finally:
            with self._cond:
                self._turns -= 1
                self._cond.notify_all()

    def readmit(self, index: int) -> bool:
        """A card that was lost answers again (after a reset): register its events again, with a fresh
        handle. True when they are registered."""
        with self._turn():
            if self._closed:
                return False
            self._lost.discard(index)
            if index not in self.registered:
                self._nvml._forget(index)
                self._build()
            return index in self.registered

    def rebuild(self) -> None:
        """Make the set again (cards released or taken back since)."""
        with self._turn():
            if not self._closed:
                self._build()

    def wait(self, timeout_ms: int) -> list[HwEvent]:
        """Events that arrive within ``timeout_ms`` (all that are queued once one arrives); [] on timeout.
        Raises NvmlError when NVML fails for another reason (the caller should back off)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._turns)  # a rebuild or close waits: let it go first
            if self._closed:
                return []
            if self._set is None:
                raise NvmlError("no event set (making it again failed); retry")
            self._waiting = True
        out: list[HwEvent] = []
        lost = False
        try:
            timeout = int(timeout_ms)
            while len(out) < 64:
                try:
                    ev = self._nvml._call(
                        "nvmlEventSetWait", self._set, timeout, strict=True, absent=(_TIMEOUT,)
                    )
                except NvmlGpuLost:
                    lost = True
                    break
                if ev is None or self._closed:
                    break
                out.append(self._event(ev))
                timeout = 0  # drain what is already queued, without waiting again
        finally:
            with self._cond:
                self._waiting = False
                try:
                    if self._closed:
                        self._free()
                    elif lost:
                        out += self._drop_lost()
                finally:
                    self._cond.notify_all()
        return out

    def _drop_lost(self) -> list[HwEvent]:
        """After GPU_IS_LOST: find the lost card(s), make the set again without them, one event each."""
        gone = []
        for index in self.registered:
            try:
                h = self._nvml._handle(index)
                self._nvml._call("nvmlDeviceGetMemoryInfo", h, card=index, strict=True)
            except NvmlGpuLost:
                gone.append(index)
            except NvmlError:
                pass
        if not gone:
            raise NvmlGpuLost("nvmlEventSetWait: gpu is lost, but every registered card answers")
        log.warning("card(s) %s lost: no more events from them; the other cards' still come", gone)
        self._lost.update(gone)
        self._build()
        now = time.time()
        return [HwEvent(index, "lost", timestamp=now) for index in gone]

    def _event(self, ev) -> HwEvent:
        index = self._by_handle.get(_handle_key(ev.device), -1)
        kind = _EVENT_KINDS.get(ev.eventType, f"event-0x{ev.eventType:x}")
        gi, ci = int(ev.gpuInstanceId), int(ev.computeInstanceId)
        return HwEvent(
            index,
            kind,
            int(ev.eventData) if kind == "xid" else None,
            None if gi == NO_ID else gi,
            None if ci == NO_ID else ci,
            time.time(),
        )

    def close(self) -> None:
        """Stop waiting. From another thread while a wait runs: that wait frees the set when it returns
        (within its timeout) and reports nothing more."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if not self._waiting:
                self._free()
        with self._nvml._idle, contextlib.suppress(ValueError):
            self._nvml._waiters.remove(self)
