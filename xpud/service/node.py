"""The ``Node`` gRPC servicer (users' requests, on xpud.sock and admin.sock): short methods that check the
caller, convert messages and call the engine through the ``Context``. The operators' ``Admin`` servicer is
``xpud.service.admin``.

Each method goes through ``xpud.api.server``'s ``unary``/``streaming``: errors cross the wire as status
codes from one table, and the daemon never dies on a bad request.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from datetime import datetime

from xpud.api import convert, validate
from xpud.api.auth import member_of
from xpud.api.server import streaming, unary
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.controllers.rightsizer import resize, usage_rows
from xpud.errors import BadRequest, Conflict, Forbidden, Unavailable
from xpud.isolation.scope import ScopeError, process_uid
from xpud.model import CommandEnd, Mode, QueuedRequest, Request
from xpud.planning import green as carbon
from xpud.planning.usage import job_class
from xpud.service.accounts import accounts_reply, charge, report
from xpud.service.context import REPLY_BUDGET, Context, fit

MAX_ENDED_LEASES = 1000  # `ListLeases(all)` lists at most this many
MAX_EVENTS = 10_000  # `ListEvents` lists at most this many
MAX_WATCH_EVENTS = 200  # a Watch update carries at most the latest this many events
MIN_WATCH_INTERVAL_S = 0.1

log = logging.getLogger(__name__)


def _mode(text: str, ctx: Context) -> Mode:
    try:
        return Mode(text)
    except ValueError:
        sizes = ", ".join(["xpu", *ctx.engine.cfg.slices])
        raise BadRequest(f"mode {validate.clip(text)!r}: use one of {sizes}") from None


def _wait_s(request: pb.AcquireRequest, leases) -> float:
    """How long the request may queue: what it asks, the longest allowed (`--wait inf`), or the
    config's default when it does not say."""
    if request.wait_longest:
        if request.HasField("wait_s"):
            raise BadRequest("wait_longest and wait_s both set: send one")
        return leases.max_wait_s
    return request.wait_s if request.HasField("wait_s") else leases.default_wait_s


def _green_start(request: pb.AcquireRequest, ctx: Context) -> tuple[float, str]:
    """(not_before, why) of a deferrable request (``when_green`` with ``green_deadline``): the greenest
    hour of the daemon's carbon signal before the deadline; (0, why) when that is now."""
    if not (request.when_green or request.green_deadline):
        return 0.0, ""
    if not (request.when_green and request.green_deadline):
        raise BadRequest("when_green and green_deadline go together (xpu run --when-green --deadline T)")
    signal = ctx.carbon
    if signal is None or not signal.configured:
        raise BadRequest(
            "this daemon has no carbon signal: set [carbon] signal or command in xpud.toml for --when-green"
        )
    now = datetime.fromtimestamp(ctx.engine.clock()).astimezone()
    deadline = datetime.fromtimestamp(request.green_deadline).astimezone()
    if deadline <= now or deadline - now > carbon.MAX_DEFER:
        raise BadRequest(
            f"--deadline {deadline.isoformat(timespec='minutes')}: must be in the future, within "
            f"{carbon.MAX_DEFER.days} days"
        )
    start, why = carbon.plan(signal.hours, now, deadline)
    return (start.timestamp() if start > now else 0.0), why


