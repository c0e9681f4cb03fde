"""Leases survive daemon outages: the wrappers' reconnect and the restored leases' grace (issue 10, defect 3).

The daemon is SIGKILLed while real `xpu run` wrappers hold leases, stays down for 1 s to 40 s, and starts
again over the same ledger. Every wrapper must hold its lease again within the grace period, counted from
when the daemon serves (a short grace, 3 s, makes it decisive: gRPC's default reconnect backoff alone
takes 6-9 s to come back after a 35 s outage). Several daemons run side by side, each with its own series
of outages, so the 17 kills take the time of the longest series."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest

from tests.conftest import alive, poll, wait_until
from tests.syncengine import sync_engine
from tests.test_engine import Clock, cards, pcie_box
from xpud.config.schema import Config
from xpud.ledger.ledger import Ledger
from xpud.model import Mode, Request

GRACE_S = 5.0  # wrappers re-hold within ~1 s; 3 s was missed once at a load average of 20+
CONFIG = f"[leases]\ngrace_s = {GRACE_S}\nrestore_grace_s = {GRACE_S}\n"


def test_restored_leases_get_their_grace_from_when_the_daemon_serves(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    cfg = Config().replace("leases", grace_s=10.0, restore_grace_s=30.0)
    lease = sync_engine(cards(), pcie_box(), cfg, led, clock=Clock()).try_grant(
        Request(Mode.XPU, owner_uid=1)
    )[0]
    led.close()
    e = sync_engine(cards(), pcie_box(), cfg, Ledger(tmp_path / "l.sqlite"), clock=Clock())
    e.restore()
    e.clock.t += 120  # a slow start-up: reconciling the hardware took two minutes
    e.serving()
    e.clock.t += 29.9  # past grace_s, within restore_grace_s
    assert e.reap() == [] and lease.id in e.leases
    e.clock.t += 0.2
    assert [x.id for x in e.reap()] == [lease.id]


def test_a_holder_that_reconnected_after_a_restart_has_the_ordinary_grace_again(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    cfg = Config().replace("leases", grace_s=10.0, restore_grace_s=30.0)
    lease = sync_engine(cards(), pcie_box(), cfg, led, clock=Clock()).try_grant(
        Request(Mode.XPU, owner_uid=1)
    )[0]
    e = sync_engine(cards(), pcie_box(), cfg, led, clock=Clock())
    e.restore()
    e.serving()
    e.hold_closed(lease.id, e.hold_opened(lease.id))
    e.clock.t += 10.1
    assert [x.id for x in e.reap()] == [lease.id]


def _wrappers(d, modes: list[str]) -> list[subprocess.Popen]:
    return [
        d.xpu_popen(
            "run", "--mode", m, "--", "sleep", "1000", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        for m in modes
    ]


def _held(d) -> dict[str, bool]:
    try:
        with d.client() as c:
            return {x.id: x.held for x in c.leases().leases}
    except Exception:
        return {}


def _lane(d, outages: list[float], modes: list[str], results: list, rng_name: str) -> None:
    """Kill and restart ``d`` once per outage; record (outage, seconds until every lease is held again)."""
    procs = _wrappers(d, modes)
    try:
        leases = wait_until(lambda: (h := _held(d)) and len(h) == len(modes) and all(h.values()) and h, 30)
        for outage in outages:
            d.kill(signal.SIGKILL)
            time.sleep(outage)
            d.start()  # returns once the daemon answers: it serves
            serving = time.monotonic()
            back = poll(lambda: (h := _held(d)).keys() == leases.keys() and all(h.values()), 4 * GRACE_S)
            took = time.monotonic() - serving
            results.append((rng_name, outage, took if back else None, sorted(_held(d).items())))
        time.sleep(GRACE_S + 1.0)  # past every grace: nothing reclaimed since
        results.append((rng_name, "end", sorted(_held(d).items()), [alive(p.pid) for p in procs]))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def _run_lanes(daemon_factory, series: list[list[float]]) -> None:
    machines = ["pcie-8x-l40s", "dgx-h100"]
    modes = ["vxpu-half", "xpu", "vxpu-quarter"]
    results: list = []
    threads = []
    for n, outages in enumerate(series):
        d = daemon_factory(machines[n % 2], config=CONFIG, name=f"o{n}")
        t = threading.Thread(target=_lane, args=(d, outages, modes, results, f"lane {n}"))
        threads.append(t)
        t.start()
    for t in threads:
        t.join(600)
    restarts = [r for r in results if r[1] != "end"]
    assert len(restarts) == sum(map(len, series)), results
    slow = [r for r in restarts if r[2] is None or r[2] >= GRACE_S]
    assert not slow, f"leases not held again within the {GRACE_S} s grace after these restarts: {slow}"
    ends = [r for r in results if r[1] == "end"]
    assert len(ends) == len(series)
    for _, _, held, wrappers_alive in ends:
        assert len(held) == len(modes) and all(h for _, h in held), ends
        assert all(wrappers_alive), ends


def test_sixteen_short_outages_lose_no_lease(daemon_factory):
    """16 kills, outages of 1-8 s (4 daemons side by side)."""
    _run_lanes(daemon_factory, [[1, 5, 2, 8], [2, 6, 1, 3], [3, 7, 1, 2], [4, 6, 2, 1]])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_long_outage_loses_no_lease(daemon_factory):
    """A 40 s outage: gRPC's default backoff alone misses the grace after 35 s. The wrappers' own wait
    between attempts stays at 1 s at most however long the outage, so the 60, 70 and 90 s lanes this test
    had proved nothing more and cost CI ~60 s of a worker."""
    _run_lanes(daemon_factory, [[40]])


def test_a_long_lived_client_acquires_again_after_a_restart(daemon_factory):
    d = daemon_factory("pcie-8x-l40s", config=CONFIG)
    with d.client() as c:
        g = c.acquire_lease("vxpu-quarter")
        c.release(g.lease.id, g.token)
        d.kill(signal.SIGKILL)
        d.start()
        g = c.acquire_lease("vxpu-quarter")  # the new daemon does not know the old credential
        c.release(g.lease.id, g.token)


def test_a_wrapper_granted_just_before_a_crash_still_starts_its_command(daemon_factory):
    """The daemon dies between the grant and the wrapper's Confine (found by the lanes above under CI's
    load: the wrapper said "not starting the command", exited 126, and its lease was reclaimed after
    the restart's grace). The wrapper's Confine waits for the restarted daemon, as its Hold stream does."""
    from xpu_cli.run import Signals, Wakeup, _confine

    d = daemon_factory("pcie-8x-l40s", config=CONFIG)
    with d.client() as c:
        g = c.acquire_lease("vxpu-half")
        d.kill(signal.SIGKILL)
        restarted = threading.Timer(1.5, d.start)
        restarted.start()
        wake = Wakeup()
        try:
            with Signals(wake) as signals:
                t0 = time.monotonic()
                assert _confine(c, g, signals, wake, reconnect_s=30.0) is None
                assert time.monotonic() - t0 >= 1.0  # it did wait for the new daemon
        finally:
            restarted.join()
            wake.close()
        assert c.lease(g.lease.id).state == "active"
        c.release(g.lease.id, g.token)


def test_a_wrapper_whose_daemon_stays_away_gives_up_after_its_reconnect_window(daemon_factory):
    from xpu_cli.run import Signals, Wakeup, _confine

    d = daemon_factory("pcie-8x-l40s", config=CONFIG)
    with d.client() as c:
        g = c.acquire_lease("vxpu-half")
        d.kill(signal.SIGKILL)
        wake = Wakeup()
        try:
            with Signals(wake) as signals:
                assert _confine(c, g, signals, wake, reconnect_s=1.0).code == 126
        finally:
            wake.close()
