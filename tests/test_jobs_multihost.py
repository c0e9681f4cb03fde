"""Submitted multi-host jobs (issue #31): `xpu submit --nodes N --gpus-per-node G` between three real
``xpud --simulate`` daemons on 127.0.0.2-4 with mutual TLS (the fixtures of test_federation_daemons.py).
One job id, one record on the submitting host, each rank a detached job of its own host: listed once from
any host, its ranks' files read with `xpu logs --rank R` over the peer channel, cancelled from a host that
runs none of it, waited on with the first failing rank's status, alive across a SIGKILL of the daemon that
placed it, failed with one clear line when its directory is missing on one host."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, stop_job_supervisors, wait_until, xpu_env
from tests.test_federation_daemons import converged, make_host, site, three  # noqa: F401 (fixtures)


@pytest.fixture
def cluster(three, site):  # noqa: F811
    wait_until(lambda: converged(three), timeout=40, step=0.3)
    yield three
    stop_job_supervisors(site)  # detached ranks outlive their daemons


@pytest.fixture
def work():
    d = Path(tempfile.mkdtemp(prefix="xpu-mh-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def xpu(host, *args, cwd=None, timeout=60):
    return subprocess.run(
        [str(BIN / "xpu"), *args],
        env=xpu_env(host.daemon.runtime_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def listed(host, job_id: str, all_: bool = True) -> list[dict]:
    r = xpu(host, "jobs", "--json", *(["--all"] if all_ else []))
    assert r.returncode == 0, r.stderr
    return [j for j in json.loads(r.stdout)["jobs"] if j["id"] == job_id]


def submit(host, work: Path, *args) -> str:
    r = xpu(host, "submit", "--nodes", "2", "--gpus-per-node", "1", *args, cwd=work)
    assert r.returncode == 0, r.stderr + host.daemon.log.read_text()[-3000:]
    return r.stdout.strip()


def test_a_ranks_file_name_takes_slurms_patterns():
    from xpud.service.gangjobs import expand

    assert expand("/w/%j-%n-%t-%N-%%-%x.out", "ab12", 3, "h2") == "/w/ab12-3-3-h2-%-%x.out"
    assert expand("/w/plain%", "ab12", 0, "h1") == "/w/plain%"


def no_leases(hosts) -> bool:
    for h in hosts:
        with h.daemon.client() as c:
            if c.leases().leases:
                return False
    return True


def test_a_two_host_submitted_job_is_one_job_read_and_cancelled_from_a_third_host(cluster, work):
    a, _, _ = cluster
    go = work / "go"
    script = (
        f'echo "rank $NODE_RANK of $XPU_NODES at $MASTER_ADDR"; while [ ! -e {go} ]; do sleep 0.05; done; '
        "echo go; sleep 60"
    )
    job = submit(a, work, "--name", "pair", "--", "sh", "-c", script)

    def running():
        found = listed(a, job, all_=False)
        ok = found and found[0]["state"] == "running" and found[0]["ranks"]
        return ok and all(x["state"] == "running" for x in found[0]["ranks"]) and found

    shown = wait_until(running, 30, step=0.3)[0]
    assert shown["kind"] == "multi-host" and len(shown["hosts"]) == 2
    assert [x["rank"] for x in shown["ranks"]] == [0, 1] and [x["host"] for x in shown["ranks"]] == shown[
        "hosts"
    ]
    third = next(h for h in cluster if h.name not in shown["hosts"])
    # listed once from every host (each rank's own host keeps it out of its listing)
    for h in cluster:
        assert len(listed(h, job)) == 1
        r = xpu(h, "jobs", "--json")
        assert sum(1 for j in json.loads(r.stdout)["jobs"] if j["name"] == "pair") == 1
    # each rank wrote its own file (default xpu-<id>-<rank>.out), on its host
    wait_until(lambda: (work / f"xpu-{job}-1.out").exists() and (work / f"xpu-{job}-0.out").exists(), 20)
    # rank 1's file, followed from the host that runs none of it, as it grows
    follower = subprocess.Popen(
        [str(BIN / "xpu"), "logs", "-f", "--rank", "1", "pair"],
        env=xpu_env(third.daemon.runtime_dir),
        stdout=subprocess.PIPE,
        text=True,
    )
    master = next(h.ip for h in cluster if h.name == shown["hosts"][0])  # rank 0's host
    assert follower.stdout.readline() == f"rank 1 of 2 at {master}\n"
    go.touch()
    assert follower.stdout.readline() == "go\n"
    assert xpu(third, "logs", job).stdout == f"rank 0 of 2 at {master}\ngo\n"  # without --rank: rank 0
    # bad input: one line, non-zero
    r = xpu(third, "logs", "--rank", "2", job)
    assert r.returncode == 1 and r.stderr == f"xpu: --rank 2: job {job} has ranks 0..1\n", r.stderr
    # cancelled from the third host: every rank stops, the follower ends, every card is given back
    r = xpu(third, "cancel", "pair")
    assert r.returncode == 0, r.stderr
    assert follower.wait(30) == 0
    r = xpu(third, "wait", job, timeout=60)
    assert r.returncode == 143 and "cancelled" in r.stdout, r.stdout + r.stderr
    (ended,) = listed(third, job)
    assert ended["state"] == "cancelled" and all(x["state"] == "cancelled" for x in ended["ranks"])
    wait_until(lambda: no_leases(cluster), 20)
    # a job that cannot be placed yet queues (no host has 8 cards), and is cancelled from any host
    big = submit(a, work, "--gpus-per-node", "8", "--name", "big", "--", "true")
    wait_until(lambda: listed(third, big)[0]["reason"] not in (None, "Resources"), 20, step=0.3)
    (queued,) = listed(third, big)
    assert queued["state"] == "queued" and queued["ranks"] == [] and queued["hosts"] == []
    assert xpu(third, "cancel", "big").returncode == 0
    r = xpu(third, "wait", big)
    assert r.returncode == 143 and "cancelled" in r.stdout, r.stdout + r.stderr
    assert listed(a, big)[0]["reason"] == "cancelled by uid 0 while queued"


def test_wait_gives_the_first_failing_ranks_status_and_the_files_follow_the_pattern(cluster, work):
    a, _, c = cluster
    # rank 1 exits 3 once told; rank 0 would run a minute: --kill-on-bad-exit (the default) stops it
    go = work / "go"
    script = (
        f'echo "on $(hostname) rank $NODE_RANK"; while [ ! -e {go} ]; do sleep 0.05; done; '
        '[ "$NODE_RANK" = 1 ] && exit 3; sleep 60'
    )
    job = submit(a, work, "--output", "out-%j-%n-%N.txt", "--", "sh", "-c", script)
    # jobs after it, one host's and another multi-host one, wait for its end, then end dependency-failed
    one = xpu(a, "submit", "--after", job, "--", "true", cwd=work).stdout.strip()
    two = submit(a, work, "--after", job, "--", "true")
    assert {j["state"] for j in listed(c, one) + listed(c, two)} == {"queued"}
    go.touch()
    r = xpu(c, "wait", job, timeout=60)
    assert r.returncode == 3 and "failed (exit 3)" in r.stdout, r.stdout + r.stderr
    (shown,) = listed(c, job)
    assert shown["state"] == "failed" and shown["exit_code"] == 3
    states = {x["rank"]: x["state"] for x in shown["ranks"]}
    assert states == {0: "cancelled", 1: "failed"}, shown["ranks"]
    text = xpu(c, "show", job).stdout  # `xpu show` lists the ranks
    assert f"\nrank 1:     {shown['ranks'][1]['host']}: failed (exit 3)\n" in text, text
    for x in shown["ranks"]:
        assert (work / f"out-{job}-{x['rank']}-{x['host']}.txt").read_text().endswith(f"rank {x['rank']}\n")
    for dependent in (one, two):
        r = xpu(c, "wait", dependent, timeout=60)
        assert r.returncode == 1 and "dependency-failed" in r.stdout, r.stdout + r.stderr
    # slices on distinct hosts: --replicas R --spread, every rank's file where it ran
    r = xpu(a, "submit", "--replicas", "3", "--spread", "--mode", "vxpu-half", "--", "sh", "-c",
            'echo "$XPU_MODE $NODE_RANK"', cwd=work)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rep = r.stdout.strip()
    assert xpu(c, "wait", rep, timeout=60).returncode == 0
    (shown,) = listed(c, rep)
    assert shown["state"] == "completed" and sorted(shown["hosts"]) == ["h1", "h2", "h3"]
    assert [(work / f"xpu-{rep}-{i}.out").read_text() for i in range(3)] == [
        f"vxpu-half {i}\n" for i in range(3)
    ]
    # --time ends every rank (TERM): the job ends timeout, its status the signal's, as one host's job's
    job = submit(a, work, "--time", "2s", "--", "sleep", "60")
    r = xpu(c, "wait", job, timeout=60)
    assert r.returncode == 128 + signal.SIGTERM and "timeout" in r.stdout, r.stdout + r.stderr
    (shown,) = listed(c, job)
    assert shown["state"] == "timeout" and {x["state"] for x in shown["ranks"]} == {"timeout"}
    wait_until(lambda: no_leases(cluster), 20)


def test_the_ranks_outlive_a_sigkill_of_the_daemon_that_placed_them(cluster, work):
    a, _, c = cluster
    go = work / "go"
    script = (
        f'while [ ! -e {go} ]; do sleep 0.05; done; echo "done $NODE_RANK"; '
        '[ "$NODE_RANK" = 1 ] && exit 5; exit 0'
    )
    job = submit(a, work, "--no-kill-on-bad-exit", "--", "sh", "-c", script)
    wait_until(lambda: (listed(c, job) or [{}])[0].get("state") == "running", 30, step=0.3)
    a.daemon.kill(signal.SIGKILL)
    go.touch()
    # both ranks finish while the coordinator is down (rank 0 may run on its host: its supervisor runs on)
    wait_until(lambda: all((work / f"xpu-{job}-{i}.out").exists() for i in (0, 1)), 20)
    wait_until(lambda: all((work / f"xpu-{job}-{i}.out").read_text() == f"done {i}\n" for i in (0, 1)), 20)
    time.sleep(0.5)
    a.daemon.start()
    wait_until(lambda: c.states().get(a.name) == "alive", 30, step=0.3)  # c asks it again
    r = xpu(c, "wait", job, timeout=60)
    assert r.returncode == 5 and "failed (exit 5)" in r.stdout, r.stdout + r.stderr
    (shown,) = listed(a, job)
    assert {x["rank"]: x["state"] for x in shown["ranks"]} == {0: "completed", 1: "failed"}
    wait_until(lambda: no_leases(cluster), 20)


@pytest.fixture
def blind(site):  # noqa: F811
    """Three hosts; h2 runs in a mount namespace of its own where ``site/shared`` is an empty tmpfs: a
    directory under it that the others have does not exist on h2."""
    shared = site / "shared"
    (shared / "w").mkdir(parents=True)
    hosts = []
    try:
        first = make_host(site, 1, [])
        hosts.append(first)
        h2 = make_host(site, 2, [first.addr], start=False)
        mount = f'mount -t tmpfs none {shared} && exec "$@"'
        h2.daemon.prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh")
        h2.daemon.start()
        hosts.append(h2)
        hosts.append(make_host(site, 3, [first.addr]))
        wait_until(lambda: converged(hosts), timeout=40, step=0.3)
        yield hosts, shared / "w"
    finally:
        stop_job_supervisors(site)
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)


def test_a_directory_missing_on_one_host_fails_the_job_in_one_line(blind):
    hosts, w = blind
    a = hosts[0]
    r = xpu(a, "submit", "--nodes", "3", "--gpus-per-node", "1", "--", "sleep", "60", cwd=w)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    r = xpu(hosts[2], "wait", job, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    (shown,) = listed(a, job)
    assert shown["state"] == "failed"
    assert shown["reason"].startswith("rank ") and " on host h2 could not start: " in shown["reason"]
    assert f"working directory {w} does not exist there" in shown["reason"]
    assert all(x["state"] in ("failed", "cancelled") for x in shown["ranks"])
    wait_until(lambda: no_leases(hosts), 20)


def test_a_rank_whose_host_died_is_lost_and_the_job_with_it(cluster, work):
    a, _, _ = cluster
    job = submit(a, work, "--", "sleep", "60")
    shown = wait_until(lambda: [j for j in listed(a, job) if j["state"] == "running"], 30, step=0.3)[0]
    victim = next(h for h in cluster if h.name in shown["hosts"] and h is not a)
    victim.daemon.kill(signal.SIGKILL)  # the host dies: its daemon and its jobs
    stop_job_supervisors(victim.daemon.state_dir)
    watcher = next(h for h in cluster if h is not victim)
    r = xpu(watcher, "wait", job, timeout=90)
    assert r.returncode == 1 and "lost" in r.stdout, r.stdout + r.stderr
    (ended,) = listed(a, job)
    lost = next(x for x in ended["ranks"] if x["host"] == victim.name)
    assert lost["state"] == "lost" and ended["reason"].startswith(
        f"rank {lost['rank']} on host {victim.name}"
    )
    assert all(x["state"] in ("lost", "cancelled") for x in ended["ranks"])  # the others were stopped
