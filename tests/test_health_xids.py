"""XID classes and names: where the default lists come from, and what each XID is called.

Names follow NVIDIA's XID catalogue; the fail/warn lists follow DCGM's health watch (>= 4.4) plus 92, the
application list NVIDIA's device plugin (see the comment above ``_XID_WARN`` in xpud/config/schema.py).
"""

from __future__ import annotations

import pytest

from xpud.config.schema import HealthSection
from xpud.hw.health import CardHealth
from xpud.hw.signals import FAIL, WARN, XID_MEANING, xid_class, xid_text
from xpud.model import HealthState

CFG = HealthSection()


def test_xid_92_high_single_bit_ecc_rate_degrades_the_card_instead_of_failing_it():
    assert xid_class(92, CFG) == WARN
    ch = CardHealth(0, CFG)
    assert ch.observe_xid(92, 10.0) == WARN
    report, _ = ch.evaluate(10.0)
    assert report.state is HealthState.DEGRADED
    assert "high single-bit ECC error rate" in report.reasons[0]


@pytest.mark.parametrize(
    ("xid", "name"),
    [
        (60, "video processor exception"),  # not a thermal or power XID
        (67, "illegal access by driver"),  # not NVLink
        (73, "NVENC2"),  # not NVLink
        (38, "driver firmware error"),  # DCGM calls it a PCIe bus error
        (39, "copy engine exception"),
        (92, "high single-bit ECC error rate"),
    ],
)
def test_xid_names_follow_nvidias_catalogue(xid, name):
    assert name in xid_text(xid)


def test_every_listed_xid_has_a_name():
    listed = {*CFG.xid_application, *CFG.xid_fail, *CFG.xid_warn}
    assert listed <= set(XID_MEANING), sorted(listed - set(XID_MEANING))


def test_dcgms_always_failing_xids_fail_and_its_warnings_warn():
    for xid in (48, 74, 79, 95, 119, 120, 140, 64):
        assert xid_class(xid, CFG) == FAIL, xid
    for xid in (94, 32, 63, 38, 39, 42, 60, 61, 62, 54, 56, 57, 58, 78, 67, 73, 93, 121, 137):
        assert xid_class(xid, CFG) == WARN, xid
    assert not set(CFG.xid_fail) & set(CFG.xid_warn)
