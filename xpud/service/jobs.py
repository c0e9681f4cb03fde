"""Jobs on the wire: ``SubmitJob``, ``ListJobs``, ``CancelJobs``, ``JobLogs`` (mixed into NodeService).

Detached jobs are ``xpud.jobs.book.JobBook``'s; an attached ``xpu run`` is its lease, shown as a job with
the lease's id (``kind`` attached). The caller is who the credential handshake proved (SO_PEERCRED): a job
is cancelled, waited on and read by its owner or an operator only.
"""

from __future__ import annotations

import asyncio
import os

import grpc

from xpud.api import convert
from xpud.api.server import streaming, unary
from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import BadRequest, Conflict, Forbidden, NotFound, Unavailable
from xpud.ledger import jobs as jobdb
from xpud.ledger.jobs import JobRecord
from xpud.model import Caller, Mode, Request
from xpud.service import headless, node
from xpud.service.accounts import charge
from xpud.service.context import REPLY_BUDGET
from xpud.service.context import fit as _fit
from xpud.service.jobrecords import attached, queued_run, record_unserved  # noqa: F401 (re-exported)

CHUNK = 64 * 1024
FOLLOW_POLL_S = 0.2
MAX_JOBS = 1000  # a listing holds at most this many (and what fits in REPLY_BUDGET)
PEER_TIMEOUT_S = 5.0  # a peer's answer about its jobs


