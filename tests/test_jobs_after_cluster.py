"""`xpu submit --after` across the hosts of a cluster (issue #31): three ``xpud --simulate`` daemons with
mutual TLS (test_federation_daemons.py's fixtures). A job on one host waits for jobs of another, resolved
there by id or name over the peer channel (``Peer.PeerListJobs``): it starts when they completed with 0,
ends ``dependency-failed`` naming the one that did not, and stays queued, saying why, while the host of
its dependency does not answer."""

from __future__ import annotations

import json
import signal
import tempfile
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.test_federation_daemons import converged, site, three  # noqa: F401 (fixtures)
from tests.test_jobs_cluster import cluster, xpu  # noqa: F401 (fixture)


@pytest.fixture
def work():
    d = Path(tempfile.mkdtemp(prefix="xpu-after-", dir="/tmp"))
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def submitted(host, work: Path, *args: str) -> str:
    r = xpu(host, "submit", *args, cwd=work)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def job(host, job_id: str) -> dict:
    r = xpu(host, "show", job_id, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["job"]


def everywhere(cluster) -> set[str]:  # noqa: F811
    return {
        j["id"] for h in cluster for j in json.loads(xpu(h, "jobs", "--all", "--json", "--").stdout)["jobs"]
    }


def test_after_waits_for_another_hosts_jobs_and_fails_with_the_one_that_failed(cluster, work):  # noqa: F811
    a, b, c = cluster
    go = work / "go"
    wait = f"while [ ! -e {go} ]; do sleep 0.05; done"
    ok = submitted(a, work, "--name", "prep", "--", "sh", "-c", f"{wait}; exit 0")
    bad = submitted(b, work, "--name", "flaky", "--", "sh", "-c", f"{wait}; exit 3")
    # by name on host a and by id on host b, from host c
    both = submitted(c, work, "--after", f"prep,{bad}", "--name", "both", "--", "echo", "ran both")
    one = submitted(c, work, "--after", "prep", "--name", "one", "--", "echo", "ran one")
    shown = job(c, one)
    assert shown["state"] == "queued" and shown["reason"] == "Dependency"
    assert shown["after"] == [f"{ok}@{a.name}"], shown
    assert sorted(job(c, both)["after"]) == sorted([f"{ok}@{a.name}", f"{bad}@{b.name}"])
    go.touch()
    r = xpu(c, "wait", one, timeout=60)
    assert r.returncode == 0, (r.stdout, job(c, one))
    assert (work / f"xpu-{one}.out").read_text() == "ran one\n"
    r = xpu(c, "wait", both, timeout=60)
    ended = job(c, both)
    assert r.returncode == 1 and ended["state"] == "dependency-failed", ended
    assert ended["reason"] == f"job {bad} on host {b.name} ended failed", ended
    assert not (work / f"xpu-{both}.out").exists()
    # a job of another host that ended otherwise than completed fails a later submit's job at once
    late = submitted(a, work, "--after", bad, "--", "true")
    assert xpu(a, "wait", late, timeout=60).returncode == 1
    assert job(a, late)["reason"] == f"job {bad} on host {b.name} ended failed"


def test_an_unknown_or_ambiguous_after_job_of_the_cluster_is_refused_and_nothing_queued(cluster, work):  # noqa: F811
    a, b, c = cluster
    for h, name in ((a, "twin"), (a, "twin"), (a, "pair"), (b, "pair")):  # twins on a; a pair on a and b
        assert xpu(h, "wait", submitted(h, work, "--name", name, "--", "true"), timeout=60).returncode == 0
    assert xpu(b, "wait", submitted(b, work, "--name", "solo", "--", "true"), timeout=60).returncode == 0
    before = everywhere(cluster)
    cases = [
        ("nosuchjob", "no job 'nosuchjob' on any host of the cluster"),
        ("twin", f"--after twin: host {a.name}: 'twin' names 2 jobs"),  # two on one host
        ("pair", f"on {a.name} (completed), "),  # one on each of two hosts: "names 2 jobs: X on h1 ..."
        ("solo,nosuchjob", "no job 'nosuchjob' on any host"),  # one good, one unknown: none queued
    ]
    for after, said in cases:
        r = xpu(c, "submit", "--after", after, "--", "true", cwd=work)
        assert r.returncode != 0 and said in r.stderr and r.stderr.count("\n") == 1, (after, r.stderr)
    assert everywhere(cluster) == before


def test_a_job_whose_dependencys_host_does_not_answer_stays_queued_and_runs_later(cluster, work):  # noqa: F811
    _a, b, c = cluster
    go = work / "go"
    dep = submitted(
        b, work, "--name", "upstream", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done"
    )
    wait_until(lambda: job(b, dep)["state"] == "running", 20)
    waiting = submitted(c, work, "--after", "upstream", "--", "echo", "downstream ran")
    b.daemon.kill(signal.SIGKILL)  # the job's supervisor runs on; its host does not answer
    wait_until(lambda: "does not answer" in job(c, waiting)["reason"], 30)
    shown = job(c, waiting)
    assert shown["state"] == "queued" and f"job {dep} on host {b.name}" in shown["reason"], shown
    assert shown["reason"].count("\n") == 0
    go.touch()
    b.daemon.start()  # collects its job's end (completed)
    wait_until(lambda: converged(cluster), timeout=60, step=0.3)
    r = xpu(c, "wait", waiting, timeout=60)
    assert r.returncode == 0, job(c, waiting)
    assert (work / f"xpu-{waiting}.out").read_text() == "downstream ran\n"
