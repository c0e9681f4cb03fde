"""The ledger's tables: the migrations in order, one per schema version (``PRAGMA user_version``).

A released migration never changes: a new schema is a new step appended at the end. ``store.Store`` runs
the missing steps in order at open and refuses a ledger from a newer xpud.
"""

from __future__ import annotations

import functools
import sqlite3

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
    # 3: multi-host reservations (xpud.federation.hostjobs): the cards are held by the lease ``lease_id``;
    # held until ``expires`` (wall clock), then committed (the lease is the job's), or ended
    """
    CREATE TABLE reservations (
        job TEXT PRIMARY KEY,
        attempt INTEGER NOT NULL,
        coordinator TEXT NOT NULL,
        lease_id TEXT NOT NULL,
        cards TEXT NOT NULL,          -- JSON list of card indices
        ttl_s REAL NOT NULL,
        created REAL NOT NULL,
        expires REAL NOT NULL,
        state TEXT NOT NULL,          -- held, committed, aborted, expired, released
        ended REAL,
        rank_pid INTEGER NOT NULL DEFAULT 0  -- the rank started here (its own session), 0 before
    );
    CREATE INDEX reservations_by_state ON reservations(state);
    """,
    # 4: how each lease's command ended (its wrapper reports it at release), and the job's name
    """
    ALTER TABLE leases ADD COLUMN started REAL;          -- when the command first started
    ALTER TABLE leases ADD COLUMN exit_code INTEGER;     -- its exit status, or
    ALTER TABLE leases ADD COLUMN exit_signal INTEGER;   -- the signal that ended it (NULL: not reported)
    ALTER TABLE leases ADD COLUMN name TEXT NOT NULL DEFAULT '';
    CREATE INDEX events_by_lease ON events(lease_id, id);
    CREATE INDEX events_by_card ON events(card, id);
    """,
    # 5: a lease kept alive by a Slurm job or a pod instead of a Hold stream ("slurm:<job>", "pod:<uid>")
    """
    ALTER TABLE leases ADD COLUMN anchor TEXT NOT NULL DEFAULT '';
    """,
    # 6: right-sizing (xpud.controllers.rightsizer): each job class's latest readings, so that --mode auto
    # starts a class
    # from its history after a restart; each measured lease's class, whether it is --mode auto, its moves
    """
    CREATE TABLE usage_readings (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_class TEXT NOT NULL,
        ts REAL NOT NULL,             -- when it was read (engine clock: wall time)
        sm_pct REAL,                  -- NULL: unknown (MIG)
        membw_pct REAL,
        mem_bytes INTEGER,
        cap_pct REAL NOT NULL,
        mem_cap_bytes INTEGER NOT NULL
    );
    CREATE INDEX usage_readings_by_class ON usage_readings(job_class, id);
    CREATE TABLE auto_leases (
        lease_id TEXT PRIMARY KEY,
        job_class TEXT NOT NULL,
        auto INTEGER NOT NULL,        -- 1: --mode auto, may be moved
        moves INTEGER NOT NULL DEFAULT 0,
        last_move REAL,               -- wall time of its last automatic move
        last_direction TEXT NOT NULL DEFAULT ''
    );
    """,
    # 7: slices pre-created ahead of a forecast peak (xpud.engine.standby): held by no lease yet, handed to
    # the
    # first request of their size; recorded so that a restart adopts them instead of destroying them
    """
    CREATE TABLE standby (
        handle TEXT PRIMARY KEY,      -- MIG device UUID
        card_uuid TEXT NOT NULL,
        size TEXT NOT NULL,
        slice TEXT NOT NULL,          -- JSON of the Slice fields
        created REAL NOT NULL
    );
    """,
    # 8: MIG GPU instances this xpud made, so that start-up destroys only its own and leaves those of
    # other tools (mig-parted, the GPU Operator) alone. Written before the instance is made (the device
    # UUID once it is), removed once it is destroyed.
    """
    CREATE TABLE mig_made (
        card_uuid TEXT NOT NULL,
        start INTEGER NOT NULL,       -- placement start slot: one GPU instance per slot at a time
        profile_id INTEGER NOT NULL,  -- the driver's GPU-instance profile id
        device_uuid TEXT NOT NULL DEFAULT '',  -- MIG device UUID; '' while it is being made
        created REAL NOT NULL,
        PRIMARY KEY (card_uuid, start)
    );
    """,
    # 9: jobs (xpud.ledger.jobs): every command the daemon runs or was asked to, with its state and end
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL DEFAULT '',
        kind TEXT NOT NULL,           -- detached (xpu submit), attached (xpu run), multi-host
        uid INTEGER NOT NULL,
        gid INTEGER NOT NULL,
        cwd TEXT NOT NULL DEFAULT '',
        argv TEXT NOT NULL DEFAULT '[]',  -- JSON list
        env TEXT NOT NULL DEFAULT '{}',   -- JSON object, until the job has started
        spec TEXT NOT NULL DEFAULT '{}',  -- JSON: mode, gpus, priority, wait_s, output, error, time, after
        hosts TEXT NOT NULL DEFAULT '[]', -- JSON list
        lease_id TEXT NOT NULL DEFAULT '',
        state TEXT NOT NULL,
        exit_code INTEGER,
        exit_signal INTEGER,
        submitted REAL NOT NULL,
        started REAL,
        ended REAL,
        reason TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX jobs_by_state ON jobs(state);
    CREATE INDEX jobs_by_name ON jobs(uid, name);
    CREATE INDEX jobs_by_submitted ON jobs(submitted);
    """,
    # 10: accounts (issue #33, xpud.ledger.accounts): each lease and reservation is charged to an account
    # (those of older ledgers to "default"); each account's decayed usage, kept across restarts
    """
    ALTER TABLE leases ADD COLUMN account TEXT NOT NULL DEFAULT 'default';
    ALTER TABLE reservations ADD COLUMN account TEXT NOT NULL DEFAULT 'default';
    ALTER TABLE leases ADD COLUMN queued_s REAL NOT NULL DEFAULT 0;  -- time in the queue before the grant
    CREATE TABLE account_usage (
        account TEXT PRIMARY KEY,
        usage_s REAL NOT NULL,        -- decayed usage in GPU-seconds (xpud.planning.fairshare.accrue)
        at REAL NOT NULL              -- when it was last accrued (wall time)
    );
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)

# Columns that a released migration gained in place, before the rule above held: a ledger written in
# between has the version but not the column, and gets it at open (``store.Store._migrate``).
# (table, column, the statement that adds it)
REPAIRS: list[tuple[str, str, str]] = [
    # migration 3 as main's commits e9caced..767ac28 wrote it (b3105e7 then added the column to it)
    ("reservations", "rank_pid", "ALTER TABLE reservations ADD COLUMN rank_pid INTEGER NOT NULL DEFAULT 0"),
]


def statements(script: str) -> list[str]:
    """Split a migration script into statements (no semicolons inside our statements)."""
    lines = [ln.split("--", 1)[0] for ln in script.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


@functools.cache
def tables() -> dict[str, frozenset[str]]:
    """The tables and columns the migrations make (built once in memory)."""
    db = sqlite3.connect(":memory:")
    try:
        for m in MIGRATIONS:
            for stmt in statements(m):
                db.execute(stmt)
        tables = [
            r[0]
            for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            if not r[0].startswith("sqlite_")
        ]
        return {t: frozenset(r[1] for r in db.execute(f"PRAGMA table_info({t})")) for t in tables}
    finally:
        db.close()
