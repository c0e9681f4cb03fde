"""Submitted multi-host jobs (``xpu submit --nodes N --gpus-per-node G`` / ``--replicas R --spread``): one
job id, one record, on the host that placed it; each rank a detached job of its own host.

**The coordinator** (``Gang``, on the submitting host) records the job ``queued`` (kind ``multi-host``,
``spec.detached``), waits for its ``--after`` jobs, then places, reserves and commits it as
``Node.RunJob`` does (``federation.jobrun.JobRun.place``: same placement, same queue), records it
``running`` with its hosts and ranks, and asks every host to start its rank (``Peer.StartRank``) with the
rank's environment (``launch.rank_envs``: ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` ...).
It then reads the ranks' states (``Peer.PeerRanks``) every ``POLL_S``; with ``kill_on_bad_exit`` (the
default, as ``xpu run --nodes``) the first rank that fails stops the others. The job ends ``completed``
when every rank exited 0; else as its first failing rank (its exit code or signal; ``timeout``; ``lost``
when its host died); ``cancelled`` by ``xpu cancel``. After a restart of the coordinator the job's
ranks run on (they are not its children) and it reads their states again.

**--restartable** (as ``xpu run --nodes --restartable``, ``federation.jobrun``): each rank's host holds
the rank's lease (``follow_rank``); a card under it that fails (a move or a mark asked by the health
monitor) stops that rank, its record saying why (its reason starts ``restart: ``). The coordinator then
stops every rank, records the job ``queued`` again (``restarts`` + 1, durable: a coordinator restarted
meanwhile places it again), places it again (healthy cards) and starts every rank with
``XPU_RESTART_COUNT`` = its restarts, their files appended to; at most ``MAX_RESTARTS`` times, then such a
stop fails the job as a failing rank does.

**A rank's host** (``start_rank``): the committed reservation becomes a detached job of that host's
``JobBook`` (``HostJobs.hand_over`` + ``JobBook.adopt``, one ledger transaction), run under its supervisor
as the user, in the working directory (missing there: the rank is refused, the job fails and the others
are stopped), with stdin from /dev/null and its output in a file of that host (``expand``: %j %n %t %N).
It outlives that host's daemon as ``xpu submit``'s jobs do, and is never listed there on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import time

import grpc

from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import BadRequest, Conflict, NoCapacity, NotFound, XpudError
from xpud.federation import launch
from xpud.federation.hostjobs import RESTART
from xpud.federation.jobrun import MAX_RESTARTS
from xpud.ledger import jobs as jobdb
from xpud.ledger.jobs import JobRecord
from xpud.model import Caller, HealthState

log = logging.getLogger("xpud.gangjobs")

POLL_S = 0.5  # the ranks' states are read this often
PEER_TIMEOUT_S = 5.0
UNKNOWN_HOST_S = 60.0  # a rank's host unknown to the membership and silent this long is taken for dead
BAD = (jobdb.FAILED, jobdb.TIMEOUT, jobdb.LOST)
OPERATOR = Caller(uid=0, gid=0, admin=True)  # the daemon stopping a rank whose card failed


def expand(pattern: str, job: str, rank: int, host: str) -> str:
    """A rank's file name from ``--output``/``--error`` with Slurm's patterns: %j the job id, %n and %t
    the rank, %N the host's name, %% a %."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "%" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            sub = {"j": job, "n": str(rank), "t": str(rank), "N": host, "%": "%"}.get(nxt)
            if sub is not None:
                out.append(sub)
                i += 2
                continue
        out.append(c)
        i += 1
    return "".join(out)


def rank_files(spec: pb.LaunchSpec, host: str) -> tuple[str, str]:
    out = expand(spec.output, spec.job, spec.rank, host) if spec.output else ""
    out = out or os.path.join(spec.cwd, f"xpu-{spec.job}-{spec.rank}.out")
    err = expand(spec.error, spec.job, spec.rank, host) if spec.error else ""
    return out, err


