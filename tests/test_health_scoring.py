"""Health scoring, pure: signals and their thresholds, states, scores, hysteresis, flap damping."""

from __future__ import annotations

import dataclasses

import pytest

from xpud.config.schema import HealthSection
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.health import CardHealth
from xpud.hw.nvml import Nvml
from xpud.hw.signals import ABSENT, FAIL, INFO, OK, WARN, memory_fragmentation, xid_class
from xpud.model import CardSample, HealthState, Slice

H, D, U = HealthState.HEALTHY, HealthState.DEGRADED, HealthState.UNHEALTHY
CFG = HealthSection(clear_s=10.0, event_window_s=30.0, flap_window_s=1000.0, clear_max_s=60.0)
GIB = 1 << 30


def good(t: float, **kw) -> CardSample:
    """A healthy H100-like sample at time t."""
    base = dict(
        timestamp=t,
        utilization_gpu_pct=50,
        utilization_memory_pct=30,
        memory_used_bytes=10 * GIB,
        memory_total_bytes=80 * GIB,
        temperature_c=60,
        temperature_slowdown_c=87,
        temperature_shutdown_c=92,
        power_w=300.0,
        power_limit_w=700.0,
        performance_state=0,
        ecc_sbe_volatile=0,
        ecc_dbe_volatile=0,
        ecc_sbe_aggregate=0,
        ecc_dbe_aggregate=0,
        remapped_rows_corrected=0,
        remapped_rows_uncorrected=0,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
        clock_event_reasons=0,
        pcie_replay_counter=0,
        nvlink_replay_errors=0,
        nvlink_recovery_errors=0,
        nvlink_crc_flit_errors=0,
        nvlink_crc_data_errors=0,
        nvlink_links_down=0,
        inforom_valid=True,
    )
    base.update(kw)
    return CardSample(**base)


def card(cfg: HealthSection = CFG) -> CardHealth:
    return CardHealth(0, cfg)


def judge(ch: CardHealth, sample: CardSample):
    ch.observe_sample(sample)
    return ch.evaluate(sample.timestamp)


def sig(report, name):
    return next(s for s in report.signals if s.name == name)


def test_a_healthy_card_reports_every_signal_ok_and_scores_100():
    ch = card()
    report, change = judge(ch, good(100.0))
    assert change is None and report.state is H and report.score == 100 and report.reasons == ()
    present = [s for s in report.signals if s.status != ABSENT]
    assert len(present) >= 12, [s.name for s in present]
    assert {s.status for s in present} == {OK}
    assert sig(report, "temperature").threshold == 87
    assert sig(report, "power").threshold == 735  # 1.05 x the 700 W limit
    assert sig(report, "retired_pages").status == ABSENT  # an Ampere+ card remaps rows instead


def test_the_adapter_over_the_fake_gives_a_healthy_judgement_on_every_machine():
    for machine in ("dgx-h100", "dgx-a100", "pcie-8x-l40s", "workstation-2x"):
        nvml = Nvml(FakeNvml(machine))
        nvml.open()
        for i in range(nvml.card_count()):
            ch = CardHealth(i, CFG)
            report, _ = judge(ch, nvml.sample(i))
            assert report.state is H, (machine, i, report.reasons)
            assert len([s for s in report.signals if s.status != ABSENT]) >= 12, machine


@pytest.mark.parametrize(
    ("change", "name", "status", "state", "words"),
    [
        (dict(temperature_c=87), "temperature", WARN, D, "87 C >= 87 C"),
        (dict(clock_event_reasons=0x40), "clock_events", WARN, D, "HW thermal slowdown"),
        (dict(clock_event_reasons=0x4), "clock_events", INFO, H, "SW power cap"),
        (dict(clock_event_reasons=0x1), "clock_events", OK, H, ""),
        (dict(ecc_dbe_volatile=1), "ecc_dbe_volatile", FAIL, U, "double-bit"),
        (dict(ecc_sbe_volatile=1000), "ecc_sbe_volatile", WARN, D, "1000 corrected"),
        (dict(ecc_dbe_aggregate=2), "ecc_dbe_aggregate", INFO, H, "lifetime"),
        (dict(remapped_rows_failure=True), "remapped_rows", FAIL, U, "no spare rows"),
        (dict(remapped_rows_pending=True), "remapped_rows", FAIL, U, "pending"),
        (dict(nvlink_links_down=2), "nvlink_links_down", FAIL, U, "2 NVLink link(s) down"),
        (dict(inforom_valid=False), "inforom", WARN, D, "InfoROM"),
        (dict(lost=True), "lost", FAIL, U, "fell off the bus"),
    ],
)
def test_each_threshold_sets_the_signal_state_and_reason(change, name, status, state, words):
    ch = card()
    judge(ch, good(100.0))
    report, _ = judge(ch, good(105.0, **change))
    s = sig(report, name)
    assert s.status == status, s
    assert report.state is state
    assert words in s.reason
    if status in (WARN, FAIL):
        assert s.reason in report.reasons
    lo, hi = {H: (80, 100), D: (50, 79), U: (0, 49)}[state]
    assert lo <= report.score <= hi
    if status != OK:
        assert report.score < 100


