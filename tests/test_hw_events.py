"""Hardware events: an injected XID reaches a thread blocked in wait; idle waits time out."""

from __future__ import annotations

import threading
import time

import pynvml
import pytest

from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import HwEvent, Nvml


def waiter(machine="dgx-h100", indices=None):
    fake = FakeNvml(machine)
    nvml = Nvml(fake)
    return fake, nvml, nvml.event_waiter(indices)


def test_registers_xid_and_ecc_on_every_card():
    _, _, w = waiter()
    assert w.registered == {i: ["xid", "ecc-sbe", "ecc-dbe"] for i in range(8)} and w.unregistered == {}
    w.close()


def test_injected_xid_reaches_a_waiting_thread_promptly():
    fake, _, w = waiter()
    got: list = []
    t = threading.Thread(target=lambda: got.append((w.wait(5000), time.monotonic())))
    t.start()
    time.sleep(0.05)  # let it block
    sent = time.monotonic()
    fake.inject_xid(3, 43)
    t.join(2)
    events, received = got[0]
    assert received - sent < 0.25
    assert [(e.card_index, e.kind, e.xid, e.gpu_instance_id) for e in events] == [(3, "xid", 43, None)]
    assert abs(events[0].timestamp - time.time()) < 5
    w.close()


def test_idle_wait_times_out_empty():
    _, _, w = waiter()
    start = time.monotonic()
    assert w.wait(100) == []
    assert 0.09 <= time.monotonic() - start < 1.0
    w.close()


def test_queued_events_come_together_in_order():
    fake, _, w = waiter()
    fake.inject_xid(0, 13)
    fake.inject_ecc_dbe(6)
    events = w.wait(1000)
    assert [(e.card_index, e.kind, e.xid) for e in events] == [
        (0, "xid", 13),
        (6, "ecc-dbe", None),
        (6, "xid", 48),
    ]
    assert w.wait(0) == []
    w.close()


def test_only_registered_cards_report():
    fake, _, w = waiter(indices=[1])
    fake.inject_xid(0, 31)
    assert w.wait(50) == []
    fake.inject_xid(1, 31)
    assert [e.card_index for e in w.wait(50)] == [1]
    w.close()


def test_mig_instance_ids_come_with_the_event():
    fake, _, w = waiter()
    fake.inject_xid(2, 31, gpu_instance_id=1, compute_instance_id=0)
    (event,) = w.wait(100)
    assert event == HwEvent(2, "xid", 31, gpu_instance_id=1, compute_instance_id=0, timestamp=event.timestamp)
    w.close()


def test_lost_card_cannot_register_and_others_still_do():
    fake = FakeNvml("dgx-h100")
    fake.lose(5)
    w = Nvml(fake).event_waiter()
    assert 5 in w.unregistered and "NVML_ERROR_GPU_IS_LOST" in str(w.unregistered[5])
    assert set(w.registered) == {0, 1, 2, 3, 4, 6, 7}
    w.close()


def test_close_from_another_thread_ends_a_wait():
    _, _, w = waiter()
    got: list = []
    t = threading.Thread(target=lambda: got.append(w.wait(10_000)))
    t.start()
    time.sleep(0.05)
    w.close()
    t.join(2)
    assert not t.is_alive() and got == [[]]


def test_event_set_wait_raises_timeout_like_the_binding():
    fake = FakeNvml("workstation-2x")
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait(es, 10)
    fake.inject_xid(0, 62)
    data = fake.nvmlEventSetWait(es, 10)
    assert (data.eventType, data.eventData, data.gpuInstanceId) == (
        pynvml.nvmlEventTypeXidCriticalError,
        62,
        0xFFFFFFFF,
    )
    with pytest.raises(pynvml.NVMLError_NotSupported):  # not a type this card can report
        fake.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeGpuUnavailableError, es)
    fake.nvmlEventSetFree(es)
