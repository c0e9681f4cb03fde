"""Hardware events: an injected XID reaches a thread blocked in wait; idle waits time out."""

from __future__ import annotations

import threading
import time

import pynvml
import pytest

from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import HwEvent, Nvml, NvmlUnavailable


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


def test_close_from_another_thread_never_frees_the_set_under_a_waiting_thread():
    # Freeing a set while another thread waits on it is undefined in NVML (the fake raises): close defers
    # the free to the waiting thread, whose wait ends at its timeout with nothing more.
    fake, _, w = waiter()
    got: list = []
    t = threading.Thread(target=lambda: got.append(w.wait(300)))
    t.start()
    time.sleep(0.05)
    start = time.monotonic()
    w.close()
    assert time.monotonic() - start < 0.1  # close does not block on the wait
    fake.inject_xid(1, 31)
    t.join(2)
    assert not t.is_alive() and got == [[]]
    assert fake.calls["nvmlEventSetFree"] == 1 and fake._sets == []


def test_the_fake_refuses_to_free_a_set_another_thread_waits_on():
    fake = FakeNvml("workstation-2x")
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    errors: list = []

    def wait():
        try:
            fake.nvmlEventSetWait(es, 300)
        except pynvml.NVMLError as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    with pytest.raises(RuntimeError, match="undefined in NVML"):
        fake.nvmlEventSetFree(es)
    t.join(2)
    assert isinstance(errors[0], pynvml.NVMLError_Timeout)
    fake.nvmlEventSetFree(es)


def test_a_lost_card_leaves_the_set_with_a_lost_event_and_the_others_keep_reporting():
    fake, _, w = waiter()
    got: list = []
    t = threading.Thread(target=lambda: got.append(w.wait(5000)))
    t.start()
    time.sleep(0.05)
    fake.inject_xid(4, 79)  # fallen off the bus: the event, then the card is lost
    t.join(2)
    # The driver's wait answers GPU_IS_LOST for the whole set once the card is lost: the adapter drops
    # the card from the set and says so with a "lost" event.
    assert [(e.card_index, e.kind, e.xid) for e in got[0]] == [(4, "xid", 79), (4, "lost", None)]
    assert 4 not in w.registered and "lost" in str(w.unregistered[4])
    fake.inject_xid(6, 31)
    assert [(e.card_index, e.xid) for e in w.wait(1000)] == [(6, 31)]
    assert w.wait(50) == []
    w.close()


def test_the_fake_answers_gpu_is_lost_to_a_wait_on_a_set_with_a_lost_card():
    fake = FakeNvml("workstation-2x")
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(
        fake.nvmlDeviceGetHandleByIndex(1), pynvml.nvmlEventTypeXidCriticalError, es
    )
    fake.lose(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlEventSetWait(es, 10)
    fake.nvmlEventSetFree(es)


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


def test_close_waits_for_a_call_in_flight_and_nothing_opens_nvml_again():
    # Regression (issue 11, item 8): close shut NVML down while another thread was inside it, and the next
    # call (a sampling thread's) opened it again.
    fake, nvml, w = waiter("workstation-2x")
    t = threading.Thread(target=lambda: w.wait(300))
    t.start()
    time.sleep(0.05)
    nvml.close()  # waits for the wait to return; the fake raises on a shutdown under a waiting thread
    assert not t.is_alive() and fake.calls["nvmlShutdown"] == 1
    with pytest.raises(NvmlUnavailable, match="NVML is closed"):
        nvml.card_info(0)
    with pytest.raises(NvmlUnavailable):
        nvml.sample(1)
    assert fake.calls["nvmlInit"] == 1
    nvml.open()  # only an explicit open does
    assert nvml.card_info(0).index == 0
