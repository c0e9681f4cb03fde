"""The vocabulary of xpud: frozen dataclasses shared by every layer.

Units are in the names: ``*_bytes``, ``*_mib``, ``*_pct`` (0-100), ``*_w`` (watts), ``*_c`` (degrees
Celsius), times are seconds since the epoch (``float``). ``None`` means "the card cannot report this",
never zero.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

# The highest minor number a card's /dev/nvidia<minor> can have: under major 195 the driver gives 254 to
# /dev/nvidia-modeset and 255 to /dev/nvidiactl.
MAX_CARD_MINOR = 253

# A slice size's name: what [slices.<name>] in xpud.toml may be called, and what a request may name.
SLICE_NAME = re.compile(r"vxpu-[a-z0-9][a-z0-9-]{0,39}")


class Mode(str):
    """How a lease uses cards: ``xpu`` (N whole cards) or a slice size (``vxpu-half``, ``vxpu-quarter`` or
    any other ``[slices.<name>]`` of the config). A validated string, not a fixed list: which sizes exist
    is the config's business (``Engine.validate``). ``Mode("xpu") is Mode.XPU`` always holds."""

    XPU: ClassVar[Mode]
    VXPU_HALF: ClassVar[Mode]
    VXPU_QUARTER: ClassVar[Mode]

    def __new__(cls, value: str) -> Mode:
        if isinstance(value, Mode):
            return value
        if value == "xpu" and hasattr(cls, "XPU"):
            return cls.XPU
        if not isinstance(value, str) or not (value == "xpu" or SLICE_NAME.fullmatch(value)):
            raise ValueError(f"{value!r} is not a mode: xpu or a slice size named vxpu-<word>")
        return super().__new__(cls, value)

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def is_slice(self) -> bool:
        return self is not Mode.XPU


Mode.XPU = Mode("xpu")
Mode.VXPU_HALF = Mode("vxpu-half")
Mode.VXPU_QUARTER = Mode("vxpu-quarter")


class CardMode(StrEnum):
    WHOLE = "whole"
    SLICED = "sliced"


