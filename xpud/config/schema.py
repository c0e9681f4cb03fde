"""The schema of ``xpud.toml``: its sections, every key with its default, rules and documentation.

Every key lives in one dataclass field below, with its default and its documentation (``doc``).
``etc/xpud.toml`` documents every key, and a test checks that it lists exactly these keys with these
defaults. Reading a file into a ``Config``: ``xpud.config.read``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xpud.config import accounts as accounts_config
from xpud.config.windows import WindowSpec
from xpud.model import SliceSpec

DEFAULT_PATH = Path("/etc/xpud/xpud.toml")


def _key(default: Any, doc: str, **rules: Any) -> Any:
    """A config key: default, one-line documentation, and rules (choices, min, max)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc, **rules})
    return field(default=default, metadata={"doc": doc, **rules})


@dataclass(frozen=True)
class DaemonSection:
    runtime_dir: str = _key("/run/xpud", "Sockets live here: xpud.sock (users), admin.sock, cred.sock.")
    state_dir: str = _key("/var/lib/xpud", "The lease ledger (ledger.sqlite) lives here.")
    log_level: str = _key("info", "Log verbosity.", choices=("debug", "info", "warning", "error"))
    admin_group: str = _key("xpud-admin", "Members of this group (and root) may use admin.sock.")
    event_loop: str = _key(
        "auto",
        "The event loop: uvloop's when installed (auto), or asyncio's own, or uvloop's (refused if absent).",
        choices=("auto", "asyncio", "uvloop"),
    )


@dataclass(frozen=True)
class DevicesSection:
    backend: str = _key(
        "nvml",
        "Where cards come from: the NVIDIA driver, or a simulated machine.",
        choices=("nvml", "simulated"),
    )
    machine: str = _key("dgx-h100", "Simulated machine: a name in etc/machines/ or a path to a description.")
    seed: int = _key(0, "Seed of the simulated machine's varying values.", min=0, max=2**63 - 1)
    sim_state: str = _key(
        "",
        "File where the simulated machine's MIG and MPS state outlives the daemon; "
        "empty = simulated-hardware.json in state_dir.",
    )


@dataclass(frozen=True)
class CardsSection:
    isolation: str = _key(
        "auto",
        "How slices are isolated: auto = MIG where the card has it, else MPS; "
        "none = counted only (no enforcement).",
        choices=("auto", "mig", "mps", "none"),
    )
    reserved_memory_mib: int = _key(
        0,
        "Memory per card kept out of slices for the driver and context (MiB); 0 = the backend's estimate.",
        min=0,
        max=1 << 20,
    )
    mig_switch: str = _key(
        "idle",
        "Whether xpud switches MIG on and off: idle = on idle cards as slice and whole-card demand move "
        "(with a GPU reset where the driver needs one); never = the operator sets MIG modes.",
        choices=("idle", "never"),
    )
    mig_idle_keep_s: float = _key(
        30.0,
        "Seconds a released, empty MIG instance is kept for reuse by a slice of its size; 0 = destroy.",
        min=0.0,
        max=86400.0,
    )
    mps_idle_keep_s: float = _key(
        30.0,
        "Seconds an MPS server whose last slice ended is kept for the next slice of the same uid; "
        "0 = shut down at release. Leftover processes of an ended lease live until then, or until "
        "another user's slice comes to the card.",
        min=0.0,
        max=3600.0,
    )
    mps_keeper: bool = _key(
        False,
        "Whether `xpud mps-keeper` (its own process or pod) starts and quits the MPS control daemons, so "
        "that they outlive xpud's container; false = xpud starts them itself.",
    )
    mig_profiles_file: str = _key(
        "", "Which MIG profiles serve each slice size, per card model; empty = xpud's etc/mig-profiles.toml."
    )