class NodeService(pbg.NodeServicer):
    def __init__(self, ctx: Context):
        self.ctx = ctx

    @unary
    async def Info(self, request, context):
        caller = self.ctx.caller(context)
        return pb.InfoReply(
            **dataclasses.asdict(self.ctx.info),
            cards=len(self.ctx.engine.cards),
            caller_uid=caller.uid,
            caller_is_admin=caller.admin,
            slice_sizes=[
                pb.SliceSize(name=s.name, memory_fraction=s.memory_fraction, compute_pct=s.compute_pct)
                for s in self.ctx.engine.cfg.slices.values()
            ],
        )

    @streaming
    async def Acquire(self, request, context):
        caller = self.ctx.caller(context)
        e = self.ctx.engine
        on_behalf = request.cards or request.anchor or request.HasField("owner_uid")
        if on_behalf and not caller.admin:
            raise Forbidden("cards, anchor and owner_uid are for operators (the Slurm and kubelet bridges)")
        mode_text, cls, why = request.mode, request.job_class, ""
        if request.mode == "auto":  # right-sizing picks the size (xpud.controllers.rightsizer)
            if e.rightsizer is not None:
                mode_text, cls, why = e.rightsizer.choose(request.command, request.job_class)
            else:
                mode_text = e.cfg.auto.first
        not_before, green_why = _green_start(request, self.ctx)
        owner = request.owner_uid if request.HasField("owner_uid") else caller.uid
        # with accounts configured, the user database is read (NSS may be remote): off the loop
        charging = (e.cfg, caller, request.account, owner, request.anchor)
        account = await asyncio.to_thread(charge, *charging) if e.cfg.named_accounts else charge(*charging)
        req = e.validate(
            Request(
                mode=_mode(mode_text, self.ctx),
                gpus=request.gpus or len(request.cards) or 1,
                priority=request.priority,
                wait_s=_wait_s(request, e.cfg.leases),
                restartable=request.restartable,
                owner_uid=request.owner_uid if request.HasField("owner_uid") else caller.uid,
                holder_pid=None if request.anchor else caller.pid or None,
                command=request.command,
                name=request.name,
                cards=tuple(request.cards),
                anchor=request.anchor,
                exempt=caller.admin or member_of(caller.uid, caller.gid, e.cfg.limits.exempt_groups),
                job_class=cls,
                not_before=not_before,
                not_before_reason=green_why,
                account=account,
            )
        )
        # Granted at once (the common case), or queued in the same step: no helper task either way. A
        # caller that goes away cancels this coroutine: try_grant's shielded grant then ends what it
        # made, or the `finally` below takes the request out of the queue (synchronously: thousands of
        # waiters leaving at once cost no task each).
        updates: asyncio.Queue = asyncio.Queue()

        def on_position(q: QueuedRequest, length: int) -> None:
            queued = pb.Queued(
                ticket=q.ticket,
                position=q.position,
                queue_length=length,
                deadline=q.deadline,
                not_before=q.request.not_before,
                not_before_reason=q.request.not_before_reason,
            )
            updates.put_nowait(pb.AcquireUpdate(queued=queued))

        got = await e.grant_or_queue(req, on_position)
        if not isinstance(got, tuple):  # queued: positions stream while it waits
            w = got
            w.future.add_done_callback(updates.put_nowait)  # its answer comes last down the queue
            try:
                while (item := await updates.get()) is not w.future:
                    yield item
                got = w.future.result()  # NoCapacity when its wait ran out
            finally:
                w.future.remove_done_callback(updates.put_nowait)  # a leaver's cancel schedules nothing
                e.leave(w)
                if not isinstance(got, tuple) and not req.anchor:  # an `xpu run` that never ran: a job
                    from xpud.service.jobrecords import record_unserved

                    record_unserved(e, w, caller)
        lease, token = got
        if e.rightsizer is not None:
            e.rightsizer.track(lease.id, cls or job_class(lease.command), request.mode == "auto")
            if why:
                e.event("auto", f"lease {lease.id} started as {lease.mode}: {why}", lease_id=lease.id)
        msg = convert.lease_pb(lease, True)
        self.ctx.remember_grant(lease, msg)
        granted = pb.AcquireUpdate()  # filled in place: a message given to a constructor is copied
        granted.granted.token = token
        granted.granted.lease.CopyFrom(msg)
        if not request.hold:
            yield granted
            return
        # Held from the instant of the grant: no window in which the reaper could take it back.
        async for ev in self._held(lease, e.hold_opened(lease.id), first=granted):
            yield ev if ev is granted else pb.AcquireUpdate(event=ev)

    @streaming
    async def Hold(self, request, context):
        self.ctx.caller(context)
        e = self.ctx.engine
        lease = e.leases.get(request.lease_id)
        if lease is None:
            raise_not_found(request.lease_id)
        if not e.ledger.token_matches(lease.id, request.token):
            raise Forbidden(f"wrong token for lease {lease.id}: Hold needs the token Acquire returned")
        async for ev in self._held(lease, e.hold_opened(lease.id)):
            yield ev

    async def _held(self, lease, q: asyncio.Queue, first=None):
        """Yield ``first`` (or a "held" event), then the lease's events until it ends; then close the hold."""
        e = self.ctx.engine
        try:
            yield first or pb.LeaseEvent(
                kind="held",
                lease_id=lease.id,
                message="holding",
                lease=convert.lease_pb(lease, True, True),
                timestamp=e.clock(),
            )
            while True:
                ev = await q.get()
                yield pb.LeaseEvent(
                    kind=ev.kind,
                    lease_id=ev.lease.id,
                    message=ev.message,
                    lease=convert.lease_pb(ev.lease, True, True),
                    timestamp=ev.timestamp,
                )
                if ev.kind == "released":
                    return
        finally:
            e.hold_closed(lease.id, q)

    @unary
    async def Release(self, request, context):
        caller = self.ctx.caller(context)
        end = CommandEnd(
            exit_code=request.exit_code if request.HasField("exit_code") else None,
            exit_signal=request.exit_signal if request.HasField("exit_signal") else None,
            started=request.started or None,
        )
        if end.exit_code is not None and end.exit_signal is not None:
            raise BadRequest("a command ends by an exit code or by a signal, not both: send one")
        e = self.ctx.engine
        active = e.leases.get(request.lease_id)  # what release ends when it is a whole id: no await between
        ended = await e.release(request.lease_id, caller, request.token, end)
        reply = pb.ReleaseReply()
        self.ctx.ended_msg(reply.lease, active, ended)
        return reply

    @unary
    async def AckMove(self, request, context):
        self.ctx.caller(context)
        e = self.ctx.engine
        lease = e.resolve_lease(request.lease_id)
        ack = getattr(e, "ack_move", None)
        if ack is None:
            raise Conflict(f"no move is pending for lease {lease.id}")
        moved = await ack(lease.id, request.token)
        scopes = self.ctx.scopes
        if scopes is not None:  # before the reply: the holder restarts its command on the new cards next
            try:
                await scopes.follow(moved)
            except ScopeError as e:
                log.error("lease %s moved, but its device scope did not follow: %s", moved.id, e)
        return pb.AckMoveReply(lease=convert.lease_pb(moved, True))

    @unary
    async def Confine(self, request, context):
        caller = self.ctx.caller(context)
        e = self.ctx.engine
        lease = e.leases.get(request.lease_id)
        if lease is None:
            raise_not_found(request.lease_id)
        if not request.token:
            raise BadRequest("Confine needs the lease's token (the holder confines itself)")
        e.check_authority(lease, caller, request.token)
        if caller.uid != lease.owner_uid:
            raise Forbidden(f"lease {lease.id} belongs to uid {lease.owner_uid}, not to uid {caller.uid}")
        scopes = self.ctx.scopes
        if scopes is None or not scopes.enforcement.enforced:
            how = scopes.enforcement.text if scopes else "advisory (no device scopes in this daemon)"
            return pb.ConfineReply(enforced=False, isolation=how, warn=bool(scopes and scopes.warn_today()))
        if caller.pid <= 0:  # SO_PEERCRED gives 0 for a process in a PID namespace we cannot see into
            why = "advisory (the caller is in another PID namespace)"
            return pb.ConfineReply(enforced=False, isolation=why, warn=True)
        if process_uid(caller.pid) != caller.uid:  # the handshake's process is gone (its pid reused?)
            raise Forbidden(f"process {caller.pid} is not the caller's: confine from the process that holds")
        try:
            unit = await scopes.place(lease, caller.pid)
        except ScopeError as err:
            raise Unavailable(f"device isolation could not be applied: {err}") from None
        return pb.ConfineReply(enforced=True, isolation="enforced", unit=unit)

    @unary
    async def ListCards(self, request, context):
        self.ctx.caller(context)
        return self.ctx.cards_reply()

    @unary
    async def ListLeases(self, request, context):
        caller = self.ctx.caller(context)
        leases = None
        if request.lease_id:
            return self.ctx.leases_reply(caller, REPLY_BUDGET, [self._find(request.lease_id)])
        if request.all:
            leases = self.ctx.engine.ledger.recent_leases(min(request.limit or 100, MAX_ENDED_LEASES))
        return self.ctx.leases_reply(caller, REPLY_BUDGET, leases)

    def _find(self, selector: str):
        """The one lease, active or ended, whose id starts with ``selector``."""
        found = self.ctx.engine.ledger.find_lease(selector)
        if not found:
            from xpud.errors import NotFound

            raise NotFound(f"no lease {selector!r} (see `xpu leases --all`)")
        if len(found) > 1 and found[0].id != selector:
            raise BadRequest(f"{selector!r} matches more than one lease: give more of the id")
        lease = found[0]
        return self.ctx.engine.leases.get(lease.id, lease)

    @unary
    async def ListEvents(self, request, context):
        self.ctx.caller(context)
        card = request.card if request.HasField("card") else None
        events = self.ctx.engine.ledger.events(
            min(request.limit or 100, MAX_EVENTS), card=card, lease_id=request.lease_id
        )
        return pb.EventsReply(
            events=fit((convert.event_pb(ev) for ev in events[::-1]), REPLY_BUDGET)[0][::-1]
        )

    @unary
    async def Resize(self, request, context):
        caller = self.ctx.caller(context)
        e = self.ctx.engine
        lease, how = await resize(e, request.lease_id, _mode(request.mode, self.ctx), caller, request.token)
        return pb.ResizeReply(lease=convert.lease_pb(lease, True), how=how)

    @streaming
    async def WatchLease(self, request, context):
        self.ctx.caller(context)
        e = self.ctx.engine
        lease = e.resolve_lease(request.lease_id)  # active leases only
        if e.rightsizer is None:
            raise Unavailable("right-sizing has not started yet: retry in a moment")
        async for load in e.rightsizer.watch(lease.id):
            yield convert.lease_load_pb(load)

    @unary
    async def LeaseUsage(self, request, context):
        self.ctx.caller(context)
        rs = self.ctx.engine.rightsizer
        rows = usage_rows(self.ctx.engine, rs) if rs is not None else []
        return pb.LeaseUsageReply(rows=[convert.usage_row_pb(r) for r in rows])

    @unary
    async def GetTopology(self, request, context):
        self.ctx.caller(context)
        t = self.ctx.engine.topology
        n = t.size
        cells = [(i, j) for i in range(n) for j in range(n)]
        return pb.TopologyReply(
            size=n,
            labels=[t.label(i, j) for i, j in cells],
            levels=[t.levels[i][j] for i, j in cells],
            nvlinks=[t.links(i, j) for i, j in cells],
            bandwidth_gbps=[0.0 if i == j else t.bandwidth_gbps(i, j) for i, j in cells],
            cards=self.ctx.card_msgs(),
        )

    @unary
    async def GetHealth(self, request, context):
        self.ctx.caller(context)
        e = self.ctx.engine
        cards = [e.resolve_card(request.card)] if request.card else [e.cards[i] for i in sorted(e.cards)]
        if self.ctx.health is not None:
            return pb.HealthReply(
                cards=[
                    convert.card_health_pb(self.ctx.health.view(c.info.index, request.history)) for c in cards
                ]
            )
        return pb.HealthReply(
            cards=[
                pb.CardHealth(
                    index=c.info.index, uuid=c.info.uuid, score=c.health_score, state=c.health_state.value
                )
                for c in cards
            ]
        )

    @streaming
    async def Watch(self, request, context):
        caller = self.ctx.caller(context)
        e = self.ctx.engine
        interval = min(max(request.min_interval_s or 1.0, MIN_WATCH_INTERVAL_S), 60.0)  # finite: checked
        loop = asyncio.get_running_loop()
        q = e.watch()
        try:
            recent = e.ledger.events(limit=50)
            events = collections.deque((convert.event_pb(ev) for ev in recent), MAX_WATCH_EVENTS)
            while True:
                cards = self.ctx.cards_reply()
                budget = REPLY_BUDGET - cards.ByteSize() - sum(ev.ByteSize() + 8 for ev in events)
                yield pb.WatchUpdate(
                    cards=cards, leases=self.ctx.leases_reply(caller, budget), events=list(events)
                )
                events.clear()
                deadline = loop.time() + interval
                while (remaining := deadline - loop.time()) > 0:
                    try:
                        ev = await asyncio.wait_for(q.get(), remaining)
                    except TimeoutError:
                        break
                    if ev is not None:
                        events.append(convert.event_pb(ev))
        finally:
            e.unwatch(q)

    @streaming
    async def RunJob(self, request_iterator, context):
        from xpud.federation.jobrun import JobRun

        caller = self.ctx.caller(context)
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("what") != "start":
            raise BadRequest("RunJob: the first message must be start (a JobSpec)")
        if self.ctx.hostjobs is None:
            raise Conflict("this daemon runs no multi-host jobs")
        async for ev in JobRun(self.ctx.hostjobs, self.ctx.federation, first.start, caller).events(
            request_iterator
        ):
            yield ev

    @unary
    async def GetCluster(self, request, context):
        self.ctx.caller(context)
        fed = self.ctx.federation
        if fed is None:
            return pb.ClusterReply(enabled=False)
        return pb.ClusterReply(
            enabled=True,
            name=fed.name,
            hosts=[convert.cluster_host_pb(h, h.name == fed.name) for h in fed.members()],
        )

    @unary
    async def ListAccounts(self, request, context):
        self.ctx.caller(context)
        return accounts_reply(self.ctx.engine.cfg, self.ctx.accounts)

    @unary
    async def Report(self, request, context):
        self.ctx.caller(context)
        return await report(self.ctx, request)


def raise_not_found(lease_id: str):
    from xpud.errors import NotFound

    raise NotFound(f"no active lease {lease_id!r}: it was released or reclaimed (see `xpu leases --all`)")
