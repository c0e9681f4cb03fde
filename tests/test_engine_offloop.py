"""Slow hardware never stalls the daemon: while one card's MIG instance creation hangs for seconds,
another card's lease is granted, the API answers and an XID on a third card is acted on in the usual time.
"""

from __future__ import annotations

import threading
import time

from tests.conftest import wait_until
from xpud.api.client import Client

HANG_S = 4.0


def test_a_hanging_card_does_not_stall_the_others(inproc):
    d = inproc("dgx-h100", "[leases]\ngrace_s = 60.0\n")
    with Client(d.runtime_dir) as c:
        first = c.acquire_lease("vxpu-quarter")  # its card is in MIG mode now: the next slice goes there
    fake = d.fake
    real = fake.nvmlDeviceCreateGpuInstanceWithPlacement
    hung = threading.Event()
    hung_card = list(first.lease.cards)

    # The driver takes seconds to make the next instance. (Not a MIG mode switch: while one runs, NVML
    # event waits stay out for every card by design, see Nvml.card_released.)
    def slow_create(device, profile_id, placement):
        hung.set()
        time.sleep(HANG_S)
        return real(device, profile_id, placement)

    fake.nvmlDeviceCreateGpuInstanceWithPlacement = slow_create
    slice_result: dict = {}

    def ask_slice():
        t0 = time.monotonic()
        with Client(d.runtime_dir) as c:
            g = c.acquire_lease("vxpu-quarter")
        slice_result.update(lease=g.lease, took=time.monotonic() - t0)

    t = threading.Thread(target=ask_slice)
    t.start()
    assert hung.wait(10)
    t0 = time.monotonic()
    with Client(d.runtime_dir) as c:
        whole = c.acquire_lease("xpu")  # another card, already in the right mode
        granted_after = time.monotonic() - t0
        c.cards()
    with Client(d.runtime_dir, admin=True) as admin:
        target = next(i for i in range(8) if i not in whole.lease.cards and i not in hung_card)
        t1 = time.monotonic()
        admin.inject_fault(str(target), "xid", 79)
        wait_until(lambda: admin.health(str(target)).cards[0].state == "unhealthy", timeout=HANG_S, step=0.01)
        acted_after = time.monotonic() - t1
    still_hanging = time.monotonic() - t0 < HANG_S - 0.5
    t.join(HANG_S + 20)
    assert granted_after < 1.0, f"a whole card took {granted_after:.2f} s while another card hung"
    assert acted_after < 1.5, f"the XID was acted on after {acted_after:.2f} s"
    assert still_hanging, "the checks above ran after the hang was over: they prove nothing"
    assert slice_result["took"] >= HANG_S and list(slice_result["lease"].cards) == hung_card[:1]


def test_a_release_on_a_hanging_card_answers_at_once_and_frees_the_slice_after(inproc):
    d = inproc("dgx-h100", "[leases]\ngrace_s = 60.0\n")
    with Client(d.runtime_dir) as c:
        first = c.acquire_lease("vxpu-quarter")
    card = first.lease.cards[0]
    fake = d.fake
    real = fake.nvmlDeviceCreateGpuInstanceWithPlacement
    hung = threading.Event()

    def slow_create(device, profile_id, placement):  # the next instance takes the driver seconds
        hung.set()
        time.sleep(HANG_S)
        return real(device, profile_id, placement)

    fake.nvmlDeviceCreateGpuInstanceWithPlacement = slow_create
    second: dict = {}

    def ask_slice():
        with Client(d.runtime_dir) as c:
            second["grant"] = c.acquire_lease("vxpu-quarter")

    t = threading.Thread(target=ask_slice)
    t.start()
    assert hung.wait(10)
    assert d.call(lambda: card in d.engine.busy_cards())  # the second slice is being made on that card
    with Client(d.runtime_dir) as c:
        took = timed(lambda: c.release(first.lease.id, first.token))
        assert first.lease.id not in {x.id for x in c.leases().leases}
    assert took < 1.0, f"the release waited {took:.2f} s for the card's backend"
    assert d.call(lambda: first.lease.id in d.engine.cards[card].slices)  # freed after the teardown
    t.join(HANG_S + 20)
    wait_until(lambda: d.call(lambda: first.lease.id not in d.engine.cards[card].slices), timeout=10)
    assert second["grant"].lease.cards[0] == card


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0
