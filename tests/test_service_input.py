"""Hostile input at the gRPC service: non-finite numbers, huge strings, odd digits, corrupt messages.

Each call goes through a raw gRPC channel (the client library would refuse some of these values itself)
to a real daemon, with a real credential from cred.sock.
"""

from __future__ import annotations

import math
import time

import grpc
import pytest

from xpud.api import validate
from xpud.api.auth import METADATA_KEY, handshake
from xpud.api.v1 import xpu_pb2 as pb

MAX_MESSAGE = 4 * 1024 * 1024  # gRPC's default limit on a received message


class Raw:
    """Calls any method of the daemon with any message (or any bytes)."""

    def __init__(self, d, admin: bool = False):
        sock = d.runtime_dir / ("admin.sock" if admin else "xpud.sock")
        self.channel = grpc.insecure_channel(f"unix:{sock}")
        self.md = ((METADATA_KEY, handshake(str(d.runtime_dir / "cred.sock"))["credential"]),)

    def call(self, service: str, method: str, request, timeout: float = 10.0):
        """The reply (for a stream: its first message); raises grpc.RpcError."""
        m = pb.DESCRIPTOR.services_by_name[service].methods_by_name[method]
        reply_cls = getattr(pb, m.output_type.name)
        path = f"/xpud.v1.{service}/{method}"
        serialize = (lambda b: b) if isinstance(request, bytes) else type(request).SerializeToString
        if m.client_streaming:  # one message, then the end of the client's stream
            call = self.channel.stream_stream(path, serialize, reply_cls.FromString)(
                iter([request]), metadata=self.md, timeout=timeout
            )
            try:
                return next(iter(call))
            finally:
                call.cancel()
        if m.server_streaming:
            call = self.channel.unary_stream(path, serialize, reply_cls.FromString)(
                request, metadata=self.md, timeout=timeout
            )
            try:
                return next(iter(call))
            finally:
                call.cancel()
        return self.channel.unary_unary(path, serialize, reply_cls.FromString)(
            request, metadata=self.md, timeout=timeout
        )

    def code(self, *args, **kw) -> tuple[grpc.StatusCode, str]:
        try:
            self.call(*args, **kw)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def raw(daemon):
    r = Raw(daemon, admin=True)
    yield r
    r.close()


def _methods():
    for service in ("Node", "Admin"):
        for m in pb.DESCRIPTOR.services_by_name[service].methods:
            yield service, m


NUMBER_FIELDS = [
    (s, m.name, f.name)
    for s, m in _methods()
    for f in m.input_type.fields
    if f.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT)
]


def test_every_request_field_has_a_limit():
    methods = [m for service in pb.DESCRIPTOR.services_by_name.values() for m in service.methods]
    for m in methods:
        for f in m.input_type.fields:
            assert f"{m.input_type.name}.{f.name}" in validate.LIMITS, f"{m.input_type.name}.{f.name}"
        validate.check(getattr(pb, m.input_type.name)())  # the defaults pass


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused_in_every_request(raw, value):
    assert len(NUMBER_FIELDS) >= 3  # wait_s, min_interval_s, move_budget_pct at least
    for service, method, field in NUMBER_FIELDS:
        m = pb.DESCRIPTOR.services_by_name[service].methods_by_name[method]
        request = getattr(pb, m.input_type.name)(**{field: value})
        code, detail = raw.code(service, method, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, field, code, detail)
        assert field in detail and "finite" in detail, detail


def test_watch_with_nan_interval_is_refused_not_spun(daemon, raw):
    code, detail = raw.code("Node", "Watch", pb.WatchRequest(min_interval_s=math.nan))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, detail)
    # a tiny interval is clamped: a few updates a second, not thousands
    call = raw.channel.unary_stream(
        "/xpud.v1.Node/Watch", pb.WatchRequest.SerializeToString, pb.WatchUpdate.FromString
    )(pb.WatchRequest(min_interval_s=1e-9), metadata=raw.md, timeout=1.5)
    n = 0
    with pytest.raises(grpc.RpcError):
        for _ in call:
            n += 1
    assert n <= 20