def rank_state(r: JobRecord) -> pb.JobRankState:
    reason = f"{RESTART}{r.spec['restart']}" if r.spec.get("restart") else r.reason
    msg = pb.JobRankState(
        rank=int(r.spec.get("rank", 0)), host=r.hosts[0] if r.hosts else "", state=r.state, reason=reason
    )
    msg.job = r.id
    for name in ("exit_code", "exit_signal", "ended"):
        if (v := getattr(r, name)) is not None:
            setattr(msg, name, v)
    return msg


# ---------------------------------------------------------------------------- a rank's host
async def start_rank(ctx, spec: pb.LaunchSpec, peer: str | None) -> pb.JobRankState:
    """``Peer.StartRank`` (and the coordinator's own rank): hand the committed job over to this host's
    detached jobs and start rank ``spec.rank``."""
    if ctx.hostjobs is None or ctx.jobs is None:
        raise Conflict("this host runs no multi-host jobs yet: retry in a moment")
    for what, v in (("time_limit_s", spec.time_limit_s), ("kill_grace_s", spec.kill_grace_s)):
        if not (math.isfinite(v) and 0 <= v <= 366 * 86400):
            raise BadRequest(f"{what} {v!r}: give seconds from 0 to a year")
    if not spec.cwd.startswith("/"):
        raise BadRequest(f"working directory {spec.cwd[:80]!r}: give an absolute path")
    book = ctx.jobs
    files = rank_files(spec, book.host)
    for path in files:
        if path and not path.startswith("/"):
            raise BadRequest(f"rank file {path[:80]!r}: give an absolute path")
    caller = Caller(uid=spec.uid, gid=spec.gid)

    async def adopt(lease, end_op):
        return await book.adopt(caller, spec, lease, files, also=(end_op,), coordinator=peer or "")

    r = await ctx.hostjobs.hand_over(spec, peer, adopt)
    if spec.restartable and not r.done and ctx.gang is not None:
        ctx.gang.follow_rank(r)
    return rank_state(r)


async def ranks_here(ctx, request: pb.PeerJobsRequest) -> pb.PeerRanksReply:
    """``Peer.PeerRanks``: this host's ranks of job ``request.jobs[0]`` (the caller's); with ``cancel``
    they are stopped first (TERM, KILL after the grace)."""
    book = ctx.jobs
    if book is None:
        raise Conflict("this host runs no jobs yet: retry in a moment")
    if len(request.jobs) != 1:
        raise BadRequest("PeerRanks: name one job")
    caller = Caller(uid=request.uid)
    found = [r for r in jobdb.ranks_of(book.ledger, request.jobs[0]) if r.uid == request.uid]
    out = []
    for r in found:
        live = book.get(r.id) or r
        if request.cancel and not live.done:
            live = await book.cancel(live, caller)
            if request.reason:
                live.reason = request.reason[:500]
        out.append(rank_state(live))
    return pb.PeerRanksReply(ranks=out)


