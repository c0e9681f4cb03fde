"""The ``Admin`` gRPC servicer (operators only, on admin.sock): drain, card modes, eviction, fault
injection on simulated hardware, defragmentation. Thin handlers over the shared ``Context``."""

from __future__ import annotations

import asyncio

from xpud.api import convert
from xpud.api.server import unary
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import BadRequest, Conflict, Forbidden
from xpud.model import Caller
from xpud.service.context import Context

FAULT_KINDS = ("xid", "ecc-dbe", "ecc-sbe", "overheat", "nvlink-down", "lost", "inforom")


class AdminService(pbg.AdminServicer):
    def __init__(self, ctx: Context):
        self.ctx = ctx

    def _operator(self, context) -> Caller:
        caller = self.ctx.caller(context)
        if not caller.admin:
            raise Forbidden(f"uid {caller.uid} is not an operator: use root or a member of the admin group")
        return caller

    def _card(self, view) -> pb.CardReply:
        return pb.CardReply(card=convert.card_pb(view, self.ctx.engine.isolation_name(view.info.index)))

    @unary
    async def Drain(self, request, context):
        self._operator(context)
        return self._card(await self.ctx.engine.drain(request.card, request.reason))

    @unary
    async def Undrain(self, request, context):
        self._operator(context)
        return self._card(await self.ctx.engine.undrain(request.card))

    @unary
    async def SetCardMode(self, request, context):
        self._operator(context)
        return self._card(await self.ctx.engine.set_mode(request.card, request.mode))

    @unary
    async def Evict(self, request, context):
        self._operator(context)
        return pb.EvictReply(
            lease=convert.lease_pb(await self.ctx.engine.evict(request.lease_id, request.reason), True)
        )

    @unary
    async def InjectFault(self, request, context):
        self._operator(context)
        fake = self._fake()
        card = self.ctx.engine.resolve_card(request.card).info.index
        kind = request.kind
        if kind == "xid":
            if request.xid <= 0:
                raise BadRequest("fault xid needs an XID number, e.g. `xpu fault inject 3 xid 79`")
            fake.inject_xid(card, request.xid)
        elif kind == "ecc-dbe":
            fake.inject_ecc_dbe(card)
        elif kind == "ecc-sbe":
            fake.inject_ecc_sbe(card)
        elif kind == "inforom":
            fake.corrupt_inforom(card)
        elif kind == "overheat":
            fake.set_overheat(card)
        elif kind == "nvlink-down":
            fake.nvlink_down(card)
        elif kind == "lost":
            fake.lose(card)
        else:
            raise BadRequest(f"fault {kind!r}: use one of {', '.join(FAULT_KINDS)}")
        what = f"xid {request.xid}" if kind == "xid" else kind
        self.ctx.engine.event("fault", f"fault injected on card {card}: {what}", card=card)
        return pb.FaultReply(message=f"injected {what} on card {card}")

    @unary
    async def ClearFault(self, request, context):
        self._operator(context)
        fake = self._fake()
        card = self.ctx.engine.resolve_card(request.card).info.index
        fake.clear(card)
        self.ctx.engine.event("fault", f"faults cleared on card {card}", card=card)
        return pb.FaultReply(message=f"cleared faults on card {card}")

    @unary
    async def Defrag(self, request, context):
        caller = self._operator(context)
        d = self.ctx.defrag
        if d is None:
            raise Conflict("this daemon runs no defragmenter")
        if request.apply:
            d.check_idle()
        budget = request.move_budget_pct if request.HasField("move_budget_pct") else None
        plan = await d.plan_async(budget, request.gpus)
        if not request.apply or not plan.moves:
            return convert.defrag_pb(plan)
        from xpud.controllers.defragmenter import MoveOutcome

        outcomes = [MoveOutcome(m) for m in plan.moves]
        started = asyncio.Event()
        # Shielded: a caller that stops waiting does not stop the run half-way (later waves go on).
        task = asyncio.ensure_future(d.apply(plan, f"operator uid {caller.uid}", started, outcomes))
        if request.wait:
            await asyncio.shield(task)
        else:
            await started.wait()
            if task.done():
                task.result()
        counts: dict[str, int] = {}
        for o in outcomes:
            counts[o.state] = counts.get(o.state, 0) + 1
        what = ", ".join(f"{n} {state}" for state, n in counts.items())
        return convert.defrag_pb(plan, outcomes, applied=True, summary=f"{len(outcomes)} move(s): {what}")

    def _fake(self):
        if self.ctx.fake is None:
            raise Conflict("fault injection is refused on real hardware: run the daemon with --simulate")
        return self.ctx.fake
