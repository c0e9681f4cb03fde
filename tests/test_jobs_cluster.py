"""Jobs seen from any host of a cluster (issue #31): three ``xpud --simulate`` daemons on 127.0.0.2-4 with
mutual TLS (the fixtures of test_federation_daemons.py); a job submitted on one is listed, followed,
waited on and cancelled from another, over the peer channel."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import BIN, stop_job_supervisors, wait_until, xpu_env
from tests.test_federation_daemons import converged, make_host, site, three  # noqa: F401 (fixtures)


@pytest.fixture
def cluster(three, site):  # noqa: F811
    wait_until(lambda: converged(three), timeout=40, step=0.3)
    yield three
    stop_job_supervisors(site)  # detached jobs outlive their daemons


def xpu(host, *args, cwd=None, timeout=60):
    return subprocess.run(
        [str(BIN / "xpu"), *args],
        env=xpu_env(host.daemon.runtime_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def test_a_job_is_listed_followed_waited_on_and_cancelled_from_another_host(cluster):
    a, _, c = cluster
    work = Path(tempfile.mkdtemp(prefix="xpu-jobs-", dir="/tmp"))
    go = work / "go"
    script = f"echo hello from a; while [ ! -e {go} ]; do sleep 0.05; done; echo bye; exit 6"
    r = xpu(a, "submit", "--name", "on-a", "--", "sh", "-c", script, cwd=work)
    assert r.returncode == 0, r.stderr
    done_id = r.stdout.strip()
    r = xpu(a, "submit", "--name", "long", "--", "sleep", "60", cwd=work)
    long_id = r.stdout.strip()
    wait_until(lambda: (work / f"xpu-{done_id}.out").exists(), 20)
    # listed once from the third host, with the host it runs on
    listing = json.loads(xpu(c, "jobs", "--json").stdout)["jobs"]
    seen = sorted((j["id"], j["hosts"]) for j in listing)
    assert seen == sorted([(done_id, [a.name]), (long_id, [a.name])])
    # its output, followed from the third host as it grows, to its end
    follower = subprocess.Popen(
        [str(BIN / "xpu"), "logs", "-f", "on-a"],
        env=xpu_env(c.daemon.runtime_dir),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert follower.stdout.readline() == "hello from a\n"
    go.touch()
    assert follower.wait(30) == 0 and follower.stdout.read() == "bye\n"
    r = xpu(c, "wait", done_id)
    assert r.returncode == 6 and "failed (exit 6)" in r.stdout
    # cancelled by name from the third host
    r = xpu(c, "cancel", "long")
    assert r.returncode == 0, r.stderr
    r = xpu(c, "wait", "long", timeout=60)
    assert r.returncode == 143 and "cancelled" in r.stdout
    assert xpu(c, "cancel", "nosuchjob").stderr.startswith("xpu: no job 'nosuchjob' on any host")
    subprocess.run(["rm", "-rf", str(work)], check=False)


def test_a_two_host_job_is_one_job_listed_and_waited_on_from_a_third_host(cluster):
    a, _, c = cluster
    r = xpu(
        a, "run", "--nodes", "2", "--name", "pair", "--", "sh", "-c", '[ "$NODE_RANK" = 1 ] && exit 3; exit 0'
    )
    assert r.returncode == 3, r.stderr
    (job,) = [j for j in json.loads(xpu(c, "jobs", "--all", "--json").stdout)["jobs"] if j["name"] == "pair"]
    assert job["kind"] == "multi-host" and len(job["hosts"]) == 2 and job["state"] == "failed"
    assert job["exit_code"] == 3
    r = xpu(c, "wait", "pair")
    assert r.returncode == 3 and "failed (exit 3)" in r.stdout
    # its ranks wrote to the `xpu run`'s terminal: no file to read, said in one line from any host
    for host in (a, c):
        r = xpu(host, "logs", "--rank", "1", "pair")
        assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"xpu: job {job['id']} is a multi-host `xpu run`: every rank's output")


def test_a_two_host_job_is_cancelled_from_a_third_host(cluster):
    a, _, c = cluster
    p = subprocess.Popen(
        [str(BIN / "xpu"), "run", "--nodes", "2", "--name", "pair2", "--", "sleep", "60"],
        env=xpu_env(a.daemon.runtime_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def running():
        found = [j for j in json.loads(xpu(c, "jobs", "--json").stdout)["jobs"] if j["name"] == "pair2"]
        return found and found[0]["state"] == "running" and found[0]

    job = wait_until(running, 30, step=0.3)
    assert job["kind"] == "multi-host" and len(job["hosts"]) == 2
    third = next(h for h in cluster if h.name not in job["hosts"])  # runs no rank of it
    r = xpu(third, "cancel", "pair2")
    assert r.returncode == 0, r.stderr
    assert p.wait(30) != 0
    r = xpu(third, "wait", job["id"])
    assert r.returncode != 0 and "cancelled" in r.stdout
    for h in cluster:
        with h.daemon.client() as cl:
            wait_until(lambda cl=cl: not cl.leases().leases, 20)  # every rank's cards given back


def test_a_cluster_listing_holds_the_newest_jobs_up_to_its_limit(cluster):
    """Each host answers with up to ``limit`` jobs; the merged listing keeps the cluster's newest
    ``limit`` (it held every host's before: 100 hosts x 1,000 for `xpu jobs --all`)."""
    from xpud.api.client import Client

    a, b, c = cluster
    work = Path(tempfile.mkdtemp(prefix="xpu-jobs-", dir="/tmp"))
    ids = []
    for host in (a, b):
        r = xpu(host, "submit", "--", "true", cwd=work)
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.strip())
        assert xpu(host, "wait", ids[-1]).returncode == 0
    with Client(c.daemon.runtime_dir) as client:
        reply = client.jobs(all=True, limit=1)
        assert [j.id for j in reply.jobs] == [ids[1]] and reply.omitted == 1
        assert len(client.jobs(all=True).jobs) == 2
    subprocess.run(["rm", "-rf", str(work)], check=False)
