"""Health signals: one card's last sample and recent events, read against thresholds. Pure.

``SignalMemory`` keeps what a single sample cannot tell: the previous counters (a rise is an event), the
recent XIDs and ECC events, the NVLink CRC rate and a minute of PCIe replays. ``SignalMemory.signals(now)``
answers one ``Signal`` per signal: its value and threshold in its unit, and its status: ``ok``, ``info``
(worth knowing, never changes the state), ``warn``, ``fail`` or ``absent`` (the card cannot report it).
Thresholds are ``[health]`` config, drawn from DCGM's where it has one (REFERENCE.md, health section).

Counters that only rise (XIDs, double-bit ECC, remapped rows, retired DBE pages, NVLink replay/recovery,
NVLink CRC rate) are events: a rise keeps its signal raised for ``event_window_s``. A counter that drops
(a GPU reset) is a new baseline, not an event. Nothing here reads the hardware or the clock.

Some faults do not pass with time. An XID of ``[health] xid_reset`` (uncontained ECC, GSP errors, off the
bus, ...) keeps the ``xid`` signal failed until a reset is seen: the card answering again after it was
lost, volatile ECC counters or a pending row remap cleared, or the driver's recovery action
(``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) back to none after it asked for one. The recovery action is a
signal of its own; so is the NVSwitch fabric (``fabric``: CUDA fails on a card until the Fabric Manager
has trained it). A pending row remap fails the card: it needs a reset, so no new work goes there.

Power: a card at its power cap is normal under training; the signal warns only after
``power_warn_samples`` samples in a row above ``power_warn_ratio`` of the limit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from xpud.config.schema import HealthSection
from xpud.model import CardSample, Slice

OK, INFO, WARN, FAIL, ABSENT = "ok", "info", "warn", "fail", "absent"

# Clock-event reason bits (nvmlClocksEventReason*).
CLOCK_REASONS = {
    0x1: "GPU idle",
    0x2: "application clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
    0x100: "display clock setting",
}
_CLOCK_NORMAL = 0x1 | 0x2 | 0x10 | 0x100  # reasons that say nothing about the card's health

# NVML_GPU_RECOVERY_ACTION_* (nvml.h): what the driver says a card needs.
RECOVERY_ACTIONS = {
    0: "nothing",
    1: "a GPU reset (nvidia-smi -r)",
    2: "a node reboot",
    3: "its peer-to-peer (NVLink) traffic drained",
    4: "to be drained, then reset",
    5: "its IMEX domain recovered",
    6: "a bus reset",
    7: "a system reboot",
}
# NVML_GPU_FABRIC_STATE_*
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
_FABRIC_COMPLETED = 3

# What XIDs mean, after NVIDIA's XID catalogue (docs.nvidia.com/deploy/xid-errors), for reasons people can
# act on. DCGM names some differently (38 "PCIe Bus Error", 39 "PCIe Fabric Error", 42 "PCIe Replay
# Error", 60 thermal, 67/73 NVLink): these are the catalogue's names.
XID_MEANING = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    39: "copy engine exception",
    42: "video processor exception",
    43: "GPU stopped processing",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    54: "auxiliary power not connected to the board",
    56: "display engine error",
    57: "error programming video memory interface",
    58: "unstable video memory interface",
    60: "video processor exception",
    61: "internal micro-controller breakpoint or warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping recording failed",
    67: "illegal access by driver",
    68: "video decoder (NVDEC0) exception",
    69: "graphics engine class error",
    73: "video encoder (NVENC2) error",
    74: "NVLink error",
    78: "vGPU start error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    93: "InfoROM wear limit exceeded (non-fatal)",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error (corrected)",
    136: "link training failed",
    137: "NVLink FLA privilege error",
    140: "unrecovered ECC error",
    143: "GPU initialization failure",
    154: "GPU recovery action changed",
}


# PCIe transfer rate per lane by generation, GT/s.
PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
PCIE_REPLAY_FALLBACK = 16  # the rule's value for Gen4 x16, when the card cannot say its link


def pcie_replay_limit(gen: int | None, width: int | None) -> int | None:
    """Replays per minute a PCIe link may have before it warns: DCGM's rule (DcgmHealthWatch.cpp,
    GetExpectedPcieReplayRate): a bit error rate of 1e-12 at the link's rate, ceil(GT/s / 1000 * 60 * lanes)
    (Gen3 x16 8, Gen4 x16 16, Gen5 x16 31). A generation above 6 counts as 6, as DCGM caps it. None when
    the link is unknown."""
    if not gen or not width or gen < 1 or width < 1:
        return None
    return math.ceil(PCIE_GTS[min(gen, max(PCIE_GTS))] / 1000 * 60 * width)


def xid_class(xid: int, cfg: HealthSection) -> str:
    """``"application"``, ``FAIL``, ``WARN`` or ``"ignore"`` for an XID, by the configured lists."""
    if xid in cfg.xid_application:
        return "application"
    if xid in cfg.xid_fail:
        return FAIL
    if xid in cfg.xid_warn:
        return WARN
    return {"fail": FAIL, "warn": WARN}.get(cfg.xid_unlisted, "ignore")


def xid_text(xid: int) -> str:
    meaning = XID_MEANING.get(xid)
    return f"xid {xid} ({meaning})" if meaning else f"xid {xid}"


@dataclass(frozen=True)
class Signal:
    """One signal's reading: ``value`` and ``threshold`` in ``unit``; ``None`` value: cannot report."""

    name: str
    value: float | None
    threshold: float | None = None
    unit: str = ""
    status: str = OK
    reason: str = ""
    until: float | None = None  # raised by an event: it clears by itself then, unless another comes


