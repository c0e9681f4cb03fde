"""Restartable detached jobs (``xpu submit --restartable``): the daemon is their lease's holder.

What ``xpu run --restartable`` does in the user's terminal, the daemon does for a detached job: it holds
the job's lease (``Engine.hold_opened``, so the engine may move it: a failing card, the defragmenter,
right-sizing), and on a ``move`` event it stops the command (SIGTERM to its supervisor: TERM, then KILL
after the job's kill grace), acknowledges the move (``Engine.ack_anchored_move``: the new placement is
committed; the daemon proves itself by the lease's anchor ``job:<id>``, so no token is needed or kept),
records the restart on the job's row, then starts the command again on the new placement with the same
environment, ``XPU_RESTART_COUNT`` counting the restarts, its output file(s) appended to, not truncated.

A ``reclaim`` event (fair share between accounts, ``xpud.controllers.accounts``) stops the command the same
way, records the job ``queued`` again, releases its lease and queues it in the engine like a new job; once
granted again its command starts with ``XPU_RESTART_COUNT`` + 1 (the job's ``restarts``), output appended.

A command that ended by itself before it was stopped keeps its end (the move is dropped with its lease);
one that could not be started again ends ``failed`` with the reason. After a restart of xpud the book's
``restore`` holds the leases of running restartable jobs again (``follow``) before the daemon serves, so
a move asked later restarts them as before, ``XPU_RESTART_COUNT`` counting on from the job's row. The row
says ``moving`` from before the stop until the command runs again: a daemon that died in between finds
the command stopped (``cancelled`` by its supervisor, or no status) and starts it again (``take_up``) on
the lease's placement as the ledger has it (the new one once the move was acknowledged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from xpud.errors import XpudError
from xpud.jobs import supervisor
from xpud.ledger import jobs as jobdb
from xpud.ledger.jobs import JobRecord
from xpud.model import Caller, CommandEnd

log = logging.getLogger("xpud.jobs")

OPERATOR = Caller(uid=0, gid=0, admin=True)  # the daemon releasing a job's lease (as the book does)
STOP_MARGIN_S = 10.0  # beyond the job's kill grace, the longest a supervisor may take to record its end


class Restarts:
    """The restartable jobs of one ``JobBook`` that run now, and their lease streams."""

    def __init__(self, book: Any):  # xpud.jobs.book.JobBook (not imported: it imports this module)
        self.book = book
        self.followers: dict[str, asyncio.Task] = {}  # job id -> the task reading its lease's events
        self.busy: set[str] = set()  # jobs being stopped and started again: the poller leaves them be

    def follow(self, r: JobRecord, lease_id: str) -> None:
        """Hold ``r``'s lease from now on (before its command starts, or when the daemon restores it: a
        move asked meanwhile waits)."""
        if r.id in self.followers:
            return
        q = self.book.engine.hold_opened(lease_id)
        self.followers[r.id] = asyncio.ensure_future(self._follow(r, lease_id, q))

    async def stop(self) -> None:
        tasks = list(self.followers.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    async def _follow(self, r: JobRecord, lease_id: str, q: asyncio.Queue) -> None:
        try:
            while not r.done:
                ev = await q.get()
                if ev.kind == "released":
                    return
                if ev.kind == "move" and not r.done:
                    await self._restart(r, ev.message)
                elif ev.kind == "reclaim" and not r.done and await self._requeue(r, ev.message):
                    return  # queued again: the next grant's follower holds the next lease
        except asyncio.CancelledError:
            raise
        except Exception:  # one job's trouble never stops the daemon
            log.exception("job %s: following its lease", r.id)
        finally:
            self.book.engine.hold_closed(lease_id, q)
            if self.followers.get(r.id) is asyncio.current_task():  # not the next lease's follower
                self.followers.pop(r.id, None)

    async def _stop_command(self, r: JobRecord) -> dict | None:
        """SIGTERM the job's supervisor; its status once it recorded an end (None: it never did)."""
        d = self.book.dir
        doc = supervisor.read_status(d, r.id) or {}
        spid = doc.get("supervisor")
        if doc.get("state") in jobdb.ENDED:
            return doc
        if not spid or not supervisor.supervisor_alive(int(spid), r.id):
            return supervisor.read_status(d, r.id)
        with contextlib.suppress(OSError):
            os.kill(int(spid), signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(r.spec.get("kill_grace_s", 10.0)) + STOP_MARGIN_S
        while loop.time() < deadline:
            doc = supervisor.read_status(d, r.id)
            if doc is not None and doc.get("state") in jobdb.ENDED:
                if not supervisor.supervisor_alive(int(spid), r.id):
                    return doc
            elif not supervisor.supervisor_alive(int(spid), r.id):
                return supervisor.read_status(d, r.id)
            await asyncio.sleep(0.05)
        return None

    async def _requeue(self, r: JobRecord, why: str) -> bool:
        """A reclaim: stop the command (TERM, KILL after its grace), record the job queued again (its
        restart counted), release the lease, queue the job. True when it is queued again (or ended)."""
        b = self.book
        self.busy.add(r.id)
        try:
            doc = await self._stop_command(r)
            if doc is None or doc.get("state") not in jobdb.ENDED:
                why = f"stopped for a reclaim ({why}); its supervisor recorded no end"
                await b._end(r, jobdb.LOST, reason=why)
                return True
            if doc["state"] != jobdb.CANCELLED or r.id in b.cancelling:
                return False  # it ended by itself first, or was cancelled: the poller records that end
            with contextlib.suppress(OSError):
                supervisor.status_path(b.dir, r.id).unlink()
            lease_id, started = r.lease_id, r.started
            n = int(r.spec.get("restarts", 0)) + 1
            r.spec["restarts"] = n
            r.state, r.lease_id, r.started, r.reason = jobdb.QUEUED, "", None, "Resources"
            await b.ledger.write(jobdb.save_job_op(r))  # queued first: a restart of xpud queues it again
            b.running.pop(r.id, None)
            end = CommandEnd(doc.get("exit_code"), doc.get("exit_signal"), started)
            try:
                await b.engine.release(lease_id, OPERATOR, "", end)
            except XpudError as e:  # ended meanwhile (the controller's STOP_S): the job queues all the same
                log.info("job %s: releasing reclaimed lease %s: %s", r.id, lease_id, e)
            b.engine.event("job", f"job {r.id} stopped for a reclaim ({why}); queued again (restart {n})")
            b.waiting[r.id] = asyncio.ensure_future(b._run(r))
            return True
        except (XpudError, OSError, ValueError, KeyError) as e:
            if not r.done:
                await b._end(r, jobdb.FAILED, reason=f"stopped for a reclaim ({why}); not queued again: {e}")
            return True
        finally:
            self.busy.discard(r.id)

    async def _restart(self, r: JobRecord, why: str) -> None:
        b = self.book
        self.busy.add(r.id)
        try:
            try:  # on record first: a daemon that dies from here on starts it again (``resume``)
                r.spec["moving"] = why[:500]
                await b.ledger.write(jobdb.save_job_op(r))
            except XpudError as e:  # not stopped: the move times out and the lease is marked
                r.spec.pop("moving", None)
                log.error("job %s: not moved (%s): %s", r.id, why, e)
                return
            doc = await self._stop_command(r)
            if doc is None or doc.get("state") not in jobdb.ENDED:
                why = f"stopped for a move ({why}); its supervisor recorded no end"
                await b._end(r, jobdb.LOST, reason=why)
                return
            if doc["state"] != jobdb.CANCELLED or r.id in b.cancelling:
                return  # it ended by itself first, or was cancelled: the poller records that end
            with contextlib.suppress(OSError):
                supervisor.status_path(b.dir, r.id).unlink()
            lease = await b.engine.ack_anchored_move(r.lease_id, f"job:{r.id}")
            await self._start_again(r, lease, why)
        except (XpudError, OSError, ValueError, KeyError) as e:
            if not r.done:
                await b._end(r, jobdb.FAILED, reason=f"stopped for a move ({why}); not started again: {e}")
        finally:
            self.busy.discard(r.id)

    async def take_up(self, r: JobRecord, doc: dict | None) -> bool:
        """A job the daemon was moving when it stopped (its row says ``moving``) whose command is stopped
        now (``doc``: its status, ended ``cancelled``, or none) without a cancel of its own: started again
        (``resume``). True when that is so (or it is still stopping: looked at again at the next poll)."""
        if not r.spec.get("moving") or r.id in self.book.cancelling or r.id in self.busy:
            return False
        if doc is not None and doc.get("state") != jobdb.CANCELLED:
            return False
        spid = (doc or {}).get("supervisor")
        if not (spid and supervisor.supervisor_alive(int(spid), r.id)):
            await self.resume(r)
        return True

    async def resume(self, r: JobRecord) -> None:
        """Start ``r`` again on its lease as the ledger has it (the move's new placement when it was
        acknowledged before the daemon stopped, else the old one: a failing card is then left again by
        the next move). Ends it ``failed`` when it cannot be."""
        b = self.book
        why = str(r.spec.get("moving", ""))
        self.busy.add(r.id)
        try:
            lease = b.engine.leases.get(r.lease_id)
            if lease is None:
                raise ValueError(f"its lease {r.lease_id} ended meanwhile")
            with contextlib.suppress(OSError):
                supervisor.status_path(b.dir, r.id).unlink()
            await self._start_again(r, lease, f"{why} (resumed after a restart of xpud)")
        except (XpudError, OSError, ValueError, KeyError) as e:
            if not r.done:
                await b._end(r, jobdb.FAILED, reason=f"stopped for a move ({why}); not started again: {e}")
        finally:
            self.busy.discard(r.id)

    async def _start_again(self, r: JobRecord, lease: Any, why: str) -> None:
        """Record the restart, then start ``r``'s command on ``lease`` (appending to its output)."""
        b = self.book
        n = int(r.spec.get("restarts", 0)) + 1
        r.spec["restarts"] = n
        r.lease_id, r.reason = lease.id, f"restart {n}: {why}"[:500]
        await b.ledger.write(jobdb.save_job_op(r))
        env = {**r.env, **lease.env, "XPU_JOB_ID": r.id, "XPU_RESTART_COUNT": str(n)}
        fence = await b._fence(lease)  # the new cards' device fence (ScopeError: not started unfenced)
        await asyncio.shield(supervisor.launch(
            b.dir, r.id, r.argv, env, r.cwd, r.spec["output"], r.spec.get("error", ""), b._switch(r),
            r.spec.get("time_limit_s", 0.0), r.spec.get("kill_grace_s", 10.0), b.systemd_run, fence,
            append=True,
        ))  # fmt: skip
        r.spec.pop("moving", None)  # started: a later stop is its own (the row says so next time)
        with contextlib.suppress(XpudError):
            await b.ledger.write(jobdb.save_job_op(r))
        cards = ",".join(map(str, lease.cards))
        b.engine.event("job", f"job {r.id} restarted ({n}) on card {cards}", lease_id=lease.id)
