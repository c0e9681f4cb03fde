"""--mode auto decisions over readings: up when throttled at the cap, down when idle, hysteresis, budget,
and never a move for a job that cannot be restarted."""

from __future__ import annotations

import itertools

from xpud.config.schema import DEFAULT_SLICES, AutoSection
from xpud.planning.sizing import AutoState, decide, first_mode, ladder
from xpud.planning.usage import Reading, UsageBook

GIB = 1 << 30
CARD = 80 * GIB
CFG = AutoSection(sample_s=5, up_after_s=120, down_after_s=600, hold_s=900, max_moves=4)
CAP = {"vxpu-quarter": 15, "vxpu-half": 30, "xpu": 100}


def run(load, mode, restartable=True, until=4000.0, cfg=CFG, mem=GIB):
    """Feed a lease readings every sample_s from ``load(t, cap)`` (its compute use); apply each decision
    that moves (the history restarts on the new size, as xpud does). Returns (moves, decisions)."""
    hist: list[Reading] = []
    state = AutoState()
    moves, seen = [], []
    t = 0.0
    while t <= until:
        cap = CAP[mode]
        hist.append(Reading(t, min(load(t, cap), cap), mem, cap, int(CARD * 0.25)))
        d = decide("L", mode, restartable, hist, state, t, cfg, DEFAULT_SLICES, CARD)
        if d is not None:
            seen.append((t, d))
            if d.move:
                moves.append((t, mode, d.to))
                state.moves += 1
                state.last_move_t, state.last_direction = t, d.direction
                mode, hist = d.to, []
        t += cfg.sample_s
    return moves, seen


def test_ladder_is_slices_by_compute_then_a_whole_card():
    assert ladder(DEFAULT_SLICES) == ["vxpu-quarter", "vxpu-half", "xpu"]


def test_a_job_at_its_quarter_cap_moves_to_half_then_to_a_whole_card():
    moves, seen = run(lambda t, cap: 100, "vxpu-quarter")  # wants a whole card
    assert [(a, b) for _, a, b in moves] == [("vxpu-quarter", "vxpu-half"), ("vxpu-half", "xpu")]
    assert moves[0][0] == CFG.up_after_s  # after exactly the configured time at its cap
    assert moves[1][0] - moves[0][0] >= CFG.hold_s  # then the hold before the next move
    assert "throttled at its 15 % compute cap for 120 s" in seen[0][1].evidence


def test_a_job_below_its_cap_is_not_moved_up():
    moves, _ = run(lambda t, cap: 12, "vxpu-quarter")  # 12 of 15: busy, not held back
    assert moves == []


def test_an_idle_whole_card_job_moves_to_a_slice():
    moves, seen = run(lambda t, cap: 2, "xpu", until=700)
    assert moves == [(CFG.down_after_s, "xpu", "vxpu-half")]
    assert "peak compute 2 %" in seen[0][1].evidence
    # too much memory for the smaller size: it stays
    assert run(lambda t, cap: 2, "xpu", until=700, mem=60 * GIB)[0] == []


def test_hysteresis_prevents_ping_pong_under_an_oscillating_load():
    # busy (wants 25 %) for 200 s, idle for 700 s, over and over: each phase alone would trigger a move
    def load(t, cap):
        return 25 if t % 900 < 200 else 1

    moves, _ = run(load, "vxpu-quarter", until=20000)
    assert moves[0][1:] == ("vxpu-quarter", "vxpu-half")
    for (t0, _, _), (t1, _, _) in itertools.pairwise(moves):
        assert t1 - t0 >= 2 * CFG.hold_s  # never a quick move back
    assert len(moves) <= CFG.max_moves  # and the budget bounds the rest
    # without the hold and the budget, the same load flaps every cycle
    loose = AutoSection(sample_s=5, up_after_s=120, down_after_s=600, hold_s=0, max_moves=100)
    assert len(run(load, "vxpu-quarter", until=20000, cfg=loose)[0]) > 2 * len(moves)


def test_a_non_restartable_job_is_never_moved_but_gets_the_recommendation():
    moves, seen = run(lambda t, cap: 100, "vxpu-quarter", restartable=False)
    assert moves == []
    assert seen and all(not d.move for _, d in seen)
    assert seen[0][1].to == "vxpu-half" and "not restartable" in seen[0][1].line()


def test_budget_spent_turns_decisions_into_recommendations():
    cfg = AutoSection(sample_s=5, up_after_s=120, hold_s=0, max_moves=1)
    moves, seen = run(lambda t, cap: 100, "vxpu-quarter", cfg=cfg)
    assert len(moves) == 1 and "move budget spent" in seen[-1][1].evidence


def test_first_mode_from_the_class_history():
    book = UsageBook(keep=50)
    assert first_mode(book, "serve", CFG, DEFAULT_SLICES, CARD)[0] == "vxpu-half"  # [auto] first
    for i in range(20):
        book.add(f"L{i}", "serve", Reading(i, 8.0, 2 * GIB, 30, 40 * GIB))
    mode, why = first_mode(book, "serve", CFG, DEFAULT_SLICES, CARD)
    assert mode == "vxpu-quarter" and "peak compute 8 %" in why
    for i in range(20):
        book.add(f"T{i}", "train", Reading(i, 30.0, 2 * GIB, 30, 40 * GIB))  # held at the half cap
    assert first_mode(book, "train", CFG, DEFAULT_SLICES, CARD)[0] == "xpu"


def test_auto_first_must_be_a_mode_and_numbers_are_bounded():
    import pytest

    from xpud.config.read import parse
    from xpud.errors import ConfigError

    assert parse('[auto]\nfirst = "xpu"\n').auto.first == "xpu"
    with pytest.raises(ConfigError, match=r"first.*'vxpu-tiny' is not a mode"):
        parse('[auto]\nfirst = "vxpu-tiny"\n')
    with pytest.raises(ConfigError, match="at_cap"):
        parse("[auto]\nat_cap = 1.5\n")
    with pytest.raises(ConfigError, match="sample_s"):
        parse("[auto]\nsample_s = nan\n")
