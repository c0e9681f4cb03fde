"""``--mode auto``: which size a job starts in, and when it moves up or down. Pure: readings in, decisions
out (no clock, no hardware, no engine); the engine acts on a decision (``Moves.start`` with the new
mode) and records it as an event with its evidence.

The ladder is the config's slice sizes by compute share, then a whole card (by default vxpu-quarter ->
vxpu-half -> xpu). Rules (``[auto]``):

- up: every reading of the last ``up_after_s`` is throttled at the lease's cap (compute use at least
  ``at_cap`` of it), and the history covers that long;
- down: over the last ``down_after_s`` (covered likewise) the peak compute stays under ``down_below`` of
  the next size down's cap, and the peak memory fits that size;
- hysteresis: the gap between those two thresholds, plus ``hold_s`` after each move (no move at all) and
  ``2 * hold_s`` before a move back the way it came;
- budget: at most ``max_moves`` automatic moves per lease;
- a lease that is not restartable, or whose budget is spent, gets the same decision as a recommendation
  (``move`` False): it is never moved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xpud.config.schema import AutoSection
from xpud.model import SliceSpec
from xpud.planning.usage import Reading, UsageBook, summarize

XPU = "xpu"


def ladder(slices: Mapping[str, SliceSpec]) -> list[str]:
    """Sizes from small to large: slices by compute share (then memory), a whole card last."""
    return [s.name for s in sorted(slices.values(), key=lambda s: (s.compute_pct, s.memory_fraction))] + [XPU]


def caps(mode: str, slices: Mapping[str, SliceSpec]) -> tuple[float, float]:
    """(compute %, memory fraction) a mode may use of a card."""
    if mode == XPU:
        return 100.0, 1.0
    s = slices[mode]
    return float(s.compute_pct), s.memory_fraction


@dataclass
class AutoState:
    """What rightsizing remembers about one lease."""

    moves: int = 0
    last_move_t: float | None = None
    last_direction: str = ""  # "up" or "down"


@dataclass(frozen=True)
class Decision:
    lease_id: str
    direction: str  # "up" or "down"
    current: str
    to: str
    move: bool  # False: a recommendation only (not restartable, budget spent, in its hold)
    evidence: str

    def line(self) -> str:
        verb = "moving" if self.move else "recommend moving"
        where = f"from {self.current} to {self.to}"
        return f"lease {self.lease_id}: {verb} {self.direction} {where}: {self.evidence}"


def _window(history: Sequence[Reading], now: float, span: float) -> list[Reading] | None:
    """The readings of the last ``span`` seconds, or None when the history does not cover that long."""
    if not history or now - history[0].t < span:
        return None
    return [r for r in history if r.t >= now - span]


def decide(
    lease_id: str,
    mode: str,
    restartable: bool,
    history: Sequence[Reading],
    state: AutoState,
    now: float,
    cfg: AutoSection,
    slices: Mapping[str, SliceSpec],
    card_memory_bytes: int,
) -> Decision | None:
    """The move a lease should make now, if any."""
    steps = ladder(slices)
    if mode not in steps:
        return None
    k = steps.index(mode)
    found = _up(history, now, cfg, k, steps) or _down(history, now, cfg, k, steps, slices, card_memory_bytes)
    if found is None:
        return None
    direction, to, evidence = found
    why_not = ""
    if not restartable:
        why_not = "not restartable: run it with --restartable to let xpud move it"
    elif state.moves >= cfg.max_moves:
        why_not = f"move budget spent ({state.moves} of {cfg.max_moves} automatic moves)"
    elif state.last_move_t is not None:
        since = now - state.last_move_t
        if since < cfg.hold_s:
            why_not = f"moved {since:.0f} s ago (hold {cfg.hold_s:g} s)"
        elif direction != state.last_direction and since < 2 * cfg.hold_s:
            why_not = (
                f"moved {state.last_direction} {since:.0f} s ago: no move back within {2 * cfg.hold_s:g} s"
            )
    if why_not:
        evidence = f"{evidence}; not moved: {why_not}"
    return Decision(lease_id, direction, mode, to, not why_not, evidence)


def _up(history, now, cfg, k, steps):
    if k + 1 >= len(steps):
        return None
    win = _window(history, now, cfg.up_after_s)
    if not win or not all(r.throttled(cfg.at_cap) for r in win):
        return None
    s = summarize(win, cfg.at_cap)
    return (
        "up",
        steps[k + 1],
        f"throttled at its {win[-1].cap_pct:g} % compute cap for {cfg.up_after_s:g} s "
        f"({len(win)} readings, mean {s.sm_mean:.0f} %)",
    )


def _down(history, now, cfg, k, steps, slices, card_memory_bytes):
    if k == 0:
        return None
    win = _window(history, now, cfg.down_after_s)
    if not win:
        return None
    s = summarize(win, cfg.at_cap)
    lower = steps[k - 1]
    cap, mem_frac = caps(lower, slices)
    if s.sm_peak is None or max(r.sm_pct or 0.0 for r in win) > cfg.down_below * cap:
        return None
    mem_room = mem_frac * card_memory_bytes
    if s.mem_peak is None or s.mem_peak > 0.9 * mem_room:
        return None
    return (
        "down",
        lower,
        f"peak compute {max(r.sm_pct or 0.0 for r in win):.0f} % of the card and memory "
        f"{s.mem_peak / 2**30:.1f} GiB over {cfg.down_after_s:g} s, under {cfg.down_below:g} of {lower}'s "
        f"{cap:g} % cap and within its {mem_room / 2**30:.1f} GiB",
    )


def first_mode(
    book: UsageBook, cls: str, cfg: AutoSection, slices: Mapping[str, SliceSpec], card_memory: int
):
    """The mode an ``--mode auto`` job of class ``cls`` starts in, and why: the smallest size whose cap
    holds the class's peak (90th percentile) compute with room (``at_cap``) and its peak memory; ``first``
    when the class has no compute history."""
    hist = book.classes.get(cls)
    s = summarize(hist or (), cfg.at_cap)
    if not hist or s.sm_peak is None:
        return cfg.first, f"class {cls!r} has no history: starting in {cfg.first} ([auto] first)"
    for mode in ladder(slices):
        cap, mem_frac = caps(mode, slices)
        mem_ok = s.mem_peak is None or s.mem_peak <= 0.9 * mem_frac * card_memory
        if (mode == XPU or (s.sm_peak < cfg.at_cap * cap and s.throttled_share < 0.5)) and mem_ok:
            return mode, (
                f"class {cls!r}: peak compute {s.sm_peak:.0f} % of a card over {s.readings} readings"
                f" fits {mode}'s {cap:g} % cap"
            )
    return XPU, f"class {cls!r}: needs a whole card"