@dataclass(frozen=True)
class LeasesSection:
    grace_s: float = _key(
        10.0, "Seconds a lease survives after its holder's Hold stream breaks.", min=0.0, max=86400.0
    )
    restore_grace_s: float = _key(
        30.0,
        "Seconds a lease restored from the ledger survives, from when the restarted daemon serves, "
        "until its holder reconnects (at least grace_s).",
        min=0.0,
        max=86400.0,
    )
    max_wait_s: float = _key(
        86400.0, "Longest --wait a request may ask for (seconds).", min=0.0, max=30 * 86400.0
    )
    default_wait_s: float = _key(
        0.0,
        "Seconds a request queues when it does not say (`xpu run` without --wait); 0: fail at once. "
        "At most max_wait_s.",
        min=0.0,
        max=30 * 86400.0,
    )
    credential_ttl_s: float = _key(
        300.0, "Lifetime of a peer credential issued on cred.sock (seconds).", min=1.0, max=86400.0
    )
    history_days: int = _key(
        30,
        "Days ended leases, their events, finished reservations and usage readings are kept in the "
        "ledger (pruned hourly); 0 = kept forever. Raised to [forecast] history_days when the forecast "
        "is on.",
        min=0,
        max=36500,
    )
    max_priority: int = _key(
        100, "Highest priority a request may ask for; negative down to -max.", min=0, max=1_000_000
    )


@dataclass(frozen=True)
class LimitsSection:
    """Per-user limits on requests (``Engine.validate`` and ``Engine.acquire``; a multi-host job's
    reservation on each host counts as a lease there, and its coordinator checks its own). Operators (root and
    ``[daemon] admin_group``) and members of ``exempt_groups`` are exempt."""

    max_user_priority: int = _key(
        0,
        "Highest priority a caller who is not an operator may ask for (operators: [leases] max_priority).",
        min=-1_000_000,
        max=1_000_000,
    )
    max_leases_per_uid: int = _key(
        64,
        "Most active leases plus queued requests one uid may have at once; 0 = no limit.",
        min=0,
        max=1_000_000,
    )
    max_queued_per_uid: int = _key(
        16, "Most requests one uid may have waiting in the queue at once; 0 = no limit.", min=0, max=1_000_000
    )
    exempt_groups: tuple[str, ...] = _key((), "Unix groups whose members these limits do not apply to.")


# XID classes; where each list comes from (meanings: NVIDIA's XID catalogue, xpud.hw.signals.XID_MEANING):
# - application: what NVIDIA's Kubernetes device plugin skips as application errors (internal/rm/health.go).
# - fail: what DCGM's health watch always fails (DCGM >= 4.4, DcgmHealthWatch.cpp BuildXidMappings:
#   48, 74, 79, 95, 119, 120, 140) and 64, which its memory watch fails. Before 4.4 the health watch acted
#   on XID 95 only.
# - warn: DCGM's warnings (94, and its per-watch table: memory 32/63, PCIe 38/39/42, thermal 60-62, power
#   54/56-58/78, NVLink 67/73/121/137, InfoROM 93 (Volta only there); its 31 and 43 are application XIDs
#   here) and 92, a high single-bit ECC rate, which the catalogue calls non-critical (the card corrected
#   them) and DCGM does not list.
_XID_APPLICATION = (13, 31, 43, 45, 68, 109)
_XID_FAIL = (48, 64, 74, 79, 95, 119, 120, 140)
_XID_WARN = (32, 38, 39, 42, 54, 56, 57, 58, 60, 61, 62, 63, 67, 73, 78, 92, 93, 94, 121, 137)


