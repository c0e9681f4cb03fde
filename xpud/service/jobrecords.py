"""Commands the daemon knows as job records (``xpud.ledger.jobs.JobRecord``): an attached ``xpu run``'s
lease, a queued ``xpu run`` (its ticket is its id), and one that never ran (recorded when it gave up or was
cancelled). Shared by the node servicer and the jobs' RPCs (``xpud.service.jobs``)."""

from __future__ import annotations

from xpud.errors import Conflict
from xpud.ledger import jobs as jobdb
from xpud.ledger.jobs import JobRecord
from xpud.model import Caller, LeaseState


def attached(lease) -> JobRecord:
    """An `xpu run`'s lease as a job record (its id is the lease's)."""
    if lease.state == LeaseState.ACTIVE:
        state = jobdb.RUNNING
    elif lease.state == LeaseState.EVICTED:
        state = jobdb.CANCELLED
    elif lease.state == LeaseState.RECLAIMED:
        state = jobdb.LOST
    elif lease.exit_signal is not None or (lease.exit_code or 0) != 0:
        state = jobdb.FAILED
    else:
        state = jobdb.COMPLETED
    return JobRecord(
        id=lease.id,
        uid=lease.owner_uid,
        gid=-1,
        state=state,
        submitted=lease.created,
        kind=jobdb.ATTACHED,
        name=lease.name,
        argv=[lease.command] if lease.command else [],
        spec={
            "mode": str(lease.mode),
            "gpus": len(lease.cards),
            "priority": lease.priority,
            "account": lease.account,
        },
        lease_id=lease.id,
        exit_code=lease.exit_code,
        exit_signal=lease.exit_signal,
        started=lease.started or lease.created,
        ended=lease.ended,
        reason=lease.end_reason,
    )


def queued_run(w) -> JobRecord:
    """A queued `xpu run` (a waiter of the engine's queue; its ticket is its id) as a job record."""
    q = w.request
    return JobRecord(
        id=w.ticket,
        uid=q.owner_uid,
        gid=-1,
        state=jobdb.QUEUED,
        submitted=w.enqueued,
        kind=jobdb.ATTACHED,
        name=q.name,
        argv=[q.command] if q.command else [],
        spec=_spec(q),
        reason=w.reason,
    )


def _spec(q) -> dict:
    """A queued request's part of a job record (``xpud.model.Request``)."""
    return {
        "mode": str(q.mode),
        "gpus": q.gpus,
        "priority": q.priority,
        "wait_s": q.wait_s,
        "account": q.account,
    }


def record_unserved(engine, w, caller: Caller) -> None:
    """Record a queued `xpu run` that gave up (its wait ran out) or was cancelled (its caller went away)
    as an attached job that never ran; the ticket is its id. Written without waiting (the caller is
    gone); a failure is logged by the ledger."""
    f = w.future
    gave_up = f.done() and not f.cancelled() and f.exception() is not None
    why = f"gave up: {f.exception()}" if gave_up else "cancelled while queued (its `xpu run` went away)"
    if gave_up and isinstance(f.exception(), Conflict):  # `xpu cancel` of the queued run
        why = str(f.exception())
    q = w.request
    r = JobRecord(
        id=w.ticket,
        uid=q.owner_uid,
        gid=caller.gid,
        state=jobdb.CANCELLED,
        submitted=w.enqueued,
        kind=jobdb.ATTACHED,
        name=q.name,
        argv=[q.command] if q.command else [],
        spec=_spec(q),
        ended=engine.clock(),
        reason=why[:500],
    )
    engine.ledger.submit(jobdb.save_job_op(r))
    engine.event("job", f"queued request {w.ticket} (uid {q.owner_uid}) {why}")
