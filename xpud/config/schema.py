"""Load and validate ``xpud.toml``; write it back.

Every key lives in one dataclass field below, with its default and its documentation (``doc``). A bad
file is refused with the file, the line, the key and the reason; unknown keys are errors (with a
suggestion). ``etc/xpud.toml`` documents every key, and a test checks that it lists exactly these keys
with these defaults.

Precedence: command-line flags > ``XPUD_*`` environment variables > the file > defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import ipaddress
import math
import os
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from xpud.config import accounts as accounts_config
from xpud.errors import ConfigError
from xpud.model import SLICE_NAME, SliceSpec
from xpud.planning.windows import MAX_WINDOWS, WindowSpec
from xpud.planning.windows import check as check_window

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


def _device_entry_problem(entry: str) -> str:
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
    windows: tuple[WindowSpec, ...] = ()  # [[windows]]: capacity windows (xpud.planning.windows)
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


def _line_of(text: str, table: str, key: str | None) -> int | None:
    """The 1-based line of ``key`` in ``[table]`` (or of the table header when key is None)."""
    current = ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        m = re.match(r"^\[\s*([^\[\]]+?)\s*\]", line)
        if m:
            current = ".".join(p.strip().strip('"').strip("'") for p in m.group(1).split("."))
            if key is None and current == table:
                return n
            continue
        if key is not None and current == table:
            m = re.match(r"""^["']?([A-Za-z0-9_\-]+)["']?\s*=""", line)
            if m and m.group(1) == key:
                return n
    return None


class _Source:
    """Where values come from, for error messages."""

    def __init__(self, path: str, text: str):
        self.path, self.text = path, text

    def error(self, table: str, key: str | None, reason: str) -> ConfigError:
        line = _line_of(self.text, table, key)
        where = f"{self.path}:{line}" if line else self.path
        name = f"[{table}] {key}" if key else f"[{table}]"
        return ConfigError(f"{where}: {name}: {reason}")


def _hint(name: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


MAX_STRING = 4096  # characters in one string value (paths, names)
MAX_LIST = 256  # items in one list value


def _check_value(src: _Source, table: str, f: dataclasses.Field, kind: Any, value: Any) -> Any:
    """``value`` checked against the key's type and rules: finite, in range, bounded in size."""
    rules = f.metadata
    span = f"{rules['min']!r}..{rules['max']!r}" if "min" in rules and "max" in rules else ""
    if typing.get_origin(kind) is tuple:  # a TOML array of one type, kept as a tuple (immutable)
        item = typing.get_args(kind)[0]
        if not isinstance(value, list) or not all(
            isinstance(v, item) and not isinstance(v, bool) for v in value
        ):
            raise src.error(
                table,
                f.name,
                f"expected a list of {item.__name__}s, got {value!r}; default is {list(f.default)!r}",
            )
        if len(value) > MAX_LIST:
            raise src.error(table, f.name, f"{len(value)} items; at most {MAX_LIST}")
        for v in value:
            if span and not rules["min"] <= v <= rules["max"]:
                raise src.error(table, f.name, f"item {v!r} is outside {span}")
            if isinstance(v, str) and not 0 < len(v) <= MAX_STRING:
                raise src.error(table, f.name, f"item of {len(v)} characters; expected 1..{MAX_STRING}")
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    expected = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(kind, "?")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise src.error(table, f.name, f"expected {expected}, got {value!r}; default is {f.default!r}")
    if kind is float and not math.isfinite(value):
        raise src.error(table, f.name, f"{value!r} is not a finite number; use a number in {span}")
    if kind is str and len(value) > MAX_STRING:
        raise src.error(table, f.name, f"{len(value)} characters; at most {MAX_STRING}")
    if "check" in rules and (reason := rules["check"](value)):
        raise src.error(table, f.name, reason)
    if "choices" in rules and value not in rules["choices"]:
        raise src.error(table, f.name, f"{value!r} is not one of {', '.join(rules['choices'])}")
    if "min" in rules and value < rules["min"]:
        raise src.error(table, f.name, f"{value!r} is below the minimum {rules['min']!r} (range {span})")
    if "max" in rules and value > rules["max"]:
        raise src.error(table, f.name, f"{value!r} is above the maximum {rules['max']!r} (range {span})")
    return value


class _Origin(_Source):
    """A value from a flag or an environment variable, for error messages."""

    def __init__(self, origin: str):
        self.origin = origin

    def error(self, table: str, key: str | None, reason: str) -> ConfigError:
        return ConfigError(f"{self.origin}: [{table}] {key}: {reason}")


def checked(cfg: Config, section: str, key: str, value: Any, origin: str) -> Config:
    """``cfg`` with one key set from a flag or an environment variable (``origin``, e.g. "--seed" or
    "XPUD_LOG_LEVEL"), checked like a file's value. Text is parsed as the key's type. Raises ConfigError."""
    cls = SECTIONS[section]
    f = next(x for x in dataclasses.fields(cls) if x.name == key)
    kind = typing.get_type_hints(cls)[key]
    if isinstance(value, str) and kind in (int, float):
        with contextlib.suppress(ValueError):  # else _check_value names the type it expected
            value = kind(value)
    return cfg.replace(section, **{key: _check_value(_Origin(origin), section, f, kind, value)})


def _section(src: _Source, table: str, cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise src.error(table, None, "expected a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        if key not in fields:
            raise src.error(table, key, f"unknown key{_hint(key, fields)}; etc/xpud.toml lists every key")
        values[key] = _check_value(src, table, fields[key], hints[key], value)
    return cls(**values)


def _slices(src: _Source, data: Any) -> dict[str, SliceSpec]:
    if not isinstance(data, dict):
        raise src.error("slices", None, "expected a table of slice sizes, e.g. [slices.vxpu-half]")
    out = dict(DEFAULT_SLICES)
    for name, spec in data.items():
        table = f"slices.{name}"
        if not SLICE_NAME.fullmatch(name):
            reason = "a slice size is named vxpu-<word> (lowercase, digits, '-'; 45 characters at most)"
            raise src.error(table, None, reason)
        if not isinstance(spec, dict):
            raise src.error(table, None, "expected a table with memory_fraction and compute_pct")
        for key in spec:
            if key not in SLICE_KEYS:
                raise src.error(
                    table,
                    key,
                    f"unknown key{_hint(key, SLICE_KEYS)}; a slice has memory_fraction and compute_pct",
                )
        base = out.get(name)
        mem = spec.get("memory_fraction", base.memory_fraction if base else None)
        pct = spec.get("compute_pct", base.compute_pct if base else None)
        if mem is None or pct is None:
            raise src.error(table, None, "a new slice size needs both memory_fraction and compute_pct")
        if isinstance(mem, bool) or not isinstance(mem, int | float) or not 0 < mem <= 1:
            raise src.error(table, "memory_fraction", f"expected a number in (0, 1], got {mem!r}")
        if isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 100:
            raise src.error(table, "compute_pct", f"expected an integer 1..100, got {pct!r}")
        out[name] = SliceSpec(name, float(mem), pct)
    return out


def _windows(src: _Source, data: Any) -> tuple[WindowSpec, ...]:
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise src.error("windows", None, "expected [[windows]] tables (name, cron, whole_share)")
    if len(data) > MAX_WINDOWS:
        raise src.error("windows", None, f"{len(data)} windows; at most {MAX_WINDOWS}")
    out = []
    for n, spec in enumerate(data, 1):
        try:
            out.append(check_window(spec))
        except ValueError as e:
            line = _nth_line(src.text, "[[windows]]", n)
            raise ConfigError(f"{src.path}:{line or '?'}: [[windows]] #{n}: {e}") from None
    names = [w.name for w in out]
    dup = next((x for x in names if names.count(x) > 1), None)
    if dup:
        raise src.error("windows", None, f"two windows are named {dup!r}; give each its own name")
    return tuple(out)


def _nth_line(text: str, header: str, n: int) -> int | None:
    seen = 0
    for i, raw in enumerate(text.splitlines(), 1):
        if raw.strip().startswith(header):
            seen += 1
            if seen == n:
                return i
    return None


def parse(text: str, path: str = "<string>", environ: typing.Mapping[str, str] | None = None) -> Config:
    """Validate TOML text into a Config, with ``environ``'s ``XPUD_*`` overrides (``ENVIRONMENT``) applied
    before the checks across keys (a DaemonSet's ConfigMap names seeds, each node's environment its
    listen address). Raises ConfigError naming the file, line and key (or the variable)."""
    src = _Source(path, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply (arrays or tables within each other)") from None
    kwargs: dict[str, Any] = {"path": path}
    for table, value in data.items():
        if table == "slices":
            kwargs["slices"] = _slices(src, value)
        elif table == "windows":
            kwargs["windows"] = _windows(src, value)
        elif table == "accounts" and isinstance(value, dict):
            kwargs["accounts"] = _section(src, table, SECTIONS[table], accounts_config.section_data(value))
            kwargs["named_accounts"] = accounts_config.accounts(src, value)
        elif table in SECTIONS:
            kwargs[table] = _section(src, table, SECTIONS[table], value)
        else:
            raise src.error(table, None, f"unknown table{_hint(table, [*SECTIONS, 'slices', 'windows'])}")
    cfg = _environment(Config(**kwargs), environ or {})
    if cfg.leases.default_wait_s > cfg.leases.max_wait_s:
        raise src.error(
            "leases",
            "default_wait_s",
            f"{cfg.leases.default_wait_s:g} is above max_wait_s ({cfg.leases.max_wait_s:g}); "
            "lower it or raise max_wait_s",
        )
    if cfg.carbon.signal and cfg.carbon.command:
        raise src.error("carbon", "command", "give signal (a file) or command, not both")
    if cfg.health.fragmentation_slice not in cfg.slices:
        raise src.error(
            "health",
            "fragmentation_slice",
            f"{cfg.health.fragmentation_slice!r} is not a slice size; use one of {', '.join(cfg.slices)}",
        )
    if cfg.auto.first != "xpu" and cfg.auto.first not in cfg.slices:
        raise src.error(
            "auto", "first", f"{cfg.auto.first!r} is not a mode; use xpu or one of {', '.join(cfg.slices)}"
        )
    _check_cluster(src, cfg.cluster)
    for entry in cfg.isolation.extra_devices:
        if why := _device_entry_problem(entry):
            raise src.error("isolation", "extra_devices", why)
    accounts_config.check_refs(src, cfg.accounts, cfg.named_accounts)
    for name in cfg.kubelet.resources:
        domain, _, kind = name.partition("/")
        if not (_RESOURCE_DOMAIN.fullmatch(domain) and (kind == "gpu" or kind in cfg.slices)):
            raise src.error(
                "kubelet",
                "resources",
                f"{name!r}: use <domain>/gpu or <domain>/<slice size> ({', '.join(cfg.slices)}), "
                "e.g. xpu.dev/gpu",
            )
        if len(kind) > _SLOT_NAME_CHARS:  # kubelet takes device ids of 63 characters at most
            raise src.error(
                "kubelet",
                "resources",
                f"{name!r}: device ids are <card uuid>_{kind}_<n>, over kubelet's 63 characters; "
                f"serve slice sizes named in {_SLOT_NAME_CHARS} characters or fewer",
            )
    if len({n.partition("/")[2] for n in cfg.kubelet.resources}) != len(cfg.kubelet.resources):
        raise src.error("kubelet", "resources", "each kind (gpu or a slice size) may be served once")
    return cfg


_SLOT_NAME_CHARS = 63 - len("GPU-00000000-0000-0000-0000-000000000000") - len("__99")
_RESOURCE_DOMAIN = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)+")


_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # as `xpu certs issue NAME` accepts
_LOCATION_CHARS = 64  # as xpud.federation.view accepts from peers


def split_host_port(text: str) -> tuple[str, int]:
    """``"10.0.0.2:7443"`` / ``"[::1]:7443"`` / ``"node-a:7443"`` -> (host, port). Raises ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text[:80]!r} is not HOST:PORT (port 1..65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _check_cluster(src: _Source, c: ClusterSection) -> None:
    import ipaddress

    if c.name and not _HOST_NAME.match(c.name):
        raise src.error("cluster", "name", "use letters, digits, '.', '_' or '-' (at most 63)")
    for key in ("zone", "block", "domain"):
        v = getattr(c, key)
        if len(v) > _LOCATION_CHARS or not v.isprintable():
            raise src.error("cluster", key, f"at most {_LOCATION_CHARS} printable characters")
    if len(c.seeds) > MAX_SEEDS:
        raise src.error("cluster", "seeds", f"{len(c.seeds)} seeds; at most {MAX_SEEDS}")
    for seed in c.seeds:
        try:
            split_host_port(seed)
        except ValueError as e:
            raise src.error("cluster", "seeds", f'{e}, e.g. "10.0.0.2:7443"') from None
    if not c.listen:
        if c.seeds:
            raise src.error("cluster", "seeds", "set listen too: without it federation is off")
        return
    try:
        host, _ = split_host_port(c.listen)
        if ipaddress.ip_address(host).is_unspecified:
            raise ValueError(f"{host} is every address; peers reach this host at the address given here")
    except ValueError as e:
        raise src.error(
            "cluster", "listen", f'{e}; give IP:PORT of this host, e.g. "10.0.0.2:7443"'
        ) from None
    for key in ("ca", "cert", "key"):
        if not getattr(c, key):
            raise src.error(
                "cluster", key, "needed with listen: the paths `xpu certs init` and `xpu certs issue` wrote"
            )


def read_text(path: Path, what: str = "the config file") -> str:
    """``path``'s text: TOML is UTF-8; other bytes are a ConfigError naming where (OSError passes)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: {what} is not UTF-8 (byte {e.start}); save it as UTF-8") from None


def load(path: str | Path | None = None, environ: typing.Mapping[str, str] | None = None) -> Config:
    """Load the config: ``path`` (or ``$XPUD_CONFIG``, or /etc/xpud/xpud.toml if present), then the
    environment overrides. A missing explicit path is an error; a missing default file means defaults."""
    environ = os.environ if environ is None else environ
    explicit = path or environ.get("XPUD_CONFIG")
    if explicit:
        p = Path(explicit)
        try:
            cfg = parse(read_text(p), str(p), environ)
        except OSError as e:
            raise ConfigError(
                f"{p}: cannot read the config file: {e.strerror}; pass --config with a readable file"
            ) from None
    elif DEFAULT_PATH.is_file():
        cfg = parse(read_text(DEFAULT_PATH), str(DEFAULT_PATH), environ)
    else:
        cfg = parse("", "<defaults>", environ)
    return cfg


def _environment(cfg: Config, environ: typing.Mapping[str, str]) -> Config:
    for name, (section, key) in ENVIRONMENT.items():
        if environ.get(name):
            cfg = checked(cfg, section, key, environ[name], f"environment variable {name}")
            if name == "XPUD_SIMULATE":
                cfg = cfg.replace("devices", backend="simulated")
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {
        name: {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(getattr(cfg, name)).items()
        }
        for name in SECTIONS
    }
    out["slices"] = {
        n: {"memory_fraction": s.memory_fraction, "compute_pct": s.compute_pct} for n, s in cfg.slices.items()
    }
    out["accounts"].update(accounts_config.to_dict(cfg.named_accounts))
    if cfg.windows:
        out["windows"] = [
            {"name": w.name, "cron": w.cron, "whole_share": w.whole_share}
            | ({"timezone": w.timezone} if w.timezone else {})
            for w in cfg.windows
        ]
    return out


def dumps(cfg: Config) -> str:
    """The config as TOML text (tomli-w), ``[[windows]]`` as tables, as xpud.toml writes them."""
    data = to_dict(cfg)
    windows = data.pop("windows", [])
    return tomli_w.dumps(data) + "".join("\n[[windows]]\n" + tomli_w.dumps(w) for w in windows)


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