class JobsHandlers:
    """The jobs' RPCs; needs ``self.ctx`` (``xpud.service.node.Context``) with ``jobs`` (the JobBook)."""

    def _book(self):
        book = self.ctx.jobs
        if book is None:
            raise Conflict("this daemon runs no detached jobs yet: retry in a moment")
        return book

    def _job(self, selector: str, caller: Caller) -> JobRecord:
        """The job ``selector`` names: a detached one, else an attached run by its lease id."""
        try:
            return self._book().resolve(selector, caller)
        except NotFound:
            found = self.ctx.engine.ledger.find_lease(selector)
            found = [le for le in found if not le.anchor]
            if not found:
                w = self._waiter(selector)
                if w is None:
                    return self._run_named(selector, caller)
                r = queued_run(w)
                if not (caller.admin or caller.uid == r.uid):
                    raise Forbidden(
                        f"job {r.id} belongs to uid {r.uid}: only its owner or an operator"
                    ) from None
                return r
            if len(found) > 1 and found[0].id != selector:
                raise BadRequest(f"{selector!r} matches more than one lease: give more of the id") from None
            lease = self.ctx.engine.leases.get(found[0].id, found[0])
            r = attached(lease)
            if not (caller.admin or caller.uid == r.uid):
                raise Forbidden(f"job {r.id} belongs to uid {r.uid}: only its owner or an operator") from None
            return r

    def _run_named(self, name: str, caller: Caller) -> JobRecord:
        """The caller's one running or queued `xpu run` named ``name``. Raises NotFound, or BadRequest
        listing them when several have it."""
        e = self.ctx.engine
        own = (lambda uid: True) if caller.admin else (lambda uid: uid == caller.uid)
        found = [
            attached(le) for le in e.lease_list() if not le.anchor and le.name == name and own(le.owner_uid)
        ]
        found += [
            queued_run(w)
            for w in e.waitlist
            if not w.request.anchor and w.request.name == name and own(w.request.owner_uid)
        ]
        if not found:
            raise NotFound(f"no job {name!r} (see `xpu jobs --all`)")
        if len(found) > 1:
            listed = ", ".join(f"{r.id} ({r.state})" for r in found[:10])
            raise BadRequest(f"{name!r} names {len(found)} jobs: {listed}; give one id")
        return found[0]

    def _waiter(self, ticket: str):
        """The queued `xpu run` with this ticket (a whole one), or None."""
        return next(
            (w for w in self.ctx.engine.waitlist if w.ticket == ticket and not w.request.anchor), None
        )

    @unary
    async def SubmitJob(self, request, context):
        caller = self.ctx.caller(context)
        e = self.ctx.engine
        try:
            mode = Mode(request.mode or "xpu")
        except ValueError:
            raise BadRequest(
                f"mode {request.mode!r}: use one of {', '.join(['xpu', *e.cfg.slices])}"
            ) from None
        leases = e.cfg.leases
        wait_s = request.wait_s if request.HasField("wait_s") else leases.max_wait_s
        # as for `xpu run --account`: with accounts configured the user database is read off the loop
        charging = (e.cfg, caller, request.account, caller.uid)
        account = await asyncio.to_thread(charge, *charging) if e.cfg.named_accounts else charge(*charging)
        here, remote = await self._resolve_after(caller, list(request.after))
        if request.nodes or request.replicas or request.gpus_per_node or request.tasks_per_node:
            if self.ctx.gang is None:
                raise Conflict("this daemon runs no multi-host jobs yet: retry in a moment")
            if remote:
                raise BadRequest(
                    f"--after {remote[0][0]}: a job of host {remote[0][1]}; a multi-host job waits only on "
                    "jobs of the host it is submitted to for now: submit it there"
                )
            r = await self.ctx.gang.submit(caller, request, wait_s, account)
            return pb.SubmitJobReply(job=convert.job_pb(r, True))
        r = await self._book().submit(
            caller,
            list(request.argv),
            request.cwd,
            dict(request.env),
            Request(
                mode=mode,
                gpus=request.gpus or 1,
                priority=request.priority,
                wait_s=wait_s,
                owner_uid=caller.uid,
                restartable=request.restartable,
                account=account,
            ),
            name=request.name,
            output=request.output,
            error=request.error,
            time_limit_s=request.time_limit_s,
            after=here,
            kill_grace_s=request.kill_grace_s,
            remote_after=remote,
        )
        return pb.SubmitJobReply(job=convert.job_pb(r, True))

    async def _resolve_after(self, caller: Caller, selectors: list[str]) -> tuple[list[str], list]:
        """``--after``'s jobs: those of this host (as given), and (job id, host) of the ones that live on
        another host of the cluster. Raises NotFound, or BadRequest when one names several jobs."""
        here, remote = [], []
        for sel in selectors:
            try:
                self._book().resolve(sel, caller)
                here.append(sel)
                continue
            except NotFound:
                if not self._peers():
                    raise
            remote.append(await self._after_on_peers(caller, sel))
        return here, remote

    async def _after_on_peers(self, caller: Caller, selector: str) -> tuple[str, str]:
        """(job id, host) of the one job ``selector`` names on the other hosts."""
        from xpud.api.client import to_error

        asked = pb.PeerJobsRequest(uid=caller.uid, list=pb.ListJobsRequest(job=selector, here=True))
        found, silent = [], []
        peers = self._peers()
        for m, reply in zip(peers, await self._ask_peers("PeerListJobs", asked, peers), strict=True):
            if not isinstance(reply, grpc.RpcError):
                found += [(j.id, m.name, j.state) for j in reply.jobs]
            elif reply.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                silent.append(m.name)
            elif reply.code() != grpc.StatusCode.NOT_FOUND:
                e = to_error(reply, f"host {m.name}")
                raise type(e)(f"--after {selector}: host {m.name}: {e}") from None
        if len(found) > 1:
            listed = ", ".join(f"{j} on {h} ({st})" for j, h, st in found[:10])
            raise BadRequest(f"--after {selector!r} names {len(found)} jobs: {listed}; give one id")
        if not found:
            unasked = f" (host {', '.join(silent)} did not answer)" if silent else ""
            raise NotFound(f"no job {selector!r} on any host of the cluster{unasked} (see `xpu jobs --all`)")
        return found[0][0], found[0][1]

    async def peer_job_state(self, host: str, job_id: str, uid: int) -> str | None:
        """The state of job ``job_id`` (as uid ``uid`` sees it) on the cluster's host ``host``; None when
        that host has no such job. Raises Unavailable when the host is not alive or does not answer."""
        from xpud.api.client import to_error

        fed = self.ctx.federation
        if fed is None:
            raise Unavailable("this daemon does not federate with other hosts now")
        member = next((m for m in fed.members() if m.name == host), None)
        from xpud.federation.membership import State

        if member is None or member.name == fed.name or member.state != State.ALIVE:
            raise Unavailable(f"host {host} is {'not a member' if member is None else member.state} now")
        asked = pb.PeerJobsRequest(uid=uid, list=pb.ListJobsRequest(job=job_id, here=True))
        try:
            reply = await self._stub(member).PeerListJobs(asked, timeout=PEER_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise Unavailable(str(to_error(e, f"host {host}"))) from None
        found = [j.state for j in reply.jobs if j.id == job_id]
        return found[0] if found else None

    @streaming
    async def RunJob(self, request_iterator, context):
        """``NodeService.RunJob`` (a job across hosts), recorded as one job: queued at its first event,
        running with its hosts once placed, ended as its ``JobEnded`` says (or cancelled: its caller went
        away first). Its id is the multi-host job's."""
        from xpud.federation.jobrun import JobRun

        caller = self.ctx.caller(context)
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("what") != "start":
            raise BadRequest("RunJob: the first message must be start (a JobSpec)")
        if self.ctx.hostjobs is None:
            raise Conflict("this daemon runs no multi-host jobs")
        s, ledger, clock = first.start, self.ctx.engine.ledger, self.ctx.engine.clock
        run = JobRun(self.ctx.hostjobs, self.ctx.federation, s, caller)
        r, ended = None, None
        live = self.ctx.multi_host  # job id -> [JobRun, its task, its record]
        entry = live[run.job] = [run, asyncio.current_task(), None]
        try:
            async for ev in run.events(request_iterator):
                what = ev.WhichOneof("what")
                if r is None:  # checked: on record from now
                    r = JobRecord(
                        id=run.job,
                        uid=caller.uid,
                        gid=caller.gid,
                        state=jobdb.QUEUED,
                        submitted=clock(),
                        kind=jobdb.MULTI_HOST,
                        name=s.name,
                        cwd=s.cwd,
                        argv=list(s.argv),
                        spec={
                            "mode": s.mode or "xpu",
                            "gpus": s.gpus_per_node or (0 if s.replicas else 1),
                            "account": run.account,
                        },
                    )
                    entry[2] = r
                    await ledger.write(jobdb.save_job_op(r))
                if what == "placed":
                    r.state, r.started = jobdb.RUNNING, r.started or clock()
                    r.hosts = sorted({x.host for x in ev.placed.ranks})
                    await ledger.write(jobdb.save_job_op(r))
                elif what == "ended":
                    ended = ev.ended
                yield ev
        finally:
            live.pop(run.job, None)
            if r is not None:
                if r.reason.startswith("cancelled by"):
                    r.state = jobdb.CANCELLED
                    if ended is not None:
                        r.exit_code = ended.exit_code
                elif ended is not None:
                    r.state = jobdb.COMPLETED if ended.exit_code == 0 else jobdb.FAILED
                    r.exit_code, r.reason = ended.exit_code, ended.reason
                else:
                    r.state, r.reason = jobdb.CANCELLED, "its `xpu run` went away before the job ended"
                r.ended = clock()
                ledger.submit(jobdb.save_job_op(r))  # not awaited: the caller may be gone

    # ---------------------------------------------------------------- the core, for local and peer callers
    def _here(self, caller: Caller, request) -> list[pb.JobRecord]:
        """This host's jobs that ``request`` (a ListJobsRequest) asks for, as messages."""
        if request.job:
            return self._waiting_why([convert.job_pb(self._job(request.job, caller), True)])
        uid = request.uid if request.HasField("uid") else None
        limit = min(request.limit or MAX_JOBS, MAX_JOBS)
        found = jobdb.jobs(self.ctx.engine.ledger, request.all, uid, request.state, request.since, limit)
        e = self.ctx.engine
        leases = e.ledger.recent_leases(limit) if request.all else e.lease_list()
        host = self.ctx.info.hostname
        for le in leases:
            if le.anchor or (uid is not None and le.owner_uid != uid) or le.created < request.since:
                continue
            r = attached(e.leases.get(le.id, le))
            r.hosts = [self.ctx.federation.name if self.ctx.federation else host]
            if not request.state or r.state == request.state:
                found.append(r)
        if not request.state or request.state == jobdb.QUEUED:
            for w in e.waitlist:
                mine = uid is None or w.request.owner_uid == uid
                if not w.request.anchor and mine and w.enqueued >= request.since:
                    r = queued_run(w)
                    r.hosts = [self.ctx.federation.name if self.ctx.federation else host]
                    found.append(r)
        found.sort(key=lambda r: r.submitted, reverse=True)
        msgs = self._waiting_why(
            [convert.job_pb(r, caller.admin or caller.uid == r.uid) for r in found[:limit]]
        )
        if self.ctx.federation is not None:  # multi-host jobs whose coordinator is down, from their ranks
            msgs += headless.here(self.ctx, caller, request)
        return msgs

    def _waiting_why(self, msgs: list[pb.JobRecord]) -> list[pb.JobRecord]:
        """A detached job waiting for cards shows why as the queue has it now (``Fairshare: nlp over its
        share``, ``AccountLimit: ...``), not the record's ``Resources``."""
        why = {w.request.anchor: w.reason for w in self.ctx.engine.waitlist if w.request.anchor}
        for m in msgs:
            if m.state == jobdb.QUEUED and why.get(f"job:{m.id}"):
                m.reason = why[f"job:{m.id}"][:500]
        return msgs

    async def _cancel_here(self, caller: Caller, selectors) -> list[pb.JobRecord]:
        targets = [self._job(sel, caller) for sel in selectors]  # all found first: a bad one cancels none
        out = []
        for r in targets:
            if r.kind == jobdb.MULTI_HOST and r.spec.get("detached") and not r.done:
                if self.ctx.gang is None:
                    raise Conflict(f"job {r.id} is {r.state}: this daemon's multi-host jobs are not up yet")
                r = await self.ctx.gang.cancel(r, caller)
            elif r.kind == jobdb.MULTI_HOST and not r.done:
                run, task, record = self.ctx.multi_host.get(r.id, (None, None, None))
                if run is None or record is None:
                    raise Conflict(f"job {r.id} is {r.state} but not coordinated by this daemon any more")
                r = record
                r.reason = f"cancelled by uid {caller.uid}"
                await self.ctx.engine.ledger.write(jobdb.save_job_op(r))
                if not run.cancel():
                    task.cancel()  # still queued or being placed: its call ends, nothing started
            elif r.kind == jobdb.ATTACHED and r.state == jobdb.QUEUED:
                w = self._waiter(r.id)
                if w is not None and not w.future.done():  # its `xpu run` hears why and exits 1
                    w.future.set_exception(Conflict(f"cancelled by uid {caller.uid} while queued"))
                r.state, r.reason = jobdb.CANCELLED, f"cancelled by uid {caller.uid} while queued"
            elif r.kind == jobdb.ATTACHED:
                if r.state == jobdb.RUNNING:
                    await self.ctx.engine.evict(r.lease_id, f"cancelled by uid {caller.uid}")
                    r = attached(self.ctx.engine.ledger.find_lease(r.lease_id)[0])
            else:
                r = await self._book().cancel(r, caller)
            out.append(convert.job_pb(r, True))
        return out

    async def _logs_here(self, caller: Caller, request):
        if request.rank < 0:
            raise BadRequest(f"--rank {request.rank}: give a rank from 0")
        try:
            r = self._job(request.job, caller)
        except NotFound:
            rank = self._rank_here(request, caller)  # a rank of a job placed by another host
            if rank is None:
                raise
            r = rank
        if r.kind == jobdb.MULTI_HOST and r.spec.get("detached"):
            async for chunk in self._rank_logs(caller, r, request):
                yield chunk
            return
        if r.kind == jobdb.MULTI_HOST:
            raise BadRequest(
                f"job {r.id} is a multi-host `xpu run`: every rank's output went to that run's terminal, "
                "not to a file; `xpu logs` reads the files of `xpu submit` jobs"
            )
        if r.kind != jobdb.DETACHED:
            raise BadRequest(
                f"job {r.id} is an `xpu run`: its output went to its terminal, not to a file; "
                "`xpu logs` reads the files of `xpu submit` jobs"
            )
        if request.rank and "cluster_job" not in r.spec:
            raise BadRequest(f"job {r.id} is a one-host `xpu submit` job: its only rank is 0 (drop --rank)")
        async for chunk in self._file(r, request):
            yield chunk

    def _rank_here(self, request, caller: Caller) -> JobRecord | None:
        """This host's rank ``request.rank`` of the submitted multi-host job ``request.job`` (a whole id),
        the caller's; None if none is here."""
        book = self._book()
        for r in jobdb.ranks_of(book.ledger, request.job):
            if r.spec.get("rank") == request.rank and (caller.admin or caller.uid == r.uid):
                return r
        return None

    async def _rank_logs(self, caller: Caller, r: JobRecord, request):
        """A submitted multi-host job's rank's file, from this host or the rank's (over the peer channel),
        following it as it grows with ``follow``."""
        gang = self.ctx.gang
        while True:
            live = (gang.record(r.id) if gang is not None else None) or self._book().get(r.id) or r
            try:
                entry = gang.rank_entry(live, request.rank) if gang is not None else None
            except NotFound:
                if not request.follow or live.done:
                    raise
                await asyncio.sleep(FOLLOW_POLL_S)  # queued: its ranks start once it is placed
                continue
            break
        if entry is None:
            raise Conflict(f"job {r.id}: this daemon's multi-host jobs are not up yet")
        asked = pb.JobLogsRequest()
        asked.CopyFrom(request)
        asked.job = r.id
        if entry["host"] == gang.me:
            rank = self._rank_here(asked, caller)
            if rank is None:
                raise NotFound(f"job {r.id} rank {request.rank}: no record of it on this host")
            async for chunk in self._file(rank, asked):
                yield chunk
            return
        from xpud.api.client import to_error

        member = next((m for m in self._peers() if m.name == entry["host"]), None)
        if member is None:
            raise NotFound(f"job {r.id} rank {request.rank}: its host {entry['host']} is not alive")
        call = self._stub(member).PeerJobLogs(pb.PeerJobsRequest(uid=r.uid, logs=asked))
        try:
            async for chunk in call:
                yield chunk
        except grpc.RpcError as e:
            raise to_error(e, member.name) from None

    async def _file(self, r: JobRecord, request):
        """``r``'s output (or --error) file, followed until ``r`` ends with ``request.follow``."""
        path = r.spec.get("error") if request.error else r.spec.get("output")
        if not path:
            raise BadRequest(f"job {r.id} has no separate --error file: its errors are in its output")
        book = self._book()
        f, offset = None, 0
        try:
            while True:
                current = book.get(r.id) or r
                done = current.done  # read before the file: what it wrote before its end is sent
                if f is None:
                    f = await asyncio.to_thread(_open_owned, path, r.uid)
                while f is not None and (data := await asyncio.to_thread(os.pread, f, CHUNK, offset)):
                    offset += len(data)
                    yield pb.JobLogChunk(data=data)
                if done or not request.follow:
                    break
                await asyncio.sleep(FOLLOW_POLL_S)
        finally:
            if f is not None:
                os.close(f)
        if f is None and current.state != jobdb.QUEUED:
            raise NotFound(f"job {r.id}: no output file {path} (not written yet, gone, or not the owner's)")

    # ---------------------------------------------------------------- the other hosts
    def _peers(self) -> list:
        fed = self.ctx.federation
        if fed is None:
            return []
        from xpud.federation.membership import State

        return [m for m in fed.members() if m.name != fed.name and m.state == State.ALIVE]

    def _stub(self, member):
        from xpud.api.v1 import xpu_pb2_grpc as pbg

        return pbg.PeerStub(self.ctx.federation.channel(member.addr))

    async def _ask_peers(self, method: str, request, peers: list | None = None) -> list:
        """``method``'s replies from every alive peer (or ``peers``), in their order: a reply, or the
        RpcError of one that failed or was slow."""

        async def one(m):
            try:
                return await getattr(self._stub(m), method)(request, timeout=PEER_TIMEOUT_S)
            except grpc.RpcError as e:
                return e

        return await asyncio.gather(*(one(m) for m in (self._peers() if peers is None else peers)))

    async def _on_a_peer(self, method: str, request, selector: str):
        """The first peer's answer that is not "no such job" (the job lives on one host)."""
        from xpud.api.client import to_error

        for reply in await self._ask_peers(method, request):
            if not isinstance(reply, grpc.RpcError):
                return reply
            if reply.code() != grpc.StatusCode.NOT_FOUND and reply.code() != grpc.StatusCode.UNAVAILABLE:
                raise to_error(reply, "a peer")
        raise NotFound(f"no job {selector!r} on any host of the cluster (see `xpu jobs --all`)")

    # ---------------------------------------------------------------- the RPCs
    @unary
    async def ListJobs(self, request, context):
        caller = self.ctx.caller(context)
        try:
            msgs = self._here(caller, request)
        except NotFound:
            if request.here or not self._peers():
                raise
            msgs = None
        if msgs is None:  # one job by id or name, not here: ask the others
            asked = pb.ListJobsRequest()
            asked.CopyFrom(request)
            asked.here = True
            reply = await self._on_a_peer(
                "PeerListJobs", pb.PeerJobsRequest(uid=caller.uid, list=asked), request.job
            )
            return reply
        if not request.here and not request.job and self._peers():
            asked = pb.ListJobsRequest()
            asked.CopyFrom(request)
            asked.here = True
            for reply in await self._ask_peers(
                "PeerListJobs", pb.PeerJobsRequest(uid=caller.uid, list=asked)
            ):
                if not isinstance(reply, grpc.RpcError):
                    msgs.extend(reply.jobs)
            msgs = headless.merge(msgs)  # a job whose coordinator is down: once, from all its ranks
            msgs.sort(key=lambda j: j.submitted, reverse=True)
        limit = min(request.limit or MAX_JOBS, MAX_JOBS)  # the cluster's newest, as on one host
        kept, _ = _fit(msgs[:limit], REPLY_BUDGET)
        return pb.ListJobsReply(jobs=kept, omitted=len(msgs) - len(kept))

    @unary
    async def CancelJobs(self, request, context):
        caller = self.ctx.caller(context)
        if not request.jobs:
            raise BadRequest("name a job to cancel: `xpu cancel JOB|NAME ...`")
        out = []
        for sel in request.jobs:
            try:
                out += await self._cancel_here(caller, [sel])
            except NotFound as e:
                missing = e
            else:
                continue
            try:
                if not self._peers():
                    raise missing
                reply = await self._on_a_peer(
                    "PeerCancelJobs", pb.PeerJobsRequest(uid=caller.uid, jobs=[sel]), sel
                )
                out += reply.jobs
            except NotFound:  # a multi-host job whose coordinator is down: its ranks here and there
                msg = (
                    await headless.cancel(self.ctx, self._peers(), caller, sel)
                    if self.ctx.federation
                    else None
                )
                if msg is None:
                    raise
                out.append(msg)
        return pb.CancelJobsReply(jobs=out)

    @streaming
    async def JobLogs(self, request, context):
        caller = self.ctx.caller(context)
        try:
            self._job(request.job, caller)
        except NotFound:
            if not self._peers():
                raise
            async for chunk in self._logs_from_a_peer(caller, request):
                yield chunk
            return
        async for chunk in self._logs_here(caller, request):
            yield chunk

    async def _logs_from_a_peer(self, caller: Caller, request):
        from xpud.api.client import to_error

        for m in self._peers():
            call = self._stub(m).PeerJobLogs(pb.PeerJobsRequest(uid=caller.uid, logs=request))
            try:
                async for chunk in call:
                    yield chunk
                return
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    raise to_error(e, m.name) from None
        raise NotFound(f"no job {request.job!r} on any host of the cluster (see `xpu jobs --all`)")


class PeerJobs:
    """What the other hosts ask of this one's jobs (``Peer.PeerListJobs`` ...): their caller acts as its
    uid, never as an operator."""

    def __init__(self, handlers: JobsHandlers):
        self.handlers = handlers

    async def list(self, request) -> pb.ListJobsReply:
        msgs = self.handlers._here(Caller(uid=request.uid), request.list)
        kept, _ = _fit(msgs, REPLY_BUDGET)
        return pb.ListJobsReply(jobs=kept, omitted=len(msgs) - len(kept))

    async def cancel(self, request) -> pb.CancelJobsReply:
        return pb.CancelJobsReply(
            jobs=await self.handlers._cancel_here(Caller(uid=request.uid), request.jobs)
        )

    def logs(self, request):
        return self.handlers._logs_here(Caller(uid=request.uid), request.logs)

    async def start_rank(self, spec, peer: str) -> pb.JobRankState:
        from xpud.service import gangjobs

        return await gangjobs.start_rank(self.handlers.ctx, spec, peer)

    async def ranks(self, request) -> pb.PeerRanksReply:
        from xpud.service import gangjobs

        return await gangjobs.ranks_here(self.handlers.ctx, request)


class NodeService(JobsHandlers, node.NodeService):
    """The user socket's Node service with the jobs' RPCs."""


def _open_owned(path: str, uid: int) -> int | None:
    """An fd of ``path`` for reading when the file is the job owner's (the job created it as that user),
    else None: a file swapped for a link to another's file is never read for the owner."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    st = os.fstat(fd)
    if os.geteuid() == 0 and st.st_uid != uid:
        os.close(fd)
        return None
    return fd
