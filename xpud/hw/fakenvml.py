"""A faithful fake of the pynvml surface that ``xpud.hw.nvml`` uses, driven by a machine description.

``FakeNvml(machine)`` has the same function names as the ``pynvml`` module (as methods), takes and
returns the same things (opaque ctypes handles, pynvml's own ctypes structs, friendly objects, plain
ints and strs) and raises pynvml's own exception classes, so the adapter runs unchanged over it.
Nothing here calls the NVML library: pynvml is imported only for its constants, structs and errors.

Values that move (utilisation, temperature, power, memory in use) are pure functions of the seed,
the card and ``clock()``, so a seed and a clock give the same readings in any call order.

Beyond the pynvml surface (all thread-safe; none needs nvmlInit):
- processes: ``add_process``, ``remove_process``; other NVML clients (a monitoring agent such as DCGM)
  that hold a card: ``add_client``, ``remove_client``;
- link power: ``nvlink_sleep`` (links in their low-power state: not a fault);
- PCIe: ``add_pcie_replays`` (the replay counter rises);
- faults: ``inject_xid``, ``inject_ecc_sbe``, ``inject_ecc_dbe``, ``set_overheat``, ``nvlink_down``,
  ``lose``, ``corrupt_inforom``, ``set_fabric`` (NVSwitch fabric not trained, or failed), ``clear``
  (faults gone, volatile counters reset), ``reset`` (a GPU reset, ``nvidia-smi -r``: also applies a
  pending MIG mode; refused while the card is held);
- tests: ``fail(name, code, index)`` makes one call fail, ``hide(name)`` makes it missing as in an old
  binding, ``invalid_profiles`` (profile enums answered INVALID_ARGUMENT), ``calls`` counts calls by
  name, ``mig_layout(index)`` shows the MIG instances.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import time
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pynvml as N

from xpud.hw.machines import CardSpec, Machine, MigProfileSpec, load_machine

# What the fake models, and where it is deliberately simpler than the driver (nvml.h; REFERENCE.md):
# - MIG mode (nvmlDeviceSetMigMode): the pending mode is set first; the driver then tries to activate it
#   by resetting the card itself, which fails with activation status IN_USE while anything holds the card
#   (a compute process, another NVML client such as DCGM, or an event set with the card registered, ours
#   included); the pending mode stays until a later reset or until the current mode is asked for again.
#   ``passthrough=True`` models a VM where the driver cannot reset: RESET_REQUIRED, and only ``reset``
#   (which a VM reboot would be) applies it. Simpler: a reset keeps device handles valid (the driver may
#   renumber minors; the adapter re-reads handles after a switch anyway), and nvidia-persistenced is not
#   modelled (it does not block a switch on real hosts either).
# - Profiles: GPU-instance profile calls answer NOT_SUPPORTED while MIG is off, as the driver does; a
#   driver older than R570 knows fewer profile enums (the binding's later ones answer INVALID_ARGUMENT).
#   Simpler: the enum count is a two-step model of driver history, not a table per release.
# - Events: a lost card makes nvmlEventSetWait answer GPU_IS_LOST once the events queued before the loss
#   are handed out (what the driver does with those is not documented; the adapter copes either way).
#   Freeing a set while another thread waits on it, or shutting NVML down then, is undefined in NVML: the
#   fake raises RuntimeError so that a test finds the misuse. Simpler: no per-process event limits, no
#   nvmlEventSetWait_v3 contexts.
# - NVSwitch fabric (nvmlDeviceGetGpuFabricInfoV, R550 and later; older drivers lack the symbol): Hopper
#   and later cards wired to NVSwitch chips answer the Fabric Manager's training state, COMPLETED with
#   status SUCCESS once trained (``set_fabric`` sets another); Hopper cards without NVSwitch answer SUCCESS
#   with state NOT_SUPPORTED; older cards NOT_SUPPORTED. The struct's version must be v2 or v3
#   (ARGUMENT_VERSION_MISMATCH otherwise). Simpler: a reset does not send the card through training again.
# - Recovery action (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, R550 and later; older drivers answer the
#   field NOT_SUPPORTED): a fail-class XID (``_RESET_XIDS``) or a pending row remap asks for a GPU reset
#   (NVML_GPU_RECOVERY_ACTION_GPU_RESET) until ``reset``; nothing clears it by time.
# - Profile enumeration: ``invalid_profiles`` (GPU-instance profile enums) answer INVALID_ARGUMENT in the
#   middle of the enumeration, as some drivers do for a profile the board does not offer (go-nvlib and
#   mig-parted skip them).
# - Values that move are smooth noise, not physics; NVLink, clocks and power are out of this list's scope.

MIB = 1 << 20
NO_ID = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of an event or process that concerns the whole card
_RESERVED_MIB = 512  # framebuffer the driver keeps for itself on an idle card
_MIG_DEVICE_MIB = 12  # ... and on an idle MIG device
_ARCH = {
    name: getattr(N, f"NVML_DEVICE_ARCH_{name.upper()}")
    for name in ("kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell")
}
_NVLINK_VERSION = {"1.0": 1, "2.0": 2, "2.2": 3, "3.0": 4, "3.1": 5, "4.0": 6, "5.0": 7, "6.0": 8}
_CI_PROFILE_BY_SLICES = {
    1: 0,
    2: 1,
    3: 2,
    4: 3,
    7: 4,
    8: 5,
    6: 6,
}  # slices -> NVML_COMPUTE_INSTANCE_PROFILE_*
_SUPPORTED_EVENTS = N.nvmlEventTypeXidCriticalError | N.nvmlEventTypePState | N.nvmlEventTypeClock
_ECC_EVENTS = N.nvmlEventTypeSingleBitEccError | N.nvmlEventTypeDoubleBitEccError
# Profile enums a driver knows: before R570 it knows the GPU-instance enums up to 1_SLICE_REV2 and the
# compute-instance enums up to 1_SLICE_REV1; asked about a later enum it answers INVALID_ARGUMENT.
_OLD_DRIVER_GI_PROFILES = N.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 + 1
_OLD_DRIVER_CI_PROFILES = N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1 + 1
# XIDs after which the driver asks for a GPU reset (NVIDIA's XID catalogue: uncontained and unrecovered
# ECC, GSP errors, a remap that could not be recorded, NVLink errors, double-bit ECC).
_RESET_XIDS = frozenset({48, 64, 74, 95, 119, 120, 140})
_FABRIC_ARCH = ("hopper", "blackwell")  # cards whose fabric state NVML reports
_LINK_COUNTERS = 4  # DL_REPLAY, DL_RECOVERY, DL_CRC_FLIT, DL_CRC_DATA
_FIELD_TOTALS = {  # field id -> per-link counter it sums
    N.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: N.NVML_NVLINK_ERROR_DL_REPLAY,
    N.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: N.NVML_NVLINK_ERROR_DL_RECOVERY,
    N.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: N.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    N.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: N.NVML_NVLINK_ERROR_DL_CRC_DATA,
}


def _err(code: int) -> N.NVMLError:
    return N.NVMLError(code)  # pynvml maps the code to its subclass, e.g. NVMLError_InUse


# ------------------------------------------------------------------------------------------ card state


@dataclass
class _Proc:
    pid: int
    used_bytes: int | None
    gi: int = NO_ID
    ci: int = NO_ID
    sm_pct: int = 0  # share of the card's SMs it kept busy over the last sample period (set_process_load)
    mem_pct: int = 0  # share of the memory controller's time (read/write), likewise
    since: float = 0.0  # clock when its load was last set: no sample is older than this


# The driver samples per-process utilisation on its own period and keeps the samples in a buffer;
# nvmlDeviceGetProcessUtilization returns those newer than the caller's lastSeenTimeStamp (microseconds).
PROCESS_SAMPLE_PERIOD_S = 1 / 6


@dataclass
class _Ci:
    gi: _Gi
    id: int
    profile: int  # NVML_COMPUTE_INSTANCE_PROFILE_* (the driver's CI profile ids are the enum values)
    slices: int
    start: int
    mig_index: int
    uuid: str
    handle: object = None  # c_nvmlComputeInstance_t
    device: object = None  # c_nvmlDevice_t of the MIG device

    @property
    def card(self) -> _Card:
        return self.gi.card


@dataclass
class _Gi:
    card: _Card
    id: int
    spec: MigProfileSpec
    start: int
    cis: dict[int, _Ci] = field(default_factory=dict)
    handle: object = None  # c_nvmlGpuInstance_t


class _Card:
    """Everything the fake knows about one card, healthy values first."""

    def __init__(self, spec: CardSpec):
        self.spec, self.model, self.index = spec, spec.model, spec.index
        self.lost = self.overheat = self.inforom_corrupt = False
        # NVLink: the board's links (NVML counts them all); the wired ones come first and come up.
        self.links_up = [k < spec.nvlink_count for k in range(spec.nvlink_links)]
        self.links_asleep: set[int] = set()  # in the low-power (sleep) state: still trained
        self.link_errors = [[0] * _LINK_COUNTERS for _ in range(spec.nvlink_links)]
        self.ecc = {"sbe_vol": 0, "dbe_vol": 0, "sbe_agg": 0, "dbe_agg": 0}
        self.retired: dict[int, list[int]] = {0: [], 1: []}  # NVML_PAGE_RETIREMENT_CAUSE_* -> addresses
        self.retired_pending = False
        self.rows = [0, 0, 0, 0]  # remapped rows: corrected, uncorrected, pending, failure
        self.pcie_replays = 0
        self.compute_mode = N.NVML_COMPUTEMODE_DEFAULT
        self.persistence = N.NVML_FEATURE_ENABLED  # as on hosts that run nvidia-persistenced
        self.mig = self.mig_pending = int(spec.mig_enabled)
        self.minor = spec.minor  # /dev/nvidia<minor>
        self.minor_after_reset: int | None = None  # what a reset renumbers it to (``renumber_on_reset``)
        self.gis: dict[int, _Gi] = {}
        self.mig_devices: dict[int, _Ci] = {}
        self.procs: dict[int, _Proc] = {}
        self.clients: set[str] = set()  # other NVML clients holding the card (e.g. "dcgm")
        self.handle: object = None
        # NVSwitch fabric (state, status): trained where the card is wired to NVSwitch chips
        self.fabric = (N.NVML_GPU_FABRIC_STATE_COMPLETED, N.NVML_SUCCESS)
        self.recovery_action = N.NVML_GPU_RECOVERY_ACTION_NONE

    def clear_faults(self) -> None:
        """What a GPU reset puts right: faults gone, volatile counters back to zero."""
        self.lost = self.overheat = False
        self.links_up = [k < self.spec.nvlink_count for k in range(self.spec.nvlink_links)]
        self.link_errors = [[0] * _LINK_COUNTERS for _ in range(self.spec.nvlink_links)]
        self.ecc["sbe_vol"] = self.ecc["dbe_vol"] = 0
        self.pcie_replays = 0
        self.retired_pending = False
        self.rows[2] = 0  # the pending remap is applied by the reset
        self.recovery_action = N.NVML_GPU_RECOVERY_ACTION_NONE


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # card index -> event mask
    queue: deque = field(default_factory=deque)
    freed: bool = False
    waiting: int = 0  # threads inside nvmlEventSetWait on this set


# ---------------------------------------------------------------------------------- deterministic noise

_M64 = (1 << 64) - 1


def _hash01(*parts: int) -> float:
    """A number in [0, 1) that depends only on ``parts`` (splitmix64 finaliser)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = ((x ^ (p & _M64)) * 0xBF58476D1CE4E5B9) & _M64
        x ^= x >> 31
        x = (x * 0x94D049BB133111EB) & _M64
        x ^= x >> 29
    return (x >> 11) / float(1 << 53)


