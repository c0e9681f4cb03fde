"""One host's side of multi-host jobs: the Peer service's Reserve, Commit and Abort (and the hooks the
Launch handler uses). This host stays the only authority over its cards.

Invariants: a reservation is a lease of this host's engine (so the engine never gives its cards to anyone
else) plus a row in the ledger's ``reservations`` table, both written before the coordinator hears of it;
expiry, commit and abort change the lease and the row in one ledger transaction; Reserve, Commit and
Abort run to their end even when the caller goes away (``uninterrupted``), so the table and the ledger
never disagree. The decision logic is ``reserve.Reservations``'s; this module adds the engine, the ledger
and the clock.

The life of a reservation (expiry, commit, abort, restart) and the Launch hooks: see docs/federation.md,
Reservations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from xpud.api.auth import member_of, user_and_groups
from xpud.api.v1 import xpu_pb2 as pb
from xpud.config.accounts import resolve
from xpud.config.schema import ClusterSection
from xpud.engine.uninterrupted import uninterrupted
from xpud.errors import BadRequest, Conflict, Forbidden, NoCapacity
from xpud.federation import trust
from xpud.federation.reserve import Refused, Reservation, Reservations, ResState, check_request
from xpud.federation.room import Room
from xpud.isolation.scope import ScopeError
from xpud.ledger import accounts as ledger_accounts
from xpud.ledger.ledger import LedgerUnavailable, ReservationRecord
from xpud.model import HealthState, Lease, LeaseState, Mode, Request

log = logging.getLogger("xpud.hostjobs")

RESTART = "restart: "  # RankEnded.error of a rank stopped because a card under it failed (item: moves)
RESERVE_BUSY_WAIT_S = 1.0  # a Reserve waits this long for busy cards (the coordinator waits 5 s per step)
MAX_REMEMBERED = 10_000  # entries of the reservation table (ended ones are forgotten after KEEP_ENDED_S)
KEEP_ENDED_S = 600.0  # ended reservations are remembered this long (a retried message gets its answer)

Kill = Callable[[], Awaitable[None]]


@dataclass
class _Job:
    lease_id: str
    ttl_s: float
    hold: asyncio.Queue | None = None  # this module holds the lease (the engine's reaper leaves it)
    watcher: asyncio.Task | None = None
    kill: Kill | None = None  # the rank's, once launching
    launch_by: float = 0.0  # a committed job not launched by then is released


def free_port(host: str = "") -> int:
    """A TCP port free on this host now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kill_session(pid: int) -> None:
    """SIGKILL the process group of a rank started before a restart, if it still runs: ranks lead a session
    of their own (pid = session id), which another process reusing the pid would not."""
    try:
        if os.getsid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            log.warning("killed the process group %d of a rank started before this daemon restarted", pid)
    except (ProcessLookupError, PermissionError):
        pass


async def _stop_units(job: str) -> None:
    """Ranks run as systemd units here: stop ``job``'s (killing systemd-run's session does not)."""
    from xpud.federation import rankproc, sysunit

    units = rankproc.default_units()
    if units is not None:
        rc, _ = await units.runner(sysunit.stop_job_argv(job))
        await units.runner(sysunit.reset_job_argv(job))  # stopped, they failed: unloaded for a next attempt
        log.warning("stopped the units of job %s started before this daemon restarted (exit %d)", job, rc)


def _live(r: Reservation) -> bool:
    return r.state in (ResState.HELD, ResState.COMMITTED)


