"""Federation between real daemons: three ``xpud --simulate`` processes on 127.0.0.2, .3 and .4, each with a
certificate from one site CA, joined through a seed. The view converges; a killed daemon is suspected, then
declared dead within ``dead_after_s``, and rejoins with a higher incarnation when it comes back; a clean stop
is a "left"; peers without a certificate from the site's CA are refused before anything reaches the
servicer; bad certificate files stop the daemon with one line."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from xpu_cli.output import to_dict

from tests.conftest import BIN, wait_until, xpu_env
from tests.daemons import DaemonProc, stop_all
from xpud import config
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.federation.certs import init_ca, issue

DEAD_AFTER_S = 4.0
MACHINES = ("workstation-2x", "pcie-4x-h100", "workstation-2x")


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


@dataclass
class Host:
    name: str
    ip: str
    port: int
    dir: Path  # its key and certificate
    daemon: DaemonProc

    @property
    def addr(self) -> str:
        return f"{self.ip}:{self.port}"

    def cluster(self) -> dict:
        """``xpu cluster --json``'s document, read through the API (cheap enough to poll every 20 ms)."""
        with self.daemon.client() as c:
            return to_dict(c.cluster())

    def cli(self) -> dict:
        r = self.daemon.xpu("cluster", "--json", timeout=30)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def states(self) -> dict[str, str]:
        return {h["name"]: h["state"] for h in self.cluster()["hosts"]}