@dataclass(frozen=True)
class HealthSection:
    """Health signals, scoring, hysteresis and the actions on unhealthy cards (``xpud.hw.health``)."""

    poll_interval_s: float = _key(
        5.0, "Seconds between two polls of every card's signals.", min=0.05, max=3600.0
    )
    clear_s: float = _key(
        60.0,
        "Seconds a card's signals must stay clear before its state improves (hysteresis).",
        min=0.0,
        max=7 * 86400.0,
    )
    flap_window_s: float = _key(
        3600.0, "Failures within this many seconds count for flap damping.", min=0.0, max=30 * 86400.0
    )
    flap_factor: float = _key(
        2.0,
        "Each further failure within flap_window_s multiplies the clear time by this.",
        min=1.0,
        max=100.0,
    )
    clear_max_s: float = _key(
        3600.0, "Longest clear time flap damping may ask for (seconds).", min=0.0, max=30 * 86400.0
    )
    event_window_s: float = _key(
        300.0,
        "Seconds an XID or a rise of an error counter (ECC, remapped rows, NVLink) keeps its signal raised.",
        min=0.0,
        max=7 * 86400.0,
    )
    move_ack_timeout_s: float = _key(
        30.0,
        "Seconds a restartable job's holder has to stop it and acknowledge a move; then the move is "
        "abandoned and the lease marked.",
        min=0.1,
        max=3600.0,
    )
    temperature_margin_c: int = _key(
        0, "Warn when the temperature is within this many degrees of the slowdown threshold.", min=0, max=200
    )
    power_warn_ratio: float = _key(
        1.05,
        "Warn when the power draw is above this share of the enforced power limit (a card at its cap is "
        "normal under training).",
        min=0.0,
        max=10.0,
    )
    power_warn_samples: int = _key(
        3, "Warn only when this many samples in a row are above power_warn_ratio.", min=1, max=1000
    )
    clock_warn_mask: int = _key(
        0xE8,
        "Clock-event reasons that warn: HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, power brake 0x80.",
        min=0,
        max=2**64 - 1,
    )
    ecc_sbe_volatile_warn: int = _key(
        1000,
        "Warn when this many corrected (single-bit) ECC errors were counted since the last reset.",
        min=1,
        max=2**63 - 1,
    )
    retired_pages_fail: int = _key(63, "Fail when this many pages are retired (DCGM).", min=1, max=1 << 20)
    retired_pages_dbe_fail: int = _key(
        15,
        "Fail when more pages than this are retired for double-bit errors and still growing (DCGM).",
        min=0,
        max=1 << 20,
    )
    pcie_replay_warn_per_min: float = _key(
        0.0,
        "Warn when PCIe replays in the last minute exceed this; 0: derive it from each card's PCIe link "
        "as DCGM does (ceil(GT/s / 1000 x 60 x lanes): Gen4 x16 16, Gen5 x16 31).",
        min=0.0,
        max=1e9,
    )
    nvlink_crc_fail_per_s: float = _key(
        100.0,
        "Fail when NVLink CRC errors (flit + data, all links) reach this rate (DCGM).",
        min=0.0,
        max=1e9,
    )
    fragmentation_slice: str = _key(
        "vxpu-quarter", "Slice size that memory fragmentation is measured against (a [slices] name)."
    )
    fragmentation_info: float = _key(
        0.5,
        "Report (without changing the state) fragmentation above this share of free memory.",
        min=0.0,
        max=1.0,
    )
    xid_application: tuple[int, ...] = _key(
        _XID_APPLICATION,
        "Application XIDs: counted against the lease that caused them, not the card.",
        min=0,
        max=65535,
    )
    xid_fail: tuple[int, ...] = _key(_XID_FAIL, "XIDs that make a card unhealthy.", min=0, max=65535)
    xid_warn: tuple[int, ...] = _key(_XID_WARN, "XIDs that make a card degraded.", min=0, max=65535)
    xid_reset: tuple[int, ...] = _key(
        _XID_FAIL,
        "XIDs that keep a card failed until a GPU reset is seen (they do not clear with time).",
        min=0,
        max=65535,
    )
    xid_unlisted: str = _key(
        "fail", "What an XID in none of the lists does to the card.", choices=("fail", "warn", "ignore")
    )
    weight_lost: int = _key(100, "Score points a lost card loses.", min=0, max=100)
    weight_xid: int = _key(60, "Score points for a failing XID (half for a warning).", min=0, max=100)
    weight_ecc: int = _key(60, "Score points for ECC errors.", min=0, max=100)
    weight_memory_errors: int = _key(50, "Score points for retired pages / remapped rows.", min=0, max=100)
    weight_nvlink: int = _key(40, "Score points for NVLink errors or links down.", min=0, max=100)
    weight_temperature: int = _key(30, "Score points for temperature.", min=0, max=100)
    weight_clock_events: int = _key(20, "Score points for clock-event (throttle) reasons.", min=0, max=100)
    weight_inforom: int = _key(20, "Score points for an invalid InfoROM.", min=0, max=100)
    weight_pcie: int = _key(15, "Score points for PCIe replays.", min=0, max=100)
    weight_power: int = _key(10, "Score points for power above the limit.", min=0, max=100)
    weight_fabric: int = _key(
        100, "Score points for an NVSwitch fabric that is not trained (CUDA fails then).", min=0, max=100
    )
    weight_recovery: int = _key(
        60, "Score points for a recovery action the driver asks for (a reset, a reboot).", min=0, max=100
    )
    weight_fragmentation: int = _key(10, "Score points for memory fragmentation.", min=0, max=100)


