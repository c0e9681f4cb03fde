"""A submitted multi-host job whose coordinator does not answer (its daemon is down, or its host): the job
is listed and cancelled from the other hosts through its ranks' records (``xpud.service.gangjobs``).

- **Listed once**: each host that runs (or, with ``--all``, ran) a rank of it whose coordinator is not
  alive in its view shows the job from its ranks' records (``here``): the job's id, its ranks, a state as
  they say (``running`` while any runs), reason ``its coordinator H does not answer``. The host asked
  merges these entries with one another (``merge``) and drops them where the coordinator's own record came.
- **Cancelled**: ``cancel`` asks every host that answers to stop its ranks of the job (``Peer.PeerRanks``
  with ``cancel``, the owner's only), the ranks' reason ``cancelled by uid U ...``; the reply says in one
  line which hosts could not be reached. The coordinator, back, reads that reason from a rank and ends the
  job ``cancelled`` (stopping the ranks still running, its own host's among them).
"""

from __future__ import annotations

import asyncio

import grpc

from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import XpudError
from xpud.ledger import jobs as jobdb
from xpud.model import Caller

HEADLESS = "its coordinator "  # the reason of an entry built from the ranks' records
BAD = (jobdb.FAILED, jobdb.TIMEOUT, jobdb.LOST)
PEER_TIMEOUT_S = 5.0


def _me(ctx) -> str:
    fed = ctx.federation
    return fed.name if fed is not None else ctx.info.hostname


def _alive(ctx) -> set[str]:
    fed = ctx.federation
    if fed is None:
        return {_me(ctx)}
    from xpud.federation.membership import State

    return {m.name for m in fed.members() if m.state == State.ALIVE} | {fed.name}


def _state(ranks) -> str:
    states = [x.state for x in ranks]
    if any(s not in jobdb.ENDED for s in states):
        return jobdb.RUNNING
    bad = [s for s in states if s in BAD]
    if bad:
        return bad[0]
    if all(s == jobdb.COMPLETED for s in states):
        return jobdb.COMPLETED
    return jobdb.CANCELLED


def entry(job: str, records, coordinator: str, full: bool) -> pb.JobRecord:
    """The job ``job`` as its ranks' records ``records`` (JobRecords of one host) show it."""
    import shlex

    first = records[0]
    msg = pb.JobRecord(
        id=job,
        kind=jobdb.MULTI_HOST,
        uid=first.uid,
        gid=first.gid,
        submitted=min(r.submitted for r in records),
        mode=str(first.spec.get("mode", "")),
        gpus=int(first.spec.get("gpus", 0)),
        reason=f"{HEADLESS}{coordinator} does not answer",
    )
    from xpud.service.gangjobs import rank_state

    for r in records:
        s = rank_state(r)
        m = msg.ranks.add(rank=s.rank, host=s.host, state=s.state, job=s.job)
        m.reason = s.reason if full else ""
        for name in ("exit_code", "exit_signal", "ended"):
            if s.HasField(name):
                setattr(m, name, getattr(s, name))
    _settle(msg)
    if full:
        msg.command = shlex.join(first.argv)[:500]
        msg.cwd = first.cwd
    return msg


def _settle(msg: pb.JobRecord) -> None:
    """Its hosts and state from its ranks (by rank; a rank's latest record, when a restart left several)."""
    latest = {}
    for x in sorted(msg.ranks, key=lambda x: (x.rank, x.state not in jobdb.ENDED)):
        latest[x.rank] = x
    ranks = [latest[k] for k in sorted(latest)]
    del msg.ranks[:]
    msg.ranks.extend(ranks)
    msg.hosts[:] = [x.host for x in ranks]
    msg.state = _state(ranks)


def here(ctx, caller: Caller, request) -> list[pb.JobRecord]:
    """This host's entries for the jobs it runs ranks of whose coordinator is not alive in its view."""
    ledger = ctx.engine.ledger
    uid = request.uid if request.HasField("uid") else None
    alive = _alive(ctx)
    out = []
    for job, coordinator in jobdb.rank_jobs(ledger, request.all or bool(request.state), uid):
        if not coordinator or coordinator in alive:
            continue  # listed by its coordinator (or placed by a daemon that did not record it)
        records = [r for r in jobdb.ranks_of(ledger, job) if r.submitted >= request.since]
        if not records:
            continue
        msg = entry(job, records, coordinator, caller.admin or caller.uid == records[0].uid)
        if not request.state or msg.state == request.state:
            out.append(msg)
    return out


def merge(msgs: list[pb.JobRecord]) -> list[pb.JobRecord]:
    """One entry per job: the coordinator's record where it came, else the hosts' entries merged."""
    real = {m.id for m in msgs if not m.reason.startswith(HEADLESS) or m.kind != jobdb.MULTI_HOST}
    out, seen = [], {}
    for m in msgs:
        headless = m.kind == jobdb.MULTI_HOST and m.reason.startswith(HEADLESS)
        if not headless:
            out.append(m)
        elif m.id in real:
            continue
        elif m.id in seen:
            seen[m.id].ranks.extend(m.ranks)
            _settle(seen[m.id])
        else:
            seen[m.id] = m
            out.append(m)
    return out


async def cancel(ctx, peers: list, caller: Caller, job: str) -> pb.JobRecord | None:
    """Stop the ranks of ``job`` (a whole id) here and on ``peers`` (the alive members); None when no host
    has one."""
    from xpud.api.v1 import xpu_pb2_grpc as pbg
    from xpud.service.gangjobs import ranks_here

    me = _me(ctx)
    records = jobdb.ranks_of(ctx.engine.ledger, job)
    why = f"cancelled by uid {caller.uid} from host {me} while its coordinator did not answer"
    req = pb.PeerJobsRequest(uid=caller.uid, jobs=[job], cancel=True, reason=why)

    async def one(m):
        try:
            return await pbg.PeerStub(ctx.federation.channel(m.addr)).PeerRanks(req, timeout=PEER_TIMEOUT_S)
        except grpc.RpcError as e:
            return e

    try:
        mine = await ranks_here(ctx, req)
    except XpudError:
        mine = pb.PeerRanksReply()
    replies = await asyncio.gather(*(one(m) for m in peers))
    ranks = list(mine.ranks)
    unreached = set()
    for m, reply in zip(peers, replies, strict=True):
        if isinstance(reply, grpc.RpcError):
            unreached.add(m.name)
        else:
            ranks += reply.ranks
    if not ranks:
        return None
    coordinator = str(records[0].spec.get("coordinator", "")) if records else ""
    fed = ctx.federation
    if fed is not None:
        from xpud.federation.membership import State

        unreached |= {m.name for m in fed.members() if m.state in (State.SUSPECT, State.DEAD)}
    if coordinator and coordinator not in _alive(ctx):
        unreached.add(coordinator)
    unreached.discard(me)
    msg = pb.JobRecord(id=job, kind=jobdb.MULTI_HOST, uid=caller.uid)
    for s in ranks:
        m = msg.ranks.add(rank=s.rank, host=s.host, state=s.state, job=s.job, reason=s.reason)
        for name in ("exit_code", "exit_signal", "ended"):
            if s.HasField(name):
                setattr(m, name, getattr(s, name))
    _settle(msg)
    reached = ", ".join(sorted({x.host for x in msg.ranks})) or "none"
    msg.reason = (
        f"{HEADLESS}{coordinator or '(unknown)'} does not answer: its ranks on {reached} are stopped; "
        f"hosts not reached: {', '.join(sorted(unreached)) or 'none'} (its coordinator ends the job "
        "cancelled when it is back)"
    )
    return msg