def test_oversized_strings_are_refused_naming_the_field_and_never_echoed(raw):
    big = "x" * 100_000
    cases = [
        ("Node", "Acquire", pb.AcquireRequest(mode=big)),
        ("Node", "Release", pb.ReleaseRequest(lease_id=big)),
        ("Node", "GetHealth", pb.HealthRequest(card=big)),
        ("Admin", "Drain", pb.DrainRequest(card="0", reason=big)),
        ("Admin", "SetCardMode", pb.SetCardModeRequest(card="0", mode=big)),
        ("Admin", "InjectFault", pb.FaultRequest(card="0", kind=big)),
    ]
    for service, method, request in cases:
        code, detail = raw.code(service, method, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, detail[:200])
        assert "at most" in detail and len(detail) < 200, detail[:300]
    # just under a limit but wrong: the error quotes at most 80 characters of it
    code, detail = raw.code("Node", "Acquire", pb.AcquireRequest(mode="y" * 64))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(detail) < 300 and "y" * 81 not in detail


@pytest.mark.parametrize("card", ["²", "٣", "３", "0x1", " 1", "-1"])
def test_card_selectors_take_ascii_digits_and_uuids_only(daemon, raw, card):
    code, _ = raw.code("Node", "GetHealth", pb.HealthRequest(card=card))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), code
    code, _ = raw.code("Admin", "Drain", pb.DrainRequest(card=card, reason="test"))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), code
    with daemon.client() as c:
        assert not any(x.drained for x in c.cards().cards)  # "٣" did not drain card 3
        assert c.health("3").cards[0].index == 3  # ASCII digits still work


def test_corrupt_messages_get_invalid_argument_and_one_log_line(daemon, raw):
    garbage = [b"\x0a\x05ab", b"\xff\xff\xff\xff", b"\x08" + b"\xff" * 11, b"\x12\x80\x80\x80\x80\x10"]
    for _ in range(20):
        for payload in garbage:
            code, detail = raw.code("Node", "Acquire", payload)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (payload, code, detail)
            assert "AcquireRequest" in detail
            code, _ = raw.code("Admin", "Drain", payload)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (payload, code)
    with daemon.client() as c:
        c.info()
    log = daemon.log.read_text()
    assert "Traceback" not in log
    assert log.count("undecodable") <= 2, log[-2000:]


def test_huge_commands_do_not_break_listings_for_everyone(daemon):
    """Two queued requests with 3 MB commands made ListLeases and Watch fail for all users."""
    with daemon.client() as c, daemon.client() as other:
        c.acquire_lease("xpu", gpus=8)
        calls = [c.acquire("xpu", wait_s=60, command=f"{i}" * 3_000_000) for i in range(2)]
        try:
            for call in calls:
                next(iter(call))  # queued
            reply = other.leases()
            assert len(reply.queue) == 2 and reply.ByteSize() < 64 * 1024
            assert all(len(q.command) <= validate.COMMAND_CHARS for q in reply.queue)
            update = next(iter(other.watch(0.2)))
            assert len(update.leases.queue) == 2
        finally:
            for call in calls:
                call.cancel()


@pytest.mark.slow
def test_list_replies_stay_under_the_message_limit(daemon):
    """However long the queue, ListLeases and Watch fit in a message and say what they left out."""
    with daemon.client() as c:
        # Held: an unheld lease goes back after the 30 s grace and the queue starts to move.
        blocker = c.acquire("xpu", gpus=8, hold=True)
        assert next(iter(blocker)).HasField("granted")
        n = 6000  # 6,000 entries with 500-character commands: well over 4 MiB if all were listed
        calls = [c.acquire("xpu", wait_s=120, command="c" * 2000) for _ in range(n)]
        try:
            deadline = time.monotonic() + 90  # a failure says how far it got, before pytest's timeout
            while True:
                reply = c.leases()
                if len(reply.queue) + reply.queue_omitted == n or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert len(reply.queue) + reply.queue_omitted == n, f"{len(reply.queue)} + {reply.queue_omitted}"
            assert reply.queue_omitted > 0 and reply.ByteSize() < MAX_MESSAGE
            assert [q.position for q in reply.queue] == list(range(1, len(reply.queue) + 1))
            update = next(iter(c.watch(1.0)))
            assert update.ByteSize() < MAX_MESSAGE and update.leases.queue_omitted > 0
        finally:
            for call in (*calls, blocker):
                call.cancel()
