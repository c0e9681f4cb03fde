from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("version", "hostname", "backend", "driver_version", "started", "cards", "user_socket", "admin_socket", "config_path", "caller_uid", "caller_is_admin", "slice_sizes", "device_isolation")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    USER_SOCKET_FIELD_NUMBER: _ClassVar[int]
    ADMIN_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CONFIG_PATH_FIELD_NUMBER: _ClassVar[int]
    CALLER_UID_FIELD_NUMBER: _ClassVar[int]
    CALLER_IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    SLICE_SIZES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ISOLATION_FIELD_NUMBER: _ClassVar[int]
    version: str
    hostname: str
    backend: str
    driver_version: str
    started: float
    cards: int
    user_socket: str
    admin_socket: str
    config_path: str
    caller_uid: int
    caller_is_admin: bool
    slice_sizes: _containers.RepeatedCompositeFieldContainer[SliceSize]
    device_isolation: str
    def __init__(self, version: _Optional[str] = ..., hostname: _Optional[str] = ..., backend: _Optional[str] = ..., driver_version: _Optional[str] = ..., started: _Optional[float] = ..., cards: _Optional[int] = ..., user_socket: _Optional[str] = ..., admin_socket: _Optional[str] = ..., config_path: _Optional[str] = ..., caller_uid: _Optional[int] = ..., caller_is_admin: _Optional[bool] = ..., slice_sizes: _Optional[_Iterable[_Union[SliceSize, _Mapping]]] = ..., device_isolation: _Optional[str] = ...) -> None: ...

class SliceSize(_message.Message):
    __slots__ = ("name", "memory_fraction", "compute_pct")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_PCT_FIELD_NUMBER: _ClassVar[int]
    name: str
    memory_fraction: float
    compute_pct: int
    def __init__(self, name: _Optional[str] = ..., memory_fraction: _Optional[float] = ..., compute_pct: _Optional[int] = ...) -> None: ...

