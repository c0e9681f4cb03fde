"""The daemon's detached jobs (``xpu submit``): queue, start, watch, cancel, collect; restored at start-up.

Each job's row (``xpud.ledger.jobs``) changes before the world does: ``queued`` is committed before the
submitter hears the id; ``running`` with its lease before its supervisor starts; the end as the supervisor
recorded it before the lease is released. A queued job waits first for its ``--after`` jobs (each must
end ``completed``, else it ends ``dependency-failed``; a job of another host, ``<id>@<host>``, is asked for
over the peers every ``REMOTE_POLL_S``, and while its host does not answer the job stays queued and says
so), then for cards in the engine's queue, holding its
lease by the anchor ``job:<id>`` (no Hold stream). A running job belongs to its supervisor
(``xpud.jobs.supervisor``), which outlives the daemon; the daemon reads its status file every
``poll_s`` and, after a restart, collects what ended while it was away. A running job whose supervisor is
gone without a word is ``lost``.

Where device isolation is enforced (README "Isolation"), a job's unit carries its lease's device fence
(``DevicePolicy=closed`` + ``DeviceAllow=``, ``isolation/scope.py``): the supervisor and the job open
only the lease's nodes. A job whose fence cannot be computed then is not started (``failed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import secrets
import shlex
import signal
import time
from pathlib import Path

from xpud.errors import BadRequest, Conflict, Forbidden, NoCapacity, NotFound, Unavailable, XpudError
from xpud.isolation import scope, switch_user
from xpud.isolation.scope import ScopeError, Scopes
from xpud.jobs import supervisor
from xpud.jobs.restarts import Restarts
from xpud.ledger import jobs as jobdb
from xpud.ledger.jobs import JobRecord
from xpud.model import Caller, CommandEnd, Mode, Request

log = logging.getLogger("xpud.jobs")

POLL_S = 0.2  # how often running jobs' status files are read
REMOTE_POLL_S = 2.0  # how often a queued job asks another host about its --after job there
DEFAULT_KILL_GRACE_S = 10.0
OPERATOR = Caller(uid=0, gid=0, admin=True)


def may_act(r: JobRecord, caller: Caller) -> bool:
    return caller.admin or caller.uid == r.uid


def exit_status(r: JobRecord) -> int:
    """``r``'s end as a shell's ``$?``: the exit code, 128 + the signal, else non-zero for an end without
    one (cancelled before it ran 143, timeout 124, lost or dependency-failed 1)."""
    if r.exit_signal is not None:
        return 128 + r.exit_signal
    if r.exit_code is not None and r.state in (jobdb.COMPLETED, jobdb.FAILED):
        return r.exit_code
    return {jobdb.COMPLETED: 0, jobdb.CANCELLED: 143, jobdb.TIMEOUT: 124}.get(r.state, 1)


class JobBook:
    """The detached jobs of this daemon. ``systemd_run``: start supervisors as transient units;
    ``scopes``: the daemon's device scopes, whose fence each job's unit gets where it is enforced."""

    def __init__(
        self,
        engine,
        state_dir: Path,
        host: str,
        systemd_run: str | None = None,
        poll_s: float = POLL_S,
        clock=time.time,
        scopes: Scopes | None = None,
    ):
        self.engine = engine
        self.scopes = scopes
        self.ledger = engine.ledger
        self.dir = Path(state_dir) / "jobs"
        self.host = host
        self.systemd_run = systemd_run
        self.poll_s = poll_s
        self.clock = clock
        self.waiting: dict[str, asyncio.Task] = {}  # queued jobs: for their --after jobs, then cards
        self.running: dict[str, JobRecord] = {}
        self.ends: dict[str, asyncio.Future] = {}  # job id -> done once it has ended (--after, wait)
        self.cancelling: set[str] = set()
        self.cancelled_by: dict[str, int] = {}  # queued jobs being cancelled -> by whom
        self._poller: asyncio.Task | None = None
        self._stopping = False
        self.restarts = Restarts(self)  # --restartable jobs: their leases held, moves followed
        # async (host, job id, uid) -> that job's state there, None when that host has no such job;
        # raises Unavailable when the host does not answer (set by the daemon where it federates)
        self.peer_state = None

    # ------------------------------------------------------------------ start-up and shutdown
    async def restore(self) -> None:
        """Re-queue queued jobs; collect the ends of running ones (or keep watching them)."""
        unfinished = jobdb.unfinished(self.ledger)
        holding = {r.lease_id for r in unfinished if r.state == jobdb.RUNNING}
        for lease in list(self.engine.leases.values()):  # granted to a job that never recorded it
            kind, _, job_id = lease.anchor.partition(":")
            if kind == "job" and lease.id not in holding:
                why = f"job {job_id} holds it no more (the daemon stopped between its grant and its start)"
                await self.engine.reclaim(lease.id, why)
        for r in unfinished:
            if r.kind == jobdb.MULTI_HOST and r.spec.get("detached"):
                continue  # a submitted multi-host job: its coordinator (xpud.service.gangjobs) restores it
            if r.state == jobdb.QUEUED:
                self.waiting[r.id] = asyncio.ensure_future(self._run(r))
            else:
                self.running[r.id] = r
                await self._check(r, restoring=True)
                if not r.done and r.spec.get("restartable") and r.lease_id in self.engine.leases:
                    self.restarts.follow(r, r.lease_id)  # held again: a move restarts it as before

    def start(self) -> None:
        self._poller = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        """The daemon stops: queued jobs stay queued in the ledger, running ones run on."""
        self._stopping = True
        tasks = [*self.waiting.values(), *([self._poller] if self._poller else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        await self.restarts.stop()

    # ------------------------------------------------------------------ lookups
    def resolve(self, selector: str, caller: Caller) -> JobRecord:
        """The one job ``selector`` (id, id prefix, or a name of the caller's) names. Raises NotFound, or
        BadRequest listing the jobs when it names several; Forbidden when it is not the caller's."""
        found = jobdb.find(self.ledger, selector, caller.uid)
        if not found and caller.admin:  # an operator names anyone's job when none of theirs has that name
            found = jobdb.find(self.ledger, selector, None)
        if not found:
            raise NotFound(f"no job {selector!r} (see `xpu jobs --all`)")
        if len(found) > 1:
            listed = ", ".join(f"{r.id} ({r.state})" for r in found[:10])
            raise BadRequest(f"{selector!r} names {len(found)} jobs: {listed}; give one id")
        r = found[0]
        if not may_act(r, caller):
            raise Forbidden(f"job {r.id} belongs to uid {r.uid}: only its owner or an operator may act on it")
        return r

    def get(self, job_id: str) -> JobRecord | None:
        return self.running.get(job_id) or jobdb.job(self.ledger, job_id)

    # ------------------------------------------------------------------ submit
    async def submit(
        self,
        caller: Caller,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        request: Request,
        name: str = "",
        output: str = "",
        error: str = "",
        time_limit_s: float = 0.0,
        after: list[str] = (),
        kill_grace_s: float = 0.0,
        remote_after: list[tuple[str, str]] = (),
    ) -> JobRecord:
        """Check, record ``queued``, and start waiting. ``after``: this host's jobs (ids, prefixes or names);
        ``remote_after``: (job id, host) of other hosts' jobs, resolved there by the caller. Raises
        BadRequest (nothing recorded)."""
        if not argv or not argv[0]:
            raise BadRequest("no command: give it after --, e.g. `xpu submit -- python train.py`")
        for path, what in ((cwd, "directory"), (output, "--output"), (error, "--error")):
            if path and not os.path.isabs(path):
                raise BadRequest(f"{what} {path!r}: give an absolute path")
        if not cwd:
            raise BadRequest("the job's directory is missing: send the submitter's working directory")
        if os.geteuid() != 0 and caller.uid != os.geteuid():
            raise Forbidden(
                f"this daemon runs as uid {os.geteuid()}: it cannot start jobs as uid {caller.uid}"
            )
        try:
            pwd.getpwuid(caller.uid)
        except KeyError:
            raise BadRequest(f"uid {caller.uid} is unknown on this host: jobs run as a known user") from None
        try:
            switch_user.env_bytes(env)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        deps = []
        for sel in after:
            dep = self.resolve(sel, caller)  # NotFound: unknown --after job
            deps.append(dep.id)
        for job_id, host in remote_after:
            if not job_id or not host or "@" in job_id or "@" in host:
                raise BadRequest(f"--after {job_id}@{host}: not a job of another host")
            deps.append(f"{job_id}@{host}")
        req = self.engine.validate(request)
        job_id = self._new_id()
        r = JobRecord(
            id=job_id,
            uid=caller.uid,
            gid=caller.gid if caller.gid >= 0 else pwd.getpwuid(caller.uid).pw_gid,
            state=jobdb.QUEUED,
            submitted=self.clock(),
            name=name,
            cwd=cwd,
            argv=list(argv),
            env=dict(env),
            spec={
                "mode": str(req.mode),
                "gpus": req.gpus,
                "priority": req.priority,
                "wait_s": req.wait_s,
                "output": output or os.path.join(cwd, f"xpu-{job_id}.out"),
                "error": error,
                "time_limit_s": time_limit_s,
                "after": deps,
                "kill_grace_s": kill_grace_s or DEFAULT_KILL_GRACE_S,
                "restartable": req.restartable,
                "account": req.account,
            },
            hosts=[self.host],
            reason="Dependency" if deps else "Resources",
        )
        await self.ledger.write(jobdb.save_job_op(r))
        self.engine.event("job", f"job {r.id} ({name or argv[0]}) submitted by uid {r.uid}")
        self.waiting[r.id] = asyncio.ensure_future(self._run(r))
        return r

    def _new_id(self) -> str:
        taken = self.ledger.lease_ids()
        while True:
            job_id = secrets.token_hex(4)
            if job_id not in taken and jobdb.job(self.ledger, job_id) is None:
                return job_id

    def _request(self, r: JobRecord) -> Request:
        s = r.spec
        return Request(
            mode=Mode(s["mode"]),
            gpus=s["gpus"],
            priority=s["priority"],
            wait_s=s["wait_s"],
            owner_uid=r.uid,
            command=shlex.join(r.argv)[:500],
            name=r.name,
            anchor=f"job:{r.id}",
            restartable=bool(s.get("restartable", False)),
            account=str(s.get("account", "")),
        )

    # ------------------------------------------------------------------ the life of a job
    async def _run(self, r: JobRecord) -> None:
        try:
            await self._wait_for(r)
        except asyncio.CancelledError:
            by = self.cancelled_by.pop(r.id, None)
            if by is not None and not r.done:
                await self._end(r, jobdb.CANCELLED, reason=f"cancelled by uid {by} while queued ({r.reason})")
            raise
        except Exception as e:  # one job's trouble never stops the daemon
            log.exception("job %s", r.id)
            if not r.done:
                await self._end(r, jobdb.FAILED, reason=f"could not start: {e}")
        finally:
            self.waiting.pop(r.id, None)

    async def _wait_for(self, r: JobRecord) -> None:
        deps = list(r.spec.get("after", []))
        remote = [d for d in deps if "@" in d]  # <id>@<host>: another host's job
        deps = [d for d in deps if "@" not in d]
        while deps or remote:  # any one that ends otherwise than completed fails the job at once
            for dep in list(deps):
                d = self.get(dep)
                if d is None or (d.done and d.state != jobdb.COMPLETED):
                    why = f"job {dep} ended {d.state if d else 'unknown (gone from the ledger)'}"
                    await self._end(r, jobdb.DEPENDENCY_FAILED, reason=why)
                    return
                if d.done:
                    deps.remove(dep)
            unreachable = []
            for dep in list(remote):
                job_id, _, host = dep.partition("@")
                try:
                    st = await self._remote_state(host, job_id, r.uid)
                except Unavailable as e:
                    unreachable.append(f"job {job_id} on host {host}: {e}"[:200])
                    continue
                if st is None or (st in jobdb.ENDED and st != jobdb.COMPLETED):
                    why = f"job {job_id} on host {host} ended {st or 'unknown (gone from its ledger)'}"
                    await self._end(r, jobdb.DEPENDENCY_FAILED, reason=why)
                    return
                if st == jobdb.COMPLETED:
                    remote.remove(dep)
            said = "Dependency" + (
                "; its host does not answer: " + "; ".join(unreachable) if unreachable else ""
            )
            if (deps or remote) and r.reason != said[:500]:
                r.reason = said[:500]
                await self.ledger.write(jobdb.save_job_op(r))
            if deps or remote:
                pending = [asyncio.shield(self._end_future(dep)) for dep in deps]
                try:
                    if pending:
                        await asyncio.wait(
                            pending,
                            timeout=REMOTE_POLL_S if remote else None,
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    else:
                        await asyncio.sleep(REMOTE_POLL_S)
                finally:
                    for p in pending:
                        p.cancel()
        if r.reason.startswith("Dependency"):
            r.reason = "Resources"
            await self.ledger.write(jobdb.save_job_op(r))
        try:
            lease, _token = await self.engine.acquire(self._request(r))
        except NoCapacity as e:
            await self._end(r, jobdb.CANCELLED, reason=f"gave up waiting for cards: {e}")
            return
        restartable = bool(r.spec.get("restartable"))
        restarts = int(r.spec.get("restarts", 0))  # queued again after a reclaim: its output appended to
        env = {**r.env, **lease.env, "XPU_JOB_ID": r.id}
        if restarts:
            env["XPU_RESTART_COUNT"] = str(restarts)
        r.state, r.lease_id, r.started, r.reason = jobdb.RUNNING, lease.id, self.clock(), ""
        if not restartable:  # a restartable job's command starts again with it after a move
            r.env = {}
        try:
            await self.ledger.write(jobdb.save_job_op(r))
        except XpudError:
            await self.engine.release(lease.id, OPERATOR, "", None)
            raise
        self.waiting.pop(r.id, None)  # starting: a cancel now waits for the supervisor (Conflict)
        if restartable:
            self.restarts.follow(r, lease.id)
        try:
            switch = self._switch(r)
            fence = await self._fence(lease)
            await asyncio.shield(supervisor.launch(
                self.dir, r.id, r.argv, env, r.cwd, r.spec["output"], r.spec.get("error", ""), switch,
                r.spec.get("time_limit_s", 0.0), r.spec.get("kill_grace_s", DEFAULT_KILL_GRACE_S),
                self.systemd_run, fence, append=bool(restarts),
            ))  # fmt: skip
        except (OSError, ValueError, ScopeError) as e:
            await self._end(r, jobdb.FAILED, reason=f"could not start: {e}")
            return
        self.running[r.id] = r
        self.engine.event("job", f"job {r.id} started on lease {lease.id}", lease_id=lease.id)

    async def _remote_state(self, host: str, job_id: str, uid: int) -> str | None:
        """The state of job ``job_id`` on host ``host`` (None: no such job there). Raises Unavailable."""
        if self.peer_state is None:
            raise Unavailable("this daemon does not federate with other hosts now")
        try:
            return await self.peer_state(host, job_id, uid)
        except Unavailable:
            raise
        except XpudError as e:  # not a "no": asked again later
            raise Unavailable(str(e)) from None

    async def _fence(self, lease) -> list[str]:
        """The ``systemd-run --property=`` device fence of the job's unit; [] where isolation is advisory.
        ScopeError where it is enforced and the fence cannot be put up: the job would run unfenced."""
        if self.scopes is None or not self.scopes.enforcement.enforced:
            return []
        if self.systemd_run is None:
            raise ScopeError("device isolation is enforced, but no systemd-run to start the job's unit")
        try:
            return scope.unit_properties(await self.scopes.allow_async(lease))
        except ScopeError as e:
            raise ScopeError(f"device isolation: {e}") from None

    def _switch(self, r: JobRecord) -> list[str]:
        if os.geteuid() != 0:
            return []
        pw = pwd.getpwuid(r.uid)
        return switch_user.argv(r.uid, r.gid, os.getgrouplist(pw.pw_name, r.gid))

    def notify_end(self, job_id: str) -> None:
        """A job recorded elsewhere (a submitted multi-host job's coordinator) ended: its ``--after``
        dependents and waiters hear it."""
        fut = self.ends.pop(job_id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ------------------------------------------------------------------ a rank of a multi-host job
    async def adopt(
        self, caller: Caller, spec, lease, rank_files: tuple[str, str], also=(), coordinator: str = ""
    ) -> JobRecord:
        """Run rank ``spec.rank`` (a LaunchSpec) of the submitted multi-host job ``spec.job`` as a job of
        this book, on ``lease`` (committed here for it): recorded ``running`` and the lease anchored to it
        in one transaction with ``also`` (its reservation's end), then started under its supervisor, as
        ``xpu submit``'s jobs are (it outlives this daemon). ``rank_files``: its output and error paths,
        appended to when ``spec.restarts`` (the job started again); ``coordinator``: the host that placed it.
        Raises BadRequest before anything is written (a directory missing here)."""
        cwd = spec.cwd
        if not await asyncio.to_thread(os.path.isdir, cwd):
            raise BadRequest(
                f"host {self.host}: working directory {cwd} does not exist there (create it, or submit "
                "from a directory every host has)"
            )
        try:
            pw = pwd.getpwuid(caller.uid)
        except KeyError:
            raise BadRequest(f"uid {caller.uid} is unknown on host {self.host}") from None
        r = JobRecord(
            id=self._new_id(),
            uid=caller.uid,
            gid=caller.gid if caller.gid >= 0 else pw.pw_gid,
            state=jobdb.RUNNING,
            submitted=self.clock(),
            cwd=cwd,
            argv=list(spec.argv),
            spec={
                "mode": str(lease.mode),
                "gpus": len(lease.cards),
                "priority": 0,
                "wait_s": 0.0,
                "output": rank_files[0],
                "error": rank_files[1],
                "time_limit_s": spec.time_limit_s,
                "after": [],
                "kill_grace_s": spec.kill_grace_s or DEFAULT_KILL_GRACE_S,
                "restartable": False,
                "cluster_job": spec.job,
                "rank": spec.rank,
                "coordinator": coordinator or self.host,
                "rank_restartable": spec.restartable,  # a failing card stops it (xpud.service.gangjobs)
                "restarts": spec.restarts,
            },
            hosts=[self.host],
            lease_id=lease.id,
            started=self.clock(),
        )
        await self.engine.reanchor(lease.id, f"job:{r.id}", also=(jobdb.save_job_op(r), *also))
        try:
            switch = self._switch(r)
            fence = await self._fence(lease)
            await asyncio.shield(supervisor.launch(
                self.dir, r.id, r.argv, dict(spec.env), cwd, rank_files[0], rank_files[1], switch,
                spec.time_limit_s, r.spec["kill_grace_s"], self.systemd_run, fence,
                append=bool(spec.restarts),
            ))  # fmt: skip
        except (OSError, ValueError, ScopeError) as e:
            await self._end(r, jobdb.FAILED, reason=f"could not start: {e}")
            return r
        self.running[r.id] = r
        self.engine.event("job", f"job {spec.job} rank {spec.rank} started as job {r.id} on lease {lease.id}")
        return r

    def _end_future(self, job_id: str) -> asyncio.Future:
        fut = self.ends.get(job_id)
        if fut is None:
            fut = self.ends[job_id] = asyncio.get_running_loop().create_future()
        return fut

    async def wait_end(self, job_id: str) -> JobRecord | None:
        r = self.get(job_id)
        if r is None or r.done:
            return r
        await asyncio.shield(self._end_future(job_id))
        return self.get(job_id)

    async def _end(
        self,
        r: JobRecord,
        state: str,
        reason: str = "",
        exit_code: int | None = None,
        exit_signal: int | None = None,
        ended: float | None = None,
    ) -> None:
        r.state, r.reason, r.env = state, reason, {}
        r.exit_code, r.exit_signal = exit_code, exit_signal
        r.ended = ended or self.clock()
        await self.ledger.write(jobdb.save_job_op(r))
        self.running.pop(r.id, None)
        self.cancelling.discard(r.id)
        if r.lease_id and r.lease_id in self.engine.leases:
            end = CommandEnd(exit_code=exit_code, exit_signal=exit_signal, started=r.started)
            try:
                await self.engine.release(r.lease_id, OPERATOR, "", end)
            except XpudError as e:
                log.error("job %s: releasing lease %s: %s", r.id, r.lease_id, e)
        what = (
            f"exit {exit_code}" if exit_code is not None else f"signal {exit_signal}" if exit_signal else ""
        )
        self.engine.event(
            "job", f"job {r.id} {state}{' (' + what + ')' if what else ''}{': ' + reason if reason else ''}"
        )
        fut = self.ends.pop(r.id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            for r in list(self.running.values()):
                if r.id in self.restarts.busy:  # stopped for a move: started again, not ended
                    continue
                try:
                    await self._check(r)
                except Exception:
                    log.exception("job %s: reading its status", r.id)

    async def _check(self, r: JobRecord, restoring: bool = False) -> None:
        doc = supervisor.read_status(self.dir, r.id)
        if r.spec.get("restartable") and await self.restarts.take_up(r, doc):
            return  # the daemon stopped between its command's stop for a move and its start again
        if doc is not None and doc.get("state") in jobdb.ENDED:
            await self._end(
                r,
                doc["state"],
                reason=str(doc.get("reason", ""))[:500] or r.reason,
                exit_code=doc.get("exit_code"),
                exit_signal=doc.get("exit_signal"),
                ended=doc.get("ended"),
            )
            with contextlib.suppress(OSError):
                supervisor.status_path(self.dir, r.id).unlink()
            return
        spid = doc.get("supervisor") if doc else None
        if spid and supervisor.supervisor_alive(int(spid), r.id):
            if r.id in self.cancelling and restoring:
                with contextlib.suppress(OSError):
                    os.kill(int(spid), signal.SIGTERM)
            return
        # a status that never reached an end, its supervisor gone (or never started): read once more, as
        # the supervisor may have written its end between the two reads
        doc = supervisor.read_status(self.dir, r.id)
        if doc is not None and doc.get("state") in jobdb.ENDED:
            return await self._check(r)
        await self._end(r, jobdb.LOST, reason="its supervisor is gone without recording an end")

    def lease_ended(self, lease) -> None:
        """``engine.on_ended``: a running job's lease ended under it (an operator's eviction, the reaper, a
        health move-off): the job is stopped as a cancel stops it, so that it does not go on using cards
        that are no longer its own. Its own end (the book releases the lease then) passes here too: no-op."""
        kind, _, job_id = getattr(lease, "anchor", "").partition(":")
        r = self.running.get(job_id) if kind == "job" else None
        if r is None or r.lease_id != lease.id or r.id in self.cancelling:
            return
        if r.id in self.restarts.busy:  # being stopped to restart or requeue: that path ends it as it should
            return  # (the accounts controller ends a reclaimed lease after STOP_S, a long kill grace before)
        doc = supervisor.read_status(self.dir, r.id) or {}
        spid = doc.get("supervisor")
        if doc.get("state") in jobdb.ENDED or not (spid and supervisor.supervisor_alive(int(spid), r.id)):
            return  # it ended already; the poller records it
        self.cancelling.add(r.id)
        r.reason = f"its lease ended: {getattr(lease, 'end_reason', '') or 'ended'}"[:500]
        os.kill(int(spid), signal.SIGTERM)
        log.info("job %s: %s; stopping it", r.id, r.reason)

    # ------------------------------------------------------------------ cancel
    async def cancel(self, r: JobRecord, caller: Caller) -> JobRecord:
        """Cancel ``r`` (its owner or an operator): a queued job leaves the queue and ends
        ``cancelled``; a running one's supervisor gets SIGTERM (TERM to the job, KILL after its grace) and
        ends it ``cancelled``. An ended job is left as it is."""
        if not may_act(r, caller):
            raise Forbidden(f"job {r.id} belongs to uid {r.uid}: only its owner or an operator may cancel it")
        if r.done:
            return r
        task = self.waiting.get(r.id)
        if task is not None:
            self.cancelled_by[r.id] = caller.uid
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return self.get(r.id) or r
        live = self.running.get(r.id)
        if live is None:
            raise Conflict(f"job {r.id} is {r.state} but not in this daemon's hands: try again in a moment")
        doc = supervisor.read_status(self.dir, r.id) or {}
        spid = doc.get("supervisor")
        self.cancelling.add(r.id)
        if spid and supervisor.supervisor_alive(int(spid), r.id):
            os.kill(int(spid), signal.SIGTERM)
        live.reason = f"cancel asked by uid {caller.uid}"
        return live
