"""The daemon side of federation without a network: membership messages <-> protos, the [cluster] config's
checks, and this host's summary from the engine's views."""

from __future__ import annotations

import math

import pytest

from xpud import config
from xpud.api import validate
from xpud.errors import ConfigError
from xpud.federation import summary, transport
from xpud.federation.membership import Ack, Gossip, Ping, PingReq, PushPull, State, Update
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.machines import load_machine
from xpud.hw.nvml import Nvml
from xpud.model import CardMode, HealthState

U = (
    Update("h1", "10.0.0.1:7443", 5, State.ALIVE, '{"c":8}'),
    Update("h2", "10.0.0.2:7443", 2**62, State.DEAD),
    Update("h3", "[::1]:7443", 0, State.LEFT),
)


@pytest.mark.parametrize(
    "msg",
    [
        Ping(7, "h1", "10.0.0.1:7443", U, target="h2"),
        Ping(8, "h1", "10.0.0.1:7443"),
        Ack(7, "h2", "10.0.0.2:7443", U[:1], about="h3"),
        PingReq(9, "h1", "10.0.0.1:7443", "h3", "[::1]:7443", U),
        Gossip("h1", "10.0.0.1:7443", U),
        PushPull("h1", "10.0.0.1:7443", U, reply=True),
        PushPull("h1", "10.0.0.1:7443", (), reply=False),
    ],
)
def test_every_message_round_trips_and_passes_the_input_checks(msg):
    proto = transport.to_pb(msg)
    validate.check(proto)
    again = type(proto).FromString(proto.SerializeToString())
    assert transport.from_pb(again) == msg


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind 0"):
        transport.from_pb(transport.pb.SwimMessage(src="h1", src_addr="x:1"))


def _cluster(text: str) -> config.Config:
    return config.parse("[cluster]\n" + text, "xpud.toml")


CERTS = 'ca = "/c/ca.crt"\ncert = "/c/h.crt"\nkey = "/c/h.key"\n'


def test_cluster_is_off_without_listen_and_checked_with_it():
    assert not config.Config().cluster.enabled
    cfg = _cluster('listen = "10.0.0.2:7443"\nseeds = ["10.0.0.3:7443", "node-c:7443"]\n' + CERTS)
    assert cfg.cluster.enabled and cfg.cluster.dead_after_s == 10.0 and cfg.cluster.remote_launch


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('listen = "node-a:7443"\n' + CERTS, ["[cluster] listen", "IP:PORT"]),
        ('listen = "0.0.0.0:7443"\n' + CERTS, ["[cluster] listen", "every address"]),
        ('listen = "10.0.0.2:70000"\n' + CERTS, ["[cluster] listen", "port 1..65535"]),
        ('listen = "10.0.0.2:7443"\n', ["[cluster] ca", "xpu certs"]),
        ("seeds = [" + ", ".join(['"10.0.0.3:7443"'] * 65) + "]\n", ["[cluster] seeds", "at most 64"]),
        ('seeds = ["10.0.0.3"]\n', ["[cluster] seeds", "HOST:PORT"]),
        ('seeds = ["10.0.0.3:7443"]\n', ["[cluster] seeds", "set listen too"]),
        ("dead_after_s = 1.0\n", ["[cluster] dead_after_s", "minimum"]),
        ("dead_after_s = nan\n", ["[cluster] dead_after_s", "finite"]),
        ('name = "bad name"\n', ["[cluster] name"]),
        ('domain = "' + "r" * 65 + '"\n', ["[cluster] domain", "64"]),
        ('lissen = "10.0.0.2:7443"\n', ["unknown key", "listen"]),
    ],
)
def test_bad_cluster_values_are_one_line(text, words):
    with pytest.raises(ConfigError) as e:
        _cluster(text)
    msg = str(e.value)
    assert msg.startswith("xpud.toml:") and "\n" not in msg
    for w in words:
        assert w in msg, msg


def _views(machine: str = "pcie-4x-h100"):
    hw = Nvml(FakeNvml(load_machine(machine)))
    hw.open()
    from xpud.model import CardView

    return hw, [CardView(info=c, mode=CardMode.WHOLE) for c in hw.cards()]


