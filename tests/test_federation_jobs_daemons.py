"""Multi-host jobs between real daemons: three ``xpud --simulate`` processes on 127.0.0.2-4 with mutual TLS
(the fixtures of test_federation_daemons.py). A two-host job runs with each rank's torchrun environment
and its output and exit code come back; a reservation whose coordinator or host dies leaves nothing held
anywhere once its TTL has passed; killing the coordinator mid-job stops the remote ranks and frees their
cards."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from tests.conftest import poll, wait_until
from tests.otheruser import NOBODY
from tests.test_federation_daemons import Host, converged, make_host, site, three  # noqa: F401 (fixtures)
from xpud.api.client import to_error
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.federation.certs import issue


@pytest.fixture
def cluster(three):  # noqa: F811
    wait_until(lambda: converged(three), timeout=40, step=0.3)
    return three


def job(argv, nodes=2, gpus=1, **kw):
    return pb.JobSpec(
        mode="xpu",
        nodes=nodes,
        gpus_per_node=gpus,
        argv=argv,
        cwd=os.getcwd(),
        env={"PATH": os.environ["PATH"]},
        kill_on_bad_exit=True,
        **kw,
    )


def start_job(host: Host, s: pb.JobSpec, hold: threading.Event):
    c = host.daemon.client()

    def inputs():
        yield pb.JobInput(start=s)
        hold.wait(120)

    return c.node.RunJob(inputs(), metadata=c._metadata(), timeout=120)


def leases(host: Host) -> list[pb.Lease]:
    with host.daemon.client() as c:
        return list(c.leases().leases)


def live_reservations(host: Host) -> int:
    import sqlite3

    db = sqlite3.connect(host.daemon.state_dir / "ledger.sqlite")
    try:
        sql = "SELECT COUNT(*) FROM reservations WHERE state IN ('held','committed')"
        return db.execute(sql).fetchone()[0]
    finally:
        db.close()


def by_name(hosts, name) -> Host:
    return next(h for h in hosts if h.name == name)


def test_a_two_host_job_runs_with_each_ranks_environment_and_the_first_failing_exit_code(cluster):
    hold = threading.Event()
    script = 'echo "$NODE_RANK $PET_NNODES $NODE_RANK $MASTER_ADDR $XPU_HOSTS"; [ "$NODE_RANK" = 1 ] && exit 7; exit 0'  # noqa: E501
    call = start_job(cluster[0], job(["sh", "-c", script]), hold)
    try:
        events = list(call)
    except grpc.RpcError as e:
        raise to_error(e, "h1") from None
    finally:
        hold.set()
    placed = events[0].placed
    assert len(placed.ranks) == 2
    hosts = [r.host for r in placed.ranks]
    addrs = {h.name: h.ip for h in cluster}
    out = {}
    for e in events:
        if e.HasField("output"):
            out[e.output.rank] = out.get(e.output.rank, b"") + e.output.data
    for r in placed.ranks:
        rank, world, node, master, xhosts = out[r.rank].decode().split()
        assert (rank, world, node) == (str(r.rank), "2", str(r.rank))
        assert master == addrs[hosts[0]] and xhosts == ",".join(hosts)
    assert events[-1].ended.exit_code == 7
    # every host released what it held for the job
    for h in cluster:
        wait_until(lambda h=h: not leases(h) and live_reservations(h) == 0, timeout=10)


def peer_stub(site, host: Host, name="h9"):  # noqa: F811
    """A Peer client with a certificate of the site's CA, as another host (``name``) would call."""
    d = site / name
    if not (d / f"{name}.crt").exists():
        issue(name, site / "ca", d, ips=["127.0.0.9"])
    creds = grpc.ssl_channel_credentials(
        (site / "ca" / "ca.crt").read_bytes(),
        (d / f"{name}.key").read_bytes(),
        (d / f"{name}.crt").read_bytes(),
    )
    return pbg.PeerStub(grpc.secure_channel(host.addr, creds))


def reserve(stub, job_id, ttl, count=1, uid=None):
    uid = os.getuid() if uid is None else uid
    req = pb.ReserveRequest(job=job_id, attempt=0, mode="xpu", count=count, ttl_s=ttl, uid=uid)
    return stub.Reserve(req, timeout=10)


