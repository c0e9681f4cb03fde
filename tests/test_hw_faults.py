"""Each injected fault shows up in the adapter's samples (and events), and ``clear`` puts it right."""

from __future__ import annotations

import threading
from pathlib import Path

import pynvml
import pytest

from xpud.hw.fakenvml import FakeNvml
from xpud.hw.machines import load_machine
from xpud.hw.nvml import Nvml

DATA = Path(__file__).parent / "data"
THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown


def rig(machine="dgx-h100"):
    fake = FakeNvml(machine, clock=lambda: 500.0)
    nvml = Nvml(fake)
    nvml.cards()
    return fake, nvml


def test_xid_79_loses_the_card_until_cleared():
    fake, nvml = rig()
    w = nvml.event_waiter()
    fake.inject_xid(2, 79)
    assert [(e.card_index, e.kind, e.xid) for e in w.wait(100)] == [(2, "xid", 79), (2, "lost", None)]
    assert nvml.sample(2).lost and not nvml.sample(1).lost
    fake.clear(2)
    assert not nvml.sample(2).lost and nvml.sample(2).temperature_c is not None
    w.close()


def test_an_application_xid_leaves_the_card_working():
    fake, nvml = rig()
    fake.inject_xid(2, 13)
    assert not nvml.sample(2).lost


def test_double_bit_ecc_on_a_row_remapping_card():
    fake, nvml = rig()
    fake.inject_ecc_dbe(1)
    s = nvml.sample(1)
    assert (s.ecc_dbe_volatile, s.ecc_dbe_aggregate) == (1, 1)
    assert (s.remapped_rows_uncorrected, s.remapped_rows_pending) == (1, True)
    fake.clear(1)
    s = nvml.sample(1)
    assert (s.ecc_dbe_volatile, s.ecc_dbe_aggregate) == (0, 1)  # volatile reset, aggregate kept
    assert (s.remapped_rows_uncorrected, s.remapped_rows_pending) == (1, False)  # the remap was applied


def test_double_bit_ecc_on_a_page_retirement_card():
    fake, nvml = rig(load_machine(DATA / "nvlink-mesh.toml"))
    fake.inject_ecc_dbe(0)
    fake.inject_ecc_dbe(0)
    s = nvml.sample(0)
    assert (s.retired_pages_dbe, s.retired_pages_pending, s.remapped_rows_uncorrected) == (2, True, None)
    fake.clear(0)
    s = nvml.sample(0)
    assert (s.retired_pages_dbe, s.retired_pages_pending, s.ecc_dbe_volatile, s.ecc_dbe_aggregate) == (
        2,
        False,
        0,
        2,
    )


def test_single_bit_ecc():
    fake, nvml = rig()
    fake.inject_ecc_sbe(3, count=5)
    s = nvml.sample(3)
    assert (s.ecc_sbe_volatile, s.ecc_sbe_aggregate, s.ecc_dbe_volatile) == (5, 5, 0)


def test_overheat():
    fake, nvml = rig()
    fake.set_overheat(4)
    s = nvml.sample(4)
    assert s.temperature_c > s.temperature_slowdown_c
    assert s.clock_event_reasons & THERMAL == THERMAL
    fake.clear(4)
    s = nvml.sample(4)
    assert s.temperature_c < s.temperature_slowdown_c - 30 and s.clock_event_reasons & THERMAL == 0


def test_nvlink_down():
    fake, nvml = rig()
    fake.nvlink_down(6)
    s = nvml.sample(6)
    assert s.nvlink_links_down == 18
    assert (s.nvlink_replay_errors, s.nvlink_recovery_errors) == (18 * 12, 18)
    assert s.nvlink_crc_flit_errors > 0 and s.nvlink_crc_data_errors > 0
    assert nvml.card_info(6).nvlink_active_links == 0
    topo = nvml.topology()
    assert topo.links(6, 0) == 0 and topo.label(6, 0) == "SYS" and topo.links(0, 1) == 18
    fake.clear(6)
    s = nvml.sample(6)
    assert (s.nvlink_links_down, s.nvlink_replay_errors, s.nvlink_recovery_errors) == (0, 0, 0)
    assert nvml.topology().links(6, 0) == 18


def test_some_links_down():
    fake, nvml = rig()
    fake.nvlink_down(0, links=[3, 4])
    assert nvml.sample(0).nvlink_links_down == 2 and nvml.topology().links(0, 5) == 16


def test_corrupt_inforom():
    fake, nvml = rig()
    fake.corrupt_inforom(7)
    assert nvml.sample(7).inforom_valid is False and not nvml.errors
    fake.clear(7)
    assert nvml.sample(7).inforom_valid is True


def test_faults_are_thread_safe_while_sampling():
    fake, nvml = rig()
    errors: list[BaseException] = []

    def sampler():
        try:
            for _ in range(200):
                for i in range(8):
                    nvml.sample(i)
        except BaseException as e:  # any crash fails the test
            errors.append(e)

    t = threading.Thread(target=sampler)
    t.start()
    for k in range(200):
        i = k % 8
        (fake.lose, fake.set_overheat, fake.nvlink_down, fake.inject_ecc_dbe)[k % 4](i)
        fake.clear(i)
    t.join(10)
    assert not errors and not t.is_alive()


@pytest.mark.parametrize(
    "fault", ["lose", "set_overheat", "nvlink_down", "inject_ecc_dbe", "corrupt_inforom"]
)
def test_clear_restores_a_healthy_sample(fault):
    fake, nvml = rig()
    healthy = nvml.sample(5)
    getattr(fake, fault)(5)
    assert nvml.sample(5) != healthy
    fake.clear(5)
    after = nvml.sample(5)
    for key in (
        "lost",
        "temperature_c",
        "clock_event_reasons",
        "nvlink_links_down",
        "ecc_dbe_volatile",
        "remapped_rows_pending",
        "inforom_valid",
        "power_w",
    ):
        assert getattr(after, key) == getattr(healthy, key), key