class SliceHeld(_message.Message):
    __slots__ = ("lease_id", "size", "memory_bytes", "compute_pct", "handle", "placement")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_PCT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    size: str
    memory_bytes: int
    compute_pct: int
    handle: str
    placement: int
    def __init__(self, lease_id: _Optional[str] = ..., size: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., compute_pct: _Optional[int] = ..., handle: _Optional[str] = ..., placement: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("timestamp", "lost", "utilization_gpu_pct", "utilization_memory_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c", "temperature_slowdown_c", "temperature_shutdown_c", "power_w", "power_limit_w", "performance_state", "fan_pct", "ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate", "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending", "remapped_rows_corrected", "remapped_rows_uncorrected", "remapped_rows_pending", "remapped_rows_failure", "clock_event_reasons", "pcie_replay_counter", "nvlink_replay_errors", "nvlink_recovery_errors", "nvlink_crc_flit_errors", "nvlink_crc_data_errors", "nvlink_links_down", "inforom_valid")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_GPU_PCT_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_MEMORY_PCT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_SLOWDOWN_C_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_SHUTDOWN_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_W_FIELD_NUMBER: _ClassVar[int]
    PERFORMANCE_STATE_FIELD_NUMBER: _ClassVar[int]
    FAN_PCT_FIELD_NUMBER: _ClassVar[int]
    ECC_SBE_VOLATILE_FIELD_NUMBER: _ClassVar[int]
    ECC_DBE_VOLATILE_FIELD_NUMBER: _ClassVar[int]
    ECC_SBE_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    ECC_DBE_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_SBE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_DBE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_PENDING_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_CORRECTED_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_PENDING_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_FAILURE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_EVENT_REASONS_FIELD_NUMBER: _ClassVar[int]
    PCIE_REPLAY_COUNTER_FIELD_NUMBER: _ClassVar[int]
    NVLINK_REPLAY_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NVLINK_RECOVERY_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NVLINK_CRC_FLIT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NVLINK_CRC_DATA_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NVLINK_LINKS_DOWN_FIELD_NUMBER: _ClassVar[int]
    INFOROM_VALID_FIELD_NUMBER: _ClassVar[int]
    timestamp: float
    lost: bool
    utilization_gpu_pct: int
    utilization_memory_pct: int
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: int
    temperature_slowdown_c: int
    temperature_shutdown_c: int
    power_w: float
    power_limit_w: float
    performance_state: int
    fan_pct: int
    ecc_sbe_volatile: int
    ecc_dbe_volatile: int
    ecc_sbe_aggregate: int
    ecc_dbe_aggregate: int
    retired_pages_sbe: int
    retired_pages_dbe: int
    retired_pages_pending: bool
    remapped_rows_corrected: int
    remapped_rows_uncorrected: int
    remapped_rows_pending: bool
    remapped_rows_failure: bool
    clock_event_reasons: int
    pcie_replay_counter: int
    nvlink_replay_errors: int
    nvlink_recovery_errors: int
    nvlink_crc_flit_errors: int
    nvlink_crc_data_errors: int
    nvlink_links_down: int
    inforom_valid: bool
    def __init__(self, timestamp: _Optional[float] = ..., lost: _Optional[bool] = ..., utilization_gpu_pct: _Optional[int] = ..., utilization_memory_pct: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., temperature_c: _Optional[int] = ..., temperature_slowdown_c: _Optional[int] = ..., temperature_shutdown_c: _Optional[int] = ..., power_w: _Optional[float] = ..., power_limit_w: _Optional[float] = ..., performance_state: _Optional[int] = ..., fan_pct: _Optional[int] = ..., ecc_sbe_volatile: _Optional[int] = ..., ecc_dbe_volatile: _Optional[int] = ..., ecc_sbe_aggregate: _Optional[int] = ..., ecc_dbe_aggregate: _Optional[int] = ..., retired_pages_sbe: _Optional[int] = ..., retired_pages_dbe: _Optional[int] = ..., retired_pages_pending: _Optional[bool] = ..., remapped_rows_corrected: _Optional[int] = ..., remapped_rows_uncorrected: _Optional[int] = ..., remapped_rows_pending: _Optional[bool] = ..., remapped_rows_failure: _Optional[bool] = ..., clock_event_reasons: _Optional[int] = ..., pcie_replay_counter: _Optional[int] = ..., nvlink_replay_errors: _Optional[int] = ..., nvlink_recovery_errors: _Optional[int] = ..., nvlink_crc_flit_errors: _Optional[int] = ..., nvlink_crc_data_errors: _Optional[int] = ..., nvlink_links_down: _Optional[int] = ..., inforom_valid: _Optional[bool] = ...) -> None: ...

class Card(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_bytes", "pci_bus_id", "numa_node", "mig_capable", "mig_enabled", "mode", "mode_pinned", "drained", "drain_reason", "health_state", "health_score", "whole_lease", "slices", "free_memory_fraction", "free_compute_pct", "sample", "isolation", "cpu_affinity", "nvlink_active_links", "minor_number")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    MIG_CAPABLE_FIELD_NUMBER: _ClassVar[int]
    MIG_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_PINNED_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    HEALTH_STATE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_SCORE_FIELD_NUMBER: _ClassVar[int]
    WHOLE_LEASE_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    FREE_COMPUTE_PCT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    CPU_AFFINITY_FIELD_NUMBER: _ClassVar[int]
    NVLINK_ACTIVE_LINKS_FIELD_NUMBER: _ClassVar[int]
    MINOR_NUMBER_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    pci_bus_id: str
    numa_node: int
    mig_capable: bool
    mig_enabled: bool
    mode: str
    mode_pinned: bool
    drained: bool
    drain_reason: str
    health_state: str
    health_score: int
    whole_lease: str
    slices: _containers.RepeatedCompositeFieldContainer[SliceHeld]
    free_memory_fraction: float
    free_compute_pct: int
    sample: Sample
    isolation: str
    cpu_affinity: _containers.RepeatedScalarFieldContainer[int]
    nvlink_active_links: int
    minor_number: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., numa_node: _Optional[int] = ..., mig_capable: _Optional[bool] = ..., mig_enabled: _Optional[bool] = ..., mode: _Optional[str] = ..., mode_pinned: _Optional[bool] = ..., drained: _Optional[bool] = ..., drain_reason: _Optional[str] = ..., health_state: _Optional[str] = ..., health_score: _Optional[int] = ..., whole_lease: _Optional[str] = ..., slices: _Optional[_Iterable[_Union[SliceHeld, _Mapping]]] = ..., free_memory_fraction: _Optional[float] = ..., free_compute_pct: _Optional[int] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ..., isolation: _Optional[str] = ..., cpu_affinity: _Optional[_Iterable[int]] = ..., nvlink_active_links: _Optional[int] = ..., minor_number: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "mode", "owner_uid", "cards", "card_uuids", "slices", "env", "priority", "restartable", "holder_pid", "command", "created", "state", "restart_count", "mark", "held", "exit_code", "exit_signal", "started", "ended", "end_reason", "name", "anchor", "account")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    CARD_UUIDS_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESTARTABLE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_PID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    id: str
    mode: str
    owner_uid: int
    cards: _containers.RepeatedScalarFieldContainer[int]
    card_uuids: _containers.RepeatedScalarFieldContainer[str]
    slices: _containers.RepeatedCompositeFieldContainer[SliceHeld]
    env: _containers.ScalarMap[str, str]
    priority: int
    restartable: bool
    holder_pid: int
    command: str
    created: float
    state: str
    restart_count: int
    mark: str
    held: bool
    exit_code: int
    exit_signal: int
    started: float
    ended: float
    end_reason: str
    name: str
    anchor: str
    account: str
    def __init__(self, id: _Optional[str] = ..., mode: _Optional[str] = ..., owner_uid: _Optional[int] = ..., cards: _Optional[_Iterable[int]] = ..., card_uuids: _Optional[_Iterable[str]] = ..., slices: _Optional[_Iterable[_Union[SliceHeld, _Mapping]]] = ..., env: _Optional[_Mapping[str, str]] = ..., priority: _Optional[int] = ..., restartable: _Optional[bool] = ..., holder_pid: _Optional[int] = ..., command: _Optional[str] = ..., created: _Optional[float] = ..., state: _Optional[str] = ..., restart_count: _Optional[int] = ..., mark: _Optional[str] = ..., held: _Optional[bool] = ..., exit_code: _Optional[int] = ..., exit_signal: _Optional[int] = ..., started: _Optional[float] = ..., ended: _Optional[float] = ..., end_reason: _Optional[str] = ..., name: _Optional[str] = ..., anchor: _Optional[str] = ..., account: _Optional[str] = ...) -> None: ...

class QueueEntry(_message.Message):
    __slots__ = ("ticket", "mode", "gpus", "priority", "owner_uid", "command", "position", "enqueued", "deadline", "reason", "name", "not_before", "not_before_reason", "account")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_REASON_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    mode: str
    gpus: int
    priority: int
    owner_uid: int
    command: str
    position: int
    enqueued: float
    deadline: float
    reason: str
    name: str
    not_before: float
    not_before_reason: str
    account: str
    def __init__(self, ticket: _Optional[str] = ..., mode: _Optional[str] = ..., gpus: _Optional[int] = ..., priority: _Optional[int] = ..., owner_uid: _Optional[int] = ..., command: _Optional[str] = ..., position: _Optional[int] = ..., enqueued: _Optional[float] = ..., deadline: _Optional[float] = ..., reason: _Optional[str] = ..., name: _Optional[str] = ..., not_before: _Optional[float] = ..., not_before_reason: _Optional[str] = ..., account: _Optional[str] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("mode", "gpus", "priority", "wait_s", "restartable", "command", "hold", "name", "wait_longest", "cards", "anchor", "owner_uid", "job_class", "when_green", "green_deadline", "account")
    MODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTABLE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WAIT_LONGEST_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    JOB_CLASS_FIELD_NUMBER: _ClassVar[int]
    WHEN_GREEN_FIELD_NUMBER: _ClassVar[int]
    GREEN_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    mode: str
    gpus: int
    priority: int
    wait_s: float
    restartable: bool
    command: str
    hold: bool
    name: str
    wait_longest: bool
    cards: _containers.RepeatedScalarFieldContainer[int]
    anchor: str
    owner_uid: int
    job_class: str
    when_green: bool
    green_deadline: float
    account: str
    def __init__(self, mode: _Optional[str] = ..., gpus: _Optional[int] = ..., priority: _Optional[int] = ..., wait_s: _Optional[float] = ..., restartable: _Optional[bool] = ..., command: _Optional[str] = ..., hold: _Optional[bool] = ..., name: _Optional[str] = ..., wait_longest: _Optional[bool] = ..., cards: _Optional[_Iterable[int]] = ..., anchor: _Optional[str] = ..., owner_uid: _Optional[int] = ..., job_class: _Optional[str] = ..., when_green: _Optional[bool] = ..., green_deadline: _Optional[float] = ..., account: _Optional[str] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("ticket", "position", "queue_length", "deadline", "not_before", "not_before_reason")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_REASON_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    position: int
    queue_length: int
    deadline: float
    not_before: float
    not_before_reason: str
    def __init__(self, ticket: _Optional[str] = ..., position: _Optional[int] = ..., queue_length: _Optional[int] = ..., deadline: _Optional[float] = ..., not_before: _Optional[float] = ..., not_before_reason: _Optional[str] = ...) -> None: ...

class Granted(_message.Message):
    __slots__ = ("lease", "token")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    token: str
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., token: _Optional[str] = ...) -> None: ...

class AcquireUpdate(_message.Message):
    __slots__ = ("queued", "granted", "event")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    queued: Queued
    granted: Granted
    event: LeaseEvent
    def __init__(self, queued: _Optional[_Union[Queued, _Mapping]] = ..., granted: _Optional[_Union[Granted, _Mapping]] = ..., event: _Optional[_Union[LeaseEvent, _Mapping]] = ...) -> None: ...

class HoldRequest(_message.Message):
    __slots__ = ("lease_id", "token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    token: str
    def __init__(self, lease_id: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class LeaseEvent(_message.Message):
    __slots__ = ("kind", "lease_id", "message", "lease", "timestamp")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    kind: str
    lease_id: str
    message: str
    lease: Lease
    timestamp: float
    def __init__(self, kind: _Optional[str] = ..., lease_id: _Optional[str] = ..., message: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "token", "exit_code", "exit_signal", "started")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    token: str
    exit_code: int
    exit_signal: int
    started: float
    def __init__(self, lease_id: _Optional[str] = ..., token: _Optional[str] = ..., exit_code: _Optional[int] = ..., exit_signal: _Optional[int] = ..., started: _Optional[float] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class AckMoveRequest(_message.Message):
    __slots__ = ("lease_id", "token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    token: str
    def __init__(self, lease_id: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class AckMoveReply(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ConfineRequest(_message.Message):
    __slots__ = ("lease_id", "token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    token: str
    def __init__(self, lease_id: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class ConfineReply(_message.Message):
    __slots__ = ("enforced", "isolation", "warn", "unit")
    ENFORCED_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    WARN_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    enforced: bool
    isolation: str
    warn: bool
    unit: str
    def __init__(self, enforced: _Optional[bool] = ..., isolation: _Optional[str] = ..., warn: _Optional[bool] = ..., unit: _Optional[str] = ...) -> None: ...

class ListCardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCardsReply(_message.Message):
    __slots__ = ("cards", "hostname", "free_whole", "free_slices")
    class FreeSlicesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CARDS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    FREE_WHOLE_FIELD_NUMBER: _ClassVar[int]
    FREE_SLICES_FIELD_NUMBER: _ClassVar[int]
    cards: _containers.RepeatedCompositeFieldContainer[Card]
    hostname: str
    free_whole: int
    free_slices: _containers.ScalarMap[str, int]
    def __init__(self, cards: _Optional[_Iterable[_Union[Card, _Mapping]]] = ..., hostname: _Optional[str] = ..., free_whole: _Optional[int] = ..., free_slices: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("all", "limit", "lease_id")
    ALL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    all: bool
    limit: int
    lease_id: str
    def __init__(self, all: _Optional[bool] = ..., limit: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ListLeasesReply(_message.Message):
    __slots__ = ("leases", "queue", "leases_omitted", "queue_omitted")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    LEASES_OMITTED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_OMITTED_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    queue: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    leases_omitted: int
    queue_omitted: int
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., queue: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ..., leases_omitted: _Optional[int] = ..., queue_omitted: _Optional[int] = ...) -> None: ...

class TopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TopologyReply(_message.Message):
    __slots__ = ("size", "labels", "levels", "nvlinks", "bandwidth_gbps", "cards")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    NVLINKS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    size: int
    labels: _containers.RepeatedScalarFieldContainer[str]
    levels: _containers.RepeatedScalarFieldContainer[int]
    nvlinks: _containers.RepeatedScalarFieldContainer[int]
    bandwidth_gbps: _containers.RepeatedScalarFieldContainer[float]
    cards: _containers.RepeatedCompositeFieldContainer[Card]
    def __init__(self, size: _Optional[int] = ..., labels: _Optional[_Iterable[str]] = ..., levels: _Optional[_Iterable[int]] = ..., nvlinks: _Optional[_Iterable[int]] = ..., bandwidth_gbps: _Optional[_Iterable[float]] = ..., cards: _Optional[_Iterable[_Union[Card, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("card", "history")
    CARD_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    card: str
    history: int
    def __init__(self, card: _Optional[str] = ..., history: _Optional[int] = ...) -> None: ...

class Signal(_message.Message):
    __slots__ = ("name", "value", "threshold", "unit", "status", "reason", "until")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    threshold: float
    unit: str
    status: str
    reason: str
    until: float
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., threshold: _Optional[float] = ..., unit: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., until: _Optional[float] = ...) -> None: ...

class StateChange(_message.Message):
    __slots__ = ("timestamp", "from_state", "to_state", "reasons", "score")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    timestamp: float
    from_state: str
    to_state: str
    reasons: _containers.RepeatedScalarFieldContainer[str]
    score: int
    def __init__(self, timestamp: _Optional[float] = ..., from_state: _Optional[str] = ..., to_state: _Optional[str] = ..., reasons: _Optional[_Iterable[str]] = ..., score: _Optional[int] = ...) -> None: ...

class CardHealth(_message.Message):
    __slots__ = ("index", "uuid", "score", "state", "signals", "history", "reasons", "clear_since", "raw_state", "clear_needed_s", "back_at", "window_ends")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_SINCE_FIELD_NUMBER: _ClassVar[int]
    RAW_STATE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_NEEDED_S_FIELD_NUMBER: _ClassVar[int]
    BACK_AT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ENDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    score: int
    state: str
    signals: _containers.RepeatedCompositeFieldContainer[Signal]
    history: _containers.RepeatedCompositeFieldContainer[StateChange]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    clear_since: float
    raw_state: str
    clear_needed_s: float
    back_at: float
    window_ends: float
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., score: _Optional[int] = ..., state: _Optional[str] = ..., signals: _Optional[_Iterable[_Union[Signal, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[StateChange, _Mapping]]] = ..., reasons: _Optional[_Iterable[str]] = ..., clear_since: _Optional[float] = ..., raw_state: _Optional[str] = ..., clear_needed_s: _Optional[float] = ..., back_at: _Optional[float] = ..., window_ends: _Optional[float] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("cards",)
    CARDS_FIELD_NUMBER: _ClassVar[int]
    cards: _containers.RepeatedCompositeFieldContainer[CardHealth]
    def __init__(self, cards: _Optional[_Iterable[_Union[CardHealth, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("timestamp", "kind", "card", "lease_id", "message", "id")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CARD_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    timestamp: float
    kind: str
    card: int
    lease_id: str
    message: str
    id: int
    def __init__(self, timestamp: _Optional[float] = ..., kind: _Optional[str] = ..., card: _Optional[int] = ..., lease_id: _Optional[str] = ..., message: _Optional[str] = ..., id: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("card", "lease_id", "limit")
    CARD_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    card: int
    lease_id: str
    limit: int
    def __init__(self, card: _Optional[int] = ..., lease_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class EventsReply(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("min_interval_s",)
    MIN_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    min_interval_s: float
    def __init__(self, min_interval_s: _Optional[float] = ...) -> None: ...

class WatchUpdate(_message.Message):
    __slots__ = ("cards", "leases", "events")
    CARDS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    cards: ListCardsReply
    leases: ListLeasesReply
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, cards: _Optional[_Union[ListCardsReply, _Mapping]] = ..., leases: _Optional[_Union[ListLeasesReply, _Mapping]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class CardRequest(_message.Message):
    __slots__ = ("card",)
    CARD_FIELD_NUMBER: _ClassVar[int]
    card: str
    def __init__(self, card: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("card", "reason")
    CARD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    card: str
    reason: str
    def __init__(self, card: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SetCardModeRequest(_message.Message):
    __slots__ = ("card", "mode")
    CARD_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    card: str
    mode: str
    def __init__(self, card: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class CardReply(_message.Message):
    __slots__ = ("card",)
    CARD_FIELD_NUMBER: _ClassVar[int]
    card: Card
    def __init__(self, card: _Optional[_Union[Card, _Mapping]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("lease_id", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class FaultRequest(_message.Message):
    __slots__ = ("card", "kind", "xid")
    CARD_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    card: str
    kind: str
    xid: int
    def __init__(self, card: _Optional[str] = ..., kind: _Optional[str] = ..., xid: _Optional[int] = ...) -> None: ...

class FaultReply(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("lease_id", "from_cards", "to_cards", "cost", "reason", "mode", "wave", "state", "detail")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_CARDS_FIELD_NUMBER: _ClassVar[int]
    TO_CARDS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    from_cards: _containers.RepeatedScalarFieldContainer[int]
    to_cards: _containers.RepeatedScalarFieldContainer[int]
    cost: float
    reason: str
    mode: str
    wave: int
    state: str
    detail: str
    def __init__(self, lease_id: _Optional[str] = ..., from_cards: _Optional[_Iterable[int]] = ..., to_cards: _Optional[_Iterable[int]] = ..., cost: _Optional[float] = ..., reason: _Optional[str] = ..., mode: _Optional[str] = ..., wave: _Optional[int] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class FreeCards(_message.Message):
    __slots__ = ("idle", "group", "group_gbps", "quality_gbps", "value")
    IDLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_GBPS_FIELD_NUMBER: _ClassVar[int]
    QUALITY_GBPS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    idle: _containers.RepeatedScalarFieldContainer[int]
    group: _containers.RepeatedScalarFieldContainer[int]
    group_gbps: float
    quality_gbps: float
    value: float
    def __init__(self, idle: _Optional[_Iterable[int]] = ..., group: _Optional[_Iterable[int]] = ..., group_gbps: _Optional[float] = ..., quality_gbps: _Optional[float] = ..., value: _Optional[float] = ...) -> None: ...

class DefragRequest(_message.Message):
    __slots__ = ("apply", "move_budget_pct", "gpus", "wait")
    APPLY_FIELD_NUMBER: _ClassVar[int]
    MOVE_BUDGET_PCT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    apply: bool
    move_budget_pct: float
    gpus: int
    wait: bool
    def __init__(self, apply: _Optional[bool] = ..., move_budget_pct: _Optional[float] = ..., gpus: _Optional[int] = ..., wait: _Optional[bool] = ...) -> None: ...

class DefragReply(_message.Message):
    __slots__ = ("moves", "applied", "summary", "before", "after", "cost", "move_budget", "move_budget_pct", "active_leases", "movable_leases", "gpus", "target_cards", "notes")
    MOVES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    MOVE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MOVE_BUDGET_PCT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    MOVABLE_LEASES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TARGET_CARDS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    applied: bool
    summary: str
    before: FreeCards
    after: FreeCards
    cost: float
    move_budget: int
    move_budget_pct: float
    active_leases: int
    movable_leases: int
    gpus: int
    target_cards: _containers.RepeatedScalarFieldContainer[int]
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ..., applied: _Optional[bool] = ..., summary: _Optional[str] = ..., before: _Optional[_Union[FreeCards, _Mapping]] = ..., after: _Optional[_Union[FreeCards, _Mapping]] = ..., cost: _Optional[float] = ..., move_budget: _Optional[int] = ..., move_budget_pct: _Optional[float] = ..., active_leases: _Optional[int] = ..., movable_leases: _Optional[int] = ..., gpus: _Optional[int] = ..., target_cards: _Optional[_Iterable[int]] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AccountsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("by", "since", "until")
    BY_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    by: str
    since: float
    until: float
    def __init__(self, by: _Optional[str] = ..., since: _Optional[float] = ..., until: _Optional[float] = ...) -> None: ...

class ReportRow(_message.Message):
    __slots__ = ("key", "gpu_hours", "jobs", "mean_wait_s", "p95_wait_s", "reclaims_suffered", "reclaims_caused")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GPU_HOURS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    MEAN_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    P95_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RECLAIMS_SUFFERED_FIELD_NUMBER: _ClassVar[int]
    RECLAIMS_CAUSED_FIELD_NUMBER: _ClassVar[int]
    key: str
    gpu_hours: float
    jobs: int
    mean_wait_s: float
    p95_wait_s: float
    reclaims_suffered: int
    reclaims_caused: int
    def __init__(self, key: _Optional[str] = ..., gpu_hours: _Optional[float] = ..., jobs: _Optional[int] = ..., mean_wait_s: _Optional[float] = ..., p95_wait_s: _Optional[float] = ..., reclaims_suffered: _Optional[int] = ..., reclaims_caused: _Optional[int] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("by", "since", "until", "rows", "hosts", "hosts_missing", "truncated")
    BY_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_MISSING_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    by: str
    since: float
    until: float
    rows: _containers.RepeatedCompositeFieldContainer[ReportRow]
    hosts: _containers.RepeatedScalarFieldContainer[str]
    hosts_missing: _containers.RepeatedScalarFieldContainer[str]
    truncated: bool
    def __init__(self, by: _Optional[str] = ..., since: _Optional[float] = ..., until: _Optional[float] = ..., rows: _Optional[_Iterable[_Union[ReportRow, _Mapping]]] = ..., hosts: _Optional[_Iterable[str]] = ..., hosts_missing: _Optional[_Iterable[str]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class UsageRecordsRequest(_message.Message):
    __slots__ = ("since", "until")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    since: float
    until: float
    def __init__(self, since: _Optional[float] = ..., until: _Optional[float] = ...) -> None: ...

class UsageRecord(_message.Message):
    __slots__ = ("account", "owner_uid", "user", "card_model", "gpus", "start", "end", "wait_s")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    CARD_MODEL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    account: str
    owner_uid: int
    user: str
    card_model: str
    gpus: float
    start: float
    end: float
    wait_s: float
    def __init__(self, account: _Optional[str] = ..., owner_uid: _Optional[int] = ..., user: _Optional[str] = ..., card_model: _Optional[str] = ..., gpus: _Optional[float] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ReclaimRecord(_message.Message):
    __slots__ = ("at", "victim", "beneficiary")
    AT_FIELD_NUMBER: _ClassVar[int]
    VICTIM_FIELD_NUMBER: _ClassVar[int]
    BENEFICIARY_FIELD_NUMBER: _ClassVar[int]
    at: float
    victim: str
    beneficiary: str
    def __init__(self, at: _Optional[float] = ..., victim: _Optional[str] = ..., beneficiary: _Optional[str] = ...) -> None: ...

class UsageRecordsReply(_message.Message):
    __slots__ = ("host", "records", "reclaims", "truncated")
    HOST_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    host: str
    records: _containers.RepeatedCompositeFieldContainer[UsageRecord]
    reclaims: _containers.RepeatedCompositeFieldContainer[ReclaimRecord]
    truncated: bool
    def __init__(self, host: _Optional[str] = ..., records: _Optional[_Iterable[_Union[UsageRecord, _Mapping]]] = ..., reclaims: _Optional[_Iterable[_Union[ReclaimRecord, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class AccountRow(_message.Message):
    __slots__ = ("name", "quota", "limit", "weight", "parent", "share", "allocated", "usage_gpu_hours", "waiting", "reclaimed_from", "reclaimed_for", "removed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    USAGE_GPU_HOURS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FROM_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FOR_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    name: str
    quota: float
    limit: float
    weight: float
    parent: str
    share: float
    allocated: float
    usage_gpu_hours: float
    waiting: float
    reclaimed_from: int
    reclaimed_for: int
    removed: bool
    def __init__(self, name: _Optional[str] = ..., quota: _Optional[float] = ..., limit: _Optional[float] = ..., weight: _Optional[float] = ..., parent: _Optional[str] = ..., share: _Optional[float] = ..., allocated: _Optional[float] = ..., usage_gpu_hours: _Optional[float] = ..., waiting: _Optional[float] = ..., reclaimed_from: _Optional[int] = ..., reclaimed_for: _Optional[int] = ..., removed: _Optional[bool] = ...) -> None: ...

class AccountsReply(_message.Message):
    __slots__ = ("enabled", "config_hash", "reclaim", "capacity", "accounts")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    config_hash: str
    reclaim: str
    capacity: float
    accounts: _containers.RepeatedCompositeFieldContainer[AccountRow]
    def __init__(self, enabled: _Optional[bool] = ..., config_hash: _Optional[str] = ..., reclaim: _Optional[str] = ..., capacity: _Optional[float] = ..., accounts: _Optional[_Iterable[_Union[AccountRow, _Mapping]]] = ...) -> None: ...

class ClusterHost(_message.Message):
    __slots__ = ("name", "addr", "state", "incarnation", "age_s", "self", "zone", "block", "domain", "cards", "free_whole", "free_slices", "health", "queue", "summary_valid", "group_gbps", "accounts_hash")
    class FreeSlicesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    SELF_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    FREE_WHOLE_FIELD_NUMBER: _ClassVar[int]
    FREE_SLICES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_VALID_FIELD_NUMBER: _ClassVar[int]
    GROUP_GBPS_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTS_HASH_FIELD_NUMBER: _ClassVar[int]
    name: str
    addr: str
    state: str
    incarnation: int
    age_s: float
    self: bool
    zone: str
    block: str
    domain: str
    cards: int
    free_whole: int
    free_slices: _containers.ScalarMap[str, int]
    health: int
    queue: int
    summary_valid: bool
    group_gbps: _containers.RepeatedScalarFieldContainer[float]
    accounts_hash: str
    def __init__(self_, name: _Optional[str] = ..., addr: _Optional[str] = ..., state: _Optional[str] = ..., incarnation: _Optional[int] = ..., age_s: _Optional[float] = ..., self: _Optional[bool] = ..., zone: _Optional[str] = ..., block: _Optional[str] = ..., domain: _Optional[str] = ..., cards: _Optional[int] = ..., free_whole: _Optional[int] = ..., free_slices: _Optional[_Mapping[str, int]] = ..., health: _Optional[int] = ..., queue: _Optional[int] = ..., summary_valid: _Optional[bool] = ..., group_gbps: _Optional[_Iterable[float]] = ..., accounts_hash: _Optional[str] = ...) -> None: ...

class ClusterReply(_message.Message):
    __slots__ = ("enabled", "name", "hosts")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    name: str
    hosts: _containers.RepeatedCompositeFieldContainer[ClusterHost]
    def __init__(self, enabled: _Optional[bool] = ..., name: _Optional[str] = ..., hosts: _Optional[_Iterable[_Union[ClusterHost, _Mapping]]] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("mode", "nodes", "gpus_per_node", "replicas", "spread", "argv", "env", "cwd", "wait_s", "kill_on_bad_exit", "restartable", "name", "tasks_per_node", "label_tasks", "account")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    KILL_ON_BAD_EXIT_FIELD_NUMBER: _ClassVar[int]
    RESTARTABLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    LABEL_TASKS_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    mode: str
    nodes: int
    gpus_per_node: int
    replicas: int
    spread: bool
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    wait_s: float
    kill_on_bad_exit: bool
    restartable: bool
    name: str
    tasks_per_node: int
    label_tasks: bool
    account: str
    def __init__(self, mode: _Optional[str] = ..., nodes: _Optional[int] = ..., gpus_per_node: _Optional[int] = ..., replicas: _Optional[int] = ..., spread: _Optional[bool] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., wait_s: _Optional[float] = ..., kill_on_bad_exit: _Optional[bool] = ..., restartable: _Optional[bool] = ..., name: _Optional[str] = ..., tasks_per_node: _Optional[int] = ..., label_tasks: _Optional[bool] = ..., account: _Optional[str] = ...) -> None: ...

class JobInput(_message.Message):
    __slots__ = ("start", "stdin", "stdin_eof", "signal")
    START_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDIN_EOF_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    start: JobSpec
    stdin: bytes
    stdin_eof: bool
    signal: int
    def __init__(self, start: _Optional[_Union[JobSpec, _Mapping]] = ..., stdin: _Optional[bytes] = ..., stdin_eof: _Optional[bool] = ..., signal: _Optional[int] = ...) -> None: ...

class JobRank(_message.Message):
    __slots__ = ("rank", "host", "addr", "cards", "lease_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    addr: str
    cards: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., addr: _Optional[str] = ..., cards: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class JobPlaced(_message.Message):
    __slots__ = ("job", "ranks", "attempts", "refusals")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    job: str
    ranks: _containers.RepeatedCompositeFieldContainer[JobRank]
    attempts: int
    refusals: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[JobRank, _Mapping]]] = ..., attempts: _Optional[int] = ..., refusals: _Optional[_Iterable[str]] = ...) -> None: ...

class JobQueued(_message.Message):
    __slots__ = ("reason", "position")
    REASON_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    reason: str
    position: int
    def __init__(self, reason: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class RankOutput(_message.Message):
    __slots__ = ("rank", "fd", "data")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    fd: int
    data: bytes
    def __init__(self, rank: _Optional[int] = ..., fd: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RankEnded(_message.Message):
    __slots__ = ("rank", "exit_code", "signal", "error")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    exit_code: int
    signal: int
    error: str
    def __init__(self, rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class JobEnded(_message.Message):
    __slots__ = ("exit_code", "reason")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    reason: str
    def __init__(self, exit_code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("queued", "placed", "output", "rank_ended", "ended")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    RANK_ENDED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    queued: JobQueued
    placed: JobPlaced
    output: RankOutput
    rank_ended: RankEnded
    ended: JobEnded
    def __init__(self, queued: _Optional[_Union[JobQueued, _Mapping]] = ..., placed: _Optional[_Union[JobPlaced, _Mapping]] = ..., output: _Optional[_Union[RankOutput, _Mapping]] = ..., rank_ended: _Optional[_Union[RankEnded, _Mapping]] = ..., ended: _Optional[_Union[JobEnded, _Mapping]] = ...) -> None: ...

class SwimUpdate(_message.Message):
    __slots__ = ("name", "addr", "incarnation", "state", "meta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    name: str
    addr: str
    incarnation: int
    state: int
    meta: str
    def __init__(self, name: _Optional[str] = ..., addr: _Optional[str] = ..., incarnation: _Optional[int] = ..., state: _Optional[int] = ..., meta: _Optional[str] = ...) -> None: ...

class SwimMessage(_message.Message):
    __slots__ = ("kind", "seq", "src", "src_addr", "target", "target_addr", "about", "reply", "updates")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[SwimMessage.Kind]
        PING: _ClassVar[SwimMessage.Kind]
        ACK: _ClassVar[SwimMessage.Kind]
        PING_REQ: _ClassVar[SwimMessage.Kind]
        GOSSIP: _ClassVar[SwimMessage.Kind]
        PUSH_PULL: _ClassVar[SwimMessage.Kind]
    KIND_UNSPECIFIED: SwimMessage.Kind
    PING: SwimMessage.Kind
    ACK: SwimMessage.Kind
    PING_REQ: SwimMessage.Kind
    GOSSIP: SwimMessage.Kind
    PUSH_PULL: SwimMessage.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    SRC_ADDR_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDR_FIELD_NUMBER: _ClassVar[int]
    ABOUT_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    kind: SwimMessage.Kind
    seq: int
    src: str
    src_addr: str
    target: str
    target_addr: str
    about: str
    reply: bool
    updates: _containers.RepeatedCompositeFieldContainer[SwimUpdate]
    def __init__(self, kind: _Optional[_Union[SwimMessage.Kind, str]] = ..., seq: _Optional[int] = ..., src: _Optional[str] = ..., src_addr: _Optional[str] = ..., target: _Optional[str] = ..., target_addr: _Optional[str] = ..., about: _Optional[str] = ..., reply: _Optional[bool] = ..., updates: _Optional[_Iterable[_Union[SwimUpdate, _Mapping]]] = ...) -> None: ...

class SwimReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("job", "attempt", "mode", "count", "ttl_s", "uid", "gid", "user", "restartable", "command", "account")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    RESTARTABLE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    job: str
    attempt: int
    mode: str
    count: int
    ttl_s: float
    uid: int
    gid: int
    user: str
    restartable: bool
    command: str
    account: str
    def __init__(self, job: _Optional[str] = ..., attempt: _Optional[int] = ..., mode: _Optional[str] = ..., count: _Optional[int] = ..., ttl_s: _Optional[float] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., user: _Optional[str] = ..., restartable: _Optional[bool] = ..., command: _Optional[str] = ..., account: _Optional[str] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("cards", "expires_in_s")
    CARDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    cards: _containers.RepeatedScalarFieldContainer[int]
    expires_in_s: float
    def __init__(self, cards: _Optional[_Iterable[int]] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("job", "attempt")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job: str
    attempt: int
    def __init__(self, job: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("lease_id", "cards", "env", "free_port")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    FREE_PORT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    cards: _containers.RepeatedScalarFieldContainer[int]
    env: _containers.ScalarMap[str, str]
    free_port: int
    def __init__(self, lease_id: _Optional[str] = ..., cards: _Optional[_Iterable[int]] = ..., env: _Optional[_Mapping[str, str]] = ..., free_port: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("job", "attempt")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job: str
    attempt: int
    def __init__(self, job: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class LaunchSpec(_message.Message):
    __slots__ = ("job", "rank", "argv", "env", "cwd", "uid", "gid", "user", "tasks_per_node", "keep_going", "label", "output", "error", "time_limit_s", "kill_grace_s", "restartable", "restarts")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TASKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    KEEP_GOING_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    KILL_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTABLE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    uid: int
    gid: int
    user: str
    tasks_per_node: int
    keep_going: bool
    label: bool
    output: str
    error: str
    time_limit_s: float
    kill_grace_s: float
    restartable: bool
    restarts: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., user: _Optional[str] = ..., tasks_per_node: _Optional[int] = ..., keep_going: _Optional[bool] = ..., label: _Optional[bool] = ..., output: _Optional[str] = ..., error: _Optional[str] = ..., time_limit_s: _Optional[float] = ..., kill_grace_s: _Optional[float] = ..., restartable: _Optional[bool] = ..., restarts: _Optional[int] = ...) -> None: ...

class LaunchInput(_message.Message):
    __slots__ = ("start", "stdin", "stdin_eof", "signal")
    START_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDIN_EOF_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    start: LaunchSpec
    stdin: bytes
    stdin_eof: bool
    signal: int
    def __init__(self, start: _Optional[_Union[LaunchSpec, _Mapping]] = ..., stdin: _Optional[bytes] = ..., stdin_eof: _Optional[bool] = ..., signal: _Optional[int] = ...) -> None: ...

class LaunchStarted(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class LaunchEvent(_message.Message):
    __slots__ = ("started", "output", "ended")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    started: LaunchStarted
    output: RankOutput
    ended: RankEnded
    def __init__(self, started: _Optional[_Union[LaunchStarted, _Mapping]] = ..., output: _Optional[_Union[RankOutput, _Mapping]] = ..., ended: _Optional[_Union[RankEnded, _Mapping]] = ...) -> None: ...

class LeaseUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("lease_id", "mode", "job_class", "auto", "cap_pct", "used_pct", "peak_pct", "mem_cap_bytes", "mem_used_bytes", "throttled", "readings", "recommendation", "auto_moves")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    JOB_CLASS_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    CAP_PCT_FIELD_NUMBER: _ClassVar[int]
    USED_PCT_FIELD_NUMBER: _ClassVar[int]
    PEAK_PCT_FIELD_NUMBER: _ClassVar[int]
    MEM_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    THROTTLED_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDATION_FIELD_NUMBER: _ClassVar[int]
    AUTO_MOVES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    mode: str
    job_class: str
    auto: bool
    cap_pct: float
    used_pct: float
    peak_pct: float
    mem_cap_bytes: int
    mem_used_bytes: int
    throttled: bool
    readings: int
    recommendation: str
    auto_moves: int
    def __init__(self, lease_id: _Optional[str] = ..., mode: _Optional[str] = ..., job_class: _Optional[str] = ..., auto: _Optional[bool] = ..., cap_pct: _Optional[float] = ..., used_pct: _Optional[float] = ..., peak_pct: _Optional[float] = ..., mem_cap_bytes: _Optional[int] = ..., mem_used_bytes: _Optional[int] = ..., throttled: _Optional[bool] = ..., readings: _Optional[int] = ..., recommendation: _Optional[str] = ..., auto_moves: _Optional[int] = ...) -> None: ...

class LeaseUsageReply(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[UsageRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ...) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("lease_id", "token", "mode")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    token: str
    mode: str
    def __init__(self, lease_id: _Optional[str] = ..., token: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class ResizeReply(_message.Message):
    __slots__ = ("lease", "how")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    HOW_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    how: str
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., how: _Optional[str] = ...) -> None: ...

class WatchLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class LeaseLoad(_message.Message):
    __slots__ = ("lease_id", "mode", "t", "cap_pct", "used_pct", "mem_used_bytes", "throttled", "waiting_for_size", "moving")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    T_FIELD_NUMBER: _ClassVar[int]
    CAP_PCT_FIELD_NUMBER: _ClassVar[int]
    USED_PCT_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    THROTTLED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    MOVING_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    mode: str
    t: float
    cap_pct: float
    used_pct: float
    mem_used_bytes: int
    throttled: bool
    waiting_for_size: int
    moving: bool
    def __init__(self, lease_id: _Optional[str] = ..., mode: _Optional[str] = ..., t: _Optional[float] = ..., cap_pct: _Optional[float] = ..., used_pct: _Optional[float] = ..., mem_used_bytes: _Optional[int] = ..., throttled: _Optional[bool] = ..., waiting_for_size: _Optional[int] = ..., moving: _Optional[bool] = ...) -> None: ...

class JobRecord(_message.Message):
    __slots__ = ("id", "name", "kind", "uid", "gid", "state", "exit_code", "exit_signal", "hosts", "submitted", "started", "ended", "reason", "command", "cwd", "output", "error", "lease_id", "mode", "gpus", "priority", "time_limit_s", "after", "restartable", "restarts", "account", "ranks")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    RESTARTABLE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    kind: str
    uid: int
    gid: int
    state: str
    exit_code: int
    exit_signal: int
    hosts: _containers.RepeatedScalarFieldContainer[str]
    submitted: float
    started: float
    ended: float
    reason: str
    command: str
    cwd: str
    output: str
    error: str
    lease_id: str
    mode: str
    gpus: int
    priority: int
    time_limit_s: float
    after: _containers.RepeatedScalarFieldContainer[str]
    restartable: bool
    restarts: int
    account: str
    ranks: _containers.RepeatedCompositeFieldContainer[JobRankState]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[str] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., state: _Optional[str] = ..., exit_code: _Optional[int] = ..., exit_signal: _Optional[int] = ..., hosts: _Optional[_Iterable[str]] = ..., submitted: _Optional[float] = ..., started: _Optional[float] = ..., ended: _Optional[float] = ..., reason: _Optional[str] = ..., command: _Optional[str] = ..., cwd: _Optional[str] = ..., output: _Optional[str] = ..., error: _Optional[str] = ..., lease_id: _Optional[str] = ..., mode: _Optional[str] = ..., gpus: _Optional[int] = ..., priority: _Optional[int] = ..., time_limit_s: _Optional[float] = ..., after: _Optional[_Iterable[str]] = ..., restartable: _Optional[bool] = ..., restarts: _Optional[int] = ..., account: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[JobRankState, _Mapping]]] = ...) -> None: ...

class JobRankState(_message.Message):
    __slots__ = ("rank", "host", "state", "exit_code", "exit_signal", "reason", "job", "ended")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    state: str
    exit_code: int
    exit_signal: int
    reason: str
    job: str
    ended: float
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., state: _Optional[str] = ..., exit_code: _Optional[int] = ..., exit_signal: _Optional[int] = ..., reason: _Optional[str] = ..., job: _Optional[str] = ..., ended: _Optional[float] = ...) -> None: ...

class PeerRanksReply(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[JobRankState]
    def __init__(self, ranks: _Optional[_Iterable[_Union[JobRankState, _Mapping]]] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("argv", "cwd", "env", "name", "mode", "gpus", "priority", "wait_s", "output", "error", "time_limit_s", "after", "kill_grace_s", "restartable", "account", "nodes", "gpus_per_node", "tasks_per_node", "replicas", "spread", "kill_on_bad_exit")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARGV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    KILL_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTABLE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    TASKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    KILL_ON_BAD_EXIT_FIELD_NUMBER: _ClassVar[int]
    argv: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    env: _containers.ScalarMap[str, str]
    name: str
    mode: str
    gpus: int
    priority: int
    wait_s: float
    output: str
    error: str
    time_limit_s: float
    after: _containers.RepeatedScalarFieldContainer[str]
    kill_grace_s: float
    restartable: bool
    account: str
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    replicas: int
    spread: bool
    kill_on_bad_exit: bool
    def __init__(self, argv: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., name: _Optional[str] = ..., mode: _Optional[str] = ..., gpus: _Optional[int] = ..., priority: _Optional[int] = ..., wait_s: _Optional[float] = ..., output: _Optional[str] = ..., error: _Optional[str] = ..., time_limit_s: _Optional[float] = ..., after: _Optional[_Iterable[str]] = ..., kill_grace_s: _Optional[float] = ..., restartable: _Optional[bool] = ..., account: _Optional[str] = ..., nodes: _Optional[int] = ..., gpus_per_node: _Optional[int] = ..., tasks_per_node: _Optional[int] = ..., replicas: _Optional[int] = ..., spread: _Optional[bool] = ..., kill_on_bad_exit: _Optional[bool] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: JobRecord
    def __init__(self, job: _Optional[_Union[JobRecord, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("all", "uid", "state", "since", "job", "limit", "here")
    ALL_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    HERE_FIELD_NUMBER: _ClassVar[int]
    all: bool
    uid: int
    state: str
    since: float
    job: str
    limit: int
    here: bool
    def __init__(self, all: _Optional[bool] = ..., uid: _Optional[int] = ..., state: _Optional[str] = ..., since: _Optional[float] = ..., job: _Optional[str] = ..., limit: _Optional[int] = ..., here: _Optional[bool] = ...) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs", "omitted")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobRecord]
    omitted: int
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobRecord, _Mapping]]] = ..., omitted: _Optional[int] = ...) -> None: ...

class CancelJobsRequest(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobRecord]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobRecord, _Mapping]]] = ...) -> None: ...

class JobLogsRequest(_message.Message):
    __slots__ = ("job", "follow", "rank", "error")
    JOB_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job: str
    follow: bool
    rank: int
    error: bool
    def __init__(self, job: _Optional[str] = ..., follow: _Optional[bool] = ..., rank: _Optional[int] = ..., error: _Optional[bool] = ...) -> None: ...

class JobLogChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class PeerJobsRequest(_message.Message):
    __slots__ = ("uid", "list", "jobs", "logs", "cancel", "reason")
    UID_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    LOGS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    uid: int
    list: ListJobsRequest
    jobs: _containers.RepeatedScalarFieldContainer[str]
    logs: JobLogsRequest
    cancel: bool
    reason: str
    def __init__(self, uid: _Optional[int] = ..., list: _Optional[_Union[ListJobsRequest, _Mapping]] = ..., jobs: _Optional[_Iterable[str]] = ..., logs: _Optional[_Union[JobLogsRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