def _smooth(seed: int, card: int, channel: int, u: float) -> float:
    """Value noise: random at whole ``u``, smoothly interpolated between, in [0, 1)."""
    k = math.floor(u)
    f = u - k
    f = f * f * (3 - 2 * f)
    a, b = _hash01(seed, card, channel, k), _hash01(seed, card, channel, k + 1)
    return a + (b - a) * f


# ---------------------------------------------------------------------------------------- the fake


def _api(fn: Callable, name: str | None = None) -> Callable:
    """Mark a method as part of the pynvml surface: lock, count, check init and failure switches."""
    name = name or fn.__name__

    @functools.wraps(fn)
    def call(self: FakeNvml, *args, **kwargs):
        with self._lock:
            self.calls[name] += 1
            if not self._inits and name not in ("nvmlInit", "nvmlInitWithFlags"):
                raise _err(N.NVML_ERROR_UNINITIALIZED)
            for index, code in self._failures.get(name, ()):
                if index is None or (args and self._card_of(args[0]) == index):  # first arg: handle or index
                    raise _err(code)
            out = fn(self, *args, **kwargs)
            if self.on_change is not None and name.startswith(_CHANGES):
                self.on_change()  # xpud.hw.simstate keeps MIG and compute modes across daemon restarts
            return out

    call.__name__ = name
    return call


_CHANGES = (
    "nvmlDeviceSet",
    "nvmlDeviceCreate",
    "nvmlGpuInstanceCreate",
    "nvmlGpuInstanceDestroy",
    "nvmlComputeInstanceDestroy",
)  # calls that change state the driver keeps


def _alias(method: Callable, name: str) -> Callable:
    """Another pynvml name for the same call, counted and failed under its own name."""
    return _api(method.__wrapped__, name)


