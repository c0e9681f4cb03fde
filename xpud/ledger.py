"""The lease ledger: SQLite in WAL mode, the daemon's only durable state.

Every grant, release and card-state change is committed (``synchronous=FULL``) before the daemon
replies, so what a caller was told survives a crash. The schema is versioned with ``PRAGMA
user_version``; migrations run in order at open, and a ledger from a newer xpud is refused.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from xpud.errors import ConfigError
from xpud.model import Lease, LeaseState, Mode, Slice

MIGRATIONS: list[str] = [
    # 1: leases, card state, events
    """
    CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        token_hash TEXT NOT NULL,
        mode TEXT NOT NULL,
        owner_uid INTEGER NOT NULL,
        cards TEXT NOT NULL,          -- JSON list of card indices
        card_uuids TEXT NOT NULL,     -- JSON list
        slices TEXT NOT NULL,         -- JSON list of Slice fields
        env TEXT NOT NULL,            -- JSON object
        priority INTEGER NOT NULL,
        restartable INTEGER NOT NULL,
        holder_pid INTEGER,
        command TEXT NOT NULL,
        created REAL NOT NULL,
        state TEXT NOT NULL,
        ended REAL,
        end_reason TEXT NOT NULL DEFAULT '',
        restart_count INTEGER NOT NULL DEFAULT 0,
        mark TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX leases_by_state ON leases(state);
    CREATE TABLE cards (
        uuid TEXT PRIMARY KEY,
        mode TEXT NOT NULL,
        mode_pinned INTEGER NOT NULL DEFAULT 0,
        drained INTEGER NOT NULL DEFAULT 0,
        drain_reason TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        kind TEXT NOT NULL,
        card INTEGER NOT NULL DEFAULT -1,
        lease_id TEXT NOT NULL DEFAULT '',
        message TEXT NOT NULL
    );
    """,
    # 2: card health state changes, with their reasons (xpu health shows them; restored at start)
    """
    CREATE TABLE health_changes (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        card_uuid TEXT NOT NULL,
        card INTEGER NOT NULL,        -- index when it changed (indices can change across reboots)
        from_state TEXT NOT NULL,
        to_state TEXT NOT NULL,
        score INTEGER NOT NULL,
        reasons TEXT NOT NULL         -- JSON list of strings
    );
    CREATE INDEX health_changes_by_card ON health_changes(card_uuid, id);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class CardRecord:
    uuid: str
    mode: str
    mode_pinned: bool
    drained: bool
    drain_reason: str


@dataclass(frozen=True)
class HealthChangeRecord:
    ts: float
    card_uuid: str
    card: int
    from_state: str
    to_state: str
    score: int
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class EventRecord:
    id: int
    ts: float
    kind: str
    card: int
    lease_id: str
    message: str


def _slice_to_json(s: Slice) -> dict:
    return {
        "card_index": s.card_index,
        "size": s.size,
        "memory_bytes": s.memory_bytes,
        "compute_pct": s.compute_pct,
        "handle": s.handle,
        "placement": s.placement,
    }


def _lease_from_row(row: sqlite3.Row) -> Lease:
    return Lease(
        id=row["id"],
        mode=Mode(row["mode"]),
        owner_uid=row["owner_uid"],
        cards=tuple(json.loads(row["cards"])),
        card_uuids=tuple(json.loads(row["card_uuids"])),
        slices=tuple(Slice(**s) for s in json.loads(row["slices"])),
        env=json.loads(row["env"]),
        priority=row["priority"],
        restartable=bool(row["restartable"]),
        holder_pid=row["holder_pid"],
        command=row["command"],
        created=row["created"],
        state=LeaseState(row["state"]),
        restart_count=row["restart_count"],
        mark=row["mark"],
    )