def test_the_summary_counts_free_cards_groups_slices_and_health():
    hw, views = _views()
    sizes = config.DEFAULT_SLICES
    snap = summary.snapshot(views, busy=set(), queue=3, sizes=sizes)
    s = summary.summarize(snap, hw.topology(), summary.GroupCache(), "z", "b", "d")
    assert (s.cards, s.free_whole, s.queue, s.health) == (4, 4, 3, 100)
    assert len(s.group_gbps) == 4 and math.isinf(s.group_gbps[0]) and all(g > 0 for g in s.group_gbps[1:])
    assert s.free_slices == {"vxpu-half": 8, "vxpu-quarter": 16}  # idle cards the engine may slice
    assert (s.zone, s.block, s.domain) == ("z", "b", "d")
    # A held card, a drained one, a degraded one and one busy with backend work: two free, the weakest 70.
    from dataclasses import replace

    views[0] = replace(views[0], whole_lease="L1", free_memory_fraction=0.0, free_compute_pct=0)
    views[1] = replace(views[1], drained=True)
    views[2] = replace(views[2], health_state=HealthState.DEGRADED, health_score=70)
    snap = summary.snapshot(views, busy={3}, queue=0, sizes=sizes)
    s = summary.summarize(snap, hw.topology(), summary.GroupCache())
    assert (s.free_whole, s.health, len(s.group_gbps)) == (1, 70, 1)
    assert s.free_slices == {"vxpu-half": 2, "vxpu-quarter": 4}


# ------------------------------------------------------------------ the Peer servicer's forwarding
class _HostJobs:
    """What the fedjobs/fedlaunch side provides: records who asked what."""

    def __init__(self):
        self.calls = []

    async def reserve(self, request, peer):
        self.calls.append(("reserve", request.job, peer))
        return transport.pb.ReserveReply(cards=[0, 1], expires_in_s=request.ttl_s)

    async def commit(self, request, peer):
        from xpud.errors import Conflict

        raise Conflict(f"job {request.job}: no reservation held here")

    async def abort(self, request, peer):
        return transport.pb.AbortReply(dropped=False)

    async def launch(self, requests, peer, context):
        async for r in requests:
            self.calls.append(("launch", r.WhichOneof("what"), peer))
            yield transport.pb.LaunchEvent(started=transport.pb.LaunchStarted(pid=42))


def test_the_peer_service_forwards_to_hostjobs_with_the_callers_name(tmp_path):
    import asyncio

    import grpc
    from grpc import aio

    from xpud.api.server import add_to_server
    from xpud.api.v1 import xpu_pb2 as pb
    from xpud.api.v1 import xpu_pb2_grpc as pbg
    from xpud.federation.certs import init_ca, issue
    from xpud.federation.peer_service import PeerService

    init_ca(tmp_path / "ca")
    a = issue("node-a", tmp_path / "ca", tmp_path / "a", ips=["127.0.0.1"])
    b = issue("node-b", tmp_path / "ca", tmp_path / "b", ips=["127.0.0.1"])
    jobs = _HostJobs()

    async def main():
        server = aio.server()
        add_to_server(PeerService(None, jobs), server)
        creds = grpc.ssl_server_credentials(
            [(a.key.read_bytes(), a.cert.read_bytes())], a.ca.read_bytes(), require_client_auth=True
        )
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        client = grpc.ssl_channel_credentials(a.ca.read_bytes(), b.key.read_bytes(), b.cert.read_bytes())
        async with aio.secure_channel(f"127.0.0.1:{port}", client) as ch:
            stub = pbg.PeerStub(ch)
            reply = await stub.Reserve(pb.ReserveRequest(job="j1", mode="xpu", count=2, ttl_s=5), timeout=5)
            assert list(reply.cards) == [0, 1]
            with pytest.raises(aio.AioRpcError) as e:
                await stub.Commit(pb.CommitRequest(job="j1"), timeout=5)
            assert (
                e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                and "no reservation" in e.value.details()
            )
            with pytest.raises(aio.AioRpcError) as e:
                await stub.Reserve(pb.ReserveRequest(job="j 1", ttl_s=5), timeout=5)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # checked before hostjobs sees it

            async def inputs(bad: bool):
                yield pb.LaunchInput(start=pb.LaunchSpec(job="j1", rank=1, argv=["true"]))
                yield pb.LaunchInput(signal=99 if bad else 15)

            events = [ev async for ev in stub.Launch(inputs(False), timeout=5)]
            assert [ev.started.pid for ev in events] == [42, 42]
            with pytest.raises(aio.AioRpcError) as e:
                async for _ in stub.Launch(inputs(True), timeout=5):
                    pass
            assert (
                e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                and "LaunchInput.signal" in e.value.details()
            )
        await server.stop(None)

    asyncio.run(main())
    assert jobs.calls[0] == ("reserve", "j1", "node-b")
    assert ("launch", "signal", "node-b") in jobs.calls and jobs.calls.count(
        ("launch", "signal", "node-b")
    ) == 1