class HealthState(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


class LeaseState(StrEnum):
    ACTIVE = "active"
    RELEASED = "released"  # released by its holder
    RECLAIMED = "reclaimed"  # holder vanished; reclaimed after the grace period
    EVICTED = "evicted"  # taken back by an operator


@dataclass(frozen=True)
class CardInfo:
    """Static inventory of one card, as the hardware adapter reads it."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    pci_bus_id: str
    numa_node: int | None = None
    cpu_affinity: tuple[int, ...] = ()  # CPU ids this card is local to
    mig_capable: bool = False
    mig_enabled: bool = False
    nvlink_active_links: int = 0
    serial: str | None = None
    architecture: str | None = None
    # The minor number of the card's device node, /dev/nvidia<minor> (nvmlDeviceGetMinorNumber). It need not
    # follow the NVML index (DGX/HGX hosts) and may change with a MIG mode change; device nodes, cgroup rules
    # and gres File= use it, never the index. None: the driver did not say (then nothing is derived from it).
    minor_number: int | None = None


@dataclass(frozen=True)
class CardSample:
    """One reading of a card's live values and raw health signals. Every field is optional."""

    timestamp: float
    lost: bool = False  # the card fell off the bus (NVMLError_GpuIsLost)
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: int | None = None
    temperature_slowdown_c: int | None = None
    temperature_shutdown_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    performance_state: int | None = None  # 0 (max) .. 15, None when unknown (32)
    fan_pct: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    clock_event_reasons: int | None = None  # bitmask, NVML clocks-event reasons
    pcie_replay_counter: int | None = None
    nvlink_replay_errors: int | None = None  # summed over links
    nvlink_recovery_errors: int | None = None
    nvlink_crc_flit_errors: int | None = None
    nvlink_crc_data_errors: int | None = None
    # NVLink links trained (active or asleep) at some point since the adapter started and inactive now;
    # links of a MIG card, or to one, are not counted (MIG takes them down); None: no link ever came up
    # (no NVLink, or a PCIe board without its bridge, whose links all read inactive by design).
    nvlink_links_down: int | None = None
    inforom_valid: bool | None = None
    # NVSwitch fabric (HGX/DGX H100, H200): NVML_GPU_FABRIC_STATE_* and the NVML return code of its training;
    # None where the card has no fabric to train. CUDA fails on the card until (COMPLETED=3, SUCCESS=0).
    fabric_state: int | None = None
    fabric_status: int | None = None
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: NVML_GPU_RECOVERY_ACTION_* (0 none, 1 GPU reset, 2 node reboot,
    # 3 drain P2P, 4 drain and reset, ...); None where the driver has no such field (before R550).
    recovery_action: int | None = None


@dataclass(frozen=True)
class SliceSpec:
    """A slice size: a share of one card's memory and compute."""

    name: str  # "vxpu-half", "vxpu-quarter", ...
    memory_fraction: float  # 0 < f <= 1
    compute_pct: int  # active-thread percentage, 1..100


@dataclass(frozen=True)
class Slice:
    """A slice held by a lease on one card."""

    card_index: int
    size: str  # SliceSpec.name
    memory_bytes: int
    compute_pct: int
    handle: str = ""  # isolation handle: MIG device UUID, "mps:<card>:<lease>" or "" (accounting only)
    placement: int | None = None  # MIG placement start slot, when MIG


@dataclass(frozen=True)
class Caller:
    """Who is calling, as the credential handshake proved it (uid from the kernel's SO_PEERCRED)."""

    uid: int
    pid: int = 0
    gid: int = -1
    admin: bool = False


@dataclass(frozen=True)
class Request:
    """What a caller asks for."""

    mode: Mode
    gpus: int = 1  # whole cards for Mode.XPU; always 1 for slices
    priority: int = 0  # higher first; FIFO within a priority
    wait_s: float = 0.0  # how long to queue when it does not fit now (0: fail at once)
    restartable: bool = False
    owner_uid: int = -1
    holder_pid: int | None = None
    command: str = ""
    name: str = ""  # the job's name (`xpu run --name`), shown in listings
    cards: tuple[int, ...] = ()  # exactly these cards (bridges: the cards Slurm gave a job); () = any
    anchor: str = ""  # what keeps the lease alive instead of a Hold stream ("slurm:<job>", "pod:<uid>")
    exempt: bool = (
        False  # the caller is an operator or in [limits] exempt_groups: per-user limits do not apply
    )
    job_class: str = ""  # `xpu run --class`, or the class --mode auto chose by; "" = from the command
    not_before: float = 0.0  # not granted before (seconds since the epoch): a green start; 0 = at once
    not_before_reason: str = ""  # why that start (the carbon signal's greenest hour ...)
    account: str = ""  # the account ([accounts.NAME]) it is charged to; "" = "default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))  # a plain "xpu" becomes Mode.XPU


@dataclass(frozen=True)
class CommandEnd:
    """How a lease's command ended, as its wrapper reports it at release: an exit status or the signal
    that ended it, and when the command first started (seconds since the epoch). None: not known."""

    exit_code: int | None = None
    exit_signal: int | None = None
    started: float | None = None


@dataclass(frozen=True)
class Lease:
    id: str
    mode: Mode
    owner_uid: int
    cards: tuple[int, ...]  # card indices
    card_uuids: tuple[str, ...]
    slices: tuple[Slice, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    priority: int = 0
    restartable: bool = False
    holder_pid: int | None = None
    command: str = ""
    created: float = 0.0
    state: LeaseState = LeaseState.ACTIVE
    restart_count: int = 0
    mark: str = ""  # set when the daemon needs the holder's attention (e.g. "card 3 unhealthy")
    name: str = ""  # the job's name (`xpu run --name`)
    # How it ended (ended leases only): when, why, and how its command ended as its wrapper reported it
    # (an exit status or a signal; both None when nobody reported), and when the command first started.
    ended: float | None = None
    end_reason: str = ""
    started: float | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    anchor: str = ""  # "slurm:<job>" / "pod:<uid>": alive while that lives, not while a Hold stream is open
    account: str = ""  # the account ([accounts.NAME]) it is charged to; "" = "default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))


@dataclass(frozen=True)
class CardView:
    """A card as the scheduler sees it: inventory, mode, holders, free capacity and last sample."""

    info: CardInfo
    mode: CardMode
    mode_pinned: bool = False  # an operator fixed the mode; the engine will not switch it
    drained: bool = False
    drain_reason: str = ""
    health_state: HealthState = HealthState.HEALTHY
    health_score: int = 100
    whole_lease: str | None = None  # lease holding the whole card
    slices: tuple[tuple[str, Slice], ...] = ()  # (lease id, slice)
    free_memory_fraction: float = 1.0  # of the card, for slices
    free_compute_pct: int = 100
    sample: CardSample | None = None

    @property
    def idle(self) -> bool:
        return self.whole_lease is None and not self.slices


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting in the queue, as listings show it."""

    ticket: str
    request: Request
    position: int  # 1-based
    enqueued: float
    deadline: float
    reason: str = "Resources"  # why it waits, as squeue's REASON (see QueueEntry.reason in the proto)
