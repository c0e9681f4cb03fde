"""Per-lease measurement: the fake's per-process utilisation (driver semantics), the adapter, readings."""

from __future__ import annotations

import os
import subprocess
import sys

import pynvml
import pytest

from tests.test_hw_nvml import Clock
from tests.test_mig_backend import backend
from xpud.config.schema import DEFAULT_SLICES
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.planning.usage import Reading, UsageBook, job_class, lease_pids, measure, summarize

GIB = 1 << 30


def fake_and_adapter():
    clock = Clock(1000.0)
    fake = FakeNvml("dgx-h100", clock=clock)
    nvml = Nvml(fake)
    nvml.open()
    return clock, fake, nvml


def test_process_samples_are_those_newer_than_the_last_seen_timestamp():
    clock, fake, nvml = fake_and_adapter()
    fake.add_process(0, 101, used_bytes=3 * GIB)
    fake.add_process(0, 102, used_bytes=1 * GIB)
    fake.set_process_load(0, 101, 15, 40)
    # the driver has not sampled since the load began: NOT_FOUND, which the adapter reads as "no sample"
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetProcessUtilization(h, 0)
    assert nvml.process_utilization(0) == []
    clock.t += 1.0
    got = nvml.process_utilization(0)
    assert [(p, sm, mem) for p, _, sm, mem in got] == [(101, 15, 40)]  # 102 idle: no sample for it
    stamp = got[0][1]
    assert stamp == pytest.approx(clock.t * 1e6, abs=1e6 / 6 + 1)  # CPU time of the sample, in µs
    assert nvml.process_utilization(0, stamp) == []  # nothing newer than what was read
    clock.t += 0.5
    assert [s[0] for s in nvml.process_utilization(0, stamp)] == [101]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetProcessUtilization(h, -1)


def test_no_per_process_utilisation_under_mig_but_memory_per_instance():
    b, card, fake, nvml, _, _ = backend()
    b.prepare(card, [], DEFAULT_SLICES["vxpu-half"], "a", 1)
    gi = fake.mig_layout(0)[0]["gpu_instance_id"]
    fake.add_process(0, 11, used_bytes=5 * GIB, gpu_instance_id=gi)
    fake.set_process_load(0, 11, 20)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetProcessUtilization(h, 0)
    assert nvml.process_utilization(0) is None
    assert nvml.process_memory(0) == {11: 5 * GIB}  # read through the MIG device
    r = measure(5.0, {11}, None, nvml.process_memory(0), 30, 40 * GIB)
    assert r.sm_pct is None and r.mem_bytes == 5 * GIB and not r.throttled(0.9)


def test_a_reading_sums_the_lease_pids_newest_samples_only():
    util = [(1, 10, 5, 0), (1, 20, 14, 0), (2, 20, 1, 0), (9, 20, 80, 0)]  # 9: someone else's
    r = measure(1.0, {1, 2}, util, {1: GIB, 2: GIB, 9: 30 * GIB}, 15, 20 * GIB)
    assert r.sm_pct == 15 and r.mem_bytes == 2 * GIB and r.throttled(0.9)
    assert measure(1.0, {1}, [], {1: GIB}, 15, GIB).sm_pct == 0.0  # NOT_FOUND: idle
    assert not Reading(0, 100, 0, 100, 0).throttled(0.9)  # a whole card has no cap to be held at


def test_class_defaults_to_the_command_first_words():
    assert job_class("/usr/bin/python serve.py --port 80") == "python serve.py"
    assert job_class("python -u train.py", "llm") == "llm"
    assert job_class("") == "unknown"


def test_lease_pids_are_the_holder_and_its_descendants():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert lease_pids(os.getpid()) >= {os.getpid(), child.pid}
    finally:
        child.kill()
        child.wait()
    assert lease_pids(None) == set()


def test_book_keeps_a_short_history_per_lease_and_class():
    book = UsageBook(keep=4)
    for i in range(6):
        book.add("L1", "serve", Reading(i, 10.0 + i, GIB, 15, 20 * GIB))
    assert [r.t for r in book.history("L1")] == [2, 3, 4, 5]
    s = summarize(book.classes["serve"], 0.9)
    assert (
        s.readings == 4 and s.sm_peak == 15.0 and s.throttled_share == 0.5
    )  # 14 and 15 are within 90 % of 15
    book.end("L1")
    assert book.history("L1") == [] and len(book.classes["serve"]) == 4


def test_profiles_follow_new_readings_and_end_with_the_lease():
    from xpud.planning.usage import Reading, UsageBook

    book = UsageBook(keep=2)
    book.add("l1", "c", Reading(1.0, 10.0, 0, 15.0, 1, 2.0))
    assert book.lease_profile("l1") == (10.0, 2.0) == book.class_profile("c")
    book.add("l1", "c", Reading(2.0, 20.0, 0, 15.0, 1, 4.0))
    book.add("l1", "c", Reading(3.0, 30.0, 0, 15.0, 1, 6.0))  # the first one drops out (keep 2)
    assert book.lease_profile("l1") == (25.0, 5.0)
    book.moved("l1")  # no readings of its own: its class's stands for it
    assert book.lease_profile("l1") == (25.0, 5.0) and "l:l1" not in book._profiles
    book.end("l1")
    assert book.lease_profile("l1") is None
    book.add("l2", "d", Reading(4.0, None, 0, 15.0, 1))  # MIG: no compute figure, no profile
    assert book.lease_profile("l2") is None


def test_book_keeps_at_most_max_classes_forgetting_the_least_recently_measured():
    book = UsageBook(keep=3, max_classes=2)
    r = Reading(1.0, 50.0, 1 << 30, 100.0, 4 << 30, 20.0)
    book.add("l1", "a", r)
    book.add("l2", "b", r)
    book.add("l1", "a", r)  # "a" measured again: "b" is now the oldest
    assert book.class_profile("b") is not None
    book.add("l3", "c", r)
    assert list(book.classes) == ["a", "c"]
    assert book.class_profile("b") is None and "c:b" not in book._profiles
