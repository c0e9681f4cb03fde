"""The coordinator of a multi-host job (``Node.RunJob``): the daemon the user asked places the job, reserves
and commits it on every chosen host, starts one rank per host and relays the ranks' output and ends.

1. **Check** the ``JobSpec``: ``nodes`` x ``gpus_per_node`` whole cards, or ``replicas`` slices of one
   size with ``spread`` (distinct hosts); a command; an absolute working directory.
2. **Place** with ``placement.multihost`` over ``federation.offers()`` (this host included); with
   federation off, this host is the whole cluster.
3. **Reserve** with ``reserve.coordinate``: ``Reserve`` on every host, ``Commit`` when all hold,
   ``Abort`` and re-plan without a host that refused. Peers are reached over the federation's mutual-TLS
   channels, this host through its ``HostJobs`` directly. With ``wait_s`` the job queues: placement is
   tried again when the view shows more free capacity (``Federation.room``: a host's summary offers
   more, this host released something; with federation off, any change of this host's engine), at the
   latest every ``RETRY_FALLBACK_S`` (``JobQueued`` with the reason and the position among this daemon's
   queued jobs, sent again when either changes). Queued jobs plan again one at a time, in queue order.
4. **Launch**: ``Peer.Launch`` on every host with ``launch.rank_envs`` (``MASTER_ADDR`` = rank 0's host,
   ``MASTER_PORT`` = the port rank 0's host found free at commit); with ``tasks_per_node`` each host's
   rank runs the command that many times under ``tasks`` (a rank here is a host's launcher). Output and
   ends come back as ``JobEvent``s; stdin goes to rank 0, signals to every rank. With
   ``kill_on_bad_exit`` the first failing rank stops the others (SIGTERM, then their Launch calls are
   cancelled: the hosts kill the process groups). ``JobEnded.exit_code`` is the first failing rank's.
5. **However the stream ends** (the job ended, the client went away, an error), every rank is stopped
   and ``Abort`` sent to every host (a held reservation is dropped, a committed lease released). What
   does not answer expires there by its TTL, or releases its lease when its Launch stream breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pwd
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import BadRequest, NoCapacity, XpudError
from xpud.federation import launch, reserve
from xpud.federation.hostjobs import RESTART, HostJobs
from xpud.federation.room import Room
from xpud.model import Caller, Mode, Request
from xpud.placement import multihost

if TYPE_CHECKING:
    from xpud.federation.node import Federation

log = logging.getLogger("xpud.jobrun")

RESERVE_TTL_S = 10.0  # a reservation the coordinator does not commit in time ends on its host
STEP_TIMEOUT_S = 5.0  # one Reserve/Commit/Abort call
MAX_ATTEMPTS = 3  # sets of hosts tried per placement round
RETRY_FALLBACK_S = 5.0  # a queued job plans again at least this often, news of room or not
RETRY_MIN_GAP_S = 0.05  # and at most this often, however much news arrives
STOP_GRACE_S = 5.0  # after SIGTERM to the other ranks, their Launch calls are cancelled
MAX_RESTARTS = 10  # restarts of a --restartable job after a card under one of its ranks failed
MAX_EARLY_SIGNALS = 16  # signals kept for the new ranks while a restart has none running


@dataclass
class _Rank:
    rank: int
    host: str
    addr: str
    inputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    ended: bool = False


class _LocalLink:
    """This host, through its HostJobs."""

    def __init__(self, run: JobRun) -> None:
        self.run = run

    async def reserve(self, job: str, attempt: int, gpus: int, ttl_s: float) -> tuple[int, ...]:
        reply = await self.run.hostjobs.reserve(self.run.reserve_request(attempt, gpus, ttl_s), None)
        return tuple(reply.cards)

    async def commit(self, job: str, attempt: int) -> None:
        self.run.commits[self.run.me] = await self.run.hostjobs.commit(
            pb.CommitRequest(job=job, attempt=attempt), None
        )

    async def abort(self, job: str, attempt: int) -> None:
        await self.run.hostjobs.abort(pb.AbortRequest(job=job, attempt=attempt), None)


class _PeerLink:
    """Another host, over the federation's mutual-TLS channel."""

    def __init__(self, run: JobRun, host: str) -> None:
        self.run, self.host = run, host
        self.stub = pbg.PeerStub(run.federation.channel(run.addrs[host]))

    async def reserve(self, job: str, attempt: int, gpus: int, ttl_s: float) -> tuple[int, ...]:
        req = self.run.reserve_request(attempt, gpus, ttl_s)
        reply = await _rpc(self.stub.Reserve(req, timeout=STEP_TIMEOUT_S), self.host)
        return tuple(reply.cards)

    async def commit(self, job: str, attempt: int) -> None:
        req = pb.CommitRequest(job=job, attempt=attempt)
        self.run.commits[self.host] = await _rpc(self.stub.Commit(req, timeout=STEP_TIMEOUT_S), self.host)

    async def abort(self, job: str, attempt: int) -> None:
        req = pb.AbortRequest(job=job, attempt=attempt)
        await _rpc(self.stub.Abort(req, timeout=STEP_TIMEOUT_S), self.host)


