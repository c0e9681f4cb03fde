"""The health monitor in process: the NVML event thread hands events to the loop, MIG application XIDs
name the slice's lease, a failing driver wait does not spin, and stopping is prompt."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from tests.syncengine import sync_engine
from xpud.config.schema import Config
from xpud.controllers.health import HealthMonitor
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.ledger.ledger import Ledger
from xpud.model import HealthState, Mode, Request


def setup(tmp_path, machine="dgx-h100", mig_card: int | None = None):
    fake = FakeNvml(machine)
    hw = Nvml(fake)
    hw.open()
    if mig_card is not None:
        hw.set_mig_mode(mig_card, True)
        fake.reset(mig_card)
    engine = sync_engine(hw.cards(), hw.topology(), Config(), Ledger(tmp_path / "l.sqlite"))
    return fake, hw, engine, HealthMonitor(engine, hw, engine.cfg)


async def until(pred, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


def test_an_xid_reaches_the_loop_within_a_second_and_stop_is_prompt(tmp_path):
    fake, _, engine, monitor = setup(tmp_path)

    async def main():
        monitor.start()
        assert all(ch.memory.xid_events for ch in monitor.cards.values())
        sent = time.monotonic()
        fake.inject_xid(4, 119)  # GSP error: fails the card, and only an event can tell
        await until(lambda: engine.cards[4].health_state is HealthState.UNHEALTHY)
        took = time.monotonic() - sent
        stopping = time.monotonic()
        monitor.stop()
        return took, time.monotonic() - stopping

    took, stop_took = asyncio.run(main())
    assert took < 1.0 and stop_took < 1.5
    assert "xid 119 (GSP RPC timeout)" in engine.cards[4].health_reason
    [change] = engine.ledger.health_changes(engine.cards[4].info.uuid)
    assert (change.from_state, change.to_state) == ("healthy", "unhealthy")
    assert [e.kind for e in engine.ledger.events() if e.card == 4] == ["health"]


def test_a_mig_application_xid_is_counted_against_the_slice_in_that_gpu_instance(tmp_path):
    fake, hw, engine, monitor = setup(tmp_path, mig_card=0)
    half = hw.create_mig_instance(0, 9, 4)  # 3g.40gb at slot 4
    quarter = hw.create_mig_instance(0, 14, 0)  # 2g.20gb at slot 0
    engine.set_mode("0", "sliced")
    a, _ = engine.try_grant(Request(Mode.VXPU_HALF, owner_uid=1))
    b, _ = engine.try_grant(Request(Mode.VXPU_QUARTER, owner_uid=1))
    assert a.cards == b.cards == (0,)
    card = engine.cards[0]  # the accounting backend made no MIG devices: give the slices theirs
    card.slices[a.id] = replace(card.slices[a.id], handle=half.uuid)
    card.slices[b.id] = replace(card.slices[b.id], handle=quarter.uuid)
    qa, qb = engine.hold_opened(a.id), engine.hold_opened(b.id)

    async def main():
        monitor.start()
        fake.inject_xid(0, 31, gpu_instance_id=quarter.gpu_instance_id)
        await until(lambda: engine.leases[b.id].mark)
        monitor.stop()

    asyncio.run(main())
    assert "xid 31 (GPU memory page fault)" in engine.leases[b.id].mark
    assert engine.leases[a.id].mark == "" and qa.empty()
    assert qb.get_nowait().kind == "mark"
    assert card.health_state is HealthState.HEALTHY and card.health_score == 100
    assert monitor.app_xids == {b.id: 1}


def test_a_failing_event_wait_backs_off_and_polling_still_judges(tmp_path, caplog):
    import pynvml

    fake, hw, engine, monitor = setup(tmp_path, machine="pcie-8x-l40s")
    fake.fail("nvmlEventSetWait", pynvml.NVML_ERROR_UNKNOWN)

    async def main():
        monitor.start()
        await asyncio.sleep(0.3)
        fake.lose(1)
        monitor.on_samples({i: hw.sample(i) for i in range(8)})
        monitor.stop()

    asyncio.run(main())
    assert fake.calls["nvmlEventSetWait"] <= 2  # one failure, then a pause: no busy loop
    assert "retrying in 1 s" in caplog.text
    assert engine.cards[1].health_state is HealthState.UNHEALTHY
    assert "fell off the bus" in engine.cards[1].health_reason


def test_a_lost_card_drops_its_xid_flag_and_the_other_cards_events_keep_coming(tmp_path):
    # Regression (issue 11, item 8): once a card was lost every event wait failed (GPU_IS_LOST), the
    # thread paused and made its set again, and the card still counted as reporting XID events.
    fake, hw, engine, monitor = setup(tmp_path)

    async def main():
        monitor.start()
        fake.inject_xid(3, 79)
        await until(lambda: not monitor.cards[3].memory.xid_events)
        await until(lambda: engine.cards[3].health_state is HealthState.UNHEALTHY)
        assert "xid 79" in engine.cards[3].health_reason  # what came before the loss still counts
        fake.inject_xid(5, 119)
        await until(lambda: engine.cards[5].health_state is HealthState.UNHEALTHY)
        assert all(monitor.cards[i].memory.xid_events for i in range(8) if i != 3)
        assert fake.calls["nvmlEventSetCreate"] == 2  # made again once, without card 3
        fake.clear(3)  # reset: the card answers again, and its events are registered again
        monitor.on_samples({3: hw.sample(3)})
        await until(lambda: monitor.cards[3].memory.xid_events)
        fake.inject_xid(3, 31)
        await until(lambda: any(e.kind == "xid" and e.card == 3 for e in engine.ledger.events()))
        await asyncio.to_thread(monitor.stop)

    asyncio.run(main())
