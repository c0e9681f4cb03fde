"""gRPC servicers: short methods that check the caller, convert messages and call the engine.

Errors cross the wire as status codes from one table (each ``XpudError`` class has its code); anything
unexpected is logged and answered INTERNAL, so the daemon never dies on a bad request.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc import aio

from xpud.api import convert, validate
from xpud.api.auth import METADATA_KEY, CredentialIssuer, member_of
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.controllers.rightsizer import resize, usage_rows
from xpud.engine.engine import Engine
from xpud.errors import BadRequest, Conflict, Forbidden, Unavailable, XpudError
from xpud.isolation.scope import ScopeError, process_uid
from xpud.model import Caller, CommandEnd, Mode, QueuedRequest, Request
from xpud.planning import green as carbon
from xpud.planning.usage import job_class
from xpud.service.accounts import accounts_reply, charge, report

log = logging.getLogger("xpud.service.node")


def _status(e: XpudError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNKNOWN)


def _detail(e: XpudError) -> str:
    """The error's message, bounded (status details travel in HTTP/2 headers, which have a size limit)."""
    return validate.clip(str(e), 1000)


def add_to_server(servicer: Any, server: aio.Server) -> None:
    """Register ``servicer`` (a Node, Admin or Peer servicer) on ``server``, as the generated
    ``add_*Servicer_to_server`` does, but with deserializers that let a corrupt message be refused with
    INVALID_ARGUMENT (``validate.tolerant``) instead of UNKNOWN and a traceback.

    As a generic handler only, not also as registered methods (the generated code does both): grpc.aio's
    server keeps one pending request per registered method and waits on all of them
    (``asyncio.wait``) for every call it accepts, a callback added and removed on each of the 17 futures
    per call; generic only, it waits on one (-4 % of the daemon's instructions per grant+release cycle,
    ``bench/instructions.py``)."""
    if isinstance(servicer, pbg.AdminServicer):
        name = "Admin"
    elif isinstance(servicer, pbg.PeerServicer):
        name = "Peer"
    else:
        name = "Node"
    service = pb.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for m in service.methods:
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = kind(
            getattr(servicer, m.name),
            request_deserializer=validate.tolerant(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def unary(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            validate.check(request)
            return await fn(self, request, context)
        except aio.AbortError:
            raise
        except XpudError as e:
            await context.abort(_status(e), _detail(e))
        except Exception:
            log.exception("%s failed", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}; see the daemon log"
            )

    return wrapper


def streaming(fn: Callable) -> Callable:
    """A server-streaming method; for a client stream too (``request`` an async iterator), each message is
    checked as it arrives."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            if isinstance(request, _ONE_MESSAGE):  # (not hasattr: a message raises inside it, ~1 us)
                validate.check(request)
            else:
                request = _checked(request)
            async for item in fn(self, request, context):
                yield item
        except aio.AbortError:
            raise
        except XpudError as e:
            await context.abort(_status(e), _detail(e))
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            log.exception("%s failed", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}; see the daemon log"
            )

    return wrapper


_ONE_MESSAGE = (Message, validate.Undecodable)  # what a server-streaming method's request is


async def _checked(requests):
    async for req in requests:
        validate.check(req)  # raises BadRequest: the stream ends with INVALID_ARGUMENT
        yield req


@dataclass
class Context:
    """What the servicers share: the engine, the credential issuer and facts about this daemon."""

    engine: Engine
    issuer: CredentialIssuer
    info: dict[str, Any]
    fake: Any = None  # the simulated NVML (fault injection is refused without it)
    health: Any = None  # the health monitor, when running
    defrag: Any = None  # xpud.controllers.defragmenter.Defragmenter
    federation: Any = None  # xpud.federation.node.Federation, when [cluster] is configured
    extras: dict[str, Any] = field(default_factory=dict)
    # lease id -> (the active Lease, its message as Acquire answered it): its Release answers a copy
    granted: dict[str, tuple[Any, pb.Lease]] = field(default_factory=dict)

    def remember_grant(self, lease, msg: pb.Lease) -> None:
        """Keep the message of a lease just granted (``lease_pb(lease, True)``): its release answers a copy
        of it with the end's fields, one Lease message built per grant+release instead of two. Leases
        ended otherwise (reclaimed, evicted) are dropped whenever the table has doubled."""
        kept = self.granted
        if len(kept) >= 2 * len(self.engine.leases) + 64:
            leases = self.engine.leases
            self.granted = kept = {k: v for k, v in kept.items() if leases.get(k) is v[0]}
        kept[lease.id] = (lease, msg)

    def ended_msg(self, msg: pb.Lease, active, ended) -> None:
        """Fill ``msg`` (empty) with ``lease_pb(ended, True)``; ``active``: the lease object that was
        ended (``ended`` is its copy with the end's fields). From the grant's message when it was made
        from that very object (a Lease is frozen: a move or a restart count makes a new one)."""
        kept = self.granted.pop(ended.id, None)
        if kept is None or active is None or kept[0] is not active:
            msg.CopyFrom(convert.lease_pb(ended, True))
            return
        msg.CopyFrom(kept[1])
        convert.end_lease_pb(msg, ended)

    def caller(self, context: aio.ServicerContext) -> Caller:
        md = dict(context.invocation_metadata() or ())
        return self.issuer.check(md.get(METADATA_KEY))

    def card_msgs(self) -> list[pb.Card]:
        e = self.engine
        return [convert.card_pb(v, e.isolation_name(v.info.index)) for v in e.card_views()]

    def cards_reply(self) -> pb.ListCardsReply:
        return convert.cards_reply(self.card_msgs(), self.info["hostname"], self.engine.cfg.slices)

    def leases_reply(self, caller: Caller, budget: int, leases: list | None = None) -> pb.ListLeasesReply:
        """Leases (active ones unless given) then the queue, as many as fit in ``budget`` bytes; the reply
        counts what it left out, so no listing can outgrow gRPC's message limit."""
        e = self.engine
        leases = e.lease_list() if leases is None else leases
        lease_msgs = (
            convert.lease_pb(le, caller.admin or caller.uid == le.owner_uid, e.is_held(le.id))
            for le in leases
        )
        kept, budget = _fit(lease_msgs, budget)
        queue = e.queue_view()
        queued, _ = _fit((convert.queue_pb(q) for q in queue), budget)
        return pb.ListLeasesReply(
            leases=kept,
            queue=queued,
            leases_omitted=len(leases) - len(kept),
            queue_omitted=len(queue) - len(queued),
        )


REPLY_BUDGET = 3 * 1024 * 1024  # bytes per reply: gRPC refuses messages over 4 MiB unless told otherwise
MAX_ENDED_LEASES = 1000  # `ListLeases(all)` lists at most this many
MAX_EVENTS = 10_000  # `ListEvents` lists at most this many
MAX_WATCH_EVENTS = 200  # a Watch update carries at most the latest this many events
MIN_WATCH_INTERVAL_S = 0.1


def _fit(msgs, budget: int) -> tuple[list, int]:
    """The leading messages of ``msgs`` whose encoded sizes fit in ``budget`` bytes; and what is left."""
    kept = []
    for m in msgs:
        size = m.ByteSize() + 8  # + the field's tag and length
        if size > budget:
            break
        kept.append(m)
        budget -= size
    return kept, budget


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
    signal = ctx.extras.get("carbon")
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
            **self.ctx.info,
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
        account = charge(e.cfg, caller, request.account, owner, request.anchor)
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
        scopes = self.ctx.extras.get("scopes")
        if scopes is not None:  # what escaped the command's process group ends too, once the holder has left
            scopes.end_later(ended.id)
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
        scopes = self.ctx.extras.get("scopes")
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
        scopes = self.ctx.extras.get("scopes")
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
            events=_fit((convert.event_pb(ev) for ev in events[::-1]), REPLY_BUDGET)[0][::-1]
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
        daemon = self.ctx.extras.get("daemon")
        if daemon is None or getattr(daemon, "hostjobs", None) is None:
            raise Conflict("this daemon runs no multi-host jobs")
        async for ev in JobRun(daemon, first.start, caller).events(request_iterator):
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
        daemon = self.ctx.extras.get("daemon")
        return accounts_reply(self.ctx.engine.cfg, getattr(daemon, "accounts", None))

    @unary
    async def Report(self, request, context):
        self.ctx.caller(context)
        return await report(self.ctx, request)


def raise_not_found(lease_id: str):
    from xpud.errors import NotFound

    raise NotFound(f"no active lease {lease_id!r}: it was released or reclaimed (see `xpu leases --all`)")


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
