"""PCIe replays: the allowance follows DCGM's rule for the card's link (generation and width), and only a
minute with more replays than that warns (DCGM: ``pciReplayRate > expectedPcieReplayRate``)."""

from __future__ import annotations

import pytest

from xpud.config.schema import Config, HealthSection
from xpud.controllers.health import HealthMonitor
from xpud.engine.engine import Engine
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.health import CardHealth
from xpud.hw.nvml import Nvml
from xpud.hw.signals import OK, WARN, pcie_replay_limit
from xpud.ledger.ledger import Ledger
from xpud.model import CardSample


@pytest.mark.parametrize(
    ("gen", "width", "limit"),
    [(1, 16, 3), (3, 16, 8), (4, 16, 16), (4, 8, 8), (5, 16, 31), (6, 16, 62), (7, 16, 62), (4, None, None)],
)
def test_the_allowance_is_dcgms_rule(gen, width, limit):
    assert pcie_replay_limit(gen, width) == limit


def replays(link, counts, cfg: HealthSection | None = None):
    """Feed counter values one every 10 s; the pcie_replays signal after the last."""
    ch = CardHealth(0, cfg or HealthSection(), pcie_link=link)
    for k, n in enumerate(counts):
        ch.observe_sample(CardSample(timestamp=10.0 * k, pcie_replay_counter=n))
    return next(s for s in ch.signals(10.0 * (len(counts) - 1)) if s.name == "pcie_replays")


def test_a_gen5_x16_card_may_have_more_replays_than_a_gen4_one():
    assert replays((5, 16), [0, 20]).status == OK  # 20/min: fine on Gen5 x16 (31), not on Gen4 x16
    assert replays((4, 16), [0, 20]).status == WARN
    sig = replays((5, 16), [0, 32])
    assert (sig.status, sig.threshold) == (WARN, 31)
    assert "more than 31 (PCIe Gen5 x16)" in sig.reason


def test_only_more_than_the_allowance_warns():
    assert replays((4, 16), [0, 16]).status == OK
    assert replays((4, 16), [0, 17]).status == WARN


def test_a_set_threshold_overrides_the_rule_and_an_unknown_link_uses_gen4_x16():
    cfg = HealthSection(pcie_replay_warn_per_min=40.0)
    assert replays((4, 16), [0, 40], cfg).status == OK
    assert replays((4, 16), [0, 41], cfg).status == WARN
    assert replays((None, None), [0, 16]).threshold == 16


def test_the_monitor_reads_each_cards_link(tmp_path):
    fake = FakeNvml("pcie-8x-l40s")  # Gen4 x16
    hw = Nvml(fake)
    engine = Engine(hw.cards(), hw.topology(), Config(), Ledger(tmp_path / "l.sqlite"))
    monitor = HealthMonitor(engine, hw, engine.cfg)
    assert monitor.cards[0].memory.pcie_link == (4, 16)
    monitor.on_samples({0: hw.sample(0)})
    fake.add_pcie_replays(0, 17)
    monitor.on_samples({0: hw.sample(0)})
    sig = next(s for s in monitor.reports[0].signals if s.name == "pcie_replays")
    assert (sig.value, sig.threshold, sig.status) == (17, 16, WARN)