@dataclass(frozen=True)
class DefragSection:
    """The defragmenter (``xpud.controllers.defragmenter``): moves restartable jobs to free whole cards."""

    enabled: bool = _key(
        False, "Defragment periodically: plan, record the plan as an event, then move restartable jobs."
    )
    interval_s: float = _key(300.0, "Seconds between two periodic runs (when enabled).", min=1.0, max=86400.0)
    move_budget_pct: float = _key(
        25.0,
        "Most moves one run may make, as a percentage of the active leases (rounded down); also the "
        "default of `xpu defrag --move-budget`.",
        min=0.0,
        max=100.0,
    )
    min_gain: float = _key(
        1.0,
        "A periodic run acts only when its plan frees at least this many whole cards (0: also plans "
        "that only bring free cards together on an NVLink island or PCIe switch).",
        min=0.0,
        max=1e6,
    )
    move_cost: float = _key(
        0.25,
        "Cost of moving one job, in idle whole cards (times the cards it holds, times 1 + its earlier "
        "moves); a plan must gain more than it costs.",
        min=0.0,
        max=1e6,
    )
    make_room: bool = _key(
        True,
        "When a whole-card request has waited make_room_after_s and does not fit, move restartable jobs "
        "(within move_budget_pct) to make room for it, even with enabled = false.",
    )
    make_room_after_s: float = _key(
        15.0,
        "Seconds a whole-card request waits before the defragmenter makes room for it.",
        min=0.0,
        max=86400.0,
    )


MAX_SEEDS = 64  # seed peers a host may list


@dataclass(frozen=True)
class ClusterSection:
    """Federation with peer daemons (``xpud.federation``). Off (no peer traffic) unless ``listen`` is set."""

    name: str = _key("", "This host's name in the cluster (its certificate's name); empty = the hostname.")
    listen: str = _key("", "IP:PORT of the Peer service (mutual TLS); empty = federation off.")
    seeds: tuple[str, ...] = _key((), "Peers to join through, as HOST:PORT (at most 64).")
    zone: str = _key("", "Network location: the zone (largest area), for multi-host placement.")
    block: str = _key("", "Network location: the block within the zone.")
    domain: str = _key("", "Network location: the domain (rack or leaf switch) within the block.")
    ca: str = _key("", "The site CA's certificate (ca.crt from `xpu certs init`).")
    cert: str = _key("", "This host's certificate (NAME.crt from `xpu certs issue`).")
    key: str = _key("", "This host's private key (NAME.key, 0600).")
    dead_after_s: float = _key(
        10.0, "Seconds after which a crashed peer is declared dead.", min=2.0, max=3600.0
    )
    remote_launch: bool = _key(True, "Peers may start ranks of multi-host jobs on this host.")
    allow_root_jobs: bool = _key(False, "Peers may reserve and start jobs of uid 0 (root) on this host.")

    @property
    def enabled(self) -> bool:
        return bool(self.listen)


@dataclass(frozen=True)
class BurstsSection:
    """Converting idle cards between whole and sliced as demand arrives (``Engine.pump``)."""

    convert_within_s: float = _key(
        0.5,
        "Longest a queued request that fits only by switching an idle card's mode waits for cards being "
        "reconfigured (which might take it without a switch) before its own card is switched.",
        min=0.0,
        max=60.0,
    )
    hold_s: float = _key(
        300.0,
        "Hysteresis: a card switched between whole and sliced stays in its new mode at least this long "
        "before an idle switch (capacity windows, pre-provisioning) switches it back.",
        min=0.0,
        max=86400.0,
    )


