"""The wait queue under load: thousands of real queued Acquire streams, then all cancelled at once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT, wait_until
from tests.daemons import InProcDaemon
from xpud.model import Caller, Mode, Request

N_WAITERS = 5000
N_OBSERVERS = 50  # queued behind them, not cancelled: they count the position updates they get


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class Prober(threading.Thread):
    """Calls Info in a loop and records (start time, seconds it took)."""

    def __init__(self, client):
        super().__init__(daemon=True)
        self.client = client
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            self.client.info()
            self.samples.append((t0, time.monotonic() - t0))
            time.sleep(0.01)

    def worst(self, since: float) -> float:
        return max(dt for t, dt in self.samples if t >= since)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_5000_waiters_queue_and_their_cancellation_does_not_stall_other_calls(daemon_factory):
    d = daemon_factory(config="[leases]\ngrace_s = 600.0\n")
    with d.client() as c:
        c.acquire_lease("xpu", gpus=8)  # the host is full: every request below queues
        rss_before = rss_mib(d.proc.pid)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.queue_client",
                str(d.runtime_dir),
                str(N_WAITERS),
                "200",
                str(N_OBSERVERS),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline()
            assert line.startswith(f"queued {N_WAITERS + N_OBSERVERS} other={{}}"), line
            t0 = time.monotonic()
            reply = c.leases()
            took = time.monotonic() - t0
            print(f"ListLeases with {N_WAITERS} waiting: {reply.ByteSize()} bytes, {took:.3f} s")
            assert len(reply.queue) + reply.queue_omitted == N_WAITERS + N_OBSERVERS
            assert reply.ByteSize() < 4 * 1024 * 1024

            probe = Prober(c)
            probe.start()
            time.sleep(0.5)
            t_cancel = time.monotonic()
            proc.stdin.write("cancel\n")
            proc.stdin.flush()
            assert proc.stdout.readline().startswith("cancelled")
            time.sleep(3.0)  # the daemon sees the cancellations: only the prober calls meanwhile
            probe.stop.set()
            probe.join(10)
            worst = probe.worst(t_cancel)
            wait_until(lambda: len(c.leases().queue) == N_OBSERVERS, timeout=60, step=0.5)
            rss_after = rss_mib(d.proc.pid)
            slow = [(round((t - t_cancel) * 1000), round(dt * 1000)) for t, dt in probe.samples if dt > 0.03]
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            _, updates, _, observed, most = proc.stdout.readline().split()
            cancel_s = time.monotonic() - t_cancel
        finally:
            proc.kill()
            proc.wait(10)
    print(f"worst Info during the cancellation: {worst * 1000:.0f} ms; position updates: {updates}")
    print(f"{N_OBSERVERS} observers got {observed} updates, at most {most} each, in {cancel_s:.1f} s")
    print(f"Info calls over 30 ms (ms after the cancel, ms taken): {slow}")
    print(f"daemon RSS {rss_before:.0f} MiB before the queue, {rss_after:.0f} MiB after its cancellation")
    assert rss_after - rss_before < 150, (rss_before, rss_after)  # it was 73 -> 439 MiB
    # Each waiter hears its position when it joins and then at most once a second while it changes
    # (before: once per cancellation in front of it, 5,000 each).
    assert int(most) <= 2 + cancel_s, (observed, most, cancel_s)
    # Before: 1,000 cancelled waiters froze the daemon 4 s, 2,800 for 41 s (quadratic). Now the worst
    # Info is 0.23-0.48 s on the shared 2-core test machine (the loop itself lags at most ~40 ms; a bare
    # grpc.aio server with no xpud code behind it shows 0.09-0.5 s for the same burst), more when other
    # work loads the machine: hence the loose bound; the update count above is the exact check.
    assert worst < 5.0, f"Info took {worst:.3f} s while {N_WAITERS} waiters were cancelled"
    assert d.alive()


def test_a_release_before_a_long_queue_of_slices_costs_one_placement_per_kind(short_tmp):
    """With 5,000 slice requests waiting, each release tried to place every one of them (about 1 s)."""
    d = InProcDaemon(short_tmp, "pcie-8x-l40s", "[leases]\ngrace_s = 600.0\n")
    e = d.engine
    quarter = Request(mode=Mode("vxpu-quarter"), owner_uid=1000, wait_s=600, exempt=True)  # no [limits]

    fits, pumps = [], []
    place, pump = e._fit, e.pump

    def counted_fit(*args, **kw):  # counts placements; places as before
        fits.append(1)
        return place(*args, **kw)

    def timed_pump():  # times each pass; pumps as before
        t0 = time.perf_counter()
        pump()
        pumps.append(time.perf_counter() - t0)

    async def run() -> tuple[float, int]:
        leases = []
        while granted := await e.try_grant(quarter):
            leases.append(granted[0])
        waiting = [asyncio.ensure_future(e.acquire(quarter)) for _ in range(5000)]
        for _ in range(600):
            if len(e.waitlist) == 5000:
                break
            await asyncio.sleep(0.1)
        assert len(e.waitlist) == 5000
        e._fit, e.pump = counted_fit, timed_pump
        await e.release(leases[0].id, Caller(uid=0, admin=True))
        await asyncio.sleep(0.2)  # the release pumps the queue at the loop's next turn
        served = 5000 - len(e.waitlist)
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return max(pumps), served

    try:
        took, served = d.call_async(run(), timeout=120)
    finally:
        d.stop()
    assert served == 1  # the first in line got the freed quarter
    assert len(fits) <= 10, f"{len(fits)} placements in {len(pumps)} passes for one release"
    assert took < 0.3, f"a pass over the queue took {took:.3f} s with 5,000 slice requests waiting"
