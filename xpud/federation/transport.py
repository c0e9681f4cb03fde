"""Membership messages over gRPC: ``membership`` dataclasses <-> ``SwimMessage`` protos, and the sender that
delivers a batch of ``Out`` pairs as ``Peer.Swim`` calls over mutual-TLS channels.

Sending is fire-and-forget, like UDP under SWIM: each message is its own task with a short deadline; a
lost or late one is what the protocol's indirect probes and retransmissions are for. At most
``max_in_flight`` sends run at once; beyond that new messages are dropped (and counted), so a flood of
unreachable peers never piles up tasks, and the caller never waits on the network.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from grpc import aio

from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.federation.membership import Ack, Gossip, Message, Out, Ping, PingReq, PushPull, State, Update

log = logging.getLogger("xpud.federation")

K = pb.SwimMessage.Kind
# gRPC's default reconnect backoff grows to 120 s: a peer back from a restart would stay unreachable from
# here that long. Retry at least every second, as the local client does.
KEEPALIVE_S = 5  # a call to a peer that stops answering (a partition, a crash) fails within about 2x this
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 8 << 20),
    # Long calls (a rank's Launch stream) must notice a peer gone without a FIN: HTTP/2 pings while a
    # call is open (TCP alone would take minutes).
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_S * 1000),
    ("grpc.http2.max_pings_without_data", 0),
)
# The Peer server: the same pings towards the caller, and it accepts its callers' pings at that rate.
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", 8 << 20),  # a 10,000-member push-pull fits
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_S * 1000),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC sets SO_REUSEPORT on Linux by default: a second daemon on this address would bind as well and
    # the kernel would share the peers' calls between the two. Without it the second one refuses to start.
    ("grpc.so_reuseport", 0),
)


# ------------------------------------------------------------------------------------------ messages
def update_pb(u: Update) -> pb.SwimUpdate:
    return pb.SwimUpdate(name=u.name, addr=u.addr, incarnation=u.incarnation, state=int(u.state), meta=u.meta)


def update_of(m: pb.SwimUpdate) -> Update:
    return Update(m.name, m.addr, m.incarnation, State(m.state), m.meta)


def to_pb(msg: Message) -> pb.SwimMessage:
    """The proto of one membership message."""
    match msg:
        case Ping():
            kind, extra = K.PING, {"seq": msg.seq, "target": msg.target}
            updates = msg.updates
        case Ack():
            kind, extra = K.ACK, {"seq": msg.seq, "about": msg.about}
            updates = msg.updates
        case PingReq():
            kind = K.PING_REQ
            extra = {"seq": msg.seq, "target": msg.target, "target_addr": msg.target_addr}
            updates = msg.updates
        case Gossip():
            kind, extra, updates = K.GOSSIP, {}, msg.updates
        case PushPull():
            kind, extra, updates = K.PUSH_PULL, {"reply": msg.reply}, msg.members
        case _:
            raise TypeError(f"not a membership message: {type(msg).__name__}")
    return pb.SwimMessage(
        kind=kind, src=msg.src, src_addr=msg.src_addr, updates=[update_pb(u) for u in updates], **extra
    )


def from_pb(m: pb.SwimMessage) -> Message:
    """The membership message of a (validated) proto. Raises ValueError for an unknown kind."""
    updates = tuple(update_of(u) for u in m.updates)
    if m.kind == K.PING:
        return Ping(m.seq, m.src, m.src_addr, updates, target=m.target)
    if m.kind == K.ACK:
        return Ack(m.seq, m.src, m.src_addr, updates, about=m.about)
    if m.kind == K.PING_REQ:
        return PingReq(m.seq, m.src, m.src_addr, m.target, m.target_addr, updates)
    if m.kind == K.GOSSIP:
        return Gossip(m.src, m.src_addr, updates)
    if m.kind == K.PUSH_PULL:
        return PushPull(m.src, m.src_addr, updates, m.reply)
    raise ValueError(f"membership message of kind {m.kind}: expected 1..5 (ping .. push-pull)")


# ------------------------------------------------------------------------------------------ channels
class Channels:
    """Cached mutual-TLS ``grpc.aio`` channels to peers, by ``HOST:PORT`` (at most ``limit``; the least
    recently used is closed beyond that). This host's certificate is the client certificate."""

    def __init__(self, ca: bytes, cert: bytes, key: bytes, limit: int = 1024):
        self.creds = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        self.limit = limit
        self._channels: OrderedDict[str, tuple[aio.Channel, pbg.PeerStub]] = OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def get(self, addr: str) -> aio.Channel:
        return self._entry(addr)[0]

    def stub(self, addr: str) -> pbg.PeerStub:
        return self._entry(addr)[1]

    def _entry(self, addr: str) -> tuple[aio.Channel, pbg.PeerStub]:
        entry = self._channels.get(addr)
        if entry is not None:
            self._channels.move_to_end(addr)
            return entry
        ch = aio.secure_channel(addr, self.creds, options=CHANNEL_OPTIONS)
        entry = self._channels[addr] = (ch, pbg.PeerStub(ch))
        while len(self._channels) > self.limit:
            _, (old, _) = self._channels.popitem(last=False)
            self._close_later(old, 1.0)
        return entry

    def _close_later(self, ch: aio.Channel, grace: float) -> None:
        task = asyncio.ensure_future(ch.close(grace=grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def revive(self, addr: str) -> None:
        """``addr`` just reached us: if our channel to it is failing (in gRPC's reconnect backoff, which
        fails every call at once), replace it, so the reply goes out now and not after the backoff."""
        entry = self._channels.get(addr)
        if entry is not None and entry[0].get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            del self._channels[addr]
            self._close_later(entry[0], 0.1)

    async def close(self) -> None:
        channels, self._channels = [ch for ch, _ in self._channels.values()], OrderedDict()
        await asyncio.gather(
            *(ch.close(grace=0.2) for ch in channels), *self._closing, return_exceptions=True
        )


# ------------------------------------------------------------------------------------------ sending
@dataclass
class SendStats:
    sent: int = 0
    failed: int = 0  # the call ended in an error (unreachable, refused, deadline)
    dropped: int = 0  # not sent: too many in flight
    bytes: int = 0


class Sender:
    """Delivers ``Out`` batches as ``Peer.Swim`` calls; never blocks, never raises."""

    def __init__(self, channels: Channels, timeout_s: float = 1.0, max_in_flight: int = 256):
        self.channels = channels
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.stats = SendStats()
        self._tasks: set[asyncio.Task] = set()
        self._last_log: dict[str, float] = {}

    def send(self, outs: Iterable[Out]) -> None:
        for addr, msg in outs:
            if len(self._tasks) >= self.max_in_flight:
                self.stats.dropped += 1
                continue
            task = asyncio.ensure_future(self._one(addr, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, addr: str, msg: Message) -> None:
        req = to_pb(msg)
        try:
            await self.channels.stub(addr).Swim(req, timeout=self.timeout_s)
            self.stats.sent += 1
            self.stats.bytes += req.ByteSize()
        except (aio.AioRpcError, grpc.RpcError) as e:
            self.stats.failed += 1
            self._log(addr, e)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not kill the loop that called send
            self.stats.failed += 1
            log.exception("sending a membership message to %s", addr)

    def _log(self, addr: str, e: grpc.RpcError) -> None:
        """One line per peer per minute at most: a dead peer is expected, not news every 0.5 s."""
        now = time.monotonic()
        if now - self._last_log.get(addr, -1e9) < 60.0:
            return
        if len(self._last_log) > 4096:
            self._last_log.clear()
        self._last_log[addr] = now
        code = e.code() if hasattr(e, "code") else None
        detail = e.details() if hasattr(e, "details") else str(e)
        log.info("peer %s: %s %s", addr, getattr(code, "name", code), (detail or "")[:200])

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the sends in flight (at shutdown: the leave message)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