def test_retired_pages_fail_at_the_dcgm_count_and_pending_warns():
    ch = card()
    report, _ = judge(
        ch, good(0.0, retired_pages_sbe=10, retired_pages_dbe=2, remapped_rows_uncorrected=None)
    )
    assert sig(report, "retired_pages").status == INFO and report.state is H
    report, _ = judge(ch, good(5.0, retired_pages_sbe=10, retired_pages_dbe=2, retired_pages_pending=True))
    assert sig(report, "retired_pages").status == WARN
    report, _ = judge(ch, good(10.0, retired_pages_sbe=50, retired_pages_dbe=13))
    assert sig(report, "retired_pages").status == FAIL and "63 retired pages" in report.reasons[0]


def test_counter_rises_are_events_that_hold_for_the_window_and_a_drop_is_a_reset():
    ch = card()
    judge(ch, good(0.0))
    report, _ = judge(ch, good(5.0, nvlink_replay_errors=12, nvlink_recovery_errors=1))
    assert sig(report, "nvlink_replay").status == FAIL and "rose by 12" in sig(report, "nvlink_replay").reason
    assert sig(report, "nvlink_recovery").status == FAIL
    report, _ = judge(ch, good(30.0, nvlink_replay_errors=12, nvlink_recovery_errors=1))
    assert sig(report, "nvlink_replay").status == FAIL  # still within the 30 s window
    report, _ = judge(ch, good(36.0, nvlink_replay_errors=12, nvlink_recovery_errors=1))
    assert sig(report, "nvlink_replay").status == OK and report.raw_state is H
    report, _ = judge(ch, good(40.0))  # counters back to zero (a reset): not a rise
    assert sig(report, "nvlink_replay").status == OK
    report, _ = judge(ch, good(45.0, remapped_rows_uncorrected=1))
    assert sig(report, "remapped_rows").status == FAIL and "rose to 1" in sig(report, "remapped_rows").reason
    report, _ = judge(ch, good(80.0, remapped_rows_uncorrected=1))
    assert sig(report, "remapped_rows").status == INFO  # remapped and done: noted, not held against it