# ---------------------------------------------------------------------------- the coordinator
class Gang:
    """The submitted multi-host jobs this daemon placed (``ctx.gang``)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancelled_by: dict[str, int] = {}
        self.records: dict[str, JobRecord] = {}
        self.unheard: dict[str, float] = {}  # hosts not in the membership that did not answer: since
        self.followers: dict[str, asyncio.Task] = {}  # this host's restartable ranks: their leases held

    @property
    def me(self) -> str:
        fed = self.ctx.federation
        return fed.name if fed is not None else self.ctx.hostjobs.name

    @property
    def ledger(self):
        return self.ctx.engine.ledger

    def _job_spec(self, r: JobRecord) -> pb.JobSpec:
        s = r.spec
        return pb.JobSpec(
            mode=s["mode"],
            nodes=s.get("nodes", 0),
            gpus_per_node=s.get("gpus_per_node", 0),
            replicas=s.get("replicas", 0),
            spread=s.get("spread", False),
            argv=r.argv,
            env=r.env,
            cwd=r.cwd,
            wait_s=s.get("wait_s", 0.0),
            kill_on_bad_exit=s.get("kill_on_bad_exit", True),
            name=r.name,
            tasks_per_node=s.get("tasks_per_node", 0),
            account=s.get("account", ""),
            restartable=s.get("restartable", False),
        )

    def _run(self, r: JobRecord, caller: Caller):
        from xpud.federation.jobrun import JobRun

        run = JobRun(self.ctx.hostjobs, self.ctx.federation, self._job_spec(r), caller)
        run.job = r.id
        return run

    async def submit(
        self, caller: Caller, request: pb.SubmitJobRequest, wait_s: float, account: str = ""
    ) -> JobRecord:
        """Check, record ``queued``, start. ``account``: the one charged (``service.accounts.charge``,
        checked again by the coordinator and by every host). Raises BadRequest (nothing recorded)."""
        if self.ctx.hostjobs is None or self.ctx.jobs is None:
            raise Conflict("this daemon runs no multi-host jobs yet: retry in a moment")
        book = self.ctx.jobs
        for what, v in (("--time", request.time_limit_s), ("--kill-grace", request.kill_grace_s)):
            if not (math.isfinite(v) and 0 <= v <= 366 * 86400):
                raise BadRequest(f"{what} {v!r}: give seconds from 0 to a year")
        for path, what in ((request.output, "--output"), (request.error, "--error")):
            if path and not path.startswith("/"):
                raise BadRequest(f"{what} {path!r}: give an absolute path")
        kill = request.kill_on_bad_exit if request.HasField("kill_on_bad_exit") else True
        r = JobRecord(
            id=secrets.token_hex(8),  # as RunJob's: the job's id on every host
            uid=caller.uid,
            gid=max(caller.gid, 0),
            state=jobdb.QUEUED,
            submitted=self.ctx.engine.clock(),
            kind=jobdb.MULTI_HOST,
            name=request.name,
            cwd=request.cwd,
            argv=list(request.argv),
            env=dict(request.env),
            spec={
                "detached": True,
                "mode": request.mode or "xpu",
                "nodes": request.nodes,
                "gpus_per_node": request.gpus_per_node,
                "replicas": request.replicas,
                "spread": request.spread,
                "tasks_per_node": request.tasks_per_node,
                "gpus": request.gpus_per_node or 1,
                "priority": request.priority,
                "wait_s": wait_s,
                "output": request.output,
                "error": request.error,
                "time_limit_s": request.time_limit_s,
                "kill_grace_s": request.kill_grace_s,
                "kill_on_bad_exit": kill,
                "after": [],
                "ranks": [],
                "account": account,
                "restartable": request.restartable,
                "restarts": 0,
            },
        )
        run = self._run(r, caller)
        await run.check()  # the same checks as `xpu run --nodes`
        r.spec["after"] = [book.resolve(sel, caller).id for sel in request.after]
        r.reason = "Dependency" if r.spec["after"] else "Resources"
        await self.ledger.write(jobdb.save_job_op(r))
        what = r.name or r.argv[0]
        self.ctx.engine.event("job", f"job {r.id} ({what}) submitted across hosts by uid {r.uid}")
        self._start(r, caller)
        return r

    def _start(self, r: JobRecord, caller: Caller) -> None:
        self.records[r.id] = r
        task = asyncio.ensure_future(self._life(r, caller))
        self.tasks[r.id] = task
        task.add_done_callback(lambda _t, job=r.id: self.tasks.pop(job, None))

    async def restore(self) -> None:
        """After a restart: queued jobs queue again, running ones are watched again."""
        for r in jobdb.unfinished(self.ledger):
            if r.kind == jobdb.MULTI_HOST and r.spec.get("detached"):
                self._start(r, Caller(uid=r.uid, gid=r.gid))
            elif r.spec.get("rank_restartable") and self.ctx.jobs is not None:
                live = self.ctx.jobs.get(r.id)
                if live is not None and not live.done:
                    self.follow_rank(live)  # held again: a failing card still stops it

    async def stop(self) -> None:
        tasks = [*self.tasks.values(), *self.followers.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    # ------------------------------------------------------------------------ a restartable rank here
    def follow_rank(self, r: JobRecord) -> None:
        """Hold the lease of ``r`` (this host's rank of a --restartable job): a card under it that fails
        stops the rank, its record saying why (``rank_state``: ``restart: ...``)."""
        engine = self.ctx.engine
        if r.id in self.followers or r.lease_id not in engine.leases:
            return
        q = engine.hold_opened(r.lease_id)
        task = asyncio.ensure_future(self._follow_rank(r, r.lease_id, q))
        self.followers[r.id] = task
        task.add_done_callback(lambda _t, job=r.id: self.followers.pop(job, None))

    def _failed_card(self, lease_id: str) -> str:
        engine = self.ctx.engine
        lease = engine.leases.get(lease_id)
        for i in lease.cards if lease is not None else ():
            c = engine.resolve_card(str(i))
            if c.health_state is HealthState.UNHEALTHY:
                return f"card {i} on host {self.me} is unhealthy ({c.health_reason or 'failed its checks'})"
        return ""

    async def _follow_rank(self, r: JobRecord, lease_id: str, q: asyncio.Queue) -> None:
        try:
            while not r.done:
                ev = await q.get()
                if ev.kind == "released":
                    return
                if ev.kind not in ("move", "mark"):
                    continue
                why = self._failed_card(lease_id) or (ev.message if ev.kind == "move" else "")
                if not why or r.done:
                    continue
                r.spec["restart"] = why[:400]  # on record first: the coordinator reads why it ended
                await self.ledger.write(jobdb.save_job_op(r))
                await self.ctx.jobs.cancel(r, OPERATOR)
                what = f"job {r.spec.get('cluster_job')} rank {r.spec.get('rank')}"
                self.ctx.engine.event("job", f"{what} stopped: {why}; it restarts")
                return
        except asyncio.CancelledError:
            raise
        except Exception:  # one job's trouble never stops the daemon
            log.exception("job %s: following its lease", r.id)
        finally:
            self.ctx.engine.hold_closed(lease_id, q)

    # ------------------------------------------------------------------------ the life of a job
    async def _save(self, r: JobRecord) -> None:
        await self.ledger.write(jobdb.save_job_op(r))

    async def _end(self, r: JobRecord, state: str, reason: str, code=None, sig=None) -> None:
        r.state, r.reason, r.env = state, reason[:500], {}
        r.exit_code, r.exit_signal = code, sig
        r.ended = self.ctx.engine.clock()
        await self._save(r)
        self.records.pop(r.id, None)
        self.ctx.engine.event("job", f"job {r.id} {state}: {r.reason}")
        if self.ctx.jobs is not None:
            self.ctx.jobs.notify_end(r.id)

    async def _life(self, r: JobRecord, caller: Caller) -> None:
        try:
            if r.state == jobdb.QUEUED:
                if not await self._after(r):
                    return
                if not await self._place_and_start(r, caller):
                    return
            await self._watch(r, caller)
        except asyncio.CancelledError:
            by = self.cancelled_by.pop(r.id, None)
            if by is not None and r.state == jobdb.QUEUED:
                await asyncio.shield(self._end(r, jobdb.CANCELLED, f"cancelled by uid {by} while queued"))
            raise
        except Exception as e:  # one job's trouble never stops the daemon
            log.exception("job %s", r.id)
            if not r.done:
                await self._stop_ranks(r, f"job {r.id} failed: {e}")
                await self._end(r, jobdb.FAILED, f"the coordinator failed: {e}")

    async def _after(self, r: JobRecord) -> bool:
        book = self.ctx.jobs
        for dep in r.spec.get("after", []):
            d = await book.wait_end(dep)
            if d is None or d.state != jobdb.COMPLETED:
                why = f"job {dep} ended {d.state if d else 'unknown (gone from the ledger)'}"
                await self._end(r, jobdb.DEPENDENCY_FAILED, why)
                return False
        if r.reason == "Dependency":
            r.reason = "Resources"
            await self._save(r)
        return True

    async def _place_and_start(self, r: JobRecord, caller: Caller) -> bool:
        run = self._run(r, caller)
        await run.check()
        try:
            async for ev in run.place():
                if ev.HasField("queued") and ev.queued.reason != r.reason:
                    r.reason = ev.queued.reason[:500]
                    await self._save(r)
        except NoCapacity as e:
            await self._end(r, jobdb.CANCELLED, f"gave up waiting for cards: {e}")
            return False
        names = [(x.host, x.addr or "127.0.0.1") for x in run.ranks]
        restarts = int(r.spec.get("restarts", 0))
        rank0 = run.commits[run.ranks[0].host]
        envs = launch.rank_envs(
            r.id,
            names,
            rank0.free_port,
            {h: {**c.env, "XPU_RESTART_COUNT": str(restarts)} for h, c in run.commits.items()},
            dict(r.env),
            procs_per_node=run.per_host,
            tasks_per_node=r.spec.get("tasks_per_node", 0),
        )
        s = r.spec
        s["ranks"] = [
            {"rank": x.rank, "host": x.host, "addr": x.addr, "state": jobdb.RUNNING} for x in run.ranks
        ]
        r.state, r.started = jobdb.RUNNING, self.ctx.engine.clock()
        r.reason = str(r.spec.get("restarted", "")) if restarts else ""  # why it runs again
        r.hosts = [x.host for x in run.ranks]
        if not s.get("restartable"):
            r.env = {}  # a restartable job's environment is kept: its ranks start with it again
        await self._save(r)  # durable before any rank starts: a restart watches them
        specs = [
            pb.LaunchSpec(
                job=r.id,
                rank=x.rank,
                argv=r.argv,
                env={**e.env, "XPU_JOB_ID": r.id},
                cwd=r.cwd,
                uid=r.uid,
                gid=r.gid,
                user=run.user,
                tasks_per_node=s.get("tasks_per_node", 0),
                keep_going=not s.get("kill_on_bad_exit", True),
                output=s.get("output", ""),
                error=s.get("error", ""),
                time_limit_s=s.get("time_limit_s", 0.0),
                kill_grace_s=s.get("kill_grace_s", 0.0),
                restartable=s.get("restartable", False),
                restarts=restarts,
            )
            for x, e in zip(run.ranks, envs, strict=True)
        ]
        starts = [self._start_rank(x.host, x.addr, sp) for x, sp in zip(run.ranks, specs, strict=True)]
        results = await asyncio.gather(*starts, return_exceptions=True)
        failed = None
        for x, got in zip(run.ranks, results, strict=True):
            entry = s["ranks"][x.rank]
            if isinstance(got, BaseException):
                why = got.details() if isinstance(got, grpc.aio.AioRpcError) else str(got)
                entry.update(state=jobdb.FAILED, reason=f"could not start: {why}"[:500])
                failed = failed or f"rank {x.rank} on host {x.host} could not start: {why}"
            else:
                entry.update(job=got.job, state=got.state)
        with contextlib.suppress(Exception):
            await run._abort(list(run.hosts))  # what was not handed over (a refused rank) is released
        if failed:
            await self._save(r)
            await self._stop_ranks(r, f"stopped: {failed}", every=True)
            await self._wait_ranks(r)
            await self._end(r, jobdb.FAILED, failed)
            return False
        await self._save(r)
        return True

    async def _start_rank(self, host: str, addr: str, spec: pb.LaunchSpec) -> pb.JobRankState:
        if host == self.me:
            return await start_rank(self.ctx, spec, None)
        stub = pbg.PeerStub(self.ctx.federation.channel(addr))
        return await stub.StartRank(spec, timeout=PEER_TIMEOUT_S * 2)

    async def _ask(self, r: JobRecord, host: str, cancel: bool = False, reason: str = ""):
        """Host ``host``'s answer about its ranks of ``r`` (a PeerRanksReply), or an exception."""
        req = pb.PeerJobsRequest(uid=r.uid, jobs=[r.id], cancel=cancel, reason=reason)
        try:
            if host == self.me:
                return await ranks_here(self.ctx, req)
            addr = next((x.get("addr", "") for x in r.spec["ranks"] if x["host"] == host), "")
            fed = self.ctx.federation
            addr = next((m.addr for m in fed.members() if m.name == host), addr)
            return await pbg.PeerStub(fed.channel(addr)).PeerRanks(req, timeout=PEER_TIMEOUT_S)
        except (grpc.aio.AioRpcError, XpudError) as e:
            return e

    def _host_dead(self, host: str) -> bool:
        fed = self.ctx.federation
        if fed is None or host == self.me:
            return False
        from xpud.federation.membership import State

        m = next((m for m in fed.members() if m.name == host), None)
        if m is not None:
            return m.state in (State.DEAD, State.LEFT)
        # unknown here (this daemon just started and has not heard of it yet): dead once unheard long
        since = self.unheard.setdefault(host, time.monotonic())
        return time.monotonic() - since > UNKNOWN_HOST_S

    async def _refresh(self, r: JobRecord) -> bool:
        """Read every host's ranks; True when something changed (then recorded)."""
        ranks = r.spec["ranks"]
        hosts = sorted({x["host"] for x in ranks if x["state"] not in jobdb.ENDED})
        replies = await asyncio.gather(*(self._ask(r, h) for h in hosts))
        changed = False
        for host, reply in zip(hosts, replies, strict=True):
            mine = [x for x in ranks if x["host"] == host and x["state"] not in jobdb.ENDED]
            if isinstance(reply, BaseException):
                if self._host_dead(host):
                    for x in mine:
                        x.update(state=jobdb.LOST, reason=f"its host {host} died")
                        x["ended"] = self.ctx.engine.clock()
                        changed = True
                continue
            self.unheard.pop(host, None)
            for x in mine:
                m = _current(reply.ranks, x)
                if m is None:
                    x.update(state=jobdb.LOST, reason=f"host {host} has no record of it")
                    x["ended"] = self.ctx.engine.clock()
                    changed = True
                    continue
                new = {"state": m.state, "job": m.job, "reason": m.reason}
                for k in ("exit_code", "exit_signal", "ended"):
                    if m.HasField(k):
                        new[k] = getattr(m, k)
                if any(x.get(k) != v for k, v in new.items()):
                    x.update(new)
                    changed = True
        if changed:
            await self._save(r)
        return changed

    async def _stop_ranks(self, r: JobRecord, reason: str, every: bool = False) -> None:
        """Stop the ranks still running (``every``: ask every host, e.g. a StartRank whose answer was lost
        may have started its rank there)."""
        ranks = r.spec.get("ranks", [])
        hosts = sorted({x["host"] for x in ranks if every or x["state"] not in jobdb.ENDED})
        await asyncio.gather(*(self._ask(r, h, cancel=True, reason=reason) for h in hosts))

    async def _wait_ranks(self, r: JobRecord) -> None:
        while any(x["state"] not in jobdb.ENDED for x in r.spec["ranks"]):
            await asyncio.sleep(POLL_S)
            await self._refresh(r)

    def _restart_why(self, r: JobRecord) -> str:
        """Why ``r`` restarts now: a rank stopped because a card under it failed ("": none was, or the
        job is not --restartable, or has restarted ``MAX_RESTARTS`` times)."""
        if not r.spec.get("restartable") or int(r.spec.get("restarts", 0)) >= MAX_RESTARTS:
            return ""
        for x in r.spec["ranks"]:
            if x.get("reason", "").startswith(RESTART) and x["state"] in jobdb.ENDED:
                return f"rank {x['rank']} on host {x['host']}: {x['reason'].removeprefix(RESTART)}"
        return ""

    async def _restart(self, r: JobRecord, caller: Caller, why: str) -> bool:
        """Stop every rank, record ``r`` queued again (its restart counted), place and start it again."""
        await self._stop_ranks(r, "stopped: the job restarts")
        await self._wait_ranks(r)
        n = int(r.spec.get("restarts", 0)) + 1
        r.spec["restarts"], r.spec["ranks"], r.hosts = n, [], []
        r.state, r.started, r.reason = jobdb.QUEUED, None, f"restart {n}: {why}"[:500]
        r.spec["restarted"] = r.reason
        await self._save(r)  # a coordinator restarted from here on places it again
        self.ctx.engine.event("job", f"job {r.id} restarts ({n}): {why}")
        return await self._place_and_start(r, caller)

    async def _cancelled_elsewhere(self, r: JobRecord) -> bool:
        """A rank cancelled by its owner from another host while this coordinator did not answer
        (``service.headless``): the job is cancelled, its ranks still running stopped. True then."""
        if r.reason.startswith("cancelled by"):
            return False
        for x in r.spec["ranks"]:
            if x["state"] == jobdb.CANCELLED and x.get("reason", "").startswith("cancelled by uid "):
                r.reason = x["reason"][:500]
                await self._save(r)
                await self._stop_ranks(r, r.reason)
                return True
        return False

    async def _watch(self, r: JobRecord, caller: Caller) -> None:
        stopping = False
        while True:
            await self._refresh(r)
            if await self._cancelled_elsewhere(r):
                stopping = True
            why = "" if stopping or r.reason.startswith("cancelled by") else self._restart_why(r)
            if why:
                if not await self._restart(r, caller, why):
                    return
                continue
            ranks = r.spec["ranks"]
            bad = [x for x in ranks if _bad(x)]
            if bad and r.spec.get("kill_on_bad_exit", True) and not stopping:
                stopping = True
                first = min(bad, key=lambda x: x.get("ended") or math.inf)
                await self._stop_ranks(r, f"stopped: rank {first['rank']} {first['state']}")
            if all(x["state"] in jobdb.ENDED for x in ranks):
                break
            await asyncio.sleep(POLL_S)
        await self._finish(r)

    async def _finish(self, r: JobRecord) -> None:
        ranks = r.spec["ranks"]
        bad = [x for x in ranks if _bad(x)]
        if r.reason.startswith("cancelled by"):
            await self._end(r, jobdb.CANCELLED, r.reason)
        elif bad:
            x = min(bad, key=lambda x: x.get("ended") or math.inf)
            code, sig = x.get("exit_code"), x.get("exit_signal")
            what = f"signal {sig}" if sig is not None else f"exit {code}" if code is not None else x["state"]
            why = f"rank {x['rank']} on host {x['host']}: {what}"
            why += f" ({x['reason']})" if x.get("reason") else ""
            if r.spec.get("restarts"):
                why += f" (after {r.spec['restarts']} restart(s))"
            await self._end(r, x["state"] if x["state"] in BAD else jobdb.FAILED, why, code, sig)
        elif all(x["state"] == jobdb.COMPLETED for x in ranks):
            await self._end(r, jobdb.COMPLETED, "all ranks exited 0", 0)
        else:
            x = next(x for x in ranks if x["state"] != jobdb.COMPLETED)
            why = f"rank {x['rank']} on host {x['host']} {x['state']}: {x.get('reason', '')}"
            await self._end(r, x["state"], why)

    # ------------------------------------------------------------------------ for the RPCs
    def record(self, job_id: str) -> JobRecord | None:
        return self.records.get(job_id)

    async def cancel(self, r: JobRecord, caller: Caller) -> JobRecord:
        live = self.records.get(r.id)
        if r.done or (live is not None and live.done):
            return live or r
        if live is None:
            raise Conflict(f"job {r.id} is {r.state} but not in this daemon's hands: try again in a moment")
        why = f"cancelled by uid {caller.uid}"
        if live.state == jobdb.QUEUED:
            task = self.tasks.get(r.id)
            if task is not None:
                self.cancelled_by[r.id] = caller.uid
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            return jobdb.job(self.ledger, r.id) or live
        live.reason = why
        await self._save(live)
        await self._stop_ranks(live, why)
        return live

    def rank_entry(self, r: JobRecord, rank: int) -> dict:
        """Rank ``rank``'s entry of ``r`` (BadRequest when out of range)."""
        count = r.spec.get("nodes") or r.spec.get("replicas") or len(r.spec.get("ranks", []))
        if not 0 <= rank < count:
            raise BadRequest(f"--rank {rank}: job {r.id} has ranks 0..{count - 1}")
        ranks = r.spec.get("ranks", [])
        if rank >= len(ranks):
            raise NotFound(f"job {r.id} is {r.state}: its ranks have not started")
        return ranks[rank]


def _bad(x: dict) -> bool:
    """A rank that failed the job: it failed, timed out, was lost, or was stopped by a failing card when
    the job may not restart (any more)."""
    return x["state"] in BAD or (x["state"] in jobdb.ENDED and x.get("reason", "").startswith(RESTART))


def _current(found, x: dict):
    """Among a host's records of the job, the one of rank ``x`` (its own record once started; a job
    restarted leaves the earlier ranks' records there too): None when there is none."""
    mine = [m for m in found if m.rank == x["rank"]]
    if x.get("job"):
        return next((m for m in mine if m.job == x["job"]), None)
    live = [m for m in mine if m.state not in jobdb.ENDED]
    return (live or mine or [None])[-1]
