"""Admin.Defrag and the daemon's own runs, on an in-process engine and servicer: operators only, --no-wait
replies once the first wave started and the run goes on, periodic runs act only on enough gain."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from tests.test_defrag_plan import TOKENS, layout, make_engine
from xpud.api.auth import METADATA_KEY, CredentialIssuer
from xpud.api.v1 import xpu_pb2 as pb
from xpud.controllers.defragmenter import Defragmenter
from xpud.model import CardMode
from xpud.service.admin import AdminService
from xpud.service.context import Context


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class FakeCall:
    """What a servicer method sees of its call: the caller's credential, and abort."""

    def __init__(self, credential: str):
        self.credential = credential

    def invocation_metadata(self):
        return ((METADATA_KEY, self.credential),)

    async def abort(self, code, details):
        raise Aborted(code, details)


def servicer(engine):
    issuer = CredentialIssuer()
    d = Defragmenter(engine, engine.cfg)
    service = AdminService(Context(engine, issuer, defrag=d))
    operator, _ = issuer.issue(pid=1, uid=os.getuid(), gid=os.getgid())
    user, _ = issuer.issue(pid=2, uid=4242, gid=4242)
    return service, d, FakeCall(operator), FakeCall(user)


async def ack_moves(engine, n: int) -> None:
    """Acknowledge moves as their holders would, until ``n`` were acknowledged."""
    done = 0
    while done < n:
        for lease_id, pm in list(engine.moves.pending.items()):
            if pm.ready:
                await engine.ack_move(lease_id, TOKENS[lease_id])
                done += 1
        await asyncio.sleep(0.01)


def test_only_operators_may_plan_or_apply(tmp_path):
    engine = make_engine(tmp_path)
    layout(engine, {0: 1, 1: 1})
    service, _, operator, user = servicer(engine)
    for request in (pb.DefragRequest(), pb.DefragRequest(apply=True)):
        with pytest.raises(Aborted) as err:
            asyncio.run(service.Defrag(request, user))
        assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert "uid 4242 is not an operator" in err.value.details
    assert not engine.moves.pending
    reply = asyncio.run(service.Defrag(pb.DefragRequest(move_budget_pct=100), operator))
    assert not reply.applied and len(reply.moves) == 1 and reply.moves[0].state == "proposed"
    assert reply.move_budget == 2 and reply.movable_leases == 2
    assert reply.moves[0].reason == "frees whole cards"


def test_apply_without_waiting_replies_once_the_moves_started_and_the_run_goes_on(tmp_path):
    engine = make_engine(tmp_path)
    layout(engine, {0: 1, 2: 1, 4: 1, 6: 1})
    service, d, operator, _ = servicer(engine)

    async def go():
        request = pb.DefragRequest(apply=True, move_budget_pct=100, wait=False)
        reply = await service.Defrag(request, operator)
        assert reply.applied and reply.moves and {m.state for m in reply.moves} == {"moving"}
        assert d.running and set(engine.moves.pending) == {m.lease_id for m in reply.moves}
        with pytest.raises(Aborted, match="moving jobs already"):
            await service.Defrag(pb.DefragRequest(apply=True), operator)
        await ack_moves(engine, len(reply.moves))
        while d.running:
            await asyncio.sleep(0.01)
        return reply

    reply = asyncio.run(go())
    assert all(engine.leases[m.lease_id].cards == tuple(m.to_cards) for m in reply.moves)
    freed = set(reply.after.idle) - set(reply.before.idle)
    assert freed and all(engine.cards[i].idle and engine.cards[i].mode is CardMode.WHOLE for i in freed)
    log = [e.message for e in engine.ledger.events() if e.kind == "defrag"]
    assert "plan:" in log[0] and f"{len(reply.moves)} of {len(reply.moves)} move(s) done" in log[-1]


def test_a_periodic_run_acts_only_when_it_frees_min_gain_cards(tmp_path):
    engine = make_engine(tmp_path, min_gain=2.0)
    layout(engine, {0: 1, 1: 1})  # one move frees one card
    d = Defragmenter(engine, engine.cfg)
    assert asyncio.run(d.periodic()) is None
    assert not engine.moves.pending and not [e for e in engine.ledger.events() if e.kind == "defrag"]
    d = Defragmenter(engine, engine.cfg.replace("defrag", min_gain=1.0, move_budget_pct=50.0))

    async def run():
        plan = await d.periodic()
        assert d.running == "periodic"  # applying goes on in the background
        assert await d.periodic() is None  # one run at a time
        await ack_moves(engine, 1)
        while d.running:
            await asyncio.sleep(0.01)
        return plan

    plan = asyncio.run(run())
    assert plan is not None and len(plan.moves) == 1
    assert sum(c.idle for c in engine.cards.values()) == 7
    kinds = [(e.kind, e.message) for e in engine.ledger.events()]
    first_move = next(i for i, (k, _) in enumerate(kinds) if k == "move")
    assert kinds[first_move - 1][0] == "defrag" and "(periodic): plan:" in kinds[first_move - 1][1]
