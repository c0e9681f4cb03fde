"""Co-location on MPS cards (issue 16 item 4): among equally good sliced cards a new slice goes beside the
leases whose measured profile complements its class's (compute-bound beside memory-bound)."""

from __future__ import annotations

import subprocess

import pytest

from tests.syncengine import sync_engine
from tests.test_engine import Clock, pcie_box, req
from xpud.config.schema import Config
from xpud.controllers.rightsizer import Rightsizer
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.isolation.base import Accounting
from xpud.isolation.faketools import FakeNvidiaTools
from xpud.isolation.mps import MpsIsolation
from xpud.ledger.ledger import Ledger
from xpud.placement.colocate import overlap
from xpud.placement.host import CardCapacity, choose_slice_card

COMPUTE, MEMORY = (14, 2), (6, 60)  # (SM %, memory-controller %) of the card, each job on a quarter slice


def test_overlap_is_lower_beside_a_complementary_profile():
    assert overlap(COMPUTE, [MEMORY]) < overlap(COMPUTE, [COMPUTE])
    assert overlap(MEMORY, [COMPUTE]) < overlap(MEMORY, [MEMORY])
    assert overlap(COMPUTE, []) == 0.0


def test_the_tie_break_decides_only_between_cards_that_tie_on_fit_and_health():
    def sliced(i, free, health=100):
        return CardCapacity(i, True, False, True, free_memory_fraction=free, health_score=health)

    asked = []

    def cost(i):
        asked.append(i)
        return {0: 5.0, 1: 1.0, 2: 0.0}[i]

    assert choose_slice_card([sliced(0, 0.5), sliced(1, 0.5), sliced(2, 0.75)], 0.25, 15, tie_break=cost) == 1
    assert sorted(asked) == [0, 1]  # card 2 fits worse: never asked
    asked.clear()
    assert choose_slice_card([sliced(0, 0.5), sliced(1, 0.5, health=90)], 0.25, 15, tie_break=cost) == 0
    assert asked == []  # health decides: no tie
    assert choose_slice_card([sliced(0, 0.5), sliced(1, 0.5)], 0.25, 15, tie_break=lambda i: 0.0) == 0


@pytest.fixture
def mps_world(tmp_path):
    clock = Clock()
    fake = FakeNvml("pcie-8x-l40s", clock=clock)
    nvml = Nvml(fake)
    nvml.open()
    tools = FakeNvidiaTools(fake)
    infos = [nvml.card_info(i) for i in range(8)]
    cfg = Config().replace("auto", sample_s=5.0)

    def engine(isolation="mps"):
        def backend(card):
            return MpsIsolation(card, nvml, tools, tmp_path / "run") if isolation == "mps" else Accounting()

        e = sync_engine(infos, pcie_box(), cfg, Ledger(tmp_path / "l.sqlite"), backend, clock=clock)
        rs = Rightsizer(e.engine, nvml)
        e.rightsizer = rs
        return e, rs

    holders = []

    def holder():
        p = subprocess.Popen(["sleep", "60"])
        holders.append(p)
        return p.pid

    yield engine, fake, clock, holder
    for p in holders:
        p.kill()
        p.wait()


def two_cards_one_compute_one_memory(engine, fake, clock, holder):
    """Card 0 holds a compute-bound lease of class "train", card 1 a memory-bound one of class "etl",
    both measured for a minute; the classes' histories come from them."""
    e, rs = engine
    for card, cls, (sm, bw) in ((0, "train", COMPUTE), (1, "etl", MEMORY)):
        pid = holder()
        lease, _ = e.try_grant(req("vxpu-quarter", cards=(card,), holder_pid=pid, command=f"{cls} job"))
        rs.track(lease.id, cls, False)
        fake.add_process(card, pid, used_bytes=1 << 30)
        fake.set_process_load(card, pid, sm, bw)
    for _ in range(12):
        clock.t += 5
        e.run(rs.poll())
    return e, rs


def test_a_compute_bound_class_goes_beside_the_memory_bound_lease(mps_world):
    engine, fake, clock, holder = mps_world
    e, rs = two_cards_one_compute_one_memory(engine(), fake, clock, holder)
    assert rs.book.class_profile("train") == COMPUTE and rs.book.class_profile("etl") == MEMORY
    assert e._fit(req("vxpu-quarter", command="etl job --fast")) == (0,)  # class from the command
    train, _ = e.try_grant(req("vxpu-quarter", job_class="train"))
    assert train.cards == (1,)  # beside "etl", not beside the other "train" on card 0


def test_with_no_history_placement_is_unchanged(mps_world):
    engine, fake, clock, holder = mps_world
    e, rs = two_cards_one_compute_one_memory(engine(), fake, clock, holder)
    assert e._fit(req("vxpu-quarter", job_class="never-seen")) == (0,)  # the lowest index, as before
    e.rightsizer = None
    assert e._fit(req("vxpu-quarter", job_class="train")) == (0,)  # without co-location: card 0
    e.rightsizer = rs
    assert e._fit(req("vxpu-quarter", job_class="train")) == (1,)


def test_only_mps_cards_are_ranked_by_profile(mps_world):
    engine, fake, clock, holder = mps_world
    e, _ = two_cards_one_compute_one_memory(engine("none"), fake, clock, holder)
    train, _ = e.try_grant(req("vxpu-quarter", job_class="train"))
    assert train.cards == (0,)  # not MPS: no co-location, the lowest index


def test_a_moved_lease_goes_beside_its_complement_too(mps_world):
    engine, fake, clock, holder = mps_world
    e, rs = two_cards_one_compute_one_memory(engine(), fake, clock, holder)
    lease, _ = e.try_grant(req("vxpu-quarter", cards=(2,), restartable=True, command="python train.py"))
    e.hold_opened(lease.id)
    rs.track(lease.id, "train", True)
    moved = e.run(e.moves.start(lease.id, "test"))
    assert moved.cards == (1,)  # beside "etl"; without co-location card 0 (the lowest index)