def test_a_dead_coordinator_or_host_mid_reservation_leaves_nothing_held_after_the_ttl(cluster, site):  # noqa: F811
    _, h2, h3 = cluster
    ttl = 3.0
    t0 = time.monotonic()
    for h in (h2, h3):
        assert len(reserve(peer_stub(site, h), "gone", ttl).cards) == 1
    assert all(len(leases(h)) == 1 and "reserved for job gone" in leases(h)[0].mark for h in (h2, h3))
    # h3 dies holding the reservation and comes back from its ledger; the coordinator (this test) is
    # gone too: nobody ever commits or aborts.
    h3.daemon.kill(signal.SIGKILL)
    h3.daemon.start()
    assert live_reservations(h3) == 1 or time.monotonic() - t0 >= ttl
    for h in (h2, h3):
        wait_until(lambda h=h: not leases(h) and live_reservations(h) == 0, timeout=ttl + 5)
    assert time.monotonic() - t0 >= ttl - 0.5
    # a commit after the TTL is refused
    with pytest.raises(grpc.RpcError) as err:
        peer_stub(site, h2).Commit(pb.CommitRequest(job="gone", attempt=0), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "expired" in err.value.details()


def test_killing_the_coordinator_mid_job_stops_the_remote_ranks_and_frees_cards(cluster, tmp_path):
    h1, h2, h3 = cluster
    with h1.daemon.client(admin=True) as admin:  # the job goes to h2 and h3: h1 only coordinates
        for card in ("0", "1"):
            admin.drain(card, "test: keep the job off the coordinator")
    wait_until(lambda: not [o for o in h1.cluster()["hosts"] if o["name"] == "h1" and o["free_whole"]], 15)
    hold = threading.Event()
    call = start_job(h1, job(["sh", "-c", f"echo $$ > {tmp_path}/$NODE_RANK.pid; exec sleep 120"]), hold)
    it = iter(call)
    placed = next(it).placed
    assert sorted(r.host for r in placed.ranks) == ["h2", "h3"]
    if not poll(lambda: all((tmp_path / f"{r}.pid").exists() for r in (0, 1)), timeout=30):
        hold.set()
        raise AssertionError(f"{list(it)}")
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in (0, 1)]
    assert all(len(leases(h)) == 1 and leases(h)[0].mark.startswith("job ") for h in (h2, h3))
    h1.daemon.kill(signal.SIGKILL)
    hold.set()

    def dead(pid):
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        except FileNotFoundError:
            return True

    for pid in pids:
        wait_until(lambda pid=pid: dead(pid), timeout=20)
    for h in (h2, h3):
        wait_until(lambda h=h: not leases(h) and live_reservations(h) == 0, timeout=20)


def test_a_signal_stops_both_ranks_and_replicas_spread_over_distinct_hosts(cluster):
    hold = threading.Event()
    c = cluster[0].daemon.client()

    def inputs():
        yield pb.JobInput(start=job(["sh", "-c", "echo up; exec sleep 60"]))
        while not hold.wait(0.05):
            if started.is_set():
                yield pb.JobInput(signal=signal.SIGINT)  # Ctrl-C
                break
        hold.wait(60)

    started = threading.Event()
    call = c.node.RunJob(inputs(), metadata=c._metadata(), timeout=60)
    events, ups = [], 0
    t0 = time.monotonic()
    for ev in call:
        events.append(ev)
        if ev.HasField("output"):
            ups += 1
            if ups == 2:
                started.set()
                t0 = time.monotonic()
    hold.set()
    ended = [e.rank_ended for e in events if e.HasField("rank_ended")]
    assert sorted(e.rank for e in ended) == [0, 1] and all(e.exit_code == 130 for e in ended), ended
    assert events[-1].ended.exit_code == 130 and time.monotonic() - t0 < 10
    for h in cluster:
        wait_until(lambda h=h: not leases(h), timeout=10)
    # three slice replicas, one per host
    s = pb.JobSpec(
        mode="vxpu-half", replicas=3, spread=True, argv=["sh", "-c", "echo $XPU_MODE"], cwd="/", env={}
    )
    hold2 = threading.Event()
    events = list(start_job(cluster[1], s, hold2))
    hold2.set()
    placed = events[0].placed
    assert sorted(r.host for r in placed.ranks) == ["h1", "h2", "h3"]
    assert [e.output.data for e in events if e.HasField("output")] == [b"vxpu-half\n"] * 3, events
    assert events[-1].ended.exit_code == 0, events


def test_ctrl_c_is_no_bad_exit_each_rank_handles_its_own_sigint(cluster):
    """Rank 0 dies at once on the user's SIGINT (130); rank 1 traps it and cleans up for 1.5 s. Before the
    fix rank 0's 130 counted as a bad exit and the coordinator SIGTERMed rank 1 in its clean-up."""
    script = (
        "trap 'echo term $NODE_RANK' TERM; "
        "trap 'if [ $NODE_RANK = 1 ]; then sleep 1.5 || echo cut $NODE_RANK; fi; "
        "echo clean $NODE_RANK; exit 130' INT; "
        "echo up; while :; do sleep 0.1; done"
    )
    hold, started = threading.Event(), threading.Event()
    c = cluster[0].daemon.client()

    def inputs():
        yield pb.JobInput(start=job(["sh", "-c", script]))
        while not hold.wait(0.05):
            if started.is_set():
                yield pb.JobInput(signal=signal.SIGINT)
                break
        hold.wait(60)

    call = c.node.RunJob(inputs(), metadata=c._metadata(), timeout=60)
    events, ups = [], 0
    for ev in call:
        events.append(ev)
        if ev.HasField("output") and b"up" in ev.output.data:
            ups += 1
            if ups == 2:
                started.set()
    hold.set()
    out = b"".join(e.output.data for e in events if e.HasField("output")).decode()
    assert "clean 1" in out and "cut" not in out and "term" not in out, out
    ended = [e.rank_ended for e in events if e.HasField("rank_ended")]
    assert sorted(e.exit_code for e in ended) == [130, 130], ended
    assert events[-1].ended.exit_code == 130
    for h in cluster:
        wait_until(lambda h=h: not leases(h), timeout=10)


