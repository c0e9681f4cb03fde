"""Faults that do not pass with time (#29 items 15-17): fail-class XIDs and the driver's recovery action
hold a card out until a reset, a pending row remap keeps new work off it, an untrained NVSwitch fabric
keeps it out of service, and power is judged by a sustained excess, not one sample at the cap."""

from __future__ import annotations

import dataclasses

import pynvml as N

from tests.test_health_scoring import CFG, D, H, U, card, good, judge, sig
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.hw.signals import ABSENT, FAIL, OK, WARN

LATER = CFG.event_window_s + CFG.clear_max_s + 1000.0  # far past any window and any clear time


def test_a_fail_class_xid_holds_the_card_until_a_reset_not_until_its_window_ends():
    ch = card()
    judge(ch, good(0.0, recovery_action=0))
    ch.observe_xid(119, 1.0)  # GSP RPC timeout
    report, _ = judge(ch, good(2.0, recovery_action=1))
    assert report.state is U and sig(report, "xid").until is None  # no window ends it
    for t in (LATER, 2 * LATER):
        report, _ = judge(ch, good(t, recovery_action=1))
        assert report.state is U and "needs a GPU reset" in sig(report, "xid").reason
        assert sig(report, "recovery_action").status == FAIL
        assert "GPU reset" in sig(report, "recovery_action").reason
    # The driver asks for nothing any more: the card was reset. Hysteresis as usual from there.
    report, _ = judge(ch, good(3 * LATER, recovery_action=0))
    assert sig(report, "xid").status == OK and sig(report, "recovery_action").status == OK
    report, _ = judge(ch, good(3 * LATER + CFG.clear_max_s, recovery_action=0))
    assert report.state is H


def test_without_the_recovery_field_a_reset_shows_in_the_counters_or_the_card_coming_back():
    ch = card()
    judge(ch, good(0.0, ecc_sbe_volatile=4))
    ch.observe_xid(95, 1.0)  # uncontained ECC
    report, _ = judge(ch, good(LATER, ecc_sbe_volatile=5))
    assert report.state is U and sig(report, "recovery_action").status == ABSENT
    report, _ = judge(ch, good(LATER + 1, ecc_sbe_volatile=0))  # volatile counters back to zero: a reset
    assert sig(report, "xid").status == OK
    # XID 79: lost, then answering again
    ch = card()
    judge(ch, good(0.0))
    ch.observe_xid(79, 1.0)
    judge(ch, dataclasses.replace(good(2.0), lost=True))
    report, _ = judge(ch, good(LATER))
    assert sig(report, "xid").status == OK and sig(report, "lost").status == OK


def test_an_xid_outside_the_reset_list_still_clears_with_its_window():
    ch = card()
    judge(ch, good(0.0))
    ch.observe_xid(94, 1.0)  # contained ECC: a warning, not in xid_reset
    report, _ = judge(ch, good(2.0))
    assert report.state is D and sig(report, "xid").until == 1.0 + CFG.event_window_s
    report, _ = judge(ch, good(LATER))
    assert sig(report, "xid").status == OK


def test_a_pending_row_remap_keeps_new_leases_off_the_card_until_a_reset_applies_it():
    ch = card()
    report, _ = judge(ch, good(0.0, remapped_rows_pending=True))
    assert report.state is U and sig(report, "remapped_rows").status == FAIL  # unhealthy: not usable
    report, _ = judge(ch, good(LATER, remapped_rows_pending=True))
    assert report.state is U  # not by time
    judge(ch, good(LATER + 1, remapped_rows_pending=False))
    report, _ = judge(ch, good(LATER + 1 + CFG.clear_max_s, remapped_rows_pending=False))
    assert report.state is H


def test_power_at_the_cap_is_normal_only_a_sustained_excess_warns():
    ch = card()
    for t in range(5):  # at the limit, as under training: fine however long
        report, _ = judge(ch, good(float(t), power_w=700.0))
        assert sig(report, "power").status == OK
    report, _ = judge(ch, good(10.0, power_w=760.0))  # one reading above 1.05 x: not a trend
    assert sig(report, "power").status == OK and report.state is H
    judge(ch, good(11.0, power_w=760.0))
    report, _ = judge(ch, good(12.0, power_w=760.0))  # the third in a row
    assert sig(report, "power").status == WARN and report.state is D
    assert "3 sample(s) in a row" in sig(report, "power").reason
    report, _ = judge(ch, good(13.0, power_w=690.0))
    assert sig(report, "power").status == OK


def test_an_untrained_nvswitch_fabric_keeps_the_card_out_of_service_until_it_is_trained():
    ch = card()
    report, _ = judge(ch, good(0.0, fabric_state=N.NVML_GPU_FABRIC_STATE_IN_PROGRESS, fabric_status=0))
    assert report.state is U and "not trained yet (in progress)" in sig(report, "fabric").reason
    report, _ = judge(
        ch, good(1.0, fabric_state=N.NVML_GPU_FABRIC_STATE_COMPLETED, fabric_status=N.NVML_ERROR_TIMEOUT)
    )
    assert report.state is U and "training failed" in sig(report, "fabric").reason
    done = dict(fabric_state=N.NVML_GPU_FABRIC_STATE_COMPLETED, fabric_status=N.NVML_SUCCESS)
    judge(ch, good(2.0, **done))
    report, _ = judge(ch, good(2.0 + CFG.clear_max_s, **done))
    assert report.state is H and sig(report, "fabric").status == OK
    assert sig(card().report(0.0), "fabric").status == ABSENT  # no sample: nothing known


def test_through_the_fake_a_gsp_error_holds_the_card_until_nvidia_smi_reset():
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    ch = card()

    def at(t):
        return dataclasses.replace(nvml.sample(0), timestamp=t)

    judge(ch, at(0.0))
    fake.inject_xid(0, 120)
    ch.observe_xid(120, 1.0)
    report, _ = judge(ch, at(LATER))
    assert report.state is U
    assert {sig(report, n).status for n in ("xid", "recovery_action")} == {FAIL}
    fake.reset(0)
    judge(ch, at(LATER + 1))
    report, _ = judge(ch, at(LATER + 1 + CFG.clear_max_s))
    assert report.state is H, report.reasons
    # An NVSwitch card whose fabric is still training is out; trained, it comes back.
    fake.set_fabric(1, N.NVML_GPU_FABRIC_STATE_NOT_STARTED)
    other = card()
    report, _ = judge(other, dataclasses.replace(nvml.sample(1), timestamp=0.0))
    assert report.state is U and sig(report, "fabric").status == FAIL
