"""NVLink "links down" as the driver reports links: only links that were trained and dropped count.

nvml.h: nvmlDeviceGetNvLinkState answers NVML_FEATURE_ENABLED (active) or DISABLED (inactive); the field
NVML_FI_DEV_NVLINK_GET_STATE answers NVML_NVLINK_STATE_INACTIVE, _ACTIVE or _SLEEP (low power, still
trained); NVML_FI_DEV_NVLINK_LINK_COUNT counts the links the board has, wired or not. A PCIe H100/A100
without its bridge therefore has 12 links, all inactive, and a card in MIG mode has its links down
(DCGM's health watch skips both).
"""

from __future__ import annotations

import pynvml
import pytest

from xpud.config.schema import Config, HealthSection
from xpud.controllers.health import HealthMonitor
from xpud.engine.engine import Engine
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.health import CardHealth
from xpud.hw.nvml import Nvml
from xpud.ledger.ledger import Ledger
from xpud.model import HealthState


def rig(machine: str, read_inventory: bool = True) -> tuple[FakeNvml, Nvml]:
    fake = FakeNvml(machine, clock=lambda: 100.0)
    nvml = Nvml(fake)
    if read_inventory:
        nvml.cards()
    return fake, nvml


def state_of(nvml: Nvml, index: int) -> HealthState:
    ch = CardHealth(index, HealthSection())
    ch.observe_sample(nvml.sample(index))
    return ch.evaluate(100.0)[0].state


def signal(nvml: Nvml, index: int, name: str):
    ch = CardHealth(index, HealthSection())
    ch.observe_sample(nvml.sample(index))
    return next(s for s in ch.signals(100.0) if s.name == name)


def test_the_fake_reports_an_unbridged_pcie_h100_as_nvml_does():
    fake, nvml = rig("pcie-4x-h100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    (count,) = fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
    assert count.value.uiVal == 12
    assert [fake.nvmlDeviceGetNvLinkState(h, k) for k in range(12)] == [pynvml.NVML_FEATURE_DISABLED] * 12
    states = fake.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_NVLINK_GET_STATE, k) for k in range(12)])
    assert {v.value.uiVal for v in states} == {pynvml.NVML_NVLINK_STATE_INACTIVE}
    assert nvml.card_info(0).nvlink_active_links == 0 and nvml.topology().nvlinks == ()


@pytest.mark.parametrize("read_inventory", [True, False])
def test_pcie_h100_without_bridges_is_not_failed_for_its_inactive_links(read_inventory):
    _, nvml = rig("pcie-4x-h100", read_inventory)
    for i in range(4):
        assert nvml.sample(i).nvlink_links_down is None
        assert signal(nvml, i, "nvlink_links_down").status == "absent"
        assert state_of(nvml, i) is HealthState.HEALTHY
    assert not nvml.errors


def test_a_dropped_bridge_link_is_down_and_fails_the_card():
    fake, nvml = rig("pcie-4x-a100-bridged")
    assert [nvml.sample(i).nvlink_links_down for i in range(4)] == [0, 0, 0, 0]
    fake.nvlink_down(0, links=[2])
    assert nvml.sample(0).nvlink_links_down == 1
    sig = signal(nvml, 0, "nvlink_links_down")
    assert sig.status == "fail" and "1 NVLink link(s) down" in sig.reason
    assert state_of(nvml, 0) is HealthState.UNHEALTHY
    assert nvml.sample(2).nvlink_links_down == 0 and state_of(nvml, 2) is HealthState.HEALTHY


def test_sleeping_links_are_not_down():
    fake, nvml = rig("dgx-h100")
    fake.nvlink_sleep(3)
    h = fake.nvmlDeviceGetHandleByIndex(3)
    (v,) = fake.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_NVLINK_GET_STATE, 0)])
    assert v.value.uiVal == pynvml.NVML_NVLINK_STATE_SLEEP
    assert nvml.sample(3).nvlink_links_down == 0
    assert state_of(nvml, 3) is HealthState.HEALTHY
    fake.nvlink_down(3, links=[5])  # asleep or not, a link that drops is down
    assert nvml.sample(3).nvlink_links_down == 1


def test_links_that_mig_takes_down_are_not_counted():
    fake, nvml = rig("pcie-4x-a100-bridged")
    assert nvml.sample(0).nvlink_links_down == 0
    nvml.set_mig_mode(0, True)
    fake.reset(0)
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlDeviceGetNvLinkState(h0, 0) == pynvml.NVML_FEATURE_DISABLED
    assert fake.nvmlDeviceGetNvLinkState(h1, 0) == pynvml.NVML_FEATURE_DISABLED  # its partner's too
    assert nvml.sample(1).nvlink_links_down == 0  # the partner first: card 0's new mode is read then
    assert nvml.sample(0).nvlink_links_down == 0
    assert state_of(nvml, 1) is HealthState.HEALTHY
    nvml.set_mig_mode(0, False)
    fake.reset(0)
    assert [nvml.sample(i).nvlink_links_down for i in (0, 1)] == [0, 0]
    fake.nvlink_down(1, links=[0])
    assert nvml.sample(1).nvlink_links_down == 1


def test_a_link_that_comes_up_late_counts_once_it_drops():
    fake, nvml = rig("pcie-4x-a100-bridged", read_inventory=False)
    fake.nvlink_down(0, links=[4])  # down before the adapter ever saw it: not known to be wired
    assert nvml.sample(0).nvlink_links_down == 0
    fake.clear(0)
    assert nvml.sample(0).nvlink_links_down == 0
    fake.nvlink_down(0, links=[4])
    assert nvml.sample(0).nvlink_links_down == 1


def test_the_monitor_keeps_every_unbridged_pcie_h100_in_service(tmp_path):
    _, hw = rig("pcie-4x-h100", read_inventory=False)
    engine = Engine(hw.cards(), hw.topology(), Config(), Ledger(tmp_path / "l.sqlite"))
    monitor = HealthMonitor(engine, hw, engine.cfg)
    for _ in range(3):
        monitor.on_samples({i: hw.sample(i) for i in engine.cards})
    assert [c.health_state for c in engine.cards.values()] == [HealthState.HEALTHY] * 4
    assert all(c.usable for c in engine.cards.values())


def test_a_partner_that_falls_off_the_bus_takes_the_bridge_down():
    fake, nvml = rig("pcie-4x-a100-bridged")
    assert nvml.sample(1).nvlink_links_down == 0
    fake.lose(0)
    assert nvml.sample(0).lost
    assert nvml.sample(1).nvlink_links_down == 12
    fake.clear(0)
    assert nvml.sample(1).nvlink_links_down == 0