class Ledger:
    """Durable leases, card states and an event log. Not thread-safe: the daemon's loop owns it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None)  # explicit transactions below
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ConfigError(
                f"{self.path}: ledger schema v{version} is newer than this xpud "
                f"(v{SCHEMA_VERSION}); upgrade xpud or point --state-dir elsewhere"
            )
        for n in range(version, SCHEMA_VERSION):
            with self.db:
                self.db.execute("BEGIN")
                for stmt in _statements(MIGRATIONS[n]):
                    self.db.execute(stmt)
                self.db.execute(f"PRAGMA user_version={n + 1}")

    @property
    def schema_version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def close(self) -> None:
        self.db.close()

    # leases -------------------------------------------------------------------------------------
    def insert_lease(self, lease: Lease, token: str) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(
                "INSERT INTO leases (id, token_hash, mode, owner_uid, cards, card_uuids, slices, env,"
                " priority, restartable, holder_pid, command, created, state, restart_count, mark)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    lease.id,
                    hash_token(token),
                    lease.mode.value,
                    lease.owner_uid,
                    json.dumps(list(lease.cards)),
                    json.dumps(list(lease.card_uuids)),
                    json.dumps([_slice_to_json(s) for s in lease.slices]),
                    json.dumps(lease.env),
                    lease.priority,
                    int(lease.restartable),
                    lease.holder_pid,
                    lease.command,
                    lease.created,
                    lease.state.value,
                    lease.restart_count,
                    lease.mark,
                ),
            )

    def update_placement(self, lease: Lease) -> None:
        """Record a lease's new cards/slices/env (after a move)."""
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(
                "UPDATE leases SET cards=?, card_uuids=?, slices=?, env=?, restart_count=?, mark=?"
                " WHERE id=?",
                (
                    json.dumps(list(lease.cards)),
                    json.dumps(list(lease.card_uuids)),
                    json.dumps([_slice_to_json(s) for s in lease.slices]),
                    json.dumps(lease.env),
                    lease.restart_count,
                    lease.mark,
                    lease.id,
                ),
            )

    def set_mark(self, lease_id: str, mark: str) -> None:
        with self.db:
            self.db.execute("UPDATE leases SET mark=? WHERE id=?", (mark, lease_id))

    def end_lease(
        self, lease_id: str, state: LeaseState, reason: str = "", when: float | None = None
    ) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(
                "UPDATE leases SET state=?, ended=?, end_reason=? WHERE id=? AND state='active'",
                (state.value, when or time.time(), reason, lease_id),
            )

    def active_leases(self) -> list[Lease]:
        rows = self.db.execute("SELECT * FROM leases WHERE state='active' ORDER BY created").fetchall()
        return [_lease_from_row(r) for r in rows]

    def recent_leases(self, limit: int = 100) -> list[Lease]:
        rows = self.db.execute("SELECT * FROM leases ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [_lease_from_row(r) for r in rows]

    def token_matches(self, lease_id: str, token: str) -> bool:
        row = self.db.execute("SELECT token_hash FROM leases WHERE id=?", (lease_id,)).fetchone()
        return row is not None and row["token_hash"] == hash_token(token)

    def lease_ids(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT id FROM leases")}

    def prune(self, older_than_days: int, now: float | None = None) -> int:
        cutoff = (now or time.time()) - older_than_days * 86400
        with self.db:
            cur = self.db.execute("DELETE FROM leases WHERE state!='active' AND ended < ?", (cutoff,))
            self.db.execute("DELETE FROM events WHERE ts < ?", (cutoff,))
            # keep each card's latest change: it is the state restored at the next start
            self.db.execute(
                "DELETE FROM health_changes WHERE ts < ? AND id NOT IN"
                " (SELECT MAX(id) FROM health_changes GROUP BY card_uuid)",
                (cutoff,),
            )
        return cur.rowcount

    # cards --------------------------------------------------------------------------------------
    def save_card(self, rec: CardRecord) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO cards (uuid, mode, mode_pinned, drained, drain_reason) VALUES (?,?,?,?,?)"
                " ON CONFLICT(uuid) DO UPDATE SET mode=excluded.mode, mode_pinned=excluded.mode_pinned,"
                " drained=excluded.drained, drain_reason=excluded.drain_reason",
                (rec.uuid, rec.mode, int(rec.mode_pinned), int(rec.drained), rec.drain_reason),
            )

    def cards(self) -> dict[str, CardRecord]:
        rows = self.db.execute("SELECT * FROM cards").fetchall()
        return {
            r["uuid"]: CardRecord(
                r["uuid"], r["mode"], bool(r["mode_pinned"]), bool(r["drained"]), r["drain_reason"]
            )
            for r in rows
        }

    # events -------------------------------------------------------------------------------------
    def add_event(
        self, kind: str, message: str, card: int = -1, lease_id: str = "", ts: float | None = None
    ) -> EventRecord:
        ts = ts or time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO events (ts, kind, card, lease_id, message) VALUES (?,?,?,?,?)",
                (ts, kind, card, lease_id, message),
            )
        return EventRecord(cur.lastrowid, ts, kind, card, lease_id, message)

    def events(self, limit: int = 200, card: int | None = None) -> list[EventRecord]:
        q, args = "SELECT * FROM events", []
        if card is not None:
            q, args = q + " WHERE card=?", [card]
        rows = self.db.execute(q + " ORDER BY id DESC LIMIT ?", [*args, limit]).fetchall()
        return [
            EventRecord(r["id"], r["ts"], r["kind"], r["card"], r["lease_id"], r["message"])
            for r in reversed(rows)
        ]

    # health ---------------------------------------------------------------------------------------
    def add_health_change(self, rec: HealthChangeRecord) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO health_changes (ts, card_uuid, card, from_state, to_state, score, reasons)"
                " VALUES (?,?,?,?,?,?,?)",
                (
                    rec.ts,
                    rec.card_uuid,
                    rec.card,
                    rec.from_state,
                    rec.to_state,
                    rec.score,
                    json.dumps(rec.reasons),
                ),
            )

    def health_changes(self, card_uuid: str, limit: int = 20) -> list[HealthChangeRecord]:
        """A card's latest state changes, oldest first."""
        rows = self.db.execute(
            "SELECT * FROM health_changes WHERE card_uuid=? ORDER BY id DESC LIMIT ?", (card_uuid, limit)
        ).fetchall()
        return [
            HealthChangeRecord(
                r["ts"],
                r["card_uuid"],
                r["card"],
                r["from_state"],
                r["to_state"],
                r["score"],
                tuple(json.loads(r["reasons"])),
            )
            for r in reversed(rows)
        ]


def _statements(script: str) -> list[str]:
    """Split a migration script into statements (no semicolons inside our statements)."""
    lines = [ln.split("--", 1)[0] for ln in script.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
