"""The ledger's part of accounts (issue #33): which account each lease and reservation is charged to, and
each account's decayed usage (kept across restarts). Typed ops over ``xpud.ledger.ledger``'s store.

The schema step that makes room for them is ``ledger.MIGRATIONS``' "accounts" entry (one self-contained
step: its number may change when branches merge; nothing here depends on it).
"""

from __future__ import annotations

import math
import re
import sqlite3

from xpud.ledger.ledger import Op, op


def set_lease_wait_op(lease_id: str, queued_s: float) -> Op:
    """How long a lease's request waited in the queue (committed with its grant; for `xpu report`)."""
    return op("UPDATE leases SET queued_s=? WHERE id=?", max(float(queued_s), 0.0), lease_id)


def leases_between(db: sqlite3.Connection, since: float, until: float, limit: int) -> list[sqlite3.Row]:
    """Leases that held cards at some time in [since, until) (active ones too), oldest first, at most
    ``limit``: id, owner_uid, account, mode, cards, slices, created, ended, queued_s."""
    return db.execute(
        "SELECT id, owner_uid, account, mode, cards, slices, created, ended, queued_s FROM leases"
        " WHERE created < ? AND (ended IS NULL OR ended >= ?) ORDER BY created LIMIT ?",
        (until, since, limit),
    ).fetchall()


_FOR = re.compile(r"reclaimed for account ([a-z][a-z0-9_-]{0,31})")


def reclaims_between(db: sqlite3.Connection, since: float, until: float, limit: int) -> list[tuple]:
    """(time, account reclaimed from, account reclaimed for) of the fair-share reclaims in [since, until)."""
    rows = db.execute(
        "SELECT e.ts, l.account, e.message FROM events e LEFT JOIN leases l ON l.id = e.lease_id"
        " WHERE e.kind='fairshare' AND e.ts >= ? AND e.ts < ? ORDER BY e.ts LIMIT ?",
        (since, until, limit),
    ).fetchall()
    out = []
    for ts, victim, message in rows:
        m = _FOR.search(message or "")
        out.append((float(ts), victim or "default", m.group(1) if m else "default"))
    return out


def set_reservation_account_op(job: str, attempt: int, account: str) -> Op:
    return op("UPDATE reservations SET account=? WHERE job=? AND attempt=?", account, job, attempt)


def lease_accounts(db: sqlite3.Connection, ids: list[str] | None = None) -> dict[str, str]:
    """Lease id -> account, of the active leases (or of ``ids``)."""
    if ids is None:
        rows = db.execute("SELECT id, account FROM leases WHERE state='active'")
    else:
        marks = ",".join("?" * len(ids))
        rows = db.execute(f"SELECT id, account FROM leases WHERE id IN ({marks})", ids)
    return {r[0]: r[1] for r in rows}


def save_usage_op(usage: dict[str, tuple[float, float]]) -> Op:
    """Every account's (decayed usage in GPU-seconds, when accrued), replacing what was kept."""
    rows = [(a, u, t) for a, (u, t) in usage.items() if math.isfinite(u) and math.isfinite(t)]
    insert = "INSERT INTO account_usage (account, usage_s, at) VALUES (?,?,?)"
    statements = (("DELETE FROM account_usage", ()), *((insert, r) for r in rows))
    return Op(statements)


def load_usage(db: sqlite3.Connection) -> dict[str, tuple[float, float]]:
    """What ``save_usage_op`` kept; rows that are not finite and non-negative are dropped."""
    out = {}
    for a, u, t in db.execute("SELECT account, usage_s, at FROM account_usage"):
        numbers = isinstance(u, int | float) and isinstance(t, int | float)
        if numbers and math.isfinite(u) and u >= 0 and math.isfinite(t):
            out[str(a)] = (float(u), float(t))
    return out