def test_nvlink_crc_and_pcie_replays_are_rates():
    ch = card()
    judge(ch, good(0.0))
    report, _ = judge(ch, good(5.0, nvlink_crc_flit_errors=400, nvlink_crc_data_errors=99))  # 99.8/s
    assert sig(report, "nvlink_crc").status == OK and sig(report, "nvlink_crc").value == 99.8
    report, _ = judge(ch, good(10.0, nvlink_crc_flit_errors=900, nvlink_crc_data_errors=99))  # 100/s
    assert sig(report, "nvlink_crc").status == FAIL
    ch = card()
    for k in range(13):  # 15 replays spread over a minute: below 16/min
        report, _ = judge(ch, good(5.0 * k, pcie_replay_counter=k * 15 // 12))
    assert sig(report, "pcie_replays").status == OK
    report, _ = judge(ch, good(65.0, pcie_replay_counter=16 + 2))  # 16 within the last minute
    assert sig(report, "pcie_replays").status == WARN and report.state is D


def test_xid_classes_follow_the_configured_lists():
    classes = [xid_class(x, CFG) for x in (79, 48, 94, 43, 13, 999)]
    assert classes == [FAIL, FAIL, WARN, "application", "application", FAIL]
    assert xid_class(999, dataclasses.replace(CFG, xid_unlisted="ignore")) == "ignore"
    ch = card()
    judge(ch, good(0.0))
    ch.observe_xid(43, 1.0)  # application: never held against the card
    ch.observe_application_xid(43, 1.0, ["lease1"])
    report, _ = ch.evaluate(1.0)
    assert report.state is H and report.score == 100
    assert sig(report, "xid_application").status == INFO and "lease1" in sig(report, "xid_application").reason
    ch.observe_xid(94, 2.0)
    report, change = ch.evaluate(2.0)
    assert report.state is D and change.to_state is D and "xid 94 (contained ECC error)" in report.reasons[0]
    ch.observe_xid(79, 3.0)
    report, change = ch.evaluate(3.0)
    assert report.state is U and sig(report, "xid").value == 79 and "fallen off the bus" in report.reasons[0]


def test_worse_at_once_better_only_after_the_clear_time():
    ch = card()
    judge(ch, good(0.0))
    report, change = judge(ch, good(1.0, ecc_dbe_volatile=1))
    assert (change.from_state, change.to_state) == (H, U) and report.score <= 49
    assert "double-bit" in change.reasons[0]
    report, change = judge(ch, good(2.0))  # clear (a reset zeroed the volatile counter)
    assert change is None and report.state is U and report.raw_state is H and report.clear_since == 2.0
    assert report.score == 49  # held in the unhealthy band
    report, change = judge(ch, good(11.0))
    assert change is None and report.state is U  # 9 s of 10
    report, change = judge(ch, good(12.0))
    assert (change.from_state, change.to_state) == (U, H) and report.score == 100
    assert change.reasons[0].startswith("signals clear for 10 s (needed 10 s after 1 failure(s)")


def test_a_relapse_restarts_the_clear_time_and_recovery_goes_through_degraded():
    ch = card()
    judge(ch, good(0.0, ecc_dbe_volatile=1))
    judge(ch, good(1.0))
    judge(ch, good(6.0, temperature_c=90))  # warn only: still below unhealthy, but not clear
    report, change = judge(ch, good(11.0, temperature_c=90))
    assert (change.from_state, change.to_state) == (U, D)  # below unhealthy since t=1
    report, change = judge(ch, good(12.0))
    assert change is None and report.state is D  # healthy only since t=12
    report, change = judge(ch, good(22.0))
    assert change.to_state is H
    ch2 = card()
    judge(ch2, good(0.0, ecc_dbe_volatile=1))
    judge(ch2, good(1.0))
    judge(ch2, good(5.0, ecc_dbe_volatile=1))  # fails again: the clock starts over
    report, _ = judge(ch2, good(6.0))
    report, _ = judge(ch2, good(12.0))
    assert report.state is U
    report, change = judge(ch2, good(16.0))
    assert change.to_state is H


def test_flap_damping_keeps_a_card_that_keeps_failing_out_longer():
    ch = card()
    t, needed, took = 0.0, [], []
    for _ in range(5):
        judge(ch, good(t, ecc_dbe_volatile=1))
        t += 1
        start = t
        report, change = judge(ch, good(t))
        needed.append(report.clear_needed_s)
        while change is None:
            t += 1
            report, change = judge(ch, good(t))
        assert change.to_state is H
        took.append(t - start)
        t += 1
    assert needed == [10.0, 20.0, 40.0, 60.0, 60.0]  # doubled each time, capped at clear_max_s
    assert took == needed
    ch.observe_xid(79, t + 2000.0)  # long after: the old failures left the flap window
    report, _ = ch.evaluate(t + 2000.0)
    assert report.clear_needed_s == 10.0


def test_restore_keeps_a_card_out_for_a_full_clear_time():
    ch = card()
    ch.restore(U, [90.0])
    report, change = judge(ch, good(100.0))
    assert report.state is U and change is None and report.clear_since == 100.0
    report, change = judge(ch, good(110.0))
    assert change.to_state is H


@pytest.mark.parametrize(
    ("held", "fraction", "expect"),
    [
        ([], 0.25, 0.0),  # idle
        ([Slice(0, "q", 20 * GIB, 15)] * 3, 0.25, 0.0),  # a quarter left: fits one quarter
        ([Slice(0, "h", 40 * GIB, 30)], 0.25, 0.0),
        ([Slice(0, "h", 40 * GIB, 30)], 0.375, 0.25),  # half free, 3/8 usable
        ([Slice(0, "x", 30 * GIB, 30)], 0.5, 0.2),  # 5/8 free, one half fits: 1/8 of 5/8 lost
        # MIG placements (eighths): quarters at slots 2-3 and 6-7 leave 0-1 and 4-5: no half fits
        ([Slice(0, "q", 20 * GIB, 15, placement=2), Slice(0, "q", 20 * GIB, 15, placement=6)], 0.5, 1.0),
        ([Slice(0, "q", 20 * GIB, 15, placement=2), Slice(0, "q", 20 * GIB, 15, placement=6)], 0.25, 0.0),
        ([Slice(0, "q", 20 * GIB, 15, placement=0), Slice(0, "q", 20 * GIB, 15, placement=2)], 0.5, 0.0),
    ],
)
def test_memory_fragmentation(held, fraction, expect):
    assert memory_fragmentation(held, 80 * GIB, fraction) == pytest.approx(expect)


def test_fragmentation_is_noted_never_judged():
    ch = card()
    ch.observe_sample(good(0.0), fragmentation=1.0)
    report, _ = ch.evaluate(0.0)
    s = sig(report, "memory_fragmentation")
    assert s.status == INFO and "cannot hold a vxpu-quarter" in s.reason
    assert report.state is H and report.score == 98  # weight 10, a fifth of it
