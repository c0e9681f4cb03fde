"""Card health: signals -> a score and a state, with hysteresis and flap damping. Pure.

Nothing here reads the hardware, the clock or the ledger: ``CardHealth`` is fed samples and events with
their times (seconds since the epoch) and answers ``HealthReport``s and ``StateChange``s. The signals and
their thresholds are in ``xpud.hw.signals``; the daemon's monitor (``xpud.controllers.health``) does the I/O
and the
actions.

The raw state is ``unhealthy`` if any signal fails, ``degraded`` if any warns, else ``healthy``. The score
is 100 minus each signal's weight (all of it for fail, half for warn, a fifth for info), kept within its
state's band (``BANDS``), so scores order cards within a state.

Hysteresis: a worse state applies at once; a better one only after the raw state has stayed at or below
it for the clear time. Flap damping: the clear time is ``clear_s * flap_factor ** (n - 1)`` (at most
``clear_max_s``) where ``n`` counts the card's failures (entries from healthy into a worse state) within
``flap_window_s``: a card that keeps failing stays out longer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from xpud.config.schema import HealthSection
from xpud.hw.signals import ABSENT, FAIL, INFO, OK, WARN, Signal, SignalMemory
from xpud.model import CardSample, HealthState

SEVERITY = {OK: 0.0, ABSENT: 0.0, INFO: 0.2, WARN: 0.5, FAIL: 1.0}  # share of the weight lost
RANK = {HealthState.HEALTHY: 0, HealthState.DEGRADED: 1, HealthState.UNHEALTHY: 2}
BY_RANK = {v: k for k, v in RANK.items()}
BANDS = {HealthState.HEALTHY: (80, 100), HealthState.DEGRADED: (50, 79), HealthState.UNHEALTHY: (0, 49)}

# The weight (a [health] weight_* key) each signal counts with.
WEIGHT_OF = {
    "lost": "weight_lost",
    "xid": "weight_xid",
    "temperature": "weight_temperature",
    "power": "weight_power",
    "clock_events": "weight_clock_events",
    "ecc_dbe_volatile": "weight_ecc",
    "ecc_sbe_volatile": "weight_ecc",
    "ecc_dbe_aggregate": "weight_ecc",
    "ecc_sbe_aggregate": "weight_ecc",
    "retired_pages": "weight_memory_errors",
    "remapped_rows": "weight_memory_errors",
    "pcie_replays": "weight_pcie",
    "nvlink_links_down": "weight_nvlink",
    "nvlink_replay": "weight_nvlink",
    "nvlink_recovery": "weight_nvlink",
    "nvlink_crc": "weight_nvlink",
    "inforom": "weight_inforom",
    "memory_fragmentation": "weight_fragmentation",
    "fabric": "weight_fabric",
    "recovery_action": "weight_recovery",
}


@dataclass(frozen=True)
class HealthReport:
    """A card's health at ``timestamp``: the state after hysteresis, its score and every signal."""

    index: int
    timestamp: float
    state: HealthState
    raw_state: HealthState  # what the signals say now, before hysteresis
    score: int  # 0-100, within the state's band
    signals: tuple[Signal, ...]
    reasons: tuple[str, ...]  # the warn/fail signals' reasons, worst first
    clear_since: float | None = None  # raw state below ``state`` since (None: not clear)
    clear_needed_s: float = 0.0  # how long it must stay clear (flap damping included)
    # When the state improves if nothing new goes wrong (None: not known, a signal is still raised with no
    # end in sight), and when the event windows holding the signals raised end (None: none holds them).
    back_at: float | None = None
    window_ends: float | None = None


@dataclass(frozen=True)
class StateChange:
    index: int
    timestamp: float
    from_state: HealthState
    to_state: HealthState
    score: int
    reasons: tuple[str, ...]


