"""A network partition between real daemons: three ``xpud --simulate`` processes, each in a network namespace
of its own, joined by veth links to one bridge. Taking one host's link down cuts it off mid-reservation:
its cards stay held there until the TTL, are then free for its local users (never granted twice), the
coordinator's late commit is refused when the link is back, and the membership heals."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import DaemonProc, wait_until
from tests.test_federation_daemons import MACHINES, Host, cluster_config, site  # noqa: F401 (fixture)
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import NoCapacity
from xpud.federation.certs import issue

PORT = 7443


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


def netns_available() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"xpu-probe-{secrets.token_hex(3)}"
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "netns", "del", name)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot create a network namespace here: {e}"
    return ""


class Net:
    """A bridge in this namespace and one namespace per host, each linked to the bridge by a veth pair."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{200 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:], 16)}"
        self.bridge = f"xb{self.tag}"
        self.spaces: list[str] = []
        self.links: list[str] = []
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def host(self, i: int) -> tuple[str, str]:
        ns, outside, inside = f"xpu-{self.tag}-{i}", f"xv{self.tag}{i}a", f"xv{self.tag}{i}b"
        sh("ip", "netns", "add", ns)
        self.spaces.append(ns)
        sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        self.links.append(outside)
        sh("ip", "link", "set", inside, "netns", ns)
        sh("ip", "link", "set", outside, "master", self.bridge)
        sh("ip", "link", "set", outside, "up")
        ip = f"{self.subnet}.{i}"
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", inside)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        return ns, ip

    def link(self, i: int, up: bool) -> None:
        sh("ip", "link", "set", self.links[i - 1], "up" if up else "down")

    def close(self) -> None:
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.spaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def netted(site):  # noqa: F811
    why = netns_available()
    if why:
        pytest.skip(why)
    net = Net()
    hosts: list[Host] = []
    try:
        seed = f"{net.subnet}.1:{PORT}"
        for i in (1, 2, 3):
            ns, ip = net.host(i)
            name = f"h{i}"
            issue(name, site / "ca", site / name, ips=[ip])
            base = site / f"d{i}"
            base.mkdir()
            cfg = cluster_config(name, f"{ip}:{PORT}", [] if i == 1 else [seed], site / name, domain="r1")
            daemon = DaemonProc(
                base, MACHINES[i - 1], "[leases]\ngrace_s = 30.0\n" + cfg, prefix=("ip", "netns", "exec", ns)
            )
            hosts.append(Host(name, ip, PORT, site / name, daemon.start()))
        yield net, hosts
    finally:
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)
        net.close()


def alive_seen_by(h: Host) -> set[str]:
    return {x["name"] for x in h.cluster()["hosts"] if x["state"] == "alive"}


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


def test_a_partition_never_grants_a_card_twice_and_heals(netted, site):  # noqa: F811
    net, (h1, h2, h3) = netted
    wait_until(lambda: all_alive((h1, h2, h3)), timeout=40, step=0.3)
    ttl = 4.0
    stub = coordinator(site, h3)
    req = pb.ReserveRequest(job="split", attempt=0, mode="xpu", count=2, ttl_s=ttl, uid=os.getuid())
    held = stub.Reserve(req, timeout=10)
    t0 = time.monotonic()
    assert len(held.cards) == 2  # every card of h3
    net.link(3, up=False)  # h3 is cut off from everyone
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
    net.link(3, up=True)
    # the link is back: the late commit is refused; h3's cards are its local user's alone
    with pytest.raises(grpc.RpcError) as err:
        stub.Commit(pb.CommitRequest(job="split", attempt=0), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "expired" in err.value.details()
    with h3.daemon.client() as c:
        (lease,) = c.leases().leases
    assert lease.id == local.lease.id and sorted(lease.cards) == sorted(held.cards)
    # and the membership heals
    wait_until(lambda: all_alive((h1, h2, h3)), timeout=40, step=0.3)
