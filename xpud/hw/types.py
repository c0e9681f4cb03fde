"""What the hardware adapter returns and raises: errors, MIG profiles and instances, events, NVLink links.

Kept apart from ``nvml.py`` so that code which only handles these (the engine, isolation, the daemon) reads
a short file; ``xpud.hw.nvml`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass

from xpud.errors import XpudError

# ------------------------------------------------------------------------------------------- errors


class NvmlError(XpudError, RuntimeError):
    """An NVML call failed; the message is one line. ``nvml_code`` is the NVML_ERROR_* value, if any.

    A driver failure the isolation backends did not turn into a Conflict/NoCapacity is the daemon's own
    fault, so the service answers it INTERNAL (as for any unexpected error); still a RuntimeError for the
    handlers that take those."""

    code = "INTERNAL"

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.nvml_code = code


class NvmlUnavailable(NvmlError):
    """NVML cannot be used at all (no library, no driver); the message says what to do."""


class NvmlGpuLost(NvmlError):
    """The card fell off the bus (NVML_ERROR_GPU_IS_LOST)."""


class NvmlNotSupported(NvmlError):
    """The card, driver or binding cannot do this."""


class NvmlInUse(NvmlError):
    """Processes or instances still use what was to be changed (NVML_ERROR_IN_USE)."""


class NvmlInsufficientResources(NvmlError):
    """No room: e.g. a MIG placement overlaps an existing instance (NVML_ERROR_INSUFFICIENT_RESOURCES)."""


class NvmlNoPermission(NvmlError):
    """The operation needs root (NVML_ERROR_NO_PERMISSION)."""


class NvmlNotFound(NvmlError):
    """No such object, e.g. GPU instance id (NVML_ERROR_NOT_FOUND)."""


# -------------------------------------------------------------------------------------------- types


@dataclass(frozen=True)
class MigProfile:
    """A GPU-instance profile a card offers."""

    profile: int  # NVML_GPU_INSTANCE_PROFILE_* enum value (what you ask NVML about)
    id: int  # the driver's profile id (what create/list take); differs from the enum value
    name: str  # "3g.40gb"
    slice_count: int  # compute slices (of 7 on A100/H100)
    memory_slices: int  # memory slices (of 8) one instance covers
    memory_bytes: int
    max_instances: int
    multiprocessors: int
    placements: tuple[tuple[int, int], ...]  # possible (start, size), in memory slices


@dataclass(frozen=True)
class MigInstance:
    """An existing GPU instance with its compute instances and their MIG device UUIDs."""

    card_index: int
    gpu_instance_id: int
    profile_id: int  # driver's profile id
    name: str | None  # profile name, "3g.40gb"
    start: int  # placement, memory slices
    size: int
    memory_bytes: int | None
    compute_instance_ids: tuple[int, ...] = ()
    device_uuids: tuple[str, ...] = ()  # "MIG-<uuid>", aligned with compute_instance_ids

    @property
    def uuid(self) -> str | None:
        """The MIG device UUID a child process gets (first compute instance)."""
        return self.device_uuids[0] if self.device_uuids else None


@dataclass(frozen=True)
class HwEvent:
    card_index: int  # -1 when the event's device is unknown to this adapter
    kind: str  # "xid", "ecc-sbe", "ecc-dbe", "pstate", "clock", "power-source" or "event-0x..."
    xid: int | None = None
    gpu_instance_id: int | None = None  # None: the whole card
    compute_instance_id: int | None = None
    timestamp: float = 0.0


@dataclass(frozen=True)
class NvLink:
    """One NVLink link of a card, as NVML describes it."""

    link: int
    active: bool | None
    remote: str  # "gpu", "switch", "npu" or "unknown"
    remote_bus_id: str | None
    remote_index: int | None  # card index when the far end is one of this host's cards
    version: int | None  # NVML_NVLINK_VERSION_*
