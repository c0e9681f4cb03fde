"""Submitted multi-host jobs (issue #31) with ``--restartable``, and while their coordinator is down,
between three real ``xpud --simulate`` daemons on 127.0.0.2-4 with mutual TLS and a fast health monitor
(the fixtures of test_federation_daemons.py; faults injected with ``xpu fault inject`` as an operator).

A card failing under a rank of a ``--restartable`` job restarts the whole job on healthy cards, as
``xpu run --nodes --restartable`` does (test_federation_jobrun.py): every rank again with
``XPU_RESTART_COUNT`` counting, their files appended to, ``restarts`` in ``xpu jobs --json``; also after
a restart of the coordinator. While the coordinator is down the job is listed once from the other hosts
(from its ranks' records) and cancelled from them; the coordinator, back, ends it ``cancelled``."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, stop_job_supervisors, wait_until, xpu_env
from tests.test_federation_daemons import converged, make_host, site, start_together  # noqa: F401 (fixtures)
from tests.test_jobs_multihost import listed, submit, work, xpu  # noqa: F401 (fixtures)

HEALTH = """[health]
poll_interval_s = 0.2
event_window_s = 0.5
move_ack_timeout_s = 3.0
"""


@pytest.fixture
def cluster(site):  # noqa: F811
    hosts = []
    try:
        first = make_host(site, 1, [], extra=HEALTH, start=False)
        hosts.append(first)
        for i in (2, 3):
            hosts.append(make_host(site, i, [first.addr], extra=HEALTH, start=False))
        start_together(hosts)
        wait_until(lambda: converged(hosts), timeout=40, step=0.3)
        yield hosts
    finally:
        stop_job_supervisors(site)  # detached ranks outlive their daemons
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)


def by_name(cluster, name):
    return next(h for h in cluster if h.name == name)


def rank_card(host) -> int:
    """The card under the one lease of ``host`` (a rank of the test's job, 1 card per node)."""
    with host.daemon.client() as c:
        (lease,) = c.leases().leases
        return lease.cards[0]


def fault(host, card: int) -> None:
    r = subprocess.run(
        [str(BIN / "xpu"), "fault", "inject", str(card), "xid", "79"],
        env=xpu_env(host.daemon.runtime_dir),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr


def lines(d: Path, job: str, rank: int) -> list[str]:
    f = d / f"xpu-{job}-{rank}.out"
    return f.read_text().splitlines() if f.exists() else []


def running(host, job: str, restarts: int):
    found = listed(host, job)
    ok = found and found[0]["state"] == "running" and found[0]["restarts"] == restarts and found[0]["ranks"]
    return ok and all(x["state"] == "running" for x in found[0]["ranks"]) and found[0]


def test_a_failed_card_under_a_rank_restarts_the_whole_submitted_job_also_after_a_coordinator_restart(
    cluster,
    work,  # noqa: F811
):
    a, _, c = cluster
    script = 'echo "start $XPU_RESTART_COUNT $NODE_RANK $(hostname)"; exec sleep 60'
    job = submit(a, work, "--restartable", "--", "sh", "-c", script)
    shown = wait_until(lambda: running(c, job, 0), 30, step=0.3)
    assert shown["restartable"] is True
    wait_until(lambda: all(lines(work, job, i) for i in (0, 1)), 20)
    # a card under rank 1 fails: every rank stops and starts again, XPU_RESTART_COUNT=1, files appended to
    victim = by_name(cluster, shown["ranks"][1]["host"])
    bad = rank_card(victim)
    fault(victim, bad)

    def again(n):
        return all(len(lines(work, job, i)) == n + 1 for i in (0, 1)) and running(c, job, n)

    shown = wait_until(lambda: again(1), 40, step=0.3)
    for i in (0, 1):
        got = [x.split()[:2] for x in lines(work, job, i)]
        assert got == [["start", "0"], ["start", "1"]], lines(work, job, i)
    assert shown["reason"].startswith(f"restart 1: rank 1 on host {victim.name}: card {bad} ")
    assert "unhealthy" in shown["reason"]
    if victim.name in shown["hosts"]:  # placed there again: not on the failed card
        assert rank_card(victim) != bad
    # the coordinator restarts (SIGKILL): the ranks run on; a later failing card still restarts the job
    a.daemon.kill(signal.SIGKILL)
    a.daemon.start()
    wait_until(lambda: c.states().get(a.name) == "alive", 30, step=0.3)
    shown = wait_until(lambda: running(a, job, 1), 30, step=0.3)
    victim = by_name(cluster, shown["ranks"][0]["host"])
    fault(victim, rank_card(victim))
    shown = wait_until(lambda: again(2), 40, step=0.3)
    assert [x.split()[1] for x in lines(work, job, 0)] == ["0", "1", "2"]
    assert shown["reason"].startswith(f"restart 2: rank 0 on host {victim.name}: ")
    r = xpu(c, "cancel", job)
    assert r.returncode == 0, r.stderr
    r = xpu(c, "wait", job, timeout=60)
    assert r.returncode == 143 and "cancelled" in r.stdout, r.stdout + r.stderr
    (ended,) = listed(c, job)
    assert ended["state"] == "cancelled" and ended["restarts"] == 2


def test_a_failed_card_under_a_rank_of_a_job_not_restartable_does_not_restart_it(cluster, work):  # noqa: F811
    """As today (and as a one-host job that is not --restartable): nobody holds the rank's lease, so no
    move is asked; the rank runs on, on the card that failed, and the job with it."""
    a, _, c = cluster
    script = 'echo "start $XPU_RESTART_COUNT $NODE_RANK"; exec sleep 60'
    job = submit(a, work, "--", "sh", "-c", script)
    shown = wait_until(lambda: running(c, job, 0), 30, step=0.3)
    assert shown["restartable"] is False
    victim = by_name(cluster, shown["ranks"][1]["host"])
    bad = rank_card(victim)
    fault(victim, bad)
    time.sleep(8)  # the health monitor has seen it (poll 0.2 s) and a move would be over (3 s ack timeout)
    assert running(c, job, 0)
    assert rank_card(victim) == bad
    assert all(lines(work, job, i) == [f"start 0 {i}"] for i in (0, 1))
    assert xpu(c, "cancel", job).returncode == 0
    assert xpu(c, "wait", job, timeout=60).returncode == 143


def test_while_its_coordinator_is_down_the_job_is_listed_and_cancelled_from_another_host(cluster, work):  # noqa: F811
    a, b, c = cluster
    job = submit(a, work, "--nodes", "3", "--", "sleep", "120")  # a rank on every host, the coordinator's too
    assert sorted(wait_until(lambda: running(c, job, 0), 30, step=0.3)["hosts"]) == ["h1", "h2", "h3"]
    a.daemon.kill(signal.SIGKILL)  # its rank runs on (its supervisor outlives the daemon)
    wait_until(lambda: c.states().get(a.name) not in (None, "alive"), 40, step=0.3)
    wait_until(lambda: b.states().get(a.name) not in (None, "alive"), 40, step=0.3)

    def headless():
        found = listed(c, job)
        why = f"its coordinator {a.name} does not answer"
        # once, with the ranks of both hosts that answer (each host's entry merged by the one asked)
        ok = len(found) == 1 and found[0]["reason"] == why and len(found[0]["ranks"]) == 2 and found[0]
        return ok and sorted(found[0]["hosts"]) == sorted([b.name, c.name]) and ok

    shown = wait_until(headless, 30, step=0.3)
    assert shown["state"] == "running" and shown["kind"] == "multi-host", shown
    assert sorted(x["host"] for x in shown["ranks"]) == sorted([b.name, c.name]), shown
    r = xpu(c, "jobs", "--json")  # without --all too, once
    assert sum(1 for j in json.loads(r.stdout)["jobs"] if j["id"] == job) == 1, r.stdout
    r = xpu(c, "cancel", "0123456789abcdef")  # no such job, here or on the hosts that answer
    assert r.returncode == 1 and "no job '0123456789abcdef' on any host of the cluster" in r.stderr, r.stderr
    r = xpu(c, "cancel", job)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and f"hosts not reached: {a.name} " in r.stdout, r.stdout
    wait_until(lambda: listed(c, job)[0]["state"] == "cancelled", 30, step=0.3)
    # the coordinator, back, sees the cancel: its own rank is stopped, the job ends cancelled
    a.daemon.start()
    wait_until(lambda: c.states().get(a.name) == "alive", 30, step=0.3)
    r = xpu(c, "wait", job, timeout=60)
    assert r.returncode != 0 and "cancelled" in r.stdout, r.stdout + r.stderr
    (ended,) = listed(a, job)
    assert ended["state"] == "cancelled" and ended["reason"].startswith("cancelled by uid 0 from host ")
    assert [x["state"] for x in ended["ranks"]] == ["cancelled"] * 3, ended["ranks"]


def test_the_entries_of_a_job_whose_coordinator_is_down_merge_into_one():
    from xpud.api.v1 import xpu_pb2 as pb
    from xpud.service.headless import merge

    def entry(job, host, rank, state, reason="its coordinator h1 does not answer"):
        m = pb.JobRecord(id=job, kind="multi-host", state=state, reason=reason, hosts=[host])
        m.ranks.add(rank=rank, host=host, state=state)
        return m

    got = merge([
        entry("j1", "h3", 1, "cancelled"),
        pb.JobRecord(id="other", kind="detached", state="running", reason="its coordinator is a name"),
        entry("j1", "h2", 0, "running"),
        entry("j2", "h2", 0, "running"),
        pb.JobRecord(id="j2", kind="multi-host", state="running", hosts=["h1", "h2"]),  # its coordinator's
    ])  # fmt: skip
    assert [m.id for m in got] == ["j1", "other", "j2"]
    assert got[0].hosts == ["h2", "h3"] and [x.rank for x in got[0].ranks] == [0, 1]
    assert got[0].state == "running"  # while a rank runs
    assert got[2].hosts == ["h1", "h2"] and not got[2].reason