def test_a_queued_two_host_job_starts_promptly_when_a_peers_lease_is_released(cluster):
    """`--wait` queues at the coordinator, which plans again on news of room (a peer's summary offering
    more), not on a timer: the job is placed well under a second after the blocking lease on a peer ends
    (before: re-planned every 1 s on summaries refreshed every 1 s). A job queued behind it moves up."""
    h1, _, h3 = cluster
    blockers = {}
    for h in (h1, h3):  # two cards each: only h2 (four) has room for 2 hosts x 2 cards
        with h.daemon.client() as c:
            blockers[h.name] = c.acquire_lease("xpu", gpus=2)

    def free(name):
        return next(x["free_whole"] for x in h1.cluster()["hosts"] if x["name"] == name)

    wait_until(lambda: free("h1") == 0 and free("h3") == 0, timeout=15)
    holds = [threading.Event(), threading.Event()]
    calls = [
        start_job(h1, job(["sh", "-c", "echo go; exec sleep 60"], gpus=2, wait_s=60), hold) for hold in holds
    ]
    its = [iter(c) for c in calls]
    try:
        assert [next(it).queued.position for it in its] == [1, 2]
        time.sleep(0.5)  # nothing pending: what follows is the release's news, not an earlier timer's
        t0 = time.monotonic()
        with h3.daemon.client() as c:
            c.release(blockers["h3"].lease.id, blockers["h3"].token)
        placed = next(its[0]).placed
        took = time.monotonic() - t0
        assert sorted(r.host for r in placed.ranks) == ["h2", "h3"], placed
        assert took < 0.5, f"placed {took:.3f} s after the release"
        # h2's two other cards are not enough: the second job is still queued, now first (it planned
        # after the first job, in queue order, so it never took h3 from it)
        moved = next(its[1])
        while moved.queued.position != 1:
            moved = next(its[1])
        assert moved.HasField("queued") and time.monotonic() - t0 < 2.0, moved
    finally:
        for c, hold in zip(calls, holds, strict=True):
            c.cancel()
            hold.set()
    with h1.daemon.client() as c:
        c.release(blockers["h1"].lease.id, blockers["h1"].token)
    for h in cluster:
        wait_until(lambda h=h: not leases(h) and live_reservations(h) == 0, timeout=15)


def test_a_site_certificate_buys_no_root_and_no_other_hosts_job(site):  # noqa: F811
    """Over real mutual TLS, as the issue's attack did: a host key (h8's, h9's) cannot reserve as root on a
    host that does not allow root jobs, nor commit, launch or abort a job another host reserved; each
    refusal is one line and the job loses nothing."""
    host = make_host(site, 1, [], cluster={"allow_root_jobs": False})
    try:
        h9, h8 = peer_stub(site, host, "h9"), peer_stub(site, host, "h8")

        def denied(call) -> str:
            with pytest.raises(grpc.RpcError) as err:
                call()
            said = err.value.details()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "\n" not in said, said
            return said

        assert "allow_root_jobs = false" in denied(lambda: reserve(h9, "rootjob", 30.0, uid=0))
        assert not leases(host) and live_reservations(host) == 0
        assert len(reserve(h9, "j1", 30.0, uid=NOBODY).cards) == 1
        spec = pb.LaunchSpec(job="j1", argv=["true"], cwd="/", uid=NOBODY, gid=0)
        for call in (
            lambda: h8.Commit(pb.CommitRequest(job="j1", attempt=0), timeout=10),
            lambda: h8.Abort(pb.AbortRequest(job="j1", attempt=0), timeout=10),
            lambda: list(h8.Launch(iter([pb.LaunchInput(start=spec)]), timeout=10)),
        ):
            assert "reserved by host h9: host h8 may not" in denied(call)
        assert live_reservations(host) == 1 and len(leases(host)) == 1  # nothing lost
        assert h9.Commit(pb.CommitRequest(job="j1", attempt=0), timeout=10).lease_id == leases(host)[0].id
        assert h9.Abort(pb.AbortRequest(job="j1", attempt=0), timeout=10).dropped
        wait_until(lambda: not leases(host) and live_reservations(host) == 0, timeout=10)
    finally:
        host.daemon.kill(signal.SIGTERM)


def test_a_root_job_over_hosts_that_take_no_root_jobs_says_why_in_one_line(site):  # noqa: F811
    """Root's `xpu run --nodes 2` where no other host allows root jobs: refused with the hosts' reason."""
    hosts = [make_host(site, 1, [], cluster={"allow_root_jobs": False})]
    try:
        hosts.append(make_host(site, 2, [hosts[0].addr], cluster={"allow_root_jobs": False}))
        wait_until(lambda: converged(hosts), timeout=40, step=0.3)
        r = hosts[0].daemon.xpu("run", "--nodes", "2", "--", "true", timeout=60)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "allow_root_jobs" in lines[0], r.stderr
        assert all(not leases(h) and live_reservations(h) == 0 for h in hosts)
    finally:
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)