class HostJobs:
    """Reserve/Commit/Abort for this host. ``peer`` is the calling host's name (from its certificate),
    or None/"" when this host coordinates the job itself."""

    def __init__(
        self,
        engine,
        ledger,
        cluster: ClusterSection | None = None,
        clock: Callable[[], float] = time.time,
        scopes=None,
    ) -> None:
        self.engine = engine
        self.scopes = scopes  # xpud.isolation.scope.Scopes: ranks in their lease's device scope (or None)
        self.ledger = ledger
        self.cluster = cluster  # [cluster]: this host's name, remote_launch, the uids peers may send
        self.clock = clock
        self.table = Reservations()
        self.jobs: dict[str, _Job] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self.restarting: dict[str, str] = {}  # job -> why its rank here was stopped for a restart
        self.coordinating: list = []  # jobrun.JobRun waiting for room, in order (their queue positions)
        self.room = Room()  # news of room for them when federation is off (jobrun.JobRun.room)
        self.turn = asyncio.Lock()  # queued jobs plan again one at a time, in queue order

    @property
    def name(self) -> str:
        cluster = self.cluster
        return (getattr(cluster, "name", "") or socket.gethostname()) if cluster else socket.gethostname()

    def _lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    # ------------------------------------------------------------------------------ restore
    async def restore(self) -> None:
        """Take back the ledger's held and committed reservations (after the engine restored leases)."""
        now = self.clock()
        for r in self.ledger.live_reservations():
            lease = self.engine.leases.get(r.lease_id)
            if lease is None:  # reclaimed at start-up (its card gone): the reservation ended with it
                await self._try(self.ledger.end_reservation_op(r.job, r.attempt, "released", now))
                continue
            res = Reservation(r.job, r.attempt, r.coordinator, r.cards, r.created, r.expires)
            if r.state == "committed":
                res = replace(res, state=ResState.COMMITTED)
            self.table.put(res)
            self._track(r.job, r.lease_id, r.ttl_s, launch_by=now + r.ttl_s)
            if r.state == "committed":  # its unit may exist before its pid was durable: stopped by name
                await _stop_units(r.job)
            if r.state == "committed" and r.rank_pid:  # launched before the restart: its stream is gone
                _kill_session(r.rank_pid)
                await self.drop(r.job, r.attempt, "its rank's daemon restarted; the rank was stopped")
        await self.expire()

    # ------------------------------------------------------------------------------ Peer handlers
    def exempt(self, uid: int, gid: int) -> bool:
        """Whether this host's [limits] pass the submitter by, as for a local caller: operators (root,
        this daemon's uid, [daemon] admin_group) and [limits] exempt_groups. Reads the group database."""
        cfg = self.engine.cfg
        if uid in (0, os.getuid()):
            return True
        return member_of(uid, gid, (cfg.daemon.admin_group, *cfg.limits.exempt_groups))

    def account_of(self, uid: int, gid: int, asked: str = "") -> str:
        """The account a reservation of ``uid`` is charged to here: ``asked`` (``--account``: it must be an
        account of this host's [accounts], the same on every host, with the submitter a member of it here),
        else the submitter's first account, else default. Reads the group database. BadRequest (one line)
        for an unknown account or one the submitter is not a member of."""
        user, groups = user_and_groups(uid, gid)
        try:
            return resolve(self.engine.cfg.named_accounts, asked, user, groups)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    @uninterrupted
    async def reserve(self, req: pb.ReserveRequest, peer: str | None = None) -> pb.ReserveReply:
        cluster = self.cluster
        if peer and peer != self.name and cluster is not None and not cluster.remote_launch:
            raise Forbidden(
                f"host {self.name} takes no jobs from other hosts ([cluster] remote_launch = false there)"
            )
        trust.check_uid(req.uid, peer, self.name, cluster)
        mode = self._mode(req.mode)
        count = req.count or 1
        if mode is not Mode.XPU and count != 1:
            raise BadRequest(f"count {count} with mode {mode}: one slice per host; reserve on more hosts")
        try:
            pwd_entry = await asyncio.to_thread(pwd.getpwuid, req.uid)
        except KeyError:
            raise Forbidden(
                f"uid {req.uid}{f' ({req.user})' if req.user else ''} does not exist on host {self.name}: "
                "create the user there (same uid) or run the job on other hosts"
            ) from None
        exempt = await asyncio.to_thread(self.exempt, req.uid, pwd_entry.pw_gid)  # this host's groups
        try:
            account = await asyncio.to_thread(self.account_of, req.uid, pwd_entry.pw_gid, req.account)
        except BadRequest as e:  # [accounts] or the user's groups differ from the coordinator's
            raise BadRequest(f"host {self.name}: {e}") from None
        async with self._lock(req.job):
            now = self.clock()
            self.table.expire(now)
            old = self.table.get(req.job)
            if old is not None and old.coordinator not in ("", trust.caller(peer, self.name)):
                if _live(old):
                    trust.check_coordinator(req.job, old.coordinator, peer, self.name, "reserve")
                self.table.remove(req.job)  # ended, another host's (an abort that came first): not this one's
                old = None
            if old is not None:
                if req.attempt < old.attempt:
                    raise Conflict(
                        f"job {req.job}: attempt {req.attempt} is older than attempt {old.attempt}"
                    )
                if req.attempt == old.attempt:
                    if old.state is ResState.HELD:  # a retried message: the same answer
                        return pb.ReserveReply(cards=old.cards, expires_in_s=max(old.expires - now, 0.0))
                    raise Conflict(f"job {req.job} attempt {req.attempt} is {old.state} on host {self.name}")
                if old.state is ResState.COMMITTED:
                    raise Conflict(f"job {req.job} is committed on host {self.name} (attempt {old.attempt})")
                if old.state is ResState.HELD:  # a newer attempt replaces it
                    await self._end_held(old, ResState.ABORTED, f"replaced by attempt {req.attempt}")
            try:  # the table's checks on the id, attempt and TTL, before anything is granted
                check_request(req.job, req.attempt, req.ttl_s)
            except Refused as e:
                raise BadRequest(str(e)) from None
            request = self.engine.validate(
                Request(
                    mode=mode,
                    gpus=count if mode is Mode.XPU else 1,
                    owner_uid=req.uid,
                    restartable=req.restartable,
                    command=f"job {req.job}: {req.command}"[:500],
                    exempt=exempt,  # this host's [limits] apply to the submitter (a reservation is a lease)
                    account=account,
                )
            )
            self.engine.check_limits(request)  # NoCapacity naming the [limits] key, as for a lease
            granted = await self.engine.try_grant(request, RESERVE_BUSY_WAIT_S)
            if granted is None:
                raise NoCapacity(f"host {self.name}: {self.engine.why_not(request)}")
            lease = granted[0]
            now = self.clock()
            rec = ReservationRecord(
                req.job,
                req.attempt,
                peer or self.name,
                lease.id,
                lease.cards,
                req.ttl_s,
                now,
                now + req.ttl_s,
                "held",
            )
            try:
                await self.ledger.write(
                    self.ledger.save_reservation_op(rec),
                    ledger_accounts.set_reservation_account_op(req.job, req.attempt, account),
                )
            except BaseException:
                await self.engine.reclaim(lease.id, f"job {req.job}: recording its reservation failed")
                raise
            try:  # slices of different jobs share a card: the engine granted this one its own
                res = self.table.reserve(
                    req.job,
                    req.attempt,
                    rec.coordinator,
                    lease.cards,
                    req.ttl_s,
                    now,
                    set(lease.cards),
                    shared=mode is not Mode.XPU,
                )
            except Refused as e:  # undo what was written: the row and the lease, together
                end = self.ledger.end_reservation_op(
                    req.job, req.attempt, ResState.ABORTED.value, self.clock()
                )
                if await self.engine.reclaim(lease.id, f"job {req.job}: {e}", also=(end,)) is None:
                    await self.ledger.write(end)
                raise Conflict(f"host {self.name}: job {req.job}: {e}") from None
            self.restarting.pop(req.job, None)  # a new attempt: whatever stopped the last one is over
            self._track(req.job, lease.id, req.ttl_s)
            self.engine.mark(
                lease.id, f"reserved for job {req.job} by {rec.coordinator} (user {pwd_entry.pw_name})"
            )
            log.info(
                "job %s attempt %d: reserved card(s) %s (lease %s)",
                req.job,
                req.attempt,
                lease.cards,
                lease.id,
            )
            return pb.ReserveReply(cards=res.cards, expires_in_s=req.ttl_s)

    @uninterrupted
    async def commit(self, req: pb.CommitRequest, peer: str | None = None) -> pb.CommitReply:
        async with self._lock(req.job):
            now = self.clock()
            await self._expire_due(now)
            try:
                before = self.table.get(req.job)
                if before is not None:
                    trust.check_coordinator(req.job, before.coordinator, peer, self.name, "commit")
                was = before.state if before is not None else None
                res = self.table.commit(req.job, req.attempt, now)
            except Refused as e:
                raise Conflict(f"host {self.name}: {e}") from None
            job = self.jobs[req.job]
            if was is ResState.HELD:
                text = f"job {req.job} (multi-host)"
                # the table says committed from here: so does its launch deadline (the reaper may pass
                # while the row is written; a deadline of 0 there released the job at once)
                job.launch_by = now + job.ttl_s
                try:
                    await self.ledger.write(
                        self.ledger.save_reservation_op(
                            ReservationRecord(
                                res.job,
                                res.attempt,
                                res.coordinator,
                                job.lease_id,
                                res.cards,
                                job.ttl_s,
                                res.created,
                                res.expires,
                                "committed",
                            )
                        ),
                        self.ledger.set_mark_op(job.lease_id, text),
                    )
                except BaseException:
                    self.table.put(before)  # nothing changed: still held
                    raise
                self.engine.mark(job.lease_id, text)
            lease = self.engine.leases[job.lease_id]
            return pb.CommitReply(
                lease_id=lease.id,
                cards=lease.cards,
                env=lease.env,
                free_port=await asyncio.to_thread(free_port),
            )

    async def abort(self, req: pb.AbortRequest, peer: str | None = None) -> pb.AbortReply:
        dropped = await self.drop(req.job, req.attempt, f"aborted by {peer or self.name}", peer or self.name)
        return pb.AbortReply(dropped=dropped)

    @uninterrupted
    async def drop(self, job: str, attempt: int | None, why: str, by: str = "") -> bool:
        """End ``job`` here at whatever stage (``attempt`` None: any). True when something was dropped.
        ``by``: the host that asks (an abort): it must be the job's coordinator here, and an abort that
        overtook its reserve is remembered as that host's."""
        async with self._lock(job):
            r = self.table.get(job)
            if by and r is not None:
                trust.check_coordinator(job, r.coordinator, by, self.name, "abort")
            if attempt is not None and (r is None or (r.attempt < attempt and not _live(r))):
                self._overtaken(job, attempt, by)
                return False
            if r is None or (attempt is not None and r.attempt != attempt):
                return False
            if r.state is ResState.HELD:
                await self._end_held(r, ResState.ABORTED, why)
                return True
            if r.state is ResState.COMMITTED:
                await self._end_committed(r, why)
                return True
            return False

    def _overtaken(self, job: str, attempt: int, by: str = "") -> None:
        """An abort that overtook its reserve (the coordinator was cancelled while its Reserve was on the
        way): remember the attempt as aborted, so that the reserve is refused when it comes rather than
        holding cards for its whole TTL. Forgotten with the other ended entries; at most
        ``MAX_REMEMBERED`` entries in all."""
        if len(self.table) < MAX_REMEMBERED:
            now = self.clock()
            self.table.put(Reservation(job, attempt, by, (), now, now, ResState.ABORTED))

    # ------------------------------------------------------------------------------ Launch hooks
    def launching(self, job: str, kill: Kill) -> Lease:
        """The Launch handler starts ``job``'s rank here: the job must be committed on this host. ``kill``
        stops the rank (awaited before an abort releases the lease)."""
        r = self.table.get(job)
        j = self.jobs.get(job)
        if (
            r is None
            or r.state is not ResState.COMMITTED
            or j is None
            or j.lease_id not in self.engine.leases
        ):
            raise Conflict(f"job {job} is not committed on host {self.name}: reserve and commit it first")
        if j.kill is not None:
            raise Conflict(f"job {job}: its rank is running on host {self.name} already")
        j.kill = kill
        return self.engine.leases[j.lease_id]

    async def launch_ended(self, job: str, reason: str) -> None:
        """The rank is gone (it ended, or the Launch stream broke): release the job's lease here."""
        j = self.jobs.get(job)
        if j is not None:
            j.kill = None
        await self.drop(job, None, reason)

    async def launch(
        self, requests: AsyncIterator[pb.LaunchInput], peer: str | None = None, context=None
    ) -> AsyncIterator[pb.LaunchEvent]:
        """``Peer.Launch``: run the rank of a job committed here (``rankproc.Rank``) and release the job's
        lease here once it is gone. An abort stops it first (``Rank.kill``: SIGTERM, then SIGKILL)."""
        from xpud.federation import rankproc, tasks

        requests = aiter(requests)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("what") != "start":
            raise BadRequest("Launch: the first message must be start (a LaunchSpec)")
        spec = first.start
        cluster = self.cluster
        trust.check_uid(spec.uid, peer, self.name, cluster)
        held = self.table.get(spec.job)
        if held is not None:
            trust.check_coordinator(spec.job, held.coordinator, peer, self.name, "launch")
        lease = self.lease_of(spec.job)
        if lease is not None and spec.uid != lease.owner_uid:
            raise Forbidden(f"job {spec.job}: uid {spec.uid} does not own its lease on host {self.name}")
        rank = None

        async def kill() -> None:  # an abort: SIGTERM, SIGKILL after the grace; returns once reaped
            if rank is not None:
                await rank.kill()

        self.launching(spec.job, kill)  # raises unless the job is committed here

        def on_end(ended: pb.RankEnded) -> None:  # the rank is reaped: the job's lease here is released
            # in a task: an abort in progress holds the job and waits (in ``kill``) for this very end
            why = ended.error or f"its rank ended (exit {ended.exit_code})"
            self._spawn(self.launch_ended(spec.job, why))

        allowed = not peer or peer == self.name or cluster is None or cluster.remote_launch

        async def on_start(pid: int) -> None:
            # ledger first: the pid is durable before the rank runs its command (it waits at a gate until
            # this returns) and before anyone hears it started, so a daemon that crashes from here on finds
            # and stops its group when it restarts (``restore``); if this fails, the rank runs nothing
            r = self.table.get(spec.job)
            if r is not None:
                await self.ledger.write(self.ledger.set_rank_pid_op(spec.job, r.attempt, pid))
            if devices and rank is not None and not rank.unit:  # a child, not a unit: into the lease's scope
                await self.scopes.place(lease, pid)

        devices: tuple[str, ...] = ()
        try:
            r = self.table.get(spec.job)  # committed (``launching`` checked): its attempt names the unit
            attempt = r.attempt if r is not None else 0
            devices = await rank_devices(self.scopes, lease)
            # --tasks-per-node: the user's command runs under the task launcher, as the user
            rank = rankproc.Rank(tasks.wrap(spec), requests, on_end, on_start=on_start,
                                 remote_launch=allowed, attempt=attempt, devices=devices)  # fmt: skip
        except BaseException:
            await self.launch_ended(spec.job, "its rank could not be started")
            raise
        async for ev in rank.events():
            if ev.HasField("ended") and spec.job in self.restarting:
                ev.ended.error = f"{RESTART}{self.restarting[spec.job]}"[:1000]
            yield ev

    async def hand_over(self, spec: pb.LaunchSpec, peer: str | None, adopt) -> object:
        """A submitted multi-host job's rank (``StartRank``): the job committed here stops being a
        reservation and becomes a detached job of this host (it outlives this daemon). ``adopt(lease,
        end_op)`` records that job and anchors the lease to it in one transaction with ``end_op`` (the
        reservation's end) and starts it; its result is returned. Raises as ``launch`` does (not
        committed here, another's uid)."""
        trust.check_uid(spec.uid, peer, self.name, self.cluster)
        cluster = self.cluster
        if peer and peer != self.name and cluster is not None and not cluster.remote_launch:
            raise Forbidden(
                f"host {self.name} takes no jobs from other hosts ([cluster] remote_launch = false there)"
            )
        async with self._lock(spec.job):
            r = self.table.get(spec.job)
            if r is not None:
                trust.check_coordinator(spec.job, r.coordinator, peer, self.name, "launch")
            j = self.jobs.get(spec.job)
            lease = self.lease_of(spec.job)
            if r is None or r.state is not ResState.COMMITTED or j is None or lease is None:
                raise Conflict(
                    f"job {spec.job} is not committed on host {self.name}: reserve and commit it first"
                )
            if j.kill is not None:
                raise Conflict(f"job {spec.job}: its rank is running on host {self.name} already")
            if spec.uid != lease.owner_uid:
                raise Forbidden(f"job {spec.job}: uid {spec.uid} does not own its lease on host {self.name}")
            end = self.ledger.end_reservation_op(spec.job, r.attempt, "released", self.clock())
            self.table.put(replace(r, state=ResState.ABORTED))  # the watcher leaves the lease alone
            try:
                out = await adopt(lease, end)
            except BaseException:
                self.table.put(r)  # still committed: the coordinator's abort releases it
                raise
            if j.watcher is not None:
                j.watcher.cancel()  # its Hold queue closes; the lease is the detached job's now
            log.info("job %s rank %d: handed to this host's detached jobs", spec.job, spec.rank)
            return out

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def lease_of(self, job: str) -> Lease | None:
        j = self.jobs.get(job)
        return self.engine.leases.get(j.lease_id) if j is not None else None

    # ------------------------------------------------------------------------------ time
    async def expire(self) -> None:
        """Held reservations past their TTL, and committed jobs not launched in time, end here (the
        daemon's reaper calls this; nobody else needs to)."""
        now = self.clock()
        await self._expire_due(now)
        for r in self.table.all():
            job = r.job
            j = self.jobs.get(job)
            if r.state is ResState.COMMITTED and j is not None and j.kill is None and now >= j.launch_by:
                await self.drop(job, r.attempt, "not launched within its TTL after the commit")
        self.table.forget(now - KEEP_ENDED_S)
        for job in list(self.jobs):
            if self.table.get(job) is None:
                del self.jobs[job]
                self.restarting.pop(job, None)
        for job in list(self._locks):
            if self.table.get(job) is None and not self._locks[job].locked():
                del self._locks[job]

    async def _expire_due(self, now: float) -> None:
        for r in list(self.table.active()):
            if now >= r.expires:
                await self._end_held(
                    r, ResState.EXPIRED, f"not committed within its TTL ({self.jobs[r.job].ttl_s:g} s)"
                )

    # ------------------------------------------------------------------------------ internals
    def _mode(self, text: str) -> Mode:
        try:
            return Mode(text or "xpu")
        except ValueError:
            sizes = ", ".join(["xpu", *self.engine.cfg.slices])
            raise BadRequest(f"mode {text[:64]!r}: use one of {sizes}") from None

    def _track(self, job: str, lease_id: str, ttl_s: float, launch_by: float = 0.0) -> None:
        """Hold the lease (so the engine's reaper leaves it) and follow its events."""
        q = self.engine.hold_opened(lease_id)
        j = _Job(lease_id, ttl_s, hold=q, launch_by=launch_by)
        self.jobs[job] = j
        j.watcher = asyncio.ensure_future(self._watch(job, lease_id, q))

    async def _watch(self, job: str, lease_id: str, q: asyncio.Queue) -> None:
        """The lease ended by someone else (an operator's evict, a reclaim): the job ends here with it. A
        card under it that went unhealthy ends it here too, whether this host found another card for it (a
        ``move``) or not (a ``mark`` saying so): a gang cannot move one rank, so the rank ends with
        ``RESTART`` in its error and the coordinator restarts the whole job, on other hosts if need be."""
        try:
            while True:
                ev = await q.get()
                if ev.kind == "released":
                    break
                if ev.kind not in ("move", "mark") or job in self.restarting:
                    continue
                why = self._failed_card(lease_id) or (ev.message if ev.kind == "move" else "")
                if why:
                    self.restarting[job] = why
                    self._spawn(self.drop(job, None, f"{why}; the job restarts"))
        finally:
            self.engine.hold_closed(lease_id, q)
        r = self.table.get(job)
        j = self.jobs.get(job)
        if r is None or j is None or j.lease_id != lease_id or not _live(r):
            return
        kill = j.kill
        if kill is not None:
            with contextlib.suppress(Exception):
                await kill()
        state = "aborted" if r.state is ResState.HELD else "released"
        self.table.put(replace(r, state=ResState.ABORTED))
        await self._try(self.ledger.end_reservation_op(job, r.attempt, state, self.clock()))

    def _failed_card(self, lease_id: str) -> str:
        """Why the lease cannot go on here: a card under it is unhealthy ("" when none is)."""
        lease = self.engine.leases.get(lease_id)
        for i in lease.cards if lease is not None else ():
            c = self.engine.resolve_card(str(i))
            if c.health_state is HealthState.UNHEALTHY:
                return f"card {i} on host {self.name} is unhealthy ({c.health_reason or 'failed its checks'})"
        return ""

    async def _end_held(self, r: Reservation, state: ResState, why: str) -> None:
        """End a held reservation: its row and its lease in one transaction, then the cards are free."""
        j = self.jobs[r.job]
        reason = f"job {r.job} attempt {r.attempt}: {why}"
        op = self.ledger.end_reservation_op(r.job, r.attempt, state.value, self.clock())
        self.table.put(replace(r, state=state))  # the watcher leaves it to us
        try:
            if await self.engine.reclaim(j.lease_id, reason, also=(op,)) is None:
                await self.ledger.write(op)
        except BaseException:
            self.table.put(r)
            raise
        log.info("%s", reason)

    async def _end_committed(self, r: Reservation, why: str) -> None:
        j = self.jobs[r.job]
        kill, j.kill = j.kill, None
        if kill is not None:
            try:
                await kill()
            except Exception as e:  # the lease is released anyway: its process group is the hook's
                log.error("job %s: stopping its rank failed: %s", r.job, e)
        reason = f"job {r.job}: {why}"
        op = self.ledger.end_reservation_op(r.job, r.attempt, "released", self.clock())
        self.table.put(replace(r, state=ResState.ABORTED))
        try:
            ended = await self.engine.reclaim(j.lease_id, reason, state=LeaseState.RELEASED, also=(op,))
            if ended is None:
                await self.ledger.write(op)
        except BaseException:
            self.table.put(r)
            raise
        log.info("%s", reason)

    async def _try(self, *ops) -> None:
        try:
            await self.ledger.write(*ops)
        except LedgerUnavailable as e:
            log.error("%s", e)


async def rank_devices(scopes, lease) -> tuple[str, ...]:
    """The ``DeviceAllow=`` list of a rank's unit (README "Isolation"), or () where isolation is advisory.
    Raises rankproc.Refused when the lease's nodes cannot be named: the rank would run unfenced."""
    from xpud.federation import rankproc

    if scopes is None or lease is None or not scopes.enforcement.enforced:
        return ()
    try:
        return tuple(await scopes.allow_async(lease))
    except ScopeError as e:
        raise rankproc.Refused(f"device isolation: {e}") from None
