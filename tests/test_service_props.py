"""Property: every RPC of Node and Admin, given arbitrary field values (or arbitrary bytes), answers with
a proper gRPC status (never UNKNOWN or INTERNAL) and the daemon goes on serving.

One real daemon serves the whole module; an operator's credential reaches both services (admin.sock).
"""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemons import DaemonProc
from tests.test_service_input import Raw
from xpud.api.v1 import xpu_pb2 as pb

BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
METHODS = [
    (service, m.name)
    for service in ("Node", "Admin")
    for m in pb.DESCRIPTOR.services_by_name[service].methods
]
PROPS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

WORDS = ["", "0", "3", "7", "xpu", "vxpu-half", "vxpu-quarter", "whole", "sliced", "auto", "xid", "lost"]
WORDS += ["ecc-dbe", "overheat", "GPU-", "MIG-", "²", "٣", "0" * 30, " 1", "-1", "\x00", "🙂", "a/b"]
strings = st.one_of(
    st.sampled_from(WORDS),
    st.text(max_size=40),
    # (no lone surrogates: a proto string field cannot hold one, so the client could not even send it)
    st.builds(lambda ch, n: ch * n, st.characters(exclude_categories=["Cs"]), st.integers(60, 300_000)),
)
int32s = st.one_of(st.sampled_from([0, 1, 2, 8, -1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
doubles = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 100.0, -1.0, 1e308]), st.floats())
SCALARS = {
    FD.TYPE_STRING: strings,
    FD.TYPE_INT32: int32s,
    FD.TYPE_UINT32: st.one_of(st.sampled_from([0, 1, 2, 8, 2**32 - 1]), st.integers(0, 2**32 - 1)),
    FD.TYPE_UINT64: st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1)),
    FD.TYPE_DOUBLE: doubles,
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_BYTES: st.binary(max_size=64),
    FD.TYPE_ENUM: st.integers(0, 7),
}


def _field(f, depth: int) -> st.SearchStrategy:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        k, v = (f.message_type.fields_by_name[n] for n in ("key", "value"))
        return st.dictionaries(SCALARS[k.type], SCALARS[v.type], max_size=3)
    if f.message_type is not None:
        one = message(getattr(pb, f.message_type.name), depth + 1)
        return st.lists(one, max_size=2) if f.is_repeated else one
    return st.lists(SCALARS[f.type], max_size=3) if f.is_repeated else SCALARS[f.type]


def message(cls, depth: int = 0) -> st.SearchStrategy:
    """Any value of ``cls`` (a request message): each field arbitrary (nested messages, maps and lists
    too), optional fields and oneof members maybe absent."""
    fields = {}
    for f in cls.DESCRIPTOR.fields:
        if f.message_type is not None and depth >= 2:
            continue
        value = _field(f, depth)
        fields[f.name] = st.one_of(st.none(), value) if f.has_presence or f.containing_oneof else value
    return st.fixed_dictionaries(fields).map(lambda kw: _build(cls, kw))


def _build(cls, kw: dict):
    m = cls()
    for k, v in kw.items():
        if v is None:
            continue
        f = cls.DESCRIPTOR.fields_by_name[k]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            getattr(m, k).update(v)
        elif f.message_type is not None and f.is_repeated:
            getattr(m, k).extend(v)
        elif f.message_type is not None:
            getattr(m, k).CopyFrom(v)  # the last oneof member set wins, as on the wire
        elif f.is_repeated:
            getattr(m, k).extend(v)
        else:
            setattr(m, k, v)
    return m


@pytest.fixture(scope="module")
def served():
    base = Path(tempfile.mkdtemp(prefix="xpu-", dir="/tmp"))
    d = DaemonProc(base, "pcie-8x-l40s", "[leases]\ngrace_s = 5.0\n").start()
    raw = Raw(d, admin=True)
    yield d, raw
    raw.close()
    try:
        assert d.alive(), d.log.read_text()[-3000:]
        assert "Traceback" not in d.log.read_text(), d.log.read_text()[-3000:]
    finally:
        d.kill(signal.SIGTERM)
        shutil.rmtree(base, ignore_errors=True)


def _check(raw, service: str, method: str, request) -> None:
    code, detail = raw.code(service, method, request, timeout=20)
    assert code not in BAD and code != grpc.StatusCode.DEADLINE_EXCEEDED, (method, code, detail[:300])
    assert len(detail) <= 1000
    code, detail = raw.code("Node", "Info", pb.InfoRequest())
    assert code == grpc.StatusCode.OK, (code, detail)


@pytest.mark.parametrize(("service", "method"), METHODS)
def test_any_field_values_get_a_proper_status(served, service, method):
    _, raw = served
    cls = getattr(pb, pb.DESCRIPTOR.services_by_name[service].methods_by_name[method].input_type.name)

    @PROPS
    @given(message(cls))
    def prop(request):
        _check(raw, service, method, request)

    prop()


@pytest.mark.parametrize(("service", "method"), METHODS)
def test_any_bytes_get_a_proper_status(served, service, method):
    _, raw = served

    @settings(PROPS, max_examples=10)
    @given(st.binary(max_size=64))
    def prop(payload):
        _check(raw, service, method, payload)

    prop()
