"""The jobs table (ledger schema 9): one row per job, written before the job's world changes.

A job is queued (waiting for its ``--after`` jobs or for cards), running (its lease granted, its
supervisor started), then ended in one of ``ENDED``. The row holds the submitter's environment only until
the job has started (it is then cleared): the ledger is the daemon's, 0600, and a finished job needs none.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field

from xpud.ledger.ledger import Ledger, Op, op

QUEUED, RUNNING = "queued", "running"
COMPLETED, FAILED, CANCELLED, TIMEOUT = "completed", "failed", "cancelled", "timeout"
DEPENDENCY_FAILED, LOST = "dependency-failed", "lost"
ENDED = frozenset({COMPLETED, FAILED, CANCELLED, TIMEOUT, DEPENDENCY_FAILED, LOST})
STATES = (QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, DEPENDENCY_FAILED, LOST)
DETACHED, ATTACHED, MULTI_HOST = "detached", "attached", "multi-host"
# a rank of a submitted multi-host job (``spec.cluster_job``): its host's record, never listed or named
# there (the job is listed once, by the host that placed it)
NOT_A_RANK = "json_extract(spec, '$.cluster_job') IS NULL"


@dataclass
class JobRecord:
    """One job. Times in seconds since the epoch; ``spec``: what was asked (mode, gpus, priority,
    wait_s, output, error, time_limit_s, after, kill_grace_s, restartable, restarts, account)."""

    id: str
    uid: int
    gid: int
    state: str
    submitted: float
    kind: str = DETACHED
    name: str = ""
    cwd: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    spec: dict = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    lease_id: str = ""
    exit_code: int | None = None
    exit_signal: int | None = None
    started: float | None = None
    ended: float | None = None
    reason: str = ""

    @property
    def done(self) -> bool:
        return self.state in ENDED


COLUMNS = (
    "id, name, kind, uid, gid, cwd, argv, env, spec, hosts, lease_id, state, exit_code, exit_signal, "
    "submitted, started, ended, reason"
)


def _row(r: JobRecord) -> tuple:
    return (
        r.id, r.name, r.kind, r.uid, r.gid, r.cwd, json.dumps(r.argv), json.dumps(r.env), json.dumps(r.spec),
        json.dumps(r.hosts), r.lease_id, r.state, r.exit_code, r.exit_signal, r.submitted, r.started,
        r.ended, r.reason,
    )  # fmt: skip


def _record(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        id=row["id"],
        name=row["name"],
        kind=row["kind"],
        uid=row["uid"],
        gid=row["gid"],
        cwd=row["cwd"],
        argv=json.loads(row["argv"]),
        env=json.loads(row["env"]),
        spec=json.loads(row["spec"]),
        hosts=json.loads(row["hosts"]),
        lease_id=row["lease_id"],
        state=row["state"],
        exit_code=row["exit_code"],
        exit_signal=row["exit_signal"],
        submitted=row["submitted"],
        started=row["started"],
        ended=row["ended"],
        reason=row["reason"],
    )


def save_job_op(r: JobRecord) -> Op:
    """Insert or replace the whole row of ``r``."""
    marks = ", ".join("?" * len(COLUMNS.split(", ")))
    return op(f"INSERT OR REPLACE INTO jobs ({COLUMNS}) VALUES ({marks})", *_row(r))


def job(ledger: Ledger, job_id: str) -> JobRecord | None:
    row = ledger.db.execute(f"SELECT {COLUMNS} FROM jobs WHERE id=?", (job_id,)).fetchone()
    return _record(row) if row else None


def unfinished(ledger: Ledger) -> list[JobRecord]:
    """Queued and running jobs, oldest first (restored at start-up)."""
    rows = ledger.db.execute(
        f"SELECT {COLUMNS} FROM jobs WHERE state IN (?, ?) ORDER BY submitted", (QUEUED, RUNNING)
    ).fetchall()
    return [_record(r) for r in rows]


def ranks_of(ledger: Ledger, cluster_job: str) -> list[JobRecord]:
    """This host's ranks of the submitted multi-host job ``cluster_job`` (``spec.cluster_job``), by rank."""
    rows = ledger.db.execute(
        f"SELECT {COLUMNS} FROM jobs WHERE json_extract(spec, '$.cluster_job') = ?"
        " ORDER BY json_extract(spec, '$.rank')",
        (cluster_job,),
    ).fetchall()
    return [_record(r) for r in rows]


def rank_jobs(
    ledger: Ledger, all_: bool = False, uid: int | None = None, limit: int = 1000
) -> list[tuple[str, str]]:
    """The submitted multi-host jobs this host runs (or, with ``all_``, ran) a rank of, newest first: their
    ids and coordinators (the hosts that placed them, ``spec.coordinator``; "" when not recorded)."""
    where, args = ["json_extract(spec, '$.cluster_job') IS NOT NULL"], []
    if not all_:
        where.append("state IN (?, ?)")
        args += [QUEUED, RUNNING]
    if uid is not None:
        where.append("uid = ?")
        args.append(uid)
    q = (
        "SELECT json_extract(spec, '$.cluster_job') AS j, MAX(json_extract(spec, '$.coordinator')),"
        f" MAX(submitted) AS s FROM jobs WHERE {' AND '.join(where)} GROUP BY j ORDER BY s DESC LIMIT ?"
    )
    return [(row[0], row[1] or "") for row in ledger.db.execute(q, (*args, limit)).fetchall()]


def jobs(
    ledger: Ledger,
    all_: bool = False,
    uid: int | None = None,
    state: str = "",
    since: float = 0.0,
    limit: int = 1000,
) -> list[JobRecord]:
    """Jobs, newest first: queued and running ones, or with ``all_`` ended ones too; filtered by owner,
    state and submission time."""
    where, args = ["submitted >= ?", f"{NOT_A_RANK}"], [since]
    if not all_ and not state:
        where.append("state IN (?, ?)")
        args += [QUEUED, RUNNING]
    if state:
        where.append("state = ?")
        args.append(state)
    if uid is not None:
        where.append("uid = ?")
        args.append(uid)
    q = f"SELECT {COLUMNS} FROM jobs WHERE {' AND '.join(where)} ORDER BY submitted DESC LIMIT ?"
    return [_record(r) for r in ledger.db.execute(q, (*args, limit)).fetchall()]


def find(ledger: Ledger, selector: str, uid: int | None) -> list[JobRecord]:
    """Jobs that ``selector`` names: the job with that id; else those whose id starts with it (at most
    two); else those of ``uid`` (any owner when None) with that name, newest first."""
    exact = job(ledger, selector)
    if exact is not None and not exact.spec.get("cluster_job"):
        return [exact]
    rows = ledger.db.execute(
        f"SELECT {COLUMNS} FROM jobs WHERE substr(id, 1, ?) = ? AND {NOT_A_RANK}"
        " ORDER BY submitted DESC LIMIT 2",
        (len(selector), selector),
    ).fetchall()
    if rows:
        return [_record(r) for r in rows]
    if uid is None:
        q = f"SELECT {COLUMNS} FROM jobs WHERE name = ? AND {NOT_A_RANK} ORDER BY submitted DESC LIMIT 50"
        args = (selector,)
    else:
        q = (
            f"SELECT {COLUMNS} FROM jobs WHERE uid = ? AND name = ? AND {NOT_A_RANK}"
            " ORDER BY submitted DESC LIMIT 50"
        )
        args = (uid, selector)
    return [_record(r) for r in ledger.db.execute(q, args).fetchall()]