def test_engine_news_during_a_summary_refresh_waits_for_the_next_refresh(tmp_path):
    """A refresh that runs may have read the engine before the news: the news is kept, and the next tick
    after it ends refreshes again (before, it was taken and lost until the periodic refresh, 1 s)."""
    import asyncio

    from xpud import config
    from xpud.federation import node
    from xpud.federation.certs import init_ca, issue

    init_ca(tmp_path / "ca")
    c = issue("h1", tmp_path / "ca", tmp_path / "h1", ips=["127.0.0.1"])
    cfg = config.ClusterSection(
        name="h1", listen="127.0.0.1:1", ca=str(c.ca), cert=str(c.cert), key=str(c.key)
    )

    async def main():
        fed = node.Federation(cfg, engine=None)
        published = []

        async def publish():
            published.append(len(published))

        fed._publish = publish
        fed._engine_news, fed._next_summary = asyncio.Queue(), 1e9
        running = asyncio.get_running_loop().create_future()
        fed._refresh = running  # a refresh in progress
        fed._engine_news.put_nowait("a lease ended")
        fed._maybe_refresh(10.0)
        assert fed._refresh is running and fed._engine_news.qsize() == 1  # kept
        running.set_result(None)
        fed._maybe_refresh(10.05)
        await fed._refresh
        assert published == [0] and fed._engine_news.empty()
        fed._engine_news.put_nowait("another")
        fed._maybe_refresh(10.1)  # within PUBLISH_GAP_S of the last: not yet
        assert published == [0] and fed._engine_news.qsize() == 1
        fed._maybe_refresh(10.05 + node.PUBLISH_GAP_S)
        await fed._refresh
        assert published == [0, 1]
        await fed.channels.close()

    asyncio.run(main())


def test_a_second_daemon_on_the_same_peer_address_refuses_to_start(tmp_path):
    """gRPC core sets SO_REUSEPORT on Linux listeners unless ``grpc.so_reuseport`` is 0 (grpc/grpc:
    src/core/lib/iomgr/socket_utils_common_posix.cc, ``grpc_set_socket_reuse_port``; the channel arg
    GRPC_ARG_ALLOW_REUSEPORT in include/grpc/impl/channel_arg_names.h). With it, a second daemon on the same
    host and port would bind too and the kernel would split the peers' calls between the two."""
    import asyncio
    import socket

    import pytest

    from xpud import config
    from xpud.federation import node, view
    from xpud.federation.certs import init_ca, issue

    init_ca(tmp_path / "ca")
    c = issue("h1", tmp_path / "ca", tmp_path / "h1", ips=["127.0.0.1"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config.ClusterSection(
        name="h1", listen=f"127.0.0.1:{port}", ca=str(c.ca), cert=str(c.cert), key=str(c.key)
    )

    class Engine:
        def watch(self):
            return asyncio.Queue()

        def unwatch(self, q):
            pass

    async def summary():
        return view.HostSummary(cards=0, free_whole=0)

    async def main():
        first, second = node.Federation(cfg, engine=Engine()), node.Federation(cfg, engine=Engine())
        first._summary = second._summary = summary
        await first.start()
        try:
            with pytest.raises(OSError, match="the port is in use"):
                await second.start()
        finally:
            await first.stop()
            await first.channels.close()
            await second.channels.close()

    asyncio.run(main())