def listen_address(value: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` for IPv6) as (host, port); None for "" (off). Raises ValueError."""
    if not value:
        return None
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]{1,253}):([0-9]{1,5})", value)
    if not m:
        raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:9403, [::1]:9403); empty = off")
    host, port = m.group(1).strip("[]"), int(m.group(2))
    if m.group(1).startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{value!r}: {host!r} is not an IPv6 address") from None
    if port > 65535:
        raise ValueError(f"{value!r}: port {port} is outside 0..65535")
    return host, port


def _check_listen(value: str) -> str:
    try:
        listen_address(value)
    except ValueError as e:
        return str(e)
    return ""


def _check_user_name(value: str) -> str:
    if re.fullmatch(r"[0-9]{1,10}|[a-z_][a-z0-9_-]{0,31}\$?", value) and not (
        value.isdigit() and int(value) > 2**32 - 2
    ):
        return ""
    return f"{value!r} is not a user name or uid (e.g. nobody, xpud-warm, 65534)"


@dataclass(frozen=True)
class ForecastSection:
    """Slice demand forecast and pre-provisioning (``xpud.planning.forecast``,
    ``xpud.controllers.provisioner``)."""

    enabled: bool = _key(
        False, "Pre-provision sliced cards ahead of forecast slice demand; tear them down after."
    )
    interval_s: float = _key(
        300.0, "Seconds between two forecasts (and pre-provisioning decisions).", min=10.0, max=86400.0
    )
    lead_s: float = _key(
        900.0, "How far ahead the demand is provisioned for (seconds).", min=0.0, max=86400.0
    )
    alpha: float = _key(
        0.3,
        "Smoothing factor: how far one week's observation moves its hour-of-week slot.",
        min=0.01,
        max=1.0,
    )
    history_days: int = _key(
        28, "Days of the ledger's lease history the forecast learns from.", min=1, max=365
    )
    warm_command: str = _key(
        "", "Command run once for each pre-provisioned slice (e.g. to load model weights); empty = none."
    )
    warm_timeout_s: float = _key(600.0, "Longest a warm_command may run (seconds).", min=1.0, max=86400.0)
    warm_user: str = _key(
        "nobody",
        "User the warm_command runs as (a name or uid); root only when written here.",
        check=_check_user_name,
    )
    standby_max: int = _key(
        64, "Most slices pre-created at once on this host (MIG instances held by no lease).", min=0, max=1024
    )


@dataclass(frozen=True)
class CarbonSection:
    """The carbon/PUE signal that ``xpu run --when-green`` uses (``xpud.planning.green``)."""

    signal: str = _key(
        "", "File with the grid's carbon intensity (or PUE) per hour, CSV or JSON; empty = none."
    )
    command: str = _key("", "Command whose output (CSV or JSON, as the file) is the signal; empty = none.")
    refresh_s: float = _key(
        900.0, "Seconds between two readings of the signal by the daemon.", min=10.0, max=86400.0
    )


@dataclass(frozen=True)
class MetricsSection:
    """Prometheus metrics (``xpud.daemon.metrics``) on a local HTTP port."""

    listen: str = _key(
        "",
        "Address of the Prometheus /metrics endpoint, host:port (e.g. 127.0.0.1:9403; port 0 = any free "
        "port, logged); empty = off.",
        check=_check_listen,
    )


@dataclass(frozen=True)
class SlurmSection:
    """The Slurm bridge's daemon half: leases taken by ``xpu slurm prolog`` live as long as their job."""

    check_interval_s: float = _key(
        30.0,
        "Seconds between two checks (squeue) that the Slurm jobs holding leases here still run; a lease "
        "whose job has ended is reclaimed (the epilog never came).",
        min=1.0,
        max=86400.0,
    )
    squeue: str = _key("squeue", "The squeue command (a name on PATH or an absolute path).")
    conf: str = _key("", "slurm.conf for squeue (SLURM_CONF); empty = Slurm's default.")


@dataclass(frozen=True)
class KubeletSection:
    """The Kubernetes device plugin (``xpud --kubelet``): one plugin per resource name."""

    enabled: bool = _key(False, "Serve kubelet's device-plugin API (also: xpud --kubelet).")
    socket_dir: str = _key(
        "/var/lib/kubelet/device-plugins",
        "kubelet's device-plugin directory (kubelet.sock, the plugins' sockets).",
    )
    resources: tuple[str, ...] = _key(
        ("xpu.dev/gpu", "xpu.dev/vxpu-half", "xpu.dev/vxpu-quarter"),
        "Resource names to serve: <domain>/gpu for whole cards, <domain>/<slice size> for slices.",
    )
    pod_gone_grace_s: float = _key(
        60.0,
        "Seconds a pod's lease may be missing from kubelet's PodResources List before it is reclaimed.",
        min=1.0,
        max=86400.0,
    )
    pod_resources_socket: str = _key(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        "kubelet's PodResources API socket (which pods hold which devices now).",
    )
    device_list_strategy: str = _key(
        "envvar",
        "How a container is told its cards: envvar (NVIDIA_VISIBLE_DEVICES), cdi (cdi_devices), or both.",
        choices=("envvar", "cdi", "both"),
    )
    cdi_vendor: str = _key("nvidia.com", "The CDI vendor whose spec names the cards (<vendor>/gpu=<uuid>).")
    mps_shm_dir: str = _key(
        "/run/xpud/mps/shm",
        "Host tmpfs that MPS control daemons use as /dev/shm; mounted as /dev/shm in MPS client pods.",
    )
    dev_root: str = _key(
        "/dev", "Where xpud sees the host's /dev (device nodes; MIG capability nodes made here)."
    )
    proc_root: str = _key("/proc", "Where xpud sees the host's /proc (driver/nvidia/capabilities, devices).")


@dataclass(frozen=True)
class IsolationSection:
    """Device isolation of leases on bare metal (``xpud/isolation/scope.py``, README "Isolation")."""

    devices: str = _key(
        "auto",
        "Each lease's processes in a systemd scope that may open only its own device nodes: auto = on real "
        "cards where systemd and cgroup v2 allow; enforced = on simulated cards too; advisory = never.",
        choices=("auto", "enforced", "advisory"),
    )
    extra_devices: tuple[str, ...] = _key(
        ("char-infiniband_verbs rw", "/dev/infiniband/rdma_cm rw"),
        "More DeviceAllow= entries a lease's processes may open ('/dev/PATH rw' or 'char-GROUP rw').",
    )
    proc_root: str = _key("/proc", "Where xpud reads the driver's MIG capability files (driver/nvidia/).")


def device_entry_problem(entry: str) -> str:
    """Why an ``extra_devices`` entry is not ``/dev/PATH PERMS`` or ``char-GROUP PERMS`` ('' when it is)."""
    spec, _, perms = entry.partition(" ")
    if not spec.startswith(("/dev/", "char-")) or ".." in spec or not spec[5:]:
        return f"{entry!r}: give a path under /dev/ or char-GROUP (a /proc/devices name), then the access"
    if not perms or set(perms) - set("rwm"):
        return f"{entry!r}: add the access after one space, e.g. '{spec} rw'"
    return ""


@dataclass(frozen=True)
class AutoSection:
    """Right-sizing: per-lease measurement, ``xpu run --mode auto`` (``xpud.planning.usage``,
    ``xpud.planning.sizing``)."""

    first: str = _key(
        "vxpu-half",
        "Mode an --mode auto job of a class with no history starts in (xpu, or a [slices] name).",
    )
    sample_s: float = _key(
        5.0, "Seconds between two readings of the leases' per-process utilisation.", min=1.0, max=3600.0
    )
    history: int = _key(
        120, "Readings kept per lease and per job class (the short history).", min=4, max=10000
    )
    at_cap: float = _key(
        0.9,
        "A lease is throttled when its compute use is at least this share of its cap.",
        min=0.5,
        max=1.0,
    )
    up_after_s: float = _key(
        120.0, "Seconds a lease must stay throttled at its cap before it moves up.", min=1.0, max=86400.0
    )
    down_below: float = _key(
        0.25,
        "A lease is far below its size when its peak use fits under this share of the next size down.",
        min=0.01,
        max=1.0,
    )
    down_after_s: float = _key(
        600.0, "Seconds a lease must stay far below its size before it moves down.", min=1.0, max=86400.0
    )
    hold_s: float = _key(
        900.0,
        "Hysteresis: after a move a lease is not moved again, nor back, for this many seconds.",
        min=0.0,
        max=86400.0,
    )
    max_moves: int = _key(4, "Move budget: automatic moves per lease in its lifetime.", min=0, max=100)


SECTIONS: dict[str, type] = {
    "daemon": DaemonSection,
    "devices": DevicesSection,
    "cards": CardsSection,
    "leases": LeasesSection,
    "limits": LimitsSection,
    "health": HealthSection,
    "defrag": DefragSection,
    "cluster": ClusterSection,
    "metrics": MetricsSection,
    "bursts": BurstsSection,
    "carbon": CarbonSection,
    "forecast": ForecastSection,
    "slurm": SlurmSection,
    "kubelet": KubeletSection,
    "auto": AutoSection,
    "isolation": IsolationSection,
    "accounts": accounts_config.AccountsSection,  # and [accounts.NAME] tables: Config.named_accounts
}

DEFAULT_SLICES: dict[str, SliceSpec] = {
    "vxpu-half": SliceSpec("vxpu-half", 0.5, 30),
    "vxpu-quarter": SliceSpec("vxpu-quarter", 0.25, 15),
}
SLICE_KEYS = {
    "memory_fraction": "Share of the card's memory (0 < f <= 1).",
    "compute_pct": "Share of the card's compute, as an MPS active-thread percentage (1..100).",
}


@dataclass(frozen=True)
class Config:
    daemon: DaemonSection = field(default_factory=DaemonSection)
    devices: DevicesSection = field(default_factory=DevicesSection)
    cards: CardsSection = field(default_factory=CardsSection)
    leases: LeasesSection = field(default_factory=LeasesSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    health: HealthSection = field(default_factory=HealthSection)
    defrag: DefragSection = field(default_factory=DefragSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    bursts: BurstsSection = field(default_factory=BurstsSection)
    carbon: CarbonSection = field(default_factory=CarbonSection)
    forecast: ForecastSection = field(default_factory=ForecastSection)
    slurm: SlurmSection = field(default_factory=SlurmSection)
    kubelet: KubeletSection = field(default_factory=KubeletSection)
    auto: AutoSection = field(default_factory=AutoSection)
    isolation: IsolationSection = field(default_factory=IsolationSection)
    accounts: accounts_config.AccountsSection = field(default_factory=accounts_config.AccountsSection)
    named_accounts: dict[str, accounts_config.Account] = field(default_factory=dict)  # [accounts.NAME]
    slices: dict[str, SliceSpec] = field(default_factory=lambda: dict(DEFAULT_SLICES))
    windows: tuple[WindowSpec, ...] = ()  # [[windows]]: capacity windows (xpud.config.windows)
    path: str = ""  # the file it came from ("" = defaults only)

    @property
    def runtime_dir(self) -> Path:
        return Path(self.daemon.runtime_dir)

    @property
    def state_dir(self) -> Path:
        return Path(self.daemon.state_dir)

    def replace(self, section: str, **values: Any) -> Config:
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **values)})


# Environment variables that override file values: name -> (section, key).
ENVIRONMENT = {
    "XPUD_RUNTIME_DIR": ("daemon", "runtime_dir"),
    "XPUD_STATE_DIR": ("daemon", "state_dir"),
    "XPUD_LOG_LEVEL": ("daemon", "log_level"),
    "XPUD_EVENT_LOOP": ("daemon", "event_loop"),
    "XPUD_SIMULATE": ("devices", "machine"),
    # per host where one file serves many (a Kubernetes DaemonSet's ConfigMap, from the downward API)
    "XPUD_CLUSTER_NAME": ("cluster", "name"),
    "XPUD_CLUSTER_LISTEN": ("cluster", "listen"),
    "XPUD_CLUSTER_CERT": ("cluster", "cert"),
    "XPUD_CLUSTER_KEY": ("cluster", "key"),
}


def _toml_value(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def documented_keys() -> dict[str, dict[str, tuple[Any, str]]]:
    """Every key with its default and documentation: {section: {key: (default, doc)}}."""
    out = {}
    for name, cls in SECTIONS.items():
        out[name] = {
            f.name: (
                _toml_value(f.default if f.default is not dataclasses.MISSING else f.default_factory()),
                f.metadata["doc"],
            )
            for f in dataclasses.fields(cls)
        }
    return out