def cluster_config(name: str, listen: str, seeds: list[str], certs: Path, domain: str, **extra) -> str:
    lines = [
        "[cluster]",
        f'name = "{name}"',
        f'listen = "{listen}"',
        f"seeds = {json.dumps(seeds)}",
        f'domain = "{domain}"',
        'zone = "z1"',
        f'ca = "{certs / "ca.crt"}"',
        f'cert = "{certs / f"{name}.crt"}"',
        f'key = "{certs / f"{name}.key"}"',
        f"dead_after_s = {DEAD_AFTER_S}",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def site(short_tmp):
    init_ca(short_tmp / "ca")
    return short_tmp


def make_host(
    site: Path,
    i: int,
    seeds: list[str],
    start: bool = True,
    ip: str = "",
    prefix: tuple[str, ...] = (),
    extra: str = "",
    cluster: dict | None = None,
) -> Host:
    """Host ``h<i>`` at 127.0.0.<i+1> (or ``ip``, port 7443, in the network namespace ``prefix`` runs in);
    ``extra``: more of its config (other sections than ``[leases]`` and ``[cluster]``); ``cluster``: more
    ``[cluster]`` keys. The tests run as root and submit multi-host jobs as root: ``allow_root_jobs`` is
    true unless ``cluster`` says otherwise."""
    name, ip = f"h{i}", ip or f"127.0.0.{i + 1}"
    d = site / name
    issue(name, site / "ca", d, ips=[ip])
    port = 7443 if prefix else free_port(ip)
    base = site / f"d{i}"
    base.mkdir()
    keys = {"allow_root_jobs": True, **(cluster or {})}
    cfg = cluster_config(name, f"{ip}:{port}", seeds, d, domain=f"rack-{1 + (i > 2)}", **keys)
    daemon = DaemonProc(base, MACHINES[i - 1], extra + "[leases]\ngrace_s = 30.0\n" + cfg, prefix=prefix)
    host = Host(name, ip, port, d, daemon)
    if start:
        daemon.start()
    return host


@pytest.fixture
def three(site):
    hosts: list[Host] = []
    try:
        first = make_host(site, 1, [], start=False)
        hosts.append(first)
        for i in (2, 3):
            hosts.append(make_host(site, i, [first.addr], start=False))
        start_together(hosts)
        yield hosts
    finally:
        stop_all([h.daemon for h in hosts])


def start_together(hosts: list[Host]) -> None:
    """Start the first host, then all the others at once (they join through the first, which serves)."""
    hosts[0].daemon.start()
    for h in hosts[1:]:
        h.daemon.start(wait=False)
    for h in hosts[1:]:
        h.daemon.wait_ready()


def converged(hosts: list[Host]) -> bool:
    names = {h.name for h in hosts}
    for h in hosts:
        view = h.cluster()
        alive = {x["name"]: x for x in view["hosts"] if x["state"] == "alive"}
        if set(alive) != names or not all(x["summary_valid"] for x in alive.values()):
            return False
    return True


def test_the_view_converges_with_every_hosts_summary(three):
    wait_until(lambda: converged(three), timeout=30, step=0.3)
    view = three[0].cli()
    assert view["enabled"] and view["name"] == "h1"
    by = {x["name"]: x for x in view["hosts"]}
    assert by["h1"]["self"] and not by["h2"]["self"]
    assert by["h2"]["addr"] == three[1].addr and by["h3"]["addr"] == three[2].addr
    # Each host's own inventory came over the wire: 2, 4 and 2 simulated cards, all free.
    assert [by[n]["cards"] for n in ("h1", "h2", "h3")] == [2, 4, 2]
    assert [by[n]["free_whole"] for n in ("h1", "h2", "h3")] == [2, 4, 2]
    assert by["h2"]["free_slices"]["vxpu-half"] >= 4 and by["h2"]["health"] == 100
    assert (by["h3"]["zone"], by["h3"]["domain"]) == ("z1", "rack-2")
    text = three[1].daemon.xpu("cluster")
    assert text.returncode == 0 and "3 of 3 host(s) alive" in text.stdout and "h2*" in text.stdout
    topo = three[2].daemon.xpu("cluster", "topo", "--json")
    assert topo.returncode == 0, topo.stderr
    doc = json.loads(topo.stdout)
    assert doc["hosts"] == 3 and doc["free_whole"] == 8
    domains = {d["domain"]: d["hosts"] for d in doc["zones"][0]["blocks"][0]["domains"]}
    assert domains == {"rack-1": ["h1", "h2"], "rack-2": ["h3"]}
    # `xpu top`'s cluster tab (key 4) gets the same hosts from the daemon's federation.
    from xpu_tui.source import FederationHosts

    got, stop = [], threading.Event()
    with three[0].daemon.client() as c:
        FederationHosts(c, 0.1).run(lambda batch: (got.extend(batch), stop.set()), stop)
    tiles = {h.name: h for h in got}
    assert (tiles["h2"].cards, tiles["h2"].whole_free, tiles["h3"].domain) == (4, 4, "rack-2")
    assert not any(h.error for h in got) and tiles["h2"].slices_free == by["h2"]["free_slices"]


def test_a_lease_changes_the_summary_its_peers_see(three):
    wait_until(lambda: converged(three), timeout=30, step=0.3)
    with three[1].daemon.client() as c:
        c.acquire_lease("xpu", gpus=2)

        def seen() -> bool:
            by = {x["name"]: x for x in three[0].cluster()["hosts"]}
            return by["h2"]["free_whole"] == 2

        wait_until(seen, timeout=15, step=0.3)


def test_a_killed_daemon_is_suspected_then_dead_and_rejoins_with_a_higher_incarnation(three):
    wait_until(lambda: converged(three), timeout=30, step=0.3)
    victim = three[2]
    before = {x["name"]: x for x in three[0].cluster()["hosts"]}["h3"]["incarnation"]
    victim.daemon.kill(signal.SIGKILL)
    killed = time.monotonic()
    seen: dict[str, float] = {}

    def watch() -> bool:
        for h in three[:2]:
            state = h.states().get("h3")
            seen.setdefault(f"{h.name}:{state}", time.monotonic() - killed)
        return all(f"{h.name}:dead" in seen for h in three[:2])

    wait_until(watch, timeout=DEAD_AFTER_S + 10, step=0.02)
    assert "h1:suspect" in seen or "h2:suspect" in seen  # suspected before dead (SWIM)
    dead_at = max(seen["h1:dead"], seen["h2:dead"])
    # Within dead_after_s, plus slack for a loaded 2-core test machine (the `xpu` polls here cost ~0.3 s).
    assert dead_at <= DEAD_AFTER_S + 3.0, seen
    victim.daemon.start()  # same state dir, same name and address: a restart
    wait_until(lambda: converged(three), timeout=30, step=0.3)
    after = {x["name"]: x for x in three[0].cluster()["hosts"]}["h3"]["incarnation"]
    assert after > before


def test_a_clean_stop_is_a_leave_not_a_death(three):
    wait_until(lambda: converged(three), timeout=30, step=0.3)
    three[1].daemon.kill(signal.SIGTERM)
    wait_until(lambda: three[0].states().get("h2") == "left", timeout=5, step=0.2)
    rows = {line.split()[0]: line.split() for line in three[0].daemon.xpu("cluster").stdout.splitlines()}
    assert rows["h2"][2] == "left" and rows["h2"][5:] == ["-"] * 4, rows  # no free cards shown (#28 item 12)
    assert rows["h3"][5] == "2/2", rows


def _stub(host: Host, creds: grpc.ChannelCredentials):
    channel = grpc.secure_channel(host.addr, creds)
    return channel, pbg.PeerStub(channel)


def _gossip(src: str, addr: str, about: str) -> pb.SwimMessage:
    ghost = pb.SwimUpdate(name=about, addr="127.0.0.9:1", incarnation=1, state=0)
    return pb.SwimMessage(kind=pb.SwimMessage.GOSSIP, src=src, src_addr=addr, updates=[ghost])


def _names(h: Host) -> set[str]:
    return {x["name"] for x in h.cluster()["hosts"]}


def test_peers_without_the_sites_certificate_are_refused(site):
    h1 = make_host(site, 1, [])
    try:
        ca = (h1.dir / "ca.crt").read_bytes()
        issue("h2", site / "ca", site / "h2")
        other = site / "other"
        init_ca(other / "ca")
        issue("h2", other / "ca", other / "h2")

        def creds(d: Path, name: str | None) -> grpc.ChannelCredentials:
            if name is None:
                return grpc.ssl_channel_credentials(ca)
            return grpc.ssl_channel_credentials(
                ca, (d / f"{name}.key").read_bytes(), (d / f"{name}.crt").read_bytes()
            )

        for label, c in (("no certificate", creds(site, None)), ("another CA", creds(other / "h2", "h2"))):
            channel, stub = _stub(h1, c)
            with channel, pytest.raises(grpc.RpcError) as e:
                stub.Swim(_gossip("h2", "127.0.0.3:1", "ghost-" + label[:2]), timeout=5)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE, label  # the TLS handshake failed
        # A certificate of the site may speak only for its own host...
        channel, stub = _stub(h1, creds(site / "h2", "h2"))
        with channel:
            with pytest.raises(grpc.RpcError) as e:
                stub.Swim(_gossip("h3", "127.0.0.4:1", "ghost-im"), timeout=5)
            assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as e:
                stub.Reserve(
                    pb.ReserveRequest(job="j1", mode="xpu", count=1, ttl_s=5, uid=3999999), timeout=5
                )
            assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED  # reached HostJobs: no such uid
            assert "uid 3999999 does not exist on host h1" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                stub.Swim(pb.SwimMessage(kind=1, src="h2", src_addr="x" * 301), timeout=5)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # checked like local requests
            # ...and what it says is heard: the control that shows the refusals above are refusals.
            stub.Swim(_gossip("h2", "127.0.0.3:1", "ghost-ok"), timeout=5)
        wait_until(lambda: "ghost-ok" in _names(h1), timeout=5)
        assert not {"ghost-no", "ghost-an", "ghost-im"} & _names(h1)
    finally:
        h1.daemon.kill(signal.SIGTERM)


def _start_fails(daemon: DaemonProc) -> str:
    cmd = [str(BIN / "xpud"), "--config", str(daemon.config), "--simulate", daemon.machine,
           "--runtime-dir", str(daemon.runtime_dir), "--state-dir", str(daemon.state_dir)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=xpu_env(daemon.runtime_dir))
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("xpud: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_bad_certificate_files_stop_the_daemon_with_one_line(site):
    h = make_host(site, 1, [], start=False)
    good = h.daemon.config.read_text()
    h.daemon.config.write_text(good.replace("h1.crt", "nowhere.crt"))
    assert "[cluster] cert" in _start_fails(h.daemon) and "cannot read it" in _start_fails(h.daemon)
    other = site / "other"
    init_ca(other / "ca")
    issue("h1", other / "ca", other)
    h.daemon.config.write_text(good.replace(str(h.dir / "h1.crt"), str(other / "h1.crt")))
    assert "is not signed by the CA" in _start_fails(h.daemon)
    h.daemon.config.write_text(good.replace('name = "h1"', 'name = "h7"'))
    assert "issued for host 'h1'" in _start_fails(h.daemon)
    h.daemon.config.write_text(good.replace("127.0.0.2:", "127.0.0.5:"))
    assert "does not name the listen address 127.0.0.5" in _start_fails(h.daemon)
    h.daemon.config.write_text(good)
    with socket.socket() as taken:
        taken.bind((h.ip, h.port))
        taken.listen()
        assert "cannot listen there: the port is in use" in _start_fails(h.daemon)
    assert not (h.daemon.runtime_dir / "xpud.sock").exists()  # the failed start cleaned up after itself


def test_without_cluster_the_daemon_has_no_peer_traffic(daemon):
    r = daemon.xpu("cluster")
    assert r.returncode == 1 and "federation is off" in r.stderr
    with daemon.client() as c:
        assert not c.cluster().enabled


def test_doctor_on_a_host_whose_only_seed_is_itself_does_not_say_no_seeds(site):
    """#28 item 12: a first host often lists itself among the seeds (one config for every host). (The
    cluster checks alone: the whole doctor also reads the simulated cards.)"""
    from xpud.daemon import doctor

    h = make_host(site, 1, [], start=False)
    h.daemon.config.write_text(h.daemon.config.read_text().replace("seeds = []", f"seeds = [{h.addr!r}]"))
    checks = {c.name: c for c in doctor._cluster(config.load(h.daemon.config))}
    assert checks["peer certificate"].status == doctor.OK
    assert checks["peers"].message.startswith(f"the only seed is this host ({h.addr})"), checks["peers"]


def test_doctor_reaches_the_peers_and_measures_the_clock_skew(site):
    h1 = make_host(site, 1, [])
    try:
        h2 = make_host(site, 2, [h1.addr, f"127.0.0.3:{free_port('127.0.0.3')}"], start=False)
        run_dir = str(h2.daemon.runtime_dir)
        cmd = [str(BIN / "xpud"), "--config", str(h2.daemon.config), "--runtime-dir", run_dir,
               "doctor", "--simulate", "workstation-2x", "--json"]  # fmt: skip
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=60, env=xpu_env(h2.daemon.runtime_dir)
        )
        checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
        assert checks["peer certificate"]["status"] == "ok"
        assert checks["peers"]["status"] == "warn"  # the second seed runs no daemon
        assert checks["peers"]["message"].startswith("1 of 2 peer(s) answered")
        assert checks["clock skew"]["status"] == "ok", checks["clock skew"]  # one host, one clock
        assert f"against {h1.addr}" in checks["clock skew"]["message"]
    finally:
        h1.daemon.kill(signal.SIGTERM)


@pytest.fixture
def netns():
    from tests.netns import NetNs

    if not NetNs.available():
        pytest.skip("needs root and `ip netns`")
    with NetNs(3) as net:
        yield net


@pytest.mark.xdist_group("netns")  # the test network (10.213.0.0/24) is one per machine
def test_a_partitioned_host_is_dead_on_both_sides_and_rejoins_when_the_link_heals(site, netns):
    hosts: list[Host] = []
    try:
        for i in range(3):
            seeds = [f"{netns.ip(0)}:7443"] if i else []
            hosts.append(make_host(site, i + 1, seeds, ip=netns.ip(i), prefix=netns.exec(i), start=False))
        start_together(hosts)
        wait_until(lambda: converged(hosts), timeout=30, step=0.3)
        netns.cut(2)  # h3's link goes down: a partition {h1, h2} | {h3}
        wait_until(
            lambda: (
                all(h.states()["h3"] == "dead" for h in hosts[:2])
                and {hosts[2].states()[n] for n in ("h1", "h2")} == {"dead"}
            ),
            timeout=DEAD_AFTER_S + 10,
            step=0.3,
        )
        netns.heal(2)
        # Both sides swap tables with a dead member at each push-pull (15 s apart): the death is refuted.
        wait_until(lambda: converged(hosts), timeout=45, step=0.5)
    finally:
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)