def memory_fragmentation(
    held: Sequence[Slice], usable_bytes: int, slice_fraction: float, whole_held: bool = False
) -> float:
    """Share (0-1) of a card's free memory that cannot hold one more slice of ``slice_fraction``.

    From what the daemon knows: the slices held and their placement. Slices with a MIG placement occupy
    memory slots (eighths of the card, the MIG geometry of A100/H100/H200); a new slice needs an aligned
    run of free slots (its size rounded up, starting at a multiple of it), which approximates the
    driver's placement rules. Slices without a placement (MPS, accounting) share memory freely, so only
    the remainder smaller than one slice is lost. An idle or wholly leased card has 0.
    """
    if whole_held or not held or usable_bytes <= 0:
        return 0.0
    if all(s.placement is not None for s in held):
        slots = 8
        used = [False] * slots
        for s in held:
            size = max(1, math.ceil(s.memory_bytes / usable_bytes * slots - 1e-6))
            for k in range(s.placement, min(slots, s.placement + size)):
                used[k] = True
        free = used.count(False)
        if not free:
            return 0.0
        k = max(1, math.ceil(slice_fraction * slots - 1e-9))
        usable = sum(k for start in range(0, slots - k + 1, k) if not any(used[start : start + k]))
        return round((free - usable) / free, 6)
    free = 1.0 - sum(s.memory_bytes for s in held) / usable_bytes
    if free <= 1e-9:
        return 0.0
    usable = math.floor(free / slice_fraction + 1e-9) * slice_fraction
    return round(max(0.0, free - usable) / free, 6)


def _clock_names(mask: int) -> str:
    return ", ".join(name for bit, name in CLOCK_REASONS.items() if mask & bit) or f"0x{mask:x}"


@dataclass
class _Counter:
    """A counter that only rises: its last value, and when (and by how much) it last rose."""

    value: int | None = None
    rose_at: float | None = None
    rose_by: int = 0

    def update(self, value: int | None, now: float) -> None:
        if value is None:
            return
        if self.value is not None and value > self.value:
            self.rose_at, self.rose_by = now, value - self.value
        self.value = value  # a drop is a reset: the new baseline


