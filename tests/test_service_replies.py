"""What Release answers: the ended lease exactly as ``convert.lease_pb`` writes it, whether the reply is
made from the message Acquire answered (a copy with the end's fields: the common case) or from the ended
lease itself (released by a prefix of its id, or moved since its grant)."""

from __future__ import annotations

import time

from xpud.api import convert
from xpud.api.client import Client

CONFIG = "[leases]\ngrace_s = 30.0\n"


def ended_msg(d, lease_id: str):
    """The ended lease as the ledger has it, converted in full."""
    (row,) = d.call(d.engine.ledger.find_lease, lease_id)
    return convert.lease_pb(row, True)


def test_a_release_answers_the_ended_lease_as_a_full_conversion_would(inproc):
    d = inproc("pcie-8x-l40s", CONFIG)
    with Client(d.runtime_dir) as c:
        ends = [
            ("vxpu-quarter", {"exit_code": 3, "started": time.time() - 5}),
            ("xpu", {"exit_signal": 9}),
            ("vxpu-half", {}),
        ]
        for mode, how in ends:
            g = c.acquire_lease(mode, command="python train.py", name="job-1", wait_s=10)
            assert g.lease.id in d.daemon.context.granted  # its release takes the copy's path
            reply = c.release(g.lease.id, g.token, **how)
            assert reply == ended_msg(d, g.lease.id)
            assert reply.state == "released" and reply.HasField("ended") and reply.end_reason
            assert reply.HasField("exit_code") == ("exit_code" in how)
            assert reply.HasField("exit_signal") == ("exit_signal" in how)
            assert dict(reply.env) == dict(g.lease.env) and reply.id == g.lease.id
            assert g.lease.id not in d.daemon.context.granted
        g = c.acquire_lease("vxpu-quarter", wait_s=10)
        assert c.release(g.lease.id[:6], g.token) == ended_msg(d, g.lease.id)  # by a prefix: in full


def test_the_grants_kept_for_their_release_stay_bounded_when_leases_end_otherwise(inproc):
    d = inproc("pcie-8x-l40s", CONFIG)
    with Client(d.runtime_dir) as c:
        for _ in range(150):
            g = c.acquire_lease("vxpu-quarter", wait_s=10)
            d.call(d.engine.evict, g.lease.id, "test")  # never released: its kept message is stale
        assert len(d.daemon.context.granted) <= 64 + 1
        g = c.acquire_lease("vxpu-quarter", wait_s=10)
        assert c.release(g.lease.id, g.token) == ended_msg(d, g.lease.id)