class FakeNvml:
    """A simulated NVML over one machine. ``clock`` gives seconds (monotonic is fine)."""

    def __init__(
        self,
        machine: Machine | str,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        root: bool = True,
        passthrough: bool = False,
    ):
        self.machine = machine if isinstance(machine, Machine) else load_machine(machine)
        self.seed, self._clock, self.root = seed, clock, root
        self.passthrough = passthrough  # a VM: the driver cannot reset a card to apply a MIG mode
        major = self.machine.driver_version.split(".")[0]
        old = major.isdigit() and int(major) < 570
        self.driver_major = int(major) if major.isdigit() else 0
        self.invalid_profiles: set[int] = set()  # GPU-instance profile enums answered INVALID_ARGUMENT
        self.gi_profile_count = _OLD_DRIVER_GI_PROFILES if old else N.NVML_GPU_INSTANCE_PROFILE_COUNT
        self.ci_profile_count = _OLD_DRIVER_CI_PROFILES if old else N.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._inits = 0
        self._objects: dict[int, tuple[str, object, object]] = {}  # address -> (kind, object, target)
        self._sets: list[_EventSet] = []
        self._failures: dict[str, list[tuple[int | None, int]]] = {}
        self._serial = 0  # makes MIG device UUIDs differ each time an instance is created
        self.calls: Counter[str] = Counter()
        self.on_change: Callable[[], None] | None = None  # called after each change of _CHANGES and reset
        self.sim_state = None  # the xpud.hw.simstate.SimState that saves this machine's state, if any
        self._cards = [_Card(spec) for spec in self.machine.cards]
        for card in self._cards:
            card.handle = self._new_handle(N.c_nvmlDevice_t, "device", card)

    # ------------------------------------------------------------------------------- handles

    def _new_handle(self, ptr_type, kind: str, obj: object):
        target = ptr_type._type_()  # an opaque struct; its address is the handle's value
        self._objects[ctypes.addressof(target)] = (kind, obj, target)
        return ctypes.pointer(target)

    def _drop_handle(self, handle) -> None:
        self._objects.pop(ctypes.cast(handle, ctypes.c_void_p).value, None)

    def _lookup(self, handle) -> tuple[str, object] | None:
        try:
            entry = self._objects.get(ctypes.cast(handle, ctypes.c_void_p).value)
        except (ctypes.ArgumentError, TypeError):
            return None
        return entry[:2] if entry else None

    def _card_of(self, handle) -> int | None:
        if isinstance(handle, int):
            return handle  # nvmlDeviceGetHandleByIndex(index)
        found = self._lookup(handle)
        if found is None:
            return None
        obj = found[1]
        return obj.index if isinstance(obj, _Card) else getattr(getattr(obj, "card", None), "index", None)

    def _resolve(self, handle, *kinds: str):
        found = self._lookup(handle)
        if found is None or found[0] not in kinds:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        _, obj = found
        card = obj if isinstance(obj, _Card) else obj.card
        if card.lost:
            raise _err(N.NVML_ERROR_GPU_IS_LOST)
        return obj

    def _dev(self, handle) -> _Card:
        return self._resolve(handle, "device")

    def _dev_or_mig(self, handle) -> _Card | _Ci:
        return self._resolve(handle, "device", "mig")

    def _need_root(self) -> None:
        if not self.root:
            raise _err(N.NVML_ERROR_NO_PERMISSION)

    # ---------------------------------------------------------------------- system and init

    @_api
    def nvmlInit(self) -> None:
        self._inits += 1

    @_api
    def nvmlInitWithFlags(self, flags: int) -> None:
        self._inits += 1

    @_api
    def nvmlShutdown(self) -> None:
        if self._inits == 1 and any(es.waiting for es in self._sets):
            raise RuntimeError("nvmlShutdown while a thread is inside nvmlEventSetWait: undefined in NVML")
        self._inits -= 1

    @_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.machine.driver_version

    @_api
    def nvmlSystemGetNVMLVersion(self) -> str:
        return f"12.{self.machine.driver_version}"

    @_api
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        major, _, minor = self.machine.cuda_version.partition(".")
        return int(major) * 1000 + int(minor or 0) * 10

    nvmlSystemGetCudaDriverVersion_v2 = _alias(
        nvmlSystemGetCudaDriverVersion, "nvmlSystemGetCudaDriverVersion_v2"
    )

    @_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self._cards)

    @_api
    def nvmlDeviceGetHandleByIndex(self, index: int):
        if not 0 <= index < len(self._cards):
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        card = self._cards[index]
        if card.lost:
            raise _err(N.NVML_ERROR_GPU_IS_LOST)
        return card.handle

    @_api
    def nvmlDeviceGetIndex(self, handle) -> int:
        return self._dev(handle).index

    # -------------------------------------------------------------------------------- inventory

    @_api
    def nvmlDeviceGetUUID(self, handle) -> str:
        obj = self._dev_or_mig(handle)
        return obj.uuid if isinstance(obj, _Ci) else obj.spec.uuid

    @_api
    def nvmlDeviceGetName(self, handle) -> str:
        obj = self._dev_or_mig(handle)
        if isinstance(obj, _Ci):
            return f"{obj.card.model.name} MIG {obj.gi.spec.name}"
        return obj.model.name

    @_api
    def nvmlDeviceGetSerial(self, handle) -> str:
        return self._dev(handle).spec.serial

    @_api
    def nvmlDeviceGetMinorNumber(self, handle) -> int:
        # A card's own node only: a MIG device handle has no /dev/nvidia<minor> of its own (INVALID_ARGUMENT).
        return self._dev(handle).minor

    @_api
    def nvmlDeviceGetArchitecture(self, handle) -> int:
        return _ARCH.get(self._dev(handle).model.architecture, N.NVML_DEVICE_ARCH_UNKNOWN)

    @_api
    def nvmlDeviceGetPciInfo(self, handle):
        return self._pci_info(self._dev(handle).spec.bus_id)

    nvmlDeviceGetPciInfo_v3 = _alias(nvmlDeviceGetPciInfo, "nvmlDeviceGetPciInfo_v3")

    @staticmethod
    def _pci_info(bus_id: str):
        domain, bus, rest = bus_id.split(":")
        info = N.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        info.busIdLegacy = f"{int(domain, 16) & 0xFFFF:04X}:{bus}:{rest}".encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        info.pciDeviceId = 0x10DE  # NVIDIA's vendor id in the low half
        return info

    @_api
    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        obj = self._dev_or_mig(handle)
        mem = N.c_nvmlMemory_t()
        if isinstance(obj, _Ci):
            procs = [p for p in obj.card.procs.values() if (p.gi, p.ci) == (obj.gi.id, obj.id)]
            mem.total = obj.gi.spec.memory_mib * MIB
            mem.used = min(mem.total, _MIG_DEVICE_MIB * MIB + sum(p.used_bytes or 0 for p in procs))
        else:
            mem.total = obj.model.memory_mib * MIB
            mem.used = min(
                mem.total, _RESERVED_MIB * MIB + sum(p.used_bytes or 0 for p in obj.procs.values())
            )
        mem.free = mem.total - mem.used
        return mem

    @_api
    def nvmlDeviceGetCpuAffinity(self, handle, cpuSetSize: int):
        card = self._dev(handle)
        m = self.machine
        cpus = m.numa_cpus[card.spec.numa] if card.spec.numa is not None else range(m.cpu_count)
        words = (ctypes.c_ulonglong * cpuSetSize)()
        for cpu in cpus:
            if cpu // 64 < cpuSetSize:
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    @_api
    def nvmlDeviceGetMemoryAffinity(self, handle, nodeSetSize: int, scope: int):
        card = self._dev(handle)
        if card.spec.numa is None:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        words = (ctypes.c_ulonglong * nodeSetSize)()
        if card.spec.numa // 64 < nodeSetSize:
            words[card.spec.numa // 64] = 1 << (card.spec.numa % 64)
        return words

    @_api
    def nvmlDeviceGetNumaNodeId(self, handle) -> int:
        self._dev(handle)
        raise _err(N.NVML_ERROR_NOT_SUPPORTED)  # only meaningful where GPUs are NUMA nodes (Grace)

    @_api
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle) -> int:
        return self._dev(handle).model.pcie_gen

    @_api
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle) -> int:
        return self._dev(handle).model.pcie_width

    @_api
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle) -> int:
        card = self._dev(handle)
        return card.model.pcie_gen if card.procs else 1  # idle links train down to save power

    @_api
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle) -> int:
        return self._dev(handle).model.pcie_width

    @_api
    def nvmlDeviceGetTopologyCommonAncestor(self, device1, device2) -> int:
        a, b = self._dev(device1), self._dev(device2)
        return N.NVML_TOPOLOGY_INTERNAL if a is b else self.machine.level(a.index, b.index)

    # ----------------------------------------------------------------------------------- NVLink

    # A board has ``spec.nvlink_links`` links (a PCIe H100/A100 has them without its bridge: all
    # inactive); the ``spec.nvlink_count`` wired ones (peers first, then NVSwitch) come up. A card in MIG
    # mode has its links down, and so do its peers' links to it (DCGM works around exactly this:
    # DcgmHealthWatch.cpp, "NVML reports links to MIG enabled GPUs as down"). A link in its low-power
    # state reads SLEEP in NVML_FI_DEV_NVLINK_GET_STATE; the fake assumes nvmlDeviceGetNvLinkState
    # (active or not) still calls it active, as it is trained.

    def _link(self, handle, link: int) -> _Card:
        card = self._dev(handle)
        if not card.spec.nvlink_links:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < card.spec.nvlink_links:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        return card

    def _link_state(self, card: _Card, link: int) -> int:
        """NVML_NVLINK_STATE_INACTIVE, _ACTIVE or _SLEEP. A link to a peer that fell off the bus is down
        too (NVIDIA's XID catalogue, XID 74: the far end failing takes the link down)."""
        peers = card.spec.nvlink_peers
        peer = self._cards[peers[link]] if link < len(peers) else None
        if not card.links_up[link] or card.mig or (peer is not None and (peer.mig or peer.lost)):
            return N.NVML_NVLINK_STATE_INACTIVE
        return N.NVML_NVLINK_STATE_SLEEP if link in card.links_asleep else N.NVML_NVLINK_STATE_ACTIVE

    def _wired(self, card: _Card, link: int) -> None:
        if link >= card.spec.nvlink_count:  # nothing at the far end (no bridge)
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)

    @_api
    def nvmlDeviceGetNvLinkState(self, device, link: int) -> int:
        card = self._link(device, link)
        inactive = self._link_state(card, link) == N.NVML_NVLINK_STATE_INACTIVE
        return N.NVML_FEATURE_DISABLED if inactive else N.NVML_FEATURE_ENABLED

    @_api
    def nvmlDeviceGetNvLinkVersion(self, device, link: int) -> int:
        return _NVLINK_VERSION.get(self._link(device, link).model.nvlink_version or "", 0)

    @_api
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link: int) -> int:
        card = self._link(handle, link)
        self._wired(card, link)
        peer = link < len(card.spec.nvlink_peers)
        return N.NVML_NVLINK_DEVICE_TYPE_GPU if peer else N.NVML_NVLINK_DEVICE_TYPE_SWITCH

    @_api
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device, link: int):
        card = self._link(device, link)
        self._wired(card, link)
        peers = card.spec.nvlink_peers
        if link < len(peers):  # direct links come first, then the links to NVSwitch chips
            return self._pci_info(self.machine.cards[peers[link]].bus_id)
        switch = (link - len(peers)) % max(self.machine.nvswitch_count, 1)
        return self._pci_info(f"00000001:{switch:02X}:00.0")

    @_api
    def nvmlDeviceGetNvLinkErrorCounter(self, device, link: int, counter: int) -> int:
        card = self._link(device, link)
        if counter == N.NVML_NVLINK_ERROR_DL_ECC_DATA:
            return 0
        if not 0 <= counter < _LINK_COUNTERS:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        return card.link_errors[link][counter]

    @_api
    def nvmlDeviceGetFieldValues(self, handle, fieldIds: list):
        card = self._dev(handle)
        values = (N.c_nvmlFieldValue_t * len(fieldIds))()
        n = card.spec.nvlink_links
        for v, fid in zip(values, fieldIds, strict=True):
            v.fieldId, v.scopeId = fid if isinstance(fid, tuple) else (fid, 0)
            v.timestamp = int(self._clock() * 1e6)
            v.nvmlReturn = N.NVML_SUCCESS
            if v.fieldId == N.NVML_FI_DEV_NVLINK_LINK_COUNT and n:
                v.valueType, v.value.uiVal = N.NVML_VALUE_TYPE_UNSIGNED_INT, n
            elif v.fieldId in _FIELD_TOTALS and n:
                total = sum(errs[_FIELD_TOTALS[v.fieldId]] for errs in card.link_errors)
                v.valueType, v.value.ullVal = N.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, total
            elif v.fieldId == N.NVML_FI_DEV_NVLINK_GET_STATE and 0 <= v.scopeId < n:
                state = self._link_state(card, v.scopeId)
                v.valueType, v.value.uiVal = N.NVML_VALUE_TYPE_UNSIGNED_INT, state
            elif v.fieldId == N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and self.driver_major >= 550:
                v.valueType, v.value.uiVal = N.NVML_VALUE_TYPE_UNSIGNED_INT, card.recovery_action
            else:
                v.nvmlReturn = N.NVML_ERROR_NOT_SUPPORTED
        return values

    # ---------------------------------------------------------------------------- NVSwitch fabric

    @_api
    def nvmlDeviceGetGpuFabricInfoV(self, device, gpuFabricInfo) -> int:
        """Fills a ``c_nvmlGpuFabricInfoV_t`` (v2) or ``c_nvmlGpuFabricInfo_v3_t`` passed by reference."""
        card = self._dev(device)
        if self.driver_major < 550:
            raise _err(N.NVML_ERROR_FUNCTION_NOT_FOUND)  # the symbol is not in this driver's library
        if card.model.architecture not in _FABRIC_ARCH:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        info = self._in(gpuFabricInfo)
        version = getattr(info, "version", None)
        if version not in (N.nvmlGpuFabricInfo_v2, N.nvmlGpuFabricInfo_v3):
            raise _err(N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if card.spec.nvlink_switch_links:
            state, status = card.fabric
        else:
            state, status = N.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, N.NVML_SUCCESS
        info.state, info.status, info.cliqueId, info.healthMask = state, status, 0, 0
        if version == N.nvmlGpuFabricInfo_v3:
            info.healthSummary = (
                N.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
                if state == N.NVML_GPU_FABRIC_STATE_COMPLETED and status == N.NVML_SUCCESS
                else N.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED
            )
        return N.NVML_SUCCESS

    # ----------------------------------------------------------------------------- live values

    def _busy(self, card: _Card) -> bool:
        return bool(card.procs)

    def _util(self, card: _Card, t: float) -> int:
        """GPU utilisation %: 40-100 with compute processes on the card, 0-1 without."""
        n = _smooth(self.seed, card.index, 0, t / 8.0)
        return round(40 + 60 * n) if self._busy(card) else round(1.5 * n)

    def _temperature(self, card: _Card, t: float) -> int:
        m = card.model
        if card.overheat:
            return (m.temp_slowdown_c or 90) + 3 + round(2 * _smooth(self.seed, card.index, 1, t / 4.0))
        lagged = sum(self._util(card, t - 5 * k) for k in range(6)) / 6  # heat follows load over ~30 s
        wobble = 2 * _smooth(self.seed, card.index, 1, t / 4.0) - 1
        return round(m.temp_idle_c + (m.temp_load_c - m.temp_idle_c) * lagged / 100 + wobble)

    def _power_mw(self, card: _Card, t: float) -> int:
        m = card.model
        wobble = (2 * _smooth(self.seed, card.index, 2, t / 2.0) - 1) * 0.02 * m.power_limit_w
        watts = (
            m.power_idle_w + (0.92 * m.power_limit_w - m.power_idle_w) * self._util(card, t) / 100 + wobble
        )
        return int(min(max(watts, 0.5 * m.power_idle_w), m.power_limit_w) * 1000)

    def _no_util_under_mig(self, handle) -> _Card:
        obj = self._dev_or_mig(handle)
        if isinstance(obj, _Ci) or obj.mig:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)  # as on real cards: no utilisation with MIG on
        return obj

    @_api
    def nvmlDeviceGetUtilizationRates(self, handle):
        card = self._no_util_under_mig(handle)
        util = self._util(card, self._clock())
        return N.c_nvmlUtilization_t(util, round(util * 0.6))

    @_api
    def nvmlDeviceGetTemperature(self, handle, sensor: int) -> int:
        card = self._dev(handle)
        if sensor != N.NVML_TEMPERATURE_GPU:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        return self._temperature(card, self._clock())

    @_api
    def nvmlDeviceGetTemperatureThreshold(self, handle, threshold: int) -> int:
        m = self._dev(handle).model
        value = {
            N.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: m.temp_slowdown_c,
            N.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: m.temp_shutdown_c,
        }.get(threshold)
        if value is None:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        return value

    @_api
    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        card = self._dev(handle)
        return self._power_mw(card, self._clock())

    @_api
    def nvmlDeviceGetEnforcedPowerLimit(self, handle) -> int:
        return int(self._dev(handle).model.power_limit_w * 1000)

    nvmlDeviceGetPowerManagementLimit = _alias(
        nvmlDeviceGetEnforcedPowerLimit, "nvmlDeviceGetPowerManagementLimit"
    )

    @_api
    def nvmlDeviceGetPerformanceState(self, handle) -> int:
        return 0 if self._busy(self._dev(handle)) else 8

    @_api
    def nvmlDeviceGetFanSpeed(self, handle) -> int:
        card = self._dev(handle)
        if not card.model.fan:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        return 30 + self._util(card, self._clock()) // 2

    @_api
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle) -> int:
        card = self._dev(handle)
        t = self._clock()
        reasons = 0
        if not self._busy(card):
            reasons |= N.nvmlClocksEventReasonGpuIdle
        if self._power_mw(card, t) >= 0.9 * card.model.power_limit_w * 1000:
            reasons |= N.nvmlClocksEventReasonSwPowerCap
        if card.overheat:
            reasons |= N.nvmlClocksEventReasonSwThermalSlowdown | N.nvmlClocksEventReasonHwThermalSlowdown
        return reasons

    nvmlDeviceGetCurrentClocksThrottleReasons = _alias(
        nvmlDeviceGetCurrentClocksEventReasons, "nvmlDeviceGetCurrentClocksThrottleReasons"
    )

    @_api
    def nvmlDeviceGetPcieReplayCounter(self, handle) -> int:
        return self._dev(handle).pcie_replays

    @_api
    def nvmlDeviceValidateInforom(self, handle) -> None:
        if self._dev(handle).inforom_corrupt:
            raise _err(N.NVML_ERROR_CORRUPTED_INFOROM)

    @_api
    def nvmlDeviceGetTotalEccErrors(self, handle, errorType: int, counterType: int) -> int:
        card = self._dev(handle)
        if not card.model.ecc:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        kind = "sbe" if errorType == N.NVML_MEMORY_ERROR_TYPE_CORRECTED else "dbe"
        return card.ecc[f"{kind}_{'vol' if counterType == N.NVML_VOLATILE_ECC else 'agg'}"]

    @_api
    def nvmlDeviceGetRetiredPages(self, device, sourceFilter: int) -> list[int]:
        card = self._dev(device)
        if card.model.memory_errors != "retire":
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        return list(card.retired[sourceFilter])

    @_api
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device) -> int:
        card = self._dev(device)
        if card.model.memory_errors != "retire":
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        return int(card.retired_pending)

    @_api
    def nvmlDeviceGetRemappedRows(self, device) -> tuple[int, int, int, int]:
        card = self._dev(device)
        if card.model.memory_errors != "remap" or card.mig:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)  # not reported while MIG is on, as on real cards
        return tuple(card.rows)

    # ------------------------------------------------------------------ processes, compute mode

    @_api
    def nvmlDeviceGetComputeRunningProcesses(self, handle) -> list:
        obj = self._dev_or_mig(handle)
        if isinstance(obj, _Ci):
            procs = [p for p in obj.card.procs.values() if (p.gi, p.ci) == (obj.gi.id, obj.id)]
        else:
            procs = list(obj.procs.values())
        return [
            N.nvmlFriendlyObject(
                {
                    "pid": p.pid,
                    "usedGpuMemory": p.used_bytes,
                    "gpuInstanceId": p.gi,
                    "computeInstanceId": p.ci,
                }
            )
            for p in procs
        ]

    @_api
    def nvmlDeviceGetProcessUtilization(self, handle, timeStamp: int) -> list:
        """One sample per process that had non-zero utilisation in the last sample period, stamped with
        the CPU time (microseconds) the driver took it; only samples newer than ``timeStamp``. None:
        NVML_ERROR_NOT_FOUND. Not supported on a MIG device or on a card with MIG on (the driver keeps no
        per-process utilisation under MIG; memory per process is still read through the MIG device)."""
        card = self._no_util_under_mig(handle)
        if not isinstance(timeStamp, int) or timeStamp < 0:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        now = self._clock()
        tick = int(now / PROCESS_SAMPLE_PERIOD_S) * PROCESS_SAMPLE_PERIOD_S  # the driver's last sample
        out = []
        for p in card.procs.values():
            stamp = int(tick * 1e6)
            if (p.sm_pct or p.mem_pct) and tick > p.since and stamp > timeStamp:
                out.append(N.c_nvmlProcessUtilizationSample_t(p.pid, stamp, p.sm_pct, p.mem_pct, 0, 0))
        if not out:
            raise _err(N.NVML_ERROR_NOT_FOUND)
        return out

    nvmlDeviceGetComputeRunningProcesses_v3 = _alias(
        nvmlDeviceGetComputeRunningProcesses, "nvmlDeviceGetComputeRunningProcesses_v3"
    )

    @_api
    def nvmlDeviceGetComputeMode(self, handle) -> int:
        return self._dev(handle).compute_mode

    @_api
    def nvmlDeviceSetComputeMode(self, handle, mode: int) -> None:
        card = self._dev(handle)
        self._need_root()
        if mode not in (
            N.NVML_COMPUTEMODE_DEFAULT,
            N.NVML_COMPUTEMODE_PROHIBITED,
            N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        ):
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        card.compute_mode = mode

    @_api
    def nvmlDeviceGetPersistenceMode(self, handle) -> int:
        return self._dev(handle).persistence

    @_api
    def nvmlDeviceSetPersistenceMode(self, handle, mode: int) -> None:
        card = self._dev(handle)
        self._need_root()
        if mode not in (N.NVML_FEATURE_DISABLED, N.NVML_FEATURE_ENABLED):
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        card.persistence = mode

    # ----------------------------------------------------------------------------------- events

    def _set(self, handle) -> _EventSet:
        found = self._lookup(handle)
        if found is None or found[0] != "set" or found[1].freed:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        return found[1]

    @_api
    def nvmlEventSetCreate(self):
        es = _EventSet()
        self._sets.append(es)
        return self._new_handle(N.c_nvmlEventSet_t, "set", es)

    @_api
    def nvmlDeviceGetSupportedEventTypes(self, handle) -> int:
        card = self._dev(handle)
        return _SUPPORTED_EVENTS | (_ECC_EVENTS if card.model.ecc else 0)

    @_api
    def nvmlDeviceRegisterEvents(self, handle, eventTypes: int, eventSet) -> None:
        card = self._dev(handle)
        es = self._set(eventSet)
        supported = _SUPPORTED_EVENTS | (_ECC_EVENTS if card.model.ecc else 0)
        if eventTypes & ~supported:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        es.registered[card.index] = es.registered.get(card.index, 0) | eventTypes

    @_api
    def nvmlEventSetWait(self, eventSet, timeoutms: int):
        es = self._set(eventSet)
        deadline = time.monotonic() + timeoutms / 1000.0  # blocking is real time, not the fake clock
        es.waiting += 1
        try:
            while not es.queue:
                if any(self._cards[i].lost for i in es.registered):
                    raise _err(N.NVML_ERROR_GPU_IS_LOST)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _err(N.NVML_ERROR_TIMEOUT)
                self._cond.wait(left)
            return es.queue.popleft()
        finally:
            es.waiting -= 1

    nvmlEventSetWait_v2 = _alias(nvmlEventSetWait, "nvmlEventSetWait_v2")

    @_api
    def nvmlEventSetFree(self, eventSet) -> None:
        es = self._set(eventSet)
        if es.waiting:
            raise RuntimeError(
                "nvmlEventSetFree on an event set another thread waits on: undefined in NVML "
                "(let the waiting thread free it when its wait returns)"
            )
        es.freed = True
        self._sets.remove(es)
        self._drop_handle(eventSet)
        self._cond.notify_all()

    def _post(self, card: _Card, event_type: int, data: int = 0, gi: int = NO_ID, ci: int = NO_ID) -> None:
        for es in self._sets:
            if es.registered.get(card.index, 0) & event_type:
                ev = N.c_nvmlEventData_t()
                ev.device, ev.eventType, ev.eventData = card.handle, event_type, data
                ev.gpuInstanceId, ev.computeInstanceId = gi, ci
                es.queue.append(ev)
        self._cond.notify_all()

    # ------------------------------------------------------------------------------------- MIG

    def _mig_card(self, handle) -> _Card:
        card = self._dev(handle)
        if not card.model.mig_capable:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        return card

    def _held_by(self, card: _Card) -> list[str]:
        """What keeps the driver from resetting the card: processes, other NVML clients, event sets."""
        out = [f"process {pid}" for pid in card.procs]
        out += sorted(card.clients)
        out += ["an event set" for es in self._sets if card.index in es.registered]
        return out

    def _reset_card(self, card: _Card) -> None:
        card.mig = card.mig_pending
        if card.minor_after_reset is not None:
            card.minor, card.minor_after_reset = card.minor_after_reset, None
        card.clear_faults()
        card.inforom_corrupt = False

    def _profile(self, card: _Card, profile_id: int) -> MigProfileSpec:
        if not card.mig:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)  # profiles are answered only while MIG is on
        for p in card.model.mig_profiles:
            if p.id == profile_id:
                return p
        raise _err(N.NVML_ERROR_INVALID_ARGUMENT)

    @_api
    def nvmlDeviceGetMigMode(self, device) -> list[int]:
        card = self._mig_card(device)
        return [card.mig, card.mig_pending]

    @_api
    def nvmlDeviceSetMigMode(self, device, mode: int) -> int:
        """Sets the pending mode, then activates it by resetting the card when nothing holds it. Returns
        the activation status: SUCCESS (the mode is current), IN_USE (held: the mode stays pending) or,
        under ``passthrough``, RESET_REQUIRED."""
        card = self._mig_card(device)
        self._need_root()
        if mode not in (N.NVML_DEVICE_MIG_DISABLE, N.NVML_DEVICE_MIG_ENABLE):
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        if card.gis:
            raise _err(N.NVML_ERROR_IN_USE)  # GPU instances must be destroyed first
        card.mig_pending = mode
        if mode == card.mig:
            return N.NVML_SUCCESS  # asking for the current mode cancels a pending change
        if self.passthrough:
            return N.NVML_ERROR_RESET_REQUIRED
        if self._held_by(card):
            return N.NVML_ERROR_IN_USE
        self._reset_card(card)
        return N.NVML_SUCCESS

    @_api
    def nvmlDeviceGetMaxMigDeviceCount(self, device) -> int:
        return self._mig_card(device).model.max_mig_devices

    @_api
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device, profile: int, version: int = 2):
        card = self._mig_card(device)
        if not 0 <= profile < self.gi_profile_count or profile in self.invalid_profiles:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)  # an enum this driver does not know
        if not card.mig:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        spec = next((p for p in card.model.mig_profiles if p.profile == profile), None)
        if spec is None:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        info = N.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else N.c_nvmlGpuInstanceProfileInfo_t()
        info.id, info.isP2pSupported, info.sliceCount = spec.id, 1, spec.slices
        info.instanceCount, info.multiprocessorCount = spec.instances, spec.multiprocessors
        info.copyEngineCount, info.decoderCount, info.memorySizeMB = spec.slices, spec.slices, spec.memory_mib
        if version == 2:
            info.version, info.name = 2, f"MIG {spec.name}".encode()
        return info

    @staticmethod
    def _in(ref) -> object:
        """What a ``pointer(x)``, ``byref(x)`` or plain ``x`` refers to (ctypes values may be falsy)."""
        if hasattr(ref, "contents"):
            return ref.contents
        return ref._obj if hasattr(ref, "_obj") else ref

    def _out(self, ref, value: int) -> None:
        """Write an out-parameter passed as ``pointer(c_uint)``, ``byref(c_uint)`` or a ``c_uint``."""
        self._in(ref).value = value

    @_api
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device, profileId: int, placementsRef, countRef
    ) -> int:
        spec = self._profile(self._mig_card(device), profileId)
        if placementsRef is not None:
            if len(placementsRef) < len(spec.placements):
                raise _err(N.NVML_ERROR_INSUFFICIENT_SIZE)
            for slot, start in zip(placementsRef, spec.placements, strict=False):
                slot.start, slot.size = start, spec.placement_size
        self._out(countRef, len(spec.placements))
        return N.NVML_SUCCESS

    def _mig_on(self, device) -> _Card:
        card = self._mig_card(device)
        if not card.mig:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        return card

    @_api
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device, profileId: int, placement):
        card = self._mig_on(device)
        self._need_root()
        spec = self._profile(card, profileId)
        want = self._in(placement)
        start, size = want.start, want.size
        if start not in spec.placements or size != spec.placement_size:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        taken = {s for gi in card.gis.values() for s in range(gi.start, gi.start + gi.spec.placement_size)}
        same = sum(gi.spec.id == spec.id for gi in card.gis.values())
        slices = sum(gi.spec.slices for gi in card.gis.values())
        if taken & set(range(start, start + size)) or same >= spec.instances or slices + spec.slices > 7:
            raise _err(N.NVML_ERROR_INSUFFICIENT_RESOURCES)
        # The driver numbers a whole-card instance 0 and the others from 1 up.
        gi_id = 0 if size == 8 else min(set(range(1, 16)) - set(card.gis))
        gi = _Gi(card, gi_id, spec, start)
        gi.handle = self._new_handle(N.c_nvmlGpuInstance_t, "gi", gi)
        card.gis[gi_id] = gi
        return gi.handle

    @_api
    def nvmlDeviceGetGpuInstances(self, device, profileId: int, gpuInstancesRef, countRef) -> int:
        card = self._mig_on(device)
        self._profile(card, profileId)
        found = [gi for gi in sorted(card.gis.values(), key=lambda g: g.id) if gi.spec.id == profileId]
        if len(found) > len(gpuInstancesRef):
            raise _err(N.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, gi in enumerate(found):
            gpuInstancesRef[i] = gi.handle
        self._out(countRef, len(found))
        return N.NVML_SUCCESS

    @_api
    def nvmlDeviceGetGpuInstanceById(self, device, gpuInstanceId: int):
        card = self._mig_on(device)
        if gpuInstanceId not in card.gis:
            raise _err(N.NVML_ERROR_NOT_FOUND)
        return card.gis[gpuInstanceId].handle

    @_api
    def nvmlGpuInstanceGetInfo(self, gpuInstance):
        gi: _Gi = self._resolve(gpuInstance, "gi")
        info = N.c_nvmlGpuInstanceInfo_t()
        info.device, info.id, info.profileId = gi.card.handle, gi.id, gi.spec.id
        info.placement.start, info.placement.size = gi.start, gi.spec.placement_size
        return info

    def _ci_slices(self, gi: _Gi) -> dict[int, int]:
        """CI profile enum -> compute slices, for the shapes that fit in this GPU instance."""
        return {
            e: s for s, e in _CI_PROFILE_BY_SLICES.items() if s <= gi.spec.slices and s in (1, 2, 3, 4, 7)
        }

    @_api
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device, profile: int, engProfile: int, version: int = 2
    ):
        gi: _Gi = self._resolve(device, "gi")
        if not 0 <= profile < self.ci_profile_count:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)  # an enum this driver does not know
        shapes = self._ci_slices(gi)
        if profile not in shapes or engProfile != N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _err(N.NVML_ERROR_NOT_SUPPORTED)
        s = shapes[profile]
        info = (
            N.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else N.c_nvmlComputeInstanceProfileInfo_t()
        )
        info.id, info.sliceCount, info.instanceCount = profile, s, gi.spec.slices // s
        info.multiprocessorCount = gi.spec.multiprocessors * s // gi.spec.slices
        if version == 2:
            shape = gi.spec.name if s == gi.spec.slices else f"{s}c.{gi.spec.name}"
            info.version, info.name = 2, f"MIG {shape}".encode()
        return info

    @_api
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance, profileId: int):
        gi: _Gi = self._resolve(gpuInstance, "gi")
        self._need_root()
        shapes = self._ci_slices(gi)
        if profileId not in shapes:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        card, s = gi.card, shapes[profileId]
        used = sum(ci.slices for ci in gi.cis.values())
        free_index = sorted(set(range(card.model.max_mig_devices)) - set(card.mig_devices))
        if used + s > gi.spec.slices or not free_index:
            raise _err(N.NVML_ERROR_INSUFFICIENT_RESOURCES)
        self._serial += 1
        ci_id = min(set(range(8)) - set(gi.cis))
        mig_uuid = (
            f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'{card.spec.uuid}/{gi.id}/{ci_id}/{self._serial}')}"
        )
        ci = _Ci(gi, ci_id, profileId, s, used, free_index[0], mig_uuid)
        ci.handle = self._new_handle(N.c_nvmlComputeInstance_t, "ci", ci)
        ci.device = self._new_handle(N.c_nvmlDevice_t, "mig", ci)
        gi.cis[ci_id] = ci
        card.mig_devices[ci.mig_index] = ci
        return ci.handle

    @_api
    def nvmlGpuInstanceGetComputeInstances(self, gpuInstance, profileId: int, computeInstancesRef, countRef):
        gi: _Gi = self._resolve(gpuInstance, "gi")
        found = [ci for ci in sorted(gi.cis.values(), key=lambda c: c.id) if ci.profile == profileId]
        if len(found) > len(computeInstancesRef):
            raise _err(N.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, ci in enumerate(found):
            computeInstancesRef[i] = ci.handle
        self._out(countRef, len(found))
        return N.NVML_SUCCESS

    @_api
    def nvmlComputeInstanceGetInfo(self, computeInstance):
        ci: _Ci = self._resolve(computeInstance, "ci")
        info = N.c_nvmlComputeInstanceInfo_t()
        info.device, info.gpuInstance, info.id, info.profileId = (
            ci.card.handle,
            ci.gi.handle,
            ci.id,
            ci.profile,
        )
        info.placement.start, info.placement.size = ci.start, ci.slices
        return info

    @_api
    def nvmlComputeInstanceDestroy(self, computeInstance) -> None:
        ci: _Ci = self._resolve(computeInstance, "ci")
        self._need_root()
        if any((p.gi, p.ci) == (ci.gi.id, ci.id) for p in ci.card.procs.values()):
            raise _err(N.NVML_ERROR_IN_USE)
        del ci.gi.cis[ci.id]
        del ci.card.mig_devices[ci.mig_index]
        self._drop_handle(ci.handle)
        self._drop_handle(ci.device)

    @_api
    def nvmlGpuInstanceDestroy(self, gpuInstance) -> None:
        gi: _Gi = self._resolve(gpuInstance, "gi")
        self._need_root()
        if gi.cis or any(p.gi == gi.id for p in gi.card.procs.values()):
            raise _err(N.NVML_ERROR_IN_USE)
        del gi.card.gis[gi.id]
        self._drop_handle(gi.handle)

    @_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index: int):
        card = self._mig_card(device)
        if not 0 <= index < card.model.max_mig_devices:
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        if index not in card.mig_devices:
            raise _err(N.NVML_ERROR_NOT_FOUND)  # a hole: enumerations must skip it, not stop
        return card.mig_devices[index].device

    def _mig_dev(self, handle) -> _Ci:
        obj = self._dev_or_mig(handle)
        if not isinstance(obj, _Ci):
            raise _err(N.NVML_ERROR_INVALID_ARGUMENT)
        return obj

    @_api
    def nvmlDeviceIsMigDeviceHandle(self, device) -> int:
        return int(isinstance(self._dev_or_mig(device), _Ci))

    @_api
    def nvmlDeviceGetGpuInstanceId(self, device) -> int:
        return self._mig_dev(device).gi.id

    @_api
    def nvmlDeviceGetComputeInstanceId(self, device) -> int:
        return self._mig_dev(device).id

    @_api
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice):
        return self._mig_dev(migDevice).card.handle

    # ---------------------------------------------------------------- beyond pynvml: processes

    def add_process(
        self,
        index: int,
        pid: int,
        used_bytes: int | None = 1 << 30,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> None:
        """Attach a compute process to a card or to a MIG instance (by default its first compute instance)."""
        with self._lock:
            card = self._cards[index]
            gi = ci = NO_ID
            if gpu_instance_id is not None:
                if gpu_instance_id not in card.gis or not card.gis[gpu_instance_id].cis:
                    raise ValueError(
                        f"card {index} has no GPU instance {gpu_instance_id} with a compute instance"
                    )
                gi = gpu_instance_id
                ci = min(card.gis[gi].cis) if compute_instance_id is None else compute_instance_id
            card.procs[pid] = _Proc(pid, used_bytes, gi, ci)

    def set_process_load(
        self, index: int, pid: int, sm_pct: int, mem_pct: int = 0, used_bytes: int | None = None
    ) -> None:
        """What a process does from now on: its SM and memory-controller utilisation (0-100, of the whole
        card) as per-process samples report them, and optionally its device memory."""
        if not (0 <= sm_pct <= 100 and 0 <= mem_pct <= 100):
            raise ValueError(f"utilisation must be 0-100 %, got sm={sm_pct} mem={mem_pct}")
        with self._lock:
            p = self._cards[index].procs[pid]
            p.sm_pct, p.mem_pct, p.since = int(sm_pct), int(mem_pct), self._clock()
            if used_bytes is not None:
                p.used_bytes = used_bytes

    def remove_process(self, index: int, pid: int) -> None:
        with self._lock:
            self._cards[index].procs.pop(pid, None)

    def add_client(self, index: int, name: str = "dcgm") -> None:
        """Another NVML client (a monitoring agent such as DCGM) holds the card: MIG mode changes stay
        pending and resets are refused until it lets go."""
        with self._lock:
            self._cards[index].clients.add(name)

    def remove_client(self, index: int, name: str = "dcgm") -> None:
        with self._lock:
            self._cards[index].clients.discard(name)

    # -------------------------------------------------------------------- beyond pynvml: faults

    def inject_xid(
        self, index: int, xid: int, gpu_instance_id: int = NO_ID, compute_instance_id: int = NO_ID
    ) -> None:
        """Queue an XID event; XID 79 (fallen off the bus) also makes the card lost."""
        with self._lock:
            card = self._cards[index]
            self._post(card, N.nvmlEventTypeXidCriticalError, xid, gpu_instance_id, compute_instance_id)
            if xid in _RESET_XIDS:
                card.recovery_action = N.NVML_GPU_RECOVERY_ACTION_GPU_RESET
            if xid == 79:
                card.lost = True

    def inject_ecc_sbe(self, index: int, count: int = 1) -> None:
        """Corrected (single-bit) errors: counters up and an event."""
        with self._lock:
            card = self._cards[index]
            card.ecc["sbe_vol"] += count
            card.ecc["sbe_agg"] += count
            card.rows[0] += card.model.memory_errors == "remap"
            self._post(card, N.nvmlEventTypeSingleBitEccError, count)

    def inject_ecc_dbe(self, index: int) -> None:
        """An uncorrectable error: counters up, a remap (or page retirement) pending, DBE event + XID 48."""
        with self._lock:
            card = self._cards[index]
            card.ecc["dbe_vol"] += 1
            card.ecc["dbe_agg"] += 1
            if card.model.memory_errors == "remap":
                card.rows[1] += 1
                card.rows[2] = 1
            elif card.model.memory_errors == "retire":
                card.retired[N.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR].append(
                    0x1000 * (1 + card.ecc["dbe_agg"])
                )
                card.retired_pending = True
            self._post(card, N.nvmlEventTypeDoubleBitEccError, 1)
            self._post(card, N.nvmlEventTypeXidCriticalError, 48)
            card.recovery_action = N.NVML_GPU_RECOVERY_ACTION_GPU_RESET  # XID 48

    def set_overheat(self, index: int, on: bool = True) -> None:
        """Temperature above the slowdown threshold, thermal clock-event reasons set."""
        with self._lock:
            self._cards[index].overheat = on

    def nvlink_down(self, index: int, links: list[int] | None = None) -> None:
        """Take links (default: all wired ones) down; their replay/recovery/CRC counters go up."""
        with self._lock:
            card = self._cards[index]
            for link in range(card.spec.nvlink_count) if links is None else links:
                card.links_up[link] = False
                errs = card.link_errors[link]
                errs[N.NVML_NVLINK_ERROR_DL_REPLAY] += 12
                errs[N.NVML_NVLINK_ERROR_DL_RECOVERY] += 1
                errs[N.NVML_NVLINK_ERROR_DL_CRC_FLIT] += 40
                errs[N.NVML_NVLINK_ERROR_DL_CRC_DATA] += 3

    def add_pcie_replays(self, index: int, n: int) -> None:
        """The PCIe link retried ``n`` more transfers (nvmlDeviceGetPcieReplayCounter rises)."""
        with self._lock:
            self._cards[index].pcie_replays += int(n)

    def nvlink_sleep(self, index: int, links: list[int] | None = None, asleep: bool = True) -> None:
        """Put links (default: all wired ones) in their low-power state, or wake them: not a fault."""
        with self._lock:
            card = self._cards[index]
            chosen = set(range(card.spec.nvlink_count) if links is None else links)
            card.links_asleep = card.links_asleep | chosen if asleep else card.links_asleep - chosen

    def lose(self, index: int) -> None:
        """The card falls off the bus: every call on its handles raises NVMLError_GpuIsLost."""
        with self._lock:
            self._cards[index].lost = True
            self._cond.notify_all()  # an event wait on the card answers GPU_IS_LOST

    def set_fabric(
        self, index: int, state: int = N.NVML_GPU_FABRIC_STATE_IN_PROGRESS, status: int = N.NVML_SUCCESS
    ) -> None:
        """The card's NVSwitch fabric state as the Fabric Manager leaves it (NVML_GPU_FABRIC_STATE_*, and
        an NVML return code for how training went): IN_PROGRESS while it trains, NOT_STARTED before."""
        with self._lock:
            self._cards[index].fabric = (int(state), int(status))

    def corrupt_inforom(self, index: int) -> None:
        with self._lock:
            self._cards[index].inforom_corrupt = True

    def clear(self, index: int) -> None:
        """Back to healthy values, as after a GPU reset: volatile counters zero, aggregate ones kept."""
        with self._lock:
            card = self._cards[index]
            card.clear_faults()
            card.inforom_corrupt = False

    def renumber_on_reset(self, index: int, minor: int) -> None:
        """The card's next reset (a MIG mode change resets it) gives its device node another minor, as the
        driver may (REFERENCE.md: "Minor numbers ... may change with a MIG mode change")."""
        with self._lock:
            self._cards[index].minor_after_reset = minor

    def reset(self, index: int) -> None:
        """A GPU reset (``nvidia-smi -r``): refused while anything holds the card (processes, other NVML
        clients, event sets with the card registered); applies a pending MIG mode and clears faults."""
        with self._lock:
            card = self._cards[index]
            if self._held_by(card):
                raise _err(N.NVML_ERROR_IN_USE)
            self._reset_card(card)
            if self.on_change is not None:
                self.on_change()

    # ---------------------------------------------------------------------- beyond pynvml: tests

    def fail(self, name: str, code: int = N.NVML_ERROR_NOT_SUPPORTED, index: int | None = None) -> None:
        """Make the pynvml function ``name`` raise ``NVMLError(code)`` (for one card, or for all)."""
        if not callable(getattr(type(self), name, None)):
            raise AttributeError(f"FakeNvml has no {name}")
        with self._lock:
            self._failures.setdefault(name, []).append((index, code))

    def unfail(self, name: str | None = None) -> None:
        with self._lock:
            self._failures.pop(name, None) if name else self._failures.clear()

    def hide(self, name: str) -> None:
        """Make ``name`` missing, as in an old binding (the adapter finds ``None`` there)."""
        setattr(self, name, None)

    def mig_layout(self, index: int) -> list[dict]:
        """The card's GPU instances by start slot: id, profile id and name, start, size, CIs and UUIDs."""
        with self._lock:
            card = self._cards[index]
            return [
                {
                    "gpu_instance_id": gi.id,
                    "profile_id": gi.spec.id,
                    "name": gi.spec.name,
                    "start": gi.start,
                    "size": gi.spec.placement_size,
                    "compute_instances": sorted(gi.cis),
                    "uuids": [gi.cis[c].uuid for c in sorted(gi.cis)],
                }
                for gi in sorted(card.gis.values(), key=lambda g: g.start)
            ]

    def card_state(self, index: int) -> _Card:
        """The fake's own record of a card (read it; change it only through the methods above)."""
        return self._cards[index]


# The same constants, structs and exception classes as the pynvml module, so ``fake.NVML_...`` works too.
for _name in dir(N):
    if _name.startswith(("NVML_", "nvmlEventType", "nvmlClocks", "NVMLError", "c_nvml")) and not hasattr(
        FakeNvml, _name
    ):
        setattr(FakeNvml, _name, getattr(N, _name))