async def _rpc(call, host: str):
    try:
        return await call
    except grpc.aio.AioRpcError as e:
        raise reserve.Refused(f"{e.details() or e.code().name}") from None


class JobRun:
    """One RunJob call. ``events(inputs)`` yields the JobEvents; its end (however) cleans up."""

    def __init__(
        self, hostjobs: HostJobs, federation: Federation | None, spec: pb.JobSpec, caller: Caller
    ) -> None:
        self.spec = spec
        self.caller = caller
        self.hostjobs = hostjobs
        self.federation = federation  # None: federation is off, this host is the whole cluster
        self.me = self.federation.name if self.federation is not None else self.hostjobs.name
        self.job = secrets.token_hex(8)
        self.user = ""
        self.account = ""  # resolved by check(): every host's lease is charged to it
        self.mode = Mode.XPU
        self.addrs: dict[str, str] = {}
        self.commits: dict[str, pb.CommitReply] = {}
        self.attempts = 0
        self.hosts: dict[str, tuple[int, ...]] = {}
        self.ranks: list[_Rank] = []
        self.restarts = 0
        self.user_signals: set[int] = set()  # signals the user sent to every rank (Ctrl-C, ...)
        self._out: asyncio.Queue = asyncio.Queue()  # (rank, event) of the ranks running now
        self._early: list[pb.LaunchInput] = []  # signals sent while a restart has no ranks running
        self._ranks_up = asyncio.Event()  # ranks run (stdin waits for them during a restart)
        self._stdin_closed = False  # the client's stdin ended: a restarted rank 0 gets EOF at once

    # ------------------------------------------------------------------------------ checks
    async def check(self) -> None:
        s, cfg = self.spec, self.hostjobs.engine.cfg
        try:
            self.mode = Mode(s.mode or "xpu")
        except ValueError:
            raise BadRequest(f"mode {s.mode[:64]!r}: use xpu or one of {', '.join(cfg.slices)}") from None
        if self.mode is Mode.XPU:
            if s.replicas:
                raise BadRequest(
                    "--replicas is for slices (--mode vxpu-...); whole cards: --nodes N --gpus-per-node G"
                )
            if not s.nodes or not s.gpus_per_node:
                raise BadRequest("a multi-host job needs --nodes N (hosts) and --gpus-per-node G (cards)")
        else:
            if self.mode.value not in cfg.slices:
                raise BadRequest(f"mode {self.mode}: no such slice size; use one of {', '.join(cfg.slices)}")
            if s.nodes or s.gpus_per_node > 1:
                raise BadRequest(f"mode {self.mode}: give --replicas R --spread (one slice per host)")
            if not s.replicas or not s.spread:
                raise BadRequest(f"mode {self.mode}: give --replicas R with --spread (distinct hosts)")
        if s.tasks_per_node and self.mode is not Mode.XPU:
            raise BadRequest("--tasks-per-node goes with --nodes N (whole cards), not with --replicas")
        if not s.argv:
            raise BadRequest("no command: give one after --")
        if not s.cwd.startswith("/"):
            raise BadRequest(f"working directory {s.cwd[:80]!r}: give an absolute path")
        if not 0 <= s.wait_s <= cfg.leases.max_wait_s:
            raise BadRequest(f"--wait {s.wait_s:g}: must be 0..{cfg.leases.max_wait_s:g} seconds")
        try:
            self.user = (await asyncio.to_thread(pwd.getpwuid, self.caller.uid)).pw_name
        except KeyError:
            self.user = ""
        # the account, checked here first (one line for the caller); each host checks membership again
        gid = self.caller.gid
        if gid < 0:
            with contextlib.suppress(KeyError):
                gid = (await asyncio.to_thread(pwd.getpwuid, self.caller.uid)).pw_gid
        self.account = await asyncio.to_thread(self.hostjobs.account_of, self.caller.uid, gid, s.account)
        # this host's [limits] for the submitter before asking any host (each host checks its own too)
        exempt = self.caller.admin or await asyncio.to_thread(
            self.hostjobs.exempt, self.caller.uid, self.caller.gid
        )
        self.hostjobs.engine.check_limits(
            Request(mode=self.mode, gpus=1, owner_uid=self.caller.uid, exempt=exempt)
        )

    @property
    def count(self) -> int:
        return self.spec.nodes if self.mode is Mode.XPU else self.spec.replicas

    @property
    def per_host(self) -> int:
        return self.spec.gpus_per_node if self.mode is Mode.XPU else 1

    def reserve_request(self, attempt: int, gpus: int, ttl_s: float) -> pb.ReserveRequest:
        return pb.ReserveRequest(
            job=self.job,
            attempt=attempt,
            mode=self.mode.value,
            count=gpus,
            ttl_s=ttl_s,
            uid=self.caller.uid,
            gid=max(self.caller.gid, 0),
            user=self.user,
            restartable=self.spec.restartable,
            command=" ".join(self.spec.argv)[:500],
            account=self.account,
        )

    # ------------------------------------------------------------------------------ placement
    def _offers(self) -> list[multihost.HostOffer]:
        if self.federation is None:
            return []
        self.addrs = {e.name: e.addr for e in self.federation.members()}
        self.addrs[self.me] = self.federation.addr
        return self.federation.offers()

    def _plan(self, excluded: set[str]) -> list[str]:
        if self.federation is None:  # federation off: this host is the whole cluster
            if self.count > 1:
                raise multihost.ClusterTooSmall(
                    f"{self.count} hosts asked, and federation is off here ([cluster] listen): one host"
                )
            return [] if self.me in excluded else [self.me]
        known = len({e.name for e in self.federation.members()} | {self.me})  # dead ones may come back
        if self.count > known:
            raise multihost.ClusterTooSmall(
                f"{self.count} hosts asked; the cluster has {known} (`xpu cluster`): waiting cannot help, "
                f"ask for {known} at most"
            )
        offers = self._offers()
        skip = sorted(excluded)
        if self.mode is Mode.XPU:
            return list(multihost.place_gang(offers, self.count, self.per_host, exclude=skip).hosts)
        return list(multihost.place_replicas(offers, self.mode.value, self.count, exclude=skip))

    def _link(self, host: str):
        return _LocalLink(self) if host == self.me else _PeerLink(self, host)

    async def _place_once(self) -> reserve.Outcome:
        def plan(excluded: set[str]) -> list[str]:
            try:
                return self._plan(excluded)
            except multihost.NoPlacement:
                if not excluded:
                    raise
                return []

        outcome = await reserve.coordinate(
            f"{self.job}",
            plan,
            self._link,
            self.per_host,
            ttl_s=RESERVE_TTL_S,
            max_attempts=MAX_ATTEMPTS,
            step_timeout_s=STEP_TIMEOUT_S,
            first_attempt=self.attempts,
        )
        return outcome

    @property
    def room(self) -> Room:
        """News of more free capacity: the federation's, or (federation off) this host's own."""
        return self.federation.room if self.federation is not None else self.hostjobs.room

    async def _engine_news(self) -> None:
        """Federation off: every change of this host's engine may have freed room (while queued)."""
        engine = self.hostjobs.engine
        q = engine.watch()
        try:
            while True:
                await q.get()
                self.hostjobs.room.notify()
        finally:
            engine.unwatch(q)

    async def place(self) -> AsyncIterator[pb.JobEvent]:
        """Place, reserve and commit; queue with ``wait_s``. Yields JobQueued updates, then JobPlaced."""
        deadline = time.monotonic() + self.spec.wait_s
        last = None
        follow = None
        room = self.room
        try:
            while True:
                seen = room.seq  # before planning: news that arrives meanwhile is not missed
                tried = time.monotonic()
                try:
                    if last is None:
                        outcome = await self._place_once()
                    else:  # queued: the jobs ahead plan first (they woke first), none overtakes another
                        async with self.hostjobs.turn:
                            outcome = await self._place_once()
                    break
                except (multihost.NoPlacement, reserve.Refused) as e:  # coordinate aborted what it held
                    self.attempts += MAX_ATTEMPTS
                    if isinstance(e, multihost.ClusterTooSmall):
                        raise NoCapacity(f"job cannot be placed: {e}") from None
                    if time.monotonic() >= deadline:
                        hint = "" if self.spec.wait_s else "; add --wait SECONDS to queue for it"
                        raise NoCapacity(f"job cannot be placed: {e}{hint}") from None
                    if self not in self.hostjobs.coordinating:
                        self.hostjobs.coordinating.append(self)
                        if self.federation is None:
                            follow = asyncio.ensure_future(self._engine_news())
                    update = (str(e)[:500], self.hostjobs.coordinating.index(self) + 1)
                    if update != last:
                        last = update
                        yield pb.JobEvent(queued=pb.JobQueued(reason=update[0], position=update[1]))
                    left = deadline - time.monotonic()
                    await room.wait(seen, min(RETRY_FALLBACK_S, max(left, 0.0)))
                    await asyncio.sleep(min(max(tried + RETRY_MIN_GAP_S - time.monotonic(), 0.0), left))
        finally:
            if follow is not None:
                follow.cancel()
            if self in self.hostjobs.coordinating:
                self.hostjobs.coordinating.remove(self)
                room.notify()  # the jobs behind this one move up: they show their new position
        self.attempts = outcome.attempts
        self.hosts = dict(outcome.hosts)
        ranks = []
        for i, (host, cards) in enumerate(self.hosts.items()):
            c = self.commits[host]
            addr = self.addrs.get(host, "")
            ranks.append(pb.JobRank(rank=i, host=host, addr=addr, cards=cards, lease_id=c.lease_id))
            self.ranks.append(_Rank(i, host, addr))
        yield pb.JobEvent(
            placed=pb.JobPlaced(
                job=self.job, ranks=ranks, attempts=outcome.attempts, refusals=list(outcome.refusals)
            )
        )

    # ------------------------------------------------------------------------------ the job
    async def events(self, inputs: AsyncIterator[pb.JobInput]) -> AsyncIterator[pb.JobEvent]:
        await self.check()
        feeder = stopping = None
        try:
            while True:
                async for ev in self.place():
                    yield ev
                out = self._out = asyncio.Queue()
                self._start_ranks(out)
                if feeder is None:
                    feeder = asyncio.ensure_future(self._feed(inputs))
                ended: list[tuple[int, int]] = []
                restart = ""
                while len(ended) < len(self.ranks) and not restart:
                    rank, ev = await out.get()
                    if rank is None:  # a bad input from the client: the call ends with its error
                        raise ev
                    if ev is None:  # its stream ended without a RankEnded: the host is gone
                        why = f"host {rank.host}: the rank was lost"
                        ev = pb.RankEnded(rank=rank.rank, exit_code=255, error=why)
                    if not isinstance(ev, pb.RankEnded):
                        yield pb.JobEvent(output=ev)
                        continue
                    if rank.ended:
                        continue
                    rank.ended = True
                    yield pb.JobEvent(rank_ended=ev)
                    again = self.spec.restartable and self.restarts < MAX_RESTARTS
                    if again and ev.error.startswith(RESTART):
                        restart = f"rank {rank.rank} on {rank.host}: {ev.error.removeprefix(RESTART)}"
                        continue
                    ended.append((rank.rank, ev.exit_code if not ev.error else (ev.exit_code or 255)))
                    bad = ended[-1][1] and not self._by_user_signal(ev)
                    if bad and self.spec.kill_on_bad_exit and stopping is None:
                        stopping = asyncio.ensure_future(self._stop_others())
                if not restart:
                    break
                # a card under one rank failed: the whole job starts again on a healthy set of hosts
                self.restarts += 1
                self._ranks_up.clear()  # stdin waits for the new rank 0, signals are kept for the new ranks
                log.info("job %s: restart %d: %s", self.job, self.restarts, restart)
                if stopping is not None:
                    stopping.cancel()
                    stopping = None
                await asyncio.shield(asyncio.ensure_future(self._cleanup()))
                self.ranks, self.hosts, self.commits = [], {}, {}
            code = launch.first_failure(ended)
            failed = next((r for r, c in ended if c), None)
            reason = "all ranks exited 0" if failed is None else f"rank {failed} exited {code}"
            if self.restarts:
                reason += f" (after {self.restarts} restart(s))"
            yield pb.JobEvent(ended=pb.JobEnded(exit_code=code, reason=reason))
        finally:
            for t in (feeder, stopping):
                if t is not None:
                    t.cancel()
            # however it ends: stop every rank and release every host (a task of its own, so the
            # caller's cancellation does not cut the clean-up short)
            cleanup = asyncio.ensure_future(self._cleanup())
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(cleanup)

    def _by_user_signal(self, ev: pb.RankEnded) -> bool:
        """A rank that ended by (or on) a signal the user sent to every rank is no "bad exit": the
        others got it too and are handling it themselves, as under srun."""
        return not ev.error and any(ev.signal == s or ev.exit_code == 128 + s for s in self.user_signals)

    def _start_ranks(self, out: asyncio.Queue) -> None:
        names = [(r.host, r.addr or "127.0.0.1") for r in self.ranks]
        rank0 = self.commits[self.ranks[0].host]
        envs = launch.rank_envs(
            self.job,
            names,
            rank0.free_port,
            {h: {**c.env, "XPU_RESTART_COUNT": str(self.restarts)} for h, c in self.commits.items()},
            dict(self.spec.env),
            procs_per_node=self.per_host,  # torchrun's workers per host: one per card
            tasks_per_node=self.spec.tasks_per_node,  # or xpud starts the workers itself
        )
        for r, spec_env in zip(self.ranks, envs, strict=True):
            spec = pb.LaunchSpec(
                job=self.job,
                rank=r.rank,
                argv=list(self.spec.argv),
                env=spec_env.env,
                cwd=self.spec.cwd,
                uid=self.caller.uid,
                gid=max(self.caller.gid, 0),
                user=self.user,
                tasks_per_node=self.spec.tasks_per_node,
                keep_going=not self.spec.kill_on_bad_exit,
                label=self.spec.label_tasks,
            )
            r.inputs.put_nowait(pb.LaunchInput(start=spec))
            r.task = asyncio.ensure_future(self._run_rank(r, out))
        self._deliver_early()

    def _deliver_early(self) -> None:
        """New ranks (a restart) get the signals sent while none ran, and EOF on rank 0's stdin if the
        client's stdin had ended (what the old rank 0 read is not sent again); stdin flows again."""
        early, self._early = self._early, []
        for item in early:
            for r in self.ranks:
                r.inputs.put_nowait(item)
        if self._stdin_closed and self.ranks:
            self.ranks[0].inputs.put_nowait(pb.LaunchInput(stdin_eof=True))
        self._ranks_up.set()

    async def _stdin(self, item: pb.LaunchInput) -> None:
        """Stdin (or its end) to rank 0; during a restart, data waits for the new rank 0 (the client's
        stream is not read meanwhile: gRPC holds the client back), the end is remembered."""
        if item.WhichOneof("what") == "stdin_eof":
            if self._stdin_closed:
                return
            self._stdin_closed = True
            if not self._ranks_up.is_set():
                return  # _deliver_early sends it
        await self._ranks_up.wait()
        self.ranks[0].inputs.put_nowait(item)

    def _signal(self, item: pb.LaunchInput) -> None:
        """A signal to every rank still running; during a restart, kept for the new ranks (the last
        ``MAX_EARLY_SIGNALS``)."""
        if not self._ranks_up.is_set():
            self._early = [*self._early, item][-MAX_EARLY_SIGNALS:]
            return
        for r in self.ranks:
            if not r.ended:
                r.inputs.put_nowait(item)

    async def _inputs(self, r: _Rank) -> AsyncIterator[pb.LaunchInput]:
        while True:
            item = await r.inputs.get()
            if item is None:
                return
            yield item

    async def _run_rank(self, r: _Rank, out: asyncio.Queue) -> None:
        try:
            if r.host == self.me:
                stream = self.hostjobs.launch(self._inputs(r), None, None)
            else:
                stub = pbg.PeerStub(self.federation.channel(self.addrs[r.host]))
                stream = stub.Launch(self._inputs(r))
            async for ev in stream:
                if ev.HasField("output"):
                    out.put_nowait((r, ev.output))
                elif ev.HasField("ended"):
                    out.put_nowait((r, ev.ended))
                    return
            out.put_nowait((r, None))
        except asyncio.CancelledError:
            raise
        except (grpc.aio.AioRpcError, XpudError) as e:
            why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            out.put_nowait((r, pb.RankEnded(rank=r.rank, exit_code=255, error=f"host {r.host}: {why}")))
        except Exception as e:
            log.exception("job %s rank %d", self.job, r.rank)
            out.put_nowait((r, pb.RankEnded(rank=r.rank, exit_code=255, error=f"host {r.host}: {e}")))

    async def _feed(self, inputs: AsyncIterator[pb.JobInput]) -> None:
        """stdin to rank 0, signals to every rank."""
        try:
            await self._forward(inputs)
        except XpudError as e:
            self._out.put_nowait((None, e))

    async def _forward(self, inputs: AsyncIterator[pb.JobInput]) -> None:
        async for m in inputs:
            what = m.WhichOneof("what")
            if what == "stdin":
                await self._stdin(pb.LaunchInput(stdin=m.stdin))
            elif what == "stdin_eof":
                await self._stdin(pb.LaunchInput(stdin_eof=True))
            elif what == "signal":
                self.user_signals.add(m.signal)
                self._signal(pb.LaunchInput(signal=m.signal))
        await self._stdin(pb.LaunchInput(stdin_eof=True))  # the client closed its side

    def cancel(self) -> bool:
        """Stop the job from outside (`xpu cancel`): every running rank gets SIGTERM, and its stream is
        cancelled ``STOP_GRACE_S`` later (its host kills what is left). False when no rank runs yet."""
        if not self.ranks:
            return False
        self.user_signals.add(signal.SIGTERM)  # the ranks' ends by it are no "bad exit"
        self._cancelling = asyncio.ensure_future(self._stop_others())
        return True

    async def _stop_others(self) -> None:
        for r in self.ranks:
            if not r.ended:
                r.inputs.put_nowait(pb.LaunchInput(signal=signal.SIGTERM))
        await asyncio.sleep(STOP_GRACE_S)
        for r in self.ranks:
            if not r.ended and r.task is not None:
                r.task.cancel()  # the stream breaks: the host kills the group and ends the rank

    async def _cleanup(self) -> None:
        tasks = [r.task for r in self.ranks if r.task is not None and not r.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._abort(list(self.hosts))

    async def _abort(self, hosts: list[str]) -> None:
        async def one(h: str) -> None:
            try:
                await asyncio.wait_for(self._link(h).abort(self.job, self.attempts - 1), STEP_TIMEOUT_S)
            except Exception as e:  # it expires there by itself, or its Launch stream broke
                log.warning("job %s: abort on %s failed: %s", self.job, h, e)

        await asyncio.gather(*(one(h) for h in hosts))
