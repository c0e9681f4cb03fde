"""Queueing as srun users expect (issue 18, item 9): `--wait` takes durations (1m, 2h, 1h30m) and inf,
`[leases] default_wait_s` is the wait of a request that does not say, Ctrl-C while queued says it left the
queue, and each queued request shows why it waits (squeue's REASON) with its ticket where the lease id
will be."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time

import pytest
from xpu_cli.entry import parse_duration

from tests.conftest import wait_until


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        *[("0", 0), ("30", 30), ("2.5", 2.5), (".5", 0.5), ("90s", 90), ("1m", 60), ("2h", 7200)],
        *[("1d", 86400), ("1h30m", 5400), ("1d2h3m4s", 93784), ("1.5h", 5400), ("inf", math.inf)],
        ("infinity", math.inf),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "-1", "nan", "1e3", "5x", "30m1h", "1h1h", "h", "1 m", "٣"])
def test_what_is_not_a_duration_is_refused_with_the_forms_that_are(text):
    with pytest.raises(ValueError, match=r"use seconds \(30, 2\.5\), a number with a unit"):
        parse_duration(text)


def queued(d, n: int = 1) -> list[dict]:
    def entries():
        q = json.loads(d.xpu("leases", "--json").stdout)["queue"]
        return q if len(q) >= n else None

    return wait_until(entries, timeout=20)


def test_wait_durations_inf_and_the_configured_default(daemon_factory):
    d = daemon_factory(config="[leases]\ngrace_s = 30.0\nmax_wait_s = 7200.0\ndefault_wait_s = 45.0\n")
    with d.client() as c:
        c.acquire_lease("xpu", gpus=8, wait_s=0)
    jobs = [
        d.xpu_popen("run", "--wait", "1m", "-J", "minute", "--", "true", stderr=subprocess.DEVNULL),
        d.xpu_popen("run", "--wait", "inf", "--name", "forever", "--", "true", stderr=subprocess.DEVNULL),
        d.xpu_popen("run", "-J", "default", "--", "true", stderr=subprocess.DEVNULL),
    ]
    try:
        waits = {q["name"]: q["deadline"] - q["enqueued"] for q in queued(d, 3)}
        assert waits == {
            "minute": pytest.approx(60),
            "forever": pytest.approx(7200),
            "default": pytest.approx(45),
        }
        r = d.xpu("run", "--wait", "3h", "--", "true")
        assert r.returncode == 1 and "--wait 10800: must be 0..7200 seconds" in r.stderr
        r = d.xpu("run", "--wait", "soon", "--", "true")
        assert r.returncode == 2 and "'soon' is not a duration" in r.stderr
        r = d.xpu("run", "--wait", "0", "--", "true")
        assert r.returncode == 1 and "add --wait 10m (any duration, or inf) to queue for it" in r.stderr
    finally:
        for j in jobs:
            j.kill()


def test_ctrl_c_while_queued_says_it_left_the_queue(daemon):
    with daemon.client() as c:
        c.acquire_lease("xpu", gpus=8)
        p = daemon.xpu_popen("run", "--wait", "5m", "--", "true", stderr=subprocess.PIPE, text=True)
        (q,) = queued(daemon)
        p.send_signal(signal.SIGINT)
        assert p.wait(20) == -signal.SIGINT  # ends by the signal, as the command would have
        err = p.stderr.read()
        assert f"xpu: left the queue (ticket {q['ticket']}, position 1, waited " in err
        wait_until(lambda: not c.leases().queue, timeout=10)


def test_each_queued_request_shows_why_it_waits(daemon):
    with daemon.client() as c:
        held = [c.acquire_lease("xpu", gpus=1) for _ in range(7)]  # one card left idle
        big = daemon.xpu_popen("run", "--wait", "5m", "-p", "0", "-g", "2", "-J", "big", "--", "true")
        queued(daemon, 1)
        small = daemon.xpu_popen("run", "--wait", "5m", "-p", "-1", "-J", "small", "--", "true")
        try:
            entries = queued(daemon, 2)
            reasons = {q["name"]: q["reason"] for q in entries}
            # big does not fit (Resources); small would fit on the idle card, which is kept for big
            assert reasons == {"big": "Resources", "small": "Priority"}
            table = daemon.xpu("leases").stdout.splitlines()
            rows = {name: line for line in table[1:] for name in ("big", "small") if f" {name} " in line}
            tickets = {q["name"]: q["ticket"] for q in entries}
            assert rows["big"].startswith(tickets["big"]) and " queued " in rows["big"]
            assert " Resources (position 1, gives up in " in rows["big"]
            assert " Priority (position 2, gives up in " in rows["small"]
            c.release(held[0].lease.id, held[0].token)  # two idle cards: big first, then small waits on
            assert big.wait(20) == 0
            time.sleep(0.2)
        finally:
            big.kill()
            small.kill()