@dataclass
class CardHealth:
    """The health of one card over time: feed it samples and events, read reports and state changes."""

    index: int
    cfg: HealthSection
    state: HealthState = HealthState.HEALTHY
    failures: list[float] = field(default_factory=list)  # times the card left healthy
    memory: SignalMemory = field(init=False)
    _since: dict[int, float | None] = field(default_factory=lambda: {0: None, 1: None, 2: None})
    pcie_link: tuple[int | None, int | None] = (None, None)  # (generation, width): the replay allowance

    def __post_init__(self) -> None:
        self.memory = SignalMemory(self.cfg, pcie_link=self.pcie_link)

    # ------------------------------------------------------------------ inputs
    def observe_sample(self, sample: CardSample, fragmentation: float | None = None) -> None:
        """A polled sample (and the card's memory fragmentation, 0-1, from the engine's slices)."""
        self.memory.observe_sample(sample, fragmentation)

    def observe_xid(self, xid: int, now: float) -> str:
        """A card-level XID event. Returns its class; application XIDs are not held against the card."""
        return self.memory.observe_xid(xid, now)

    def observe_application_xid(self, xid: int, now: float, leases: Sequence[str]) -> None:
        """An application XID, counted against ``leases`` (shown as info on the card)."""
        self.memory.observe_application_xid(xid, now, leases)

    def observe_ecc_dbe(self, now: float) -> None:
        """A double-bit ECC event (before the next poll shows the counters)."""
        self.memory.observe_ecc_dbe(now)

    def restore(self, state: HealthState, failures: Sequence[float]) -> None:
        """Start from a state recorded before a restart. Its clear time counts from the first sample,
        since what happened while the daemon was down is unknown."""
        self.state = state
        self.failures = list(failures)
        for r in self._since:
            self._since[r] = None

    # ------------------------------------------------------------------ outputs
    def signals(self, now: float) -> list[Signal]:
        return self.memory.signals(now)

    def report(self, now: float) -> HealthReport:
        """The card's health now (no state change: see ``evaluate``)."""
        sigs = self.signals(now)
        raw = raw_state(sigs)
        return self._report(now, sigs, raw)

    def evaluate(self, now: float) -> tuple[HealthReport, StateChange | None]:
        """Judge the signals at ``now`` and step the state (hysteresis, flap damping)."""
        sigs = self.signals(now)
        raw = raw_state(sigs)
        before = self.state
        r = RANK[raw]
        for level in self._since:  # since when the raw state has been at or below each level
            self._since[level] = (
                (now if self._since[level] is None else self._since[level]) if r <= level else None
            )
        self.failures = [t for t in self.failures if now - t < self.cfg.flap_window_s]
        need = self.clear_needed_s()
        if r > RANK[before]:
            if before is HealthState.HEALTHY:
                self.failures.append(now)
            self.state = raw
        elif r < RANK[before]:
            for level in range(r, RANK[before]):  # the best level that has been clear long enough
                since = self._since[level]
                if since is not None and now - since >= need:
                    self.state = BY_RANK[level]
                    break
        report = self._report(now, sigs, raw)
        if self.state is before:
            return report, None
        reasons = report.reasons
        if RANK[self.state] < RANK[before]:
            since = self._since[RANK[self.state]]
            reasons = (
                f"signals clear for {now - since:.0f} s (needed {need:.0f} s after "
                f"{len(self.failures)} failure(s) in the last {self.cfg.flap_window_s:.0f} s)",
                *reasons,
            )
        return report, StateChange(self.index, now, before, self.state, report.score, reasons)

    def clear_needed_s(self) -> float:
        """Seconds of clear signals needed before the state improves (flap damping included)."""
        n = max(1, len(self.failures))
        return min(
            self.cfg.clear_s * self.cfg.flap_factor ** (n - 1), max(self.cfg.clear_max_s, self.cfg.clear_s)
        )

    # ------------------------------------------------------------------ helpers
    def _report(self, now: float, sigs: list[Signal], raw: HealthState) -> HealthReport:
        lo, hi = BANDS[self.state]
        weights = {name: getattr(self.cfg, key) for name, key in WEIGHT_OF.items()}
        lost = sum(weights.get(sg.name, 0) * SEVERITY[sg.status] for sg in sigs)
        score = int(min(hi, max(lo, round(100 - lost))))
        order = {FAIL: 0, WARN: 1}
        bad = sorted((sg for sg in sigs if sg.status in order), key=lambda sg: order[sg.status])
        level = RANK[self.state]
        since = self._since.get(level - 1) if level else None
        if since is None and level and RANK[raw] < level:
            since = now  # clear since this reading (the next evaluation starts the clock there too)
        need = self.clear_needed_s() if level else 0.0
        window_ends, back_at = None, None
        if level:
            # what keeps the raw state at the card's state: once those signals clear, the clock starts
            holding = [sg for sg in sigs if RANK[_STATE_OF.get(sg.status, HealthState.HEALTHY)] >= level]
            if since is not None:
                back_at = since + need
            elif holding and all(sg.until is not None for sg in holding):
                window_ends = max(sg.until for sg in holding)
                back_at = window_ends + need
        return HealthReport(
            index=self.index,
            timestamp=now,
            state=self.state,
            raw_state=raw,
            score=score,
            signals=tuple(sigs),
            reasons=tuple(sg.reason or sg.name for sg in bad),
            clear_since=since,
            clear_needed_s=need,
            back_at=back_at,
            window_ends=window_ends,
        )


_STATE_OF = {FAIL: HealthState.UNHEALTHY, WARN: HealthState.DEGRADED}


def raw_state(signals: Sequence[Signal]) -> HealthState:
    """What the signals say now: any fail -> unhealthy, any warn -> degraded, else healthy."""
    statuses = {s.status for s in signals}
    if FAIL in statuses:
        return HealthState.UNHEALTHY
    if WARN in statuses:
        return HealthState.DEGRADED
    return HealthState.HEALTHY
