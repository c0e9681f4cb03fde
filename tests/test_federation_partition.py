"""A network partition between real daemons: three ``xpud --simulate`` processes, each in a network namespace
of its own, joined by veth links to one bridge. Taking one host's link down cuts it off mid-reservation:
its cards stay held there until the TTL, are then free for its local users (never granted twice), the
coordinator's late commit is refused when the link is back, and the membership heals."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import wait_until
from tests.test_federation_daemons import Host, make_host, site, start_together  # noqa: F401 (fixture)
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import NoCapacity
from xpud.federation.certs import issue


@pytest.fixture
def netted(site):  # noqa: F811
    """Three daemons, each in a network namespace linked to one bridge; the bridge gets an address here
    so that this test can speak to them as another host (a coordinator) would."""
    from tests.netns import SUBNET, NetNs

    if not NetNs.available():
        pytest.skip("needs root and `ip netns`")
    hosts: list[Host] = []
    with NetNs(3) as net:
        subprocess.run(["ip", "addr", "add", f"{SUBNET}.254/24", "dev", net.bridge], check=True)
        try:
            for i in range(3):
                seeds = [f"{net.ip(0)}:7443"] if i else []
                hosts.append(make_host(site, i + 1, seeds, ip=net.ip(i), prefix=net.exec(i), start=False))
            start_together(hosts)
            wait_until(lambda: all_alive(hosts), timeout=40, step=0.3)
            yield net, hosts
        finally:
            for h in hosts:
                h.daemon.kill(signal.SIGTERM)


def alive_seen_by(h: Host) -> set[str]:
    return {x["name"] for x in h.cluster()["hosts"] if x["state"] == "alive"}


def late_commit(stub) -> tuple[grpc.StatusCode, str]:
    """Commit once the link is back (the first calls may meet the connection the partition broke)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            stub.Commit(pb.CommitRequest(job="split", attempt=0), timeout=5)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""


def all_alive(hosts) -> bool:
    return all(alive_seen_by(h) == {h.name for h in hosts} for h in hosts)


def coordinator(site: Path, host: Host) -> pbg.PeerStub:  # noqa: F811
    d = site / "h9"
    if not (d / "h9.crt").exists():
        issue("h9", site / "ca", d, ips=["10.0.0.9"])
    creds = grpc.ssl_channel_credentials(
        (site / "ca" / "ca.crt").read_bytes(), (d / "h9.key").read_bytes(), (d / "h9.crt").read_bytes()
    )
    return pbg.PeerStub(grpc.secure_channel(host.addr, creds))


@pytest.mark.xdist_group("netns")  # the test network (10.213.0.0/24) is one per machine
def test_a_partition_never_grants_a_card_twice_and_heals(netted, site):  # noqa: F811
    net, (h1, h2, h3) = netted
    ttl = 4.0
    stub = coordinator(site, h3)
    req = pb.ReserveRequest(job="split", attempt=0, mode="xpu", count=2, ttl_s=ttl, uid=os.getuid())
    held = stub.Reserve(req, timeout=10)
    t0 = time.monotonic()
    assert len(held.cards) == 2  # every card of h3
    net.cut(2)  # h3 is cut off from everyone
    with pytest.raises(grpc.RpcError) as err:  # the coordinator cannot commit
        stub.Commit(pb.CommitRequest(job="split", attempt=0), timeout=1.0)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    # On h3 the cards stay the reservation's until its TTL: its local users cannot have them ...
    with h3.daemon.client() as c:
        with pytest.raises(NoCapacity):
            c.acquire_lease("xpu", gpus=2)
        # ... and have them once it has expired there, with nobody's help
        wait_until(lambda: time.monotonic() - t0 >= ttl, timeout=ttl + 1)
        deadline = time.monotonic() + 10
        while True:
            try:
                local = c.acquire_lease("xpu", gpus=2)
                break
            except NoCapacity:
                assert time.monotonic() < deadline, "the reservation did not expire on the cut-off host"
                time.sleep(0.2)
    assert time.monotonic() - t0 >= ttl - 0.3
    # the others saw h3 go
    wait_until(lambda: "h3" not in alive_seen_by(h1), timeout=20, step=0.3)
    net.heal(2)
    # the link is back: the late commit is refused; h3's cards are its local user's alone
    code, details = late_commit(stub)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "expired" in details
    with h3.daemon.client() as c:
        (lease,) = c.leases().leases
    assert lease.id == local.lease.id and sorted(lease.cards) == sorted(held.cards)
    # and the membership heals
    wait_until(lambda: all_alive((h1, h2, h3)), timeout=40, step=0.3)


@pytest.mark.xdist_group("netns")
def test_a_partition_mid_job_stops_the_cut_off_rank_and_frees_its_cards_there(netted, tmp_path):
    net, (h1, h2, h3) = netted
    with h1.daemon.client(admin=True) as admin:  # the job goes to h2 and h3; h1 coordinates
        for card in ("0", "1"):
            admin.drain(card, "test: keep the job off the coordinator")
    wait_until(lambda: not [x for x in h1.cluster()["hosts"] if x["name"] == "h1" and x["free_whole"]], 15)
    spec = pb.JobSpec(
        mode="xpu",
        nodes=2,
        gpus_per_node=2,
        argv=["sh", "-c", f"echo $$ > {tmp_path}/$NODE_RANK.pid; exec sleep 120"],
        cwd="/",
        env={"PATH": os.environ["PATH"]},
        kill_on_bad_exit=True,
    )
    hold = threading.Event()
    c = h1.daemon.client()

    def inputs():
        yield pb.JobInput(start=spec)
        hold.wait(120)

    call = c.node.RunJob(inputs(), metadata=c._metadata(), timeout=120)
    it = iter(call)
    placed = next(it).placed
    rank_of = {r.host: r.rank for r in placed.ranks}
    assert sorted(rank_of) == ["h2", "h3"]
    wait_until(lambda: all(_pid_written(tmp_path / f"{r}.pid") for r in (0, 1)), timeout=30)
    pid3 = int((tmp_path / f"{rank_of['h3']}.pid").read_text())
    t0 = time.monotonic()
    net.cut(2)
    with h3.daemon.client() as local:
        with pytest.raises(NoCapacity):  # the rank still runs there: its cards are its own
            local.acquire_lease("xpu", gpus=2)
        # gRPC keepalive notices the dead link: h3 kills its rank and releases the job's lease
        wait_until(lambda: not os.path.exists(f"/proc/{pid3}"), timeout=30)
        got = local.acquire_lease("xpu", gpus=2, wait_s=10)  # now, and only now, a local user's
    cut_off_s = time.monotonic() - t0
    # the coordinator lost the rank, stopped the other one (kill-on-bad-exit) and ended the job
    events = list(it)
    hold.set()
    assert events[-1].HasField("ended") and events[-1].ended.exit_code != 0
    with h2.daemon.client() as c2:
        wait_until(lambda: not c2.leases().leases, timeout=15)
    net.heal(2)
    with h3.daemon.client() as local:
        (lease,) = local.leases().leases  # the card was never granted twice
        assert lease.id == got.lease.id
    wait_until(lambda: all_alive((h1, h2, h3)), timeout=60, step=0.5)
    assert cut_off_s < 30


def _pid_written(path) -> bool:
    """The rank wrote its pid (the file exists as soon as the shell opens it, before the number is in)."""
    return path.exists() and path.read_text().endswith("\n")