@dataclass
class SignalMemory:
    """One card's last sample and recent events; ``signals(now)`` reads them all."""

    cfg: HealthSection
    xid_events: bool = True  # the card reports XID events (False: the xid signal is absent)
    pcie_link: tuple[int | None, int | None] = (None, None)  # the card's PCIe (generation, width)
    sample: CardSample | None = None
    fragmentation: float | None = None
    _xids: deque = field(default_factory=lambda: deque(maxlen=64))  # (time, xid, class)
    _app_xids: deque = field(default_factory=lambda: deque(maxlen=64))  # (time, xid, lease ids)
    _dbe_event_at: float | None = None
    _counters: dict[str, _Counter] = field(default_factory=dict)
    _crc_high_at: float | None = None
    _crc_rate: float | None = None
    _crc_high_rate: float = 0.0
    _pcie: deque = field(default_factory=deque)  # (time, counter) over the last minute
    _power_over: int = 0  # samples in a row above power_warn_ratio of the limit
    _need_reset: dict[int, float] = field(default_factory=dict)  # xid_reset XIDs seen -> when (last)
    _asked_reset: bool = False  # the driver's recovery action asked for something since the last reset

    def observe_sample(self, sample: CardSample, fragmentation: float | None = None) -> None:
        """A polled sample. Updates counters (rises become events) and rates."""
        now = sample.timestamp
        prev = self.sample
        for name in (
            "remapped_rows_uncorrected",
            "retired_pages_dbe",
            "nvlink_replay_errors",
            "nvlink_recovery_errors",
        ):
            self._counters.setdefault(name, _Counter()).update(getattr(sample, name), now)
        crc = _crc_total(sample)
        prev_crc = _crc_total(prev) if prev else None
        if crc is not None and prev_crc is not None and prev is not None and now > prev.timestamp:
            self._crc_rate = max(0, crc - prev_crc) / (now - prev.timestamp)
            if self._crc_rate >= self.cfg.nvlink_crc_fail_per_s:
                self._crc_high_at, self._crc_high_rate = now, self._crc_rate
        if sample.pcie_replay_counter is not None:
            self._pcie.append((now, sample.pcie_replay_counter))
            while len(self._pcie) > 1 and self._pcie[1][0] <= now - 60.0:
                self._pcie.popleft()
        if not sample.lost:
            if sample.power_w is not None and sample.power_limit_w is not None:
                over = sample.power_w > sample.power_limit_w * self.cfg.power_warn_ratio
                self._power_over = self._power_over + 1 if over else 0
            if self._was_reset(prev, sample):
                self.observe_reset()
            if sample.recovery_action:
                self._asked_reset = True
        self.sample = sample  # a lost sample has no values: the counters above keep their baselines
        self.fragmentation = fragmentation

    def _was_reset(self, prev: CardSample | None, s: CardSample) -> bool:
        """Whether ``s`` shows that the card was reset since ``prev``."""
        if prev is None:
            return False
        if prev.lost:
            return True  # it answers again: a reset (or a reboot) brought it back
        if self._asked_reset and s.recovery_action == 0:
            return True  # the driver asked for a recovery action and asks for none now
        if prev.remapped_rows_pending and s.remapped_rows_pending is False:
            return True  # only a reset applies a pending remap
        return any(
            (a := getattr(prev, k)) is not None and (b := getattr(s, k)) is not None and b < a
            for k in ("ecc_sbe_volatile", "ecc_dbe_volatile")
        )

    def observe_reset(self) -> None:
        """The card was reset: XIDs that wait for a reset no longer hold it."""
        self._need_reset.clear()
        self._asked_reset = False

    def observe_xid(self, xid: int, now: float) -> str:
        """A card-level XID event. Returns its class; application XIDs are not held against the card."""
        cls = xid_class(xid, self.cfg)
        if cls in (FAIL, WARN):
            self._xids.append((now, xid, cls))
        if cls != "application" and xid in self.cfg.xid_reset:
            self._need_reset[xid] = now
        return cls

    def observe_application_xid(self, xid: int, now: float, leases: Sequence[str]) -> None:
        """An application XID, counted against ``leases`` (shown as info on the card)."""
        self._app_xids.append((now, xid, tuple(leases)))

    def observe_ecc_dbe(self, now: float) -> None:
        """A double-bit ECC event (before the next poll shows the counters)."""
        self._dbe_event_at = now

    def signals(self, now: float) -> list[Signal]:
        """Every signal at ``now``, from the last sample and the events within the window."""
        return [self._with_window(sg, now) for sg in self._signals(now)]

    def _with_window(self, sg: Signal, now: float) -> Signal:
        """``sg`` with ``until`` set when only an event within the window holds it raised."""
        if sg.status not in (WARN, FAIL):
            return sg
        w = self.cfg.event_window_s
        at: float | None = None
        if sg.name == "xid":
            if self._need_reset:
                return sg  # held until a reset, not by a window
            at = max((t for t, _, _ in self._xids if now - t < w), default=None)
        elif sg.name == "ecc_dbe_volatile" and not sg.value:  # no counter raised: the event alone
            at = self._dbe_event_at
        elif sg.name == "nvlink_crc":
            at = self._crc_high_at
        else:
            key = {
                "remapped_rows": "remapped_rows_uncorrected",
                "nvlink_replay": "nvlink_replay_errors",
                "nvlink_recovery": "nvlink_recovery_errors",
            }.get(sg.name)
            counter = self._counters.get(key) if key else None
            rose = key is not None and self._rose(key, now)
            if rose and counter is not None and (sg.name != "remapped_rows" or "rose to" in sg.reason):
                at = counter.rose_at
        return sg if at is None else replace(sg, until=at + w)

    def _signals(self, now: float) -> list[Signal]:
        c, s, w = self.cfg, self.sample, self.cfg.event_window_s
        out = [self._xid_signal(now), self._app_xid_signal(now)]
        lost = bool(s and s.lost)
        out.append(
            Signal(
                "lost",
                None if s is None else float(lost),
                None,
                "",
                FAIL if lost else (ABSENT if s is None else OK),
                "the card fell off the bus (GPU is lost): it needs a reset or a reboot" if lost else "",
            )
        )
        if s is None or lost:
            s = CardSample(timestamp=now)  # nothing to read: every other signal is absent

        # temperature against its slowdown threshold
        if s.temperature_c is None or s.temperature_slowdown_c is None:
            out.append(Signal("temperature", _f(s.temperature_c), None, "C", ABSENT))
        else:
            limit = s.temperature_slowdown_c - c.temperature_margin_c
            hot = s.temperature_c >= limit
            out.append(
                Signal(
                    "temperature",
                    s.temperature_c,
                    limit,
                    "C",
                    WARN if hot else OK,
                    f"temperature {s.temperature_c} C >= {limit} C (slowdown {s.temperature_slowdown_c} C)"
                    if hot
                    else "",
                )
            )

        # power against the enforced limit
        if s.power_w is None or s.power_limit_w is None:
            out.append(Signal("power", s.power_w, None, "W", ABSENT))
        else:
            limit = s.power_limit_w * c.power_warn_ratio
            over = self._power_over >= c.power_warn_samples
            n = c.power_warn_samples
            out.append(
                Signal(
                    "power",
                    round(s.power_w, 1),
                    round(limit, 1),
                    "W",
                    WARN if over else OK,
                    f"power {s.power_w:.0f} W above {limit:.0f} W ({c.power_warn_ratio:g} x the "
                    f"{s.power_limit_w:.0f} W limit) for {n} sample(s) in a row"
                    if over
                    else "",
                )
            )

        # clock-event (throttle) reasons
        if s.clock_event_reasons is None:
            out.append(Signal("clock_events", None, c.clock_warn_mask, "mask", ABSENT))
        else:
            r = s.clock_event_reasons
            bad, other = r & c.clock_warn_mask, r & ~c.clock_warn_mask & ~_CLOCK_NORMAL
            status = WARN if bad else INFO if other else OK
            reason = f"clocks held back: {_clock_names(bad or other)}" if bad or other else ""
            out.append(Signal("clock_events", r, c.clock_warn_mask, "mask", status, reason))

        # ECC
        dbe_event = self._dbe_event_at is not None and now - self._dbe_event_at < w
        if s.ecc_dbe_volatile is None and not dbe_event:
            out.append(Signal("ecc_dbe_volatile", None, 0, "errors", ABSENT))
        else:
            n = s.ecc_dbe_volatile or 0
            bad = n > 0 or dbe_event
            out.append(
                Signal(
                    "ecc_dbe_volatile",
                    n if s.ecc_dbe_volatile is not None else None,
                    0,
                    "errors",
                    FAIL if bad else OK,
                    (f"{n} uncorrectable (double-bit) ECC error(s) since the last reset" if n else "")
                    or ("a double-bit ECC error event" if dbe_event else ""),
                )
            )
        out.append(
            _level(
                "ecc_sbe_volatile",
                s.ecc_sbe_volatile,
                c.ecc_sbe_volatile_warn,
                "errors",
                WARN,
                "corrected (single-bit) ECC errors since the last reset",
            )
        )
        out.append(
            _level(
                "ecc_dbe_aggregate", s.ecc_dbe_aggregate, 1, "errors", INFO, "double-bit ECC errors, lifetime"
            )
        )
        out.append(_level("ecc_sbe_aggregate", s.ecc_sbe_aggregate, None, "errors", INFO, ""))

        # retired pages (pre-Ampere)
        if s.retired_pages_sbe is None and s.retired_pages_dbe is None:
            out.append(Signal("retired_pages", None, c.retired_pages_fail, "pages", ABSENT))
        else:
            total = (s.retired_pages_sbe or 0) + (s.retired_pages_dbe or 0)
            dbe = s.retired_pages_dbe or 0
            growing = self._rose("retired_pages_dbe", now)
            if total >= c.retired_pages_fail or (dbe > c.retired_pages_dbe_fail and growing):
                status, reason = FAIL, f"{total} retired pages ({dbe} for double-bit errors)"
            elif s.retired_pages_pending:
                status, reason = WARN, "a page retirement is pending: reset the card to apply it"
            elif total:
                status, reason = INFO, f"{total} retired pages"
            else:
                status, reason = OK, ""
            out.append(Signal("retired_pages", total, c.retired_pages_fail, "pages", status, reason))

        # remapped rows (Ampere and later)
        if s.remapped_rows_uncorrected is None:
            out.append(Signal("remapped_rows", None, 0, "rows", ABSENT))
        else:
            n = s.remapped_rows_uncorrected
            if s.remapped_rows_failure:
                status, reason = FAIL, "row remapping failed: no spare rows left (replace the card)"
            elif self._rose("remapped_rows_uncorrected", now):
                status, reason = FAIL, f"rows remapped for uncorrectable errors rose to {n}"
            elif s.remapped_rows_pending:
                status, reason = FAIL, "a row remap is pending: no new work until a reset applies it"
            elif n or s.remapped_rows_corrected:
                status = INFO
                fixed = s.remapped_rows_corrected or 0
                reason = f"rows remapped: {n} for uncorrectable, {fixed} for corrected errors"
            else:
                status, reason = OK, ""
            out.append(Signal("remapped_rows", n, 0, "rows", status, reason))

        # PCIe replays within the last minute, against what the link may have (warn when exceeded, as DCGM)
        limit = self.pcie_replay_limit()
        if s.pcie_replay_counter is None or not self._pcie:
            out.append(Signal("pcie_replays", None, limit, "per min", ABSENT))
        else:
            base = self._pcie[0][1]
            n = max(0, s.pcie_replay_counter - base) if s.pcie_replay_counter >= base else 0
            high = n > limit
            gen, width = self.pcie_link
            link = f" (PCIe Gen{gen} x{width})" if gen and width and not c.pcie_replay_warn_per_min else ""
            out.append(
                Signal(
                    "pcie_replays",
                    n,
                    limit,
                    "per min",
                    WARN if high else OK,
                    f"{n} PCIe replays in the last minute, more than {limit:g}{link}" if high else "",
                )
            )

        # NVLink
        if s.nvlink_links_down is None:
            out.append(Signal("nvlink_links_down", None, 0, "links", ABSENT))
        else:
            n = s.nvlink_links_down
            out.append(
                Signal(
                    "nvlink_links_down",
                    n,
                    0,
                    "links",
                    FAIL if n else OK,
                    f"{n} NVLink link(s) down that were up since start-up" if n else "",
                )
            )
        for name, key, what in (
            ("nvlink_replay", "nvlink_replay_errors", "replay"),
            ("nvlink_recovery", "nvlink_recovery_errors", "recovery"),
        ):
            value = getattr(s, key)
            if value is None:
                out.append(Signal(name, None, 0, "errors", ABSENT))
                continue
            rose = self._rose(key, now)
            by = self._counters[key].rose_by if rose else 0
            out.append(
                Signal(
                    name,
                    value,
                    0,
                    "errors",
                    FAIL if rose else OK,
                    f"NVLink {what} errors rose by {by}" if rose else "",
                )
            )
        if _crc_total(s) is None:
            out.append(Signal("nvlink_crc", None, c.nvlink_crc_fail_per_s, "per s", ABSENT))
        else:
            high = self._crc_high_at is not None and now - self._crc_high_at < w
            rate = round(self._crc_rate or 0.0, 1)
            out.append(
                Signal(
                    "nvlink_crc",
                    rate,
                    c.nvlink_crc_fail_per_s,
                    "per s",
                    FAIL if high else OK,
                    f"NVLink CRC errors at {self._crc_high_rate:.0f}/s (fails at {c.nvlink_crc_fail_per_s:g})"
                    if high
                    else "",
                )
            )

        # NVSwitch fabric: CUDA fails on the card until the Fabric Manager has trained it
        if s.fabric_state is None:
            out.append(Signal("fabric", None, _FABRIC_COMPLETED, "state", ABSENT))
        else:
            trained = s.fabric_state == _FABRIC_COMPLETED and not s.fabric_status
            state = FABRIC_STATES.get(s.fabric_state, f"state {s.fabric_state}")
            if trained:
                reason = ""
            elif s.fabric_state == _FABRIC_COMPLETED:
                reason = (
                    f"NVSwitch fabric training failed (NVML status {s.fabric_status}): see the "
                    "nvidia-fabricmanager log; the card stays out of service until it is trained"
                )
            else:
                reason = (
                    f"NVSwitch fabric not trained yet ({state}): CUDA fails on the card until "
                    "nvidia-fabricmanager has trained it (systemctl status nvidia-fabricmanager)"
                )
            out.append(
                Signal("fabric", s.fabric_state, _FABRIC_COMPLETED, "state", OK if trained else FAIL, reason)
            )

        # what the driver says the card needs (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
        if s.recovery_action is None:
            out.append(Signal("recovery_action", None, 0, "action", ABSENT))
        else:
            a = s.recovery_action
            what = RECOVERY_ACTIONS.get(a, f"recovery action {a}")
            out.append(
                Signal(
                    "recovery_action",
                    a,
                    0,
                    "action",
                    FAIL if a else OK,
                    f"the driver says the card needs {what}" if a else "",
                )
            )

        # InfoROM
        if s.inforom_valid is None:
            out.append(Signal("inforom", None, None, "", ABSENT))
        else:
            ok = s.inforom_valid
            out.append(
                Signal(
                    "inforom",
                    float(ok),
                    None,
                    "",
                    OK if ok else WARN,
                    "" if ok else "the InfoROM is corrupted (nvidia-smi -q shows which object)",
                )
            )

        # what the card is doing: shown, never judged
        out.append(
            Signal("utilization", _f(s.utilization_gpu_pct), None, "%", _present(s.utilization_gpu_pct))
        )
        out.append(
            Signal(
                "memory_used",
                _f(s.memory_used_bytes),
                _f(s.memory_total_bytes),
                "bytes",
                _present(s.memory_used_bytes),
            )
        )
        out.append(
            Signal("performance_state", _f(s.performance_state), None, "P", _present(s.performance_state))
        )
        out.append(Signal("fan", _f(s.fan_pct), None, "%", _present(s.fan_pct)))
        frag = self.fragmentation
        if frag is None or (self.sample is not None and self.sample.lost):
            out.append(Signal("memory_fragmentation", None, c.fragmentation_info, "ratio", ABSENT))
        else:
            high = frag > c.fragmentation_info
            out.append(
                Signal(
                    "memory_fragmentation",
                    frag,
                    c.fragmentation_info,
                    "ratio",
                    INFO if high else OK,
                    f"{frag:.0%} of free memory cannot hold a {c.fragmentation_slice}" if high else "",
                )
            )
        return out

    def pcie_replay_limit(self) -> float:
        """Replays per minute before the PCIe signal warns: ``[health] pcie_replay_warn_per_min`` when set,
        else DCGM's rule for the card's link (``pcie_replay_limit``)."""
        if self.cfg.pcie_replay_warn_per_min > 0:
            return self.cfg.pcie_replay_warn_per_min
        derived = pcie_replay_limit(*self.pcie_link)
        return float(PCIE_REPLAY_FALLBACK if derived is None else derived)

    def _rose(self, key: str, now: float) -> bool:
        counter = self._counters.get(key)
        return (
            counter is not None
            and counter.rose_at is not None
            and now - counter.rose_at < self.cfg.event_window_s
        )

    def _xid_signal(self, now: float) -> Signal:
        if self._need_reset:
            x = max(self._need_reset, key=lambda k: self._need_reset[k])
            more = (
                f" (and {', '.join(map(str, sorted(set(self._need_reset) - {x})))})"
                if len(self._need_reset) > 1
                else ""
            )
            worst = FAIL if any(xid_class(k, self.cfg) == FAIL for k in self._need_reset) else WARN
            return Signal(
                "xid",
                x,
                None,
                "",
                worst,
                f"{xid_text(x)}{more}: the card needs a GPU reset (nvidia-smi -r) or a reboot; "
                "it does not clear with time",
            )
        recent = [(t, x, cls) for t, x, cls in self._xids if now - t < self.cfg.event_window_s]
        if not recent:  # XIDs that came before the card stopped reporting (e.g. lost) still count
            return Signal("xid", 0 if self.xid_events else None, None, "", OK if self.xid_events else ABSENT)
        _, x, cls = max(recent, key=lambda e: (e[2] == FAIL, e[0]))
        more = f" ({len(recent)} XIDs within {self.cfg.event_window_s:g} s)" if len(recent) > 1 else ""
        return Signal("xid", x, None, "", cls, f"{xid_text(x)}{more}")

    def _app_xid_signal(self, now: float) -> Signal:
        recent = [(t, x, ls) for t, x, ls in self._app_xids if now - t < self.cfg.event_window_s]
        if not recent:
            return Signal("xid_application", 0, None, "", OK)
        _, x, leases = recent[-1]
        who = f"lease {', '.join(leases)}" if leases else "no lease (the card was idle)"
        return Signal("xid_application", x, None, "", INFO, f"{xid_text(x)}, counted against {who}")


def _crc_total(s: CardSample | None) -> int | None:
    if s is None or s.nvlink_crc_flit_errors is None or s.nvlink_crc_data_errors is None:
        return None
    return s.nvlink_crc_flit_errors + s.nvlink_crc_data_errors


def _f(v) -> float | None:
    return None if v is None else float(v)


def _present(v) -> str:
    return ABSENT if v is None else OK


def _level(name: str, value: int | None, threshold: int | None, unit: str, status: str, what: str) -> Signal:
    """A level signal: ``status`` once ``value`` reaches ``threshold``."""
    if value is None:
        return Signal(name, None, threshold, unit, ABSENT)
    high = threshold is not None and value >= threshold
    return Signal(name, value, threshold, unit, status if high else OK, f"{value} {what}" if high else "")
