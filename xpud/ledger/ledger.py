"""The lease ledger: SQLite in WAL mode, the daemon's only durable state.

Durability (the guarantee xpud chooses). ``journal_mode=WAL`` with ``synchronous=NORMAL``: a commit
survives a crash or kill of the daemon at any instant (it is in the WAL file, which the kernel writes out
whatever happens to the process); a power loss or kernel panic may lose the last commits since the last
WAL sync, and never corrupts the file. That is the durability a host-local lease needs: its holders die
with the host, so a grant lost that way has no holder left, a release lost that way is reclaimed within
the grace period after the restart, and the hardware's slices are gone too (start-up reconciles them).
What a caller is told about is always committed first: no reply before its commit.

Writes never run on the event loop. One writer thread owns the writing connection; each caller's
statements (``Op``) are queued and the thread commits whatever is queued in one transaction (group
commit), each caller's statements in a savepoint of their own so a bad write fails alone. The loop awaits
``write`` without blocking. When the database is locked by another process for more than
``BUSY_TIMEOUT_S`` (a backup, an open ``sqlite3`` shell) or the file system is full, the waiting writes
fail with ``LedgerUnavailable`` (gRPC UNAVAILABLE, "ledger busy" / "ledger full") and the caller changes
nothing. Events and health changes are a log: they are queued without waiting (their ids are assigned
here) and a failure to write them is logged, not raised. Reads use a second connection (WAL readers do
not wait for writers); the tokens of active leases and the ids in use are kept in memory.

Damage. At open: the file must be SQLite, ``PRAGMA quick_check`` must say ok, the WAL's header and frame
checksums must hold (SQLite itself would silently ignore a damaged WAL and every commit in it), and every
active lease and card row must read back. Otherwise ``LedgerDamaged`` says what is wrong in one line, the
damaged files are copied aside (``ledger.sqlite.damaged-<time>``) and the daemon refuses to start: move a
backup in place, or remove the files to start empty (the leases in it are then lost: say so to the users).

The ledger and its ``-wal``/``-shm`` files are created 0600 whatever the umask. The schema is versioned
with ``PRAGMA user_version``; migrations run in order at open, and a ledger from a newer xpud is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import hashlib
import itertools
import json
import logging
import os
import queue
import shutil
import sqlite3
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from xpud.errors import ConfigError, Unavailable, XpudError
from xpud.model import CommandEnd, Lease, LeaseState, Mode, Slice
from xpud.planning.usage import Reading

log = logging.getLogger("xpud.ledger.ledger")

BUSY_TIMEOUT_S = 2.0  # how long a write waits for another process's lock before it fails (off the loop)
READ_BUSY_TIMEOUT_MS = 100  # WAL readers wait for nobody, except in rare recovery cases: bound those
GROUP_MAX = 512  # writes committed in one transaction at most

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
    # 9: accounts (issue #33, xpud.ledger.accounts): each lease and reservation is charged to an account
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


@functools.cache
def _schema() -> dict[str, frozenset[str]]:
    """The tables and columns the migrations make (built once in memory)."""
    db = sqlite3.connect(":memory:")
    try:
        for m in MIGRATIONS:
            for stmt in _statements(m):
                db.execute(stmt)
        tables = [
            r[0]
            for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            if not r[0].startswith("sqlite_")
        ]
        return {t: frozenset(r[1] for r in db.execute(f"PRAGMA table_info({t})")) for t in tables}
    finally:
        db.close()


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
class ReservationRecord:
    """One multi-host job's hold on this host (``xpud.federation.hostjobs``)."""

    job: str
    attempt: int
    coordinator: str
    lease_id: str
    cards: tuple[int, ...]
    ttl_s: float
    created: float
    expires: float
    state: str
    rank_pid: int = 0


@dataclass(frozen=True)
class AutoLeaseRecord:
    """What right-sizing keeps about a lease across restarts (``xpud.controllers.rightsizer``)."""

    lease_id: str
    job_class: str
    auto: bool  # --mode auto: may be moved
    moves: int = 0  # automatic moves so far (its budget)
    last_move: float | None = None  # wall time of the last one
    last_direction: str = ""


@dataclass(frozen=True)
class EventRecord:
    id: int
    ts: float
    kind: str
    card: int
    lease_id: str
    message: str


def _encoder():
    """``json.dumps`` with its defaults, without building a new C encoder at each call (for these small
    values that is as much work as the encoding): the same text. ``json.dumps`` itself where the C
    encoder is missing or takes other arguments (another Python)."""
    try:
        encode = json.encoder.c_make_encoder(
            None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ": ", ", ",
            False, False, True,
        )  # fmt: skip

        def dumps(value) -> str:
            return "".join(encode(value, 0))

        sample = [{"a": [1, 2.5, None, True], "é": "x\n"}, -0.0, 1e300, "\u2028"]
        if dumps(sample) == json.dumps(sample):
            return dumps
    except (TypeError, AttributeError):
        pass
    return json.dumps


_json = _encoder()


def _lease_json(lease: Lease) -> tuple[str, str, str, str]:
    """A lease row's JSON columns: cards, card_uuids, slices, env (in one place, for its insert and its
    placement's updates)."""
    return (
        _json(list(lease.cards)),
        _json(list(lease.card_uuids)),
        _json([_slice_to_json(s) for s in lease.slices]),
        _json(lease.env),
    )


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
        name=row["name"],
        ended=row["ended"],
        end_reason=row["end_reason"],
        started=row["started"],
        exit_code=row["exit_code"],
        exit_signal=row["exit_signal"],
        anchor=row["anchor"],
        account=row["account"],
    )


class LedgerUnavailable(Unavailable):
    """The ledger cannot record a change now (locked by another process, file system full): the change was
    not made; the caller may retry."""


class LedgerDamaged(XpudError):
    """The ledger file cannot be trusted (found at open): the daemon refuses to start."""

    code = "DATA_LOSS"


@dataclass(frozen=True)
class Op:
    """Statements of one write; ``effect`` runs (in the writer thread) once they are committed."""

    statements: tuple[tuple[str, tuple], ...]
    effect: Callable[[], None] | None = None


def op(sql: str, *args, effect=None) -> Op:
    return Op(((sql, args),), effect)


@dataclass
class _Write:
    ops: tuple[Op, ...]
    future: concurrent.futures.Future | None
    then: Callable[[BaseException | None], None] | None = None  # ``submit_then``: answered on ``loop``
    loop: asyncio.AbstractEventLoop | None = None


def _answer(calls: list[tuple[Callable[[BaseException | None], None], BaseException | None]]) -> None:
    """On the loop: a batch's ``submit_then`` answers, in the order they were submitted."""
    for then, err in calls:
        try:
            then(err)
        except Exception:
            log.exception("a ledger write's completion failed")


_ENVIRONMENT = {5, 6, 8, 10, 11, 13, 14, 26}  # BUSY LOCKED READONLY IOERR CORRUPT FULL CANTOPEN NOTADB


class _Again(Exception):
    """A write of a batch failed on its own: the batch is done again, a savepoint per write."""


def _primary(e: BaseException) -> int:
    return (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF


class Ledger:
    """Durable leases, card states and an event log. Writes from any thread go through the writer thread
    (``write`` from the loop, ``write_sync`` elsewhere); reads use ``db`` on the caller's thread."""

    def __init__(self, path: str | Path, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        if not self.path.parent.exists():
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self._check_wal()
            self._create_private()
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                raise  # the daemon says: run as root or give directories you own
            raise self._unavailable(e) from None
        try:
            self.db = self._connect(check_same_thread=False)
            self._check()
            self._migrate()
            self._check_schema()
            self._load()
            self._next_event = itertools.count(self._max_id("events") + 1)
            self._next_health = itertools.count(self._max_id("health_changes") + 1)
        except sqlite3.Error as e:
            code = _primary(e)
            if code in (11, 26):  # CORRUPT, NOTADB
                raise self._damaged(str(e)) from None
            if code == 1 and str(e).startswith(("no such table", "no such column")):  # e.g. migrating
                raise self._damaged(str(e)) from None
            raise self._unavailable(e) from None
        self.db.execute(f"PRAGMA busy_timeout={READ_BUSY_TIMEOUT_MS}")  # reads run on the loop
        self._pending_events: dict[int, EventRecord] = {}
        self._pending_health: dict[int, HealthChangeRecord] = {}
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._run, name="xpud-ledger", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------------------ opening
    def _connect(self, check_same_thread: bool = True) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=check_same_thread)
        db.row_factory = sqlite3.Row
        db.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
        if db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
            raise sqlite3.OperationalError("cannot switch the ledger to WAL mode")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def _create_private(self) -> None:
        """The ledger is 0600 whatever the umask; SQLite gives its -wal and -shm the ledger's mode."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        for suffix in ("-wal", "-shm"):
            p = Path(f"{self.path}{suffix}")
            if p.exists():
                os.chmod(p, 0o600)

    def _check(self) -> None:
        rows = [r[0] for r in self.db.execute("PRAGMA quick_check(5)")]
        if rows != ["ok"]:
            raise self._damaged(f"integrity check failed: {'; '.join(rows)}")

    def _check_schema(self) -> None:
        """Every table and column of the schema is there (a table dropped by hand is damage, not a
        traceback at the first query that needs it)."""
        for table, columns in _schema().items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if not have:
                raise self._damaged(f"table {table} is missing")
            missing = sorted(columns - have)
            if missing:
                raise self._damaged(f"table {table} has no column {', '.join(missing)}")

    def _load(self) -> None:
        """Read every active lease and card row back (a bad row refuses the start); keep the ids in use and
        the active leases' token hashes in memory."""
        states = tuple(s.value for s in LeaseState)
        marks = ",".join("?" * len(states))
        sql = f"SELECT id, state FROM leases WHERE state NOT IN ({marks}) LIMIT 1"
        for r in self.db.execute(sql, states):  # else dropped silently: neither restored nor listed
            raise self._damaged(f"lease row {r['id']!r} has state {r['state']!r} ({', '.join(states)})")
        self._ids = {r[0] for r in self.db.execute("SELECT id FROM leases")}
        self._tokens: dict[str, str] = {}
        for r in self.db.execute("SELECT * FROM leases WHERE state='active'"):
            try:
                lease = _lease_from_row(r)
                if (lease.mode is not Mode.XPU and len(lease.slices) != 1) or not lease.card_uuids:
                    raise ValueError("its cards or slices do not match its mode")
            except (ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
                raise self._damaged(f"active lease row {r['id']!r} is unreadable ({e})") from None
            self._tokens[lease.id] = r["token_hash"]
        for r in self.db.execute("SELECT * FROM cards"):
            if r["mode"] not in ("whole", "sliced"):
                raise self._damaged(f"card row {r['uuid']!r} has mode {r['mode']!r} (whole or sliced)")

    def _max_id(self, table: str) -> int:
        return self.db.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()[0]

    def _check_wal(self) -> None:
        """Check the WAL before SQLite reads it: SQLite stops at the first damaged frame and drops every
        commit after it (or the whole WAL when its header is damaged) without a word."""
        wal = Path(f"{self.path}-wal")
        try:
            data = wal.read_bytes()
        except FileNotFoundError:
            return
        problem = wal_damage(data)
        if problem:
            raise self._damaged(f"its WAL file {wal.name} is damaged ({problem})")

    def _damaged(self, what: str) -> LedgerDamaged:
        kept = self._keep_aside()
        where = f"a copy is kept as {kept}" if kept else "no copy could be made"
        return LedgerDamaged(
            f"ledger {self.path} is damaged: {what}; {where}. Restore a backup to {self.path}, or remove "
            f"{self.path.name} (and its -wal, -shm) to start with an empty ledger: its leases are then lost"
        )

    def _keep_aside(self) -> str:
        """Copy the damaged files aside once (named by their content, so a restart loop makes no more)."""
        files = [p for p in (self.path, Path(f"{self.path}-wal")) if p.exists()]
        h = hashlib.sha256()
        for p in files:
            with p.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        name = f"{self.path}.damaged-{h.hexdigest()[:12]}"
        try:
            for p in files:
                dst = Path(name + p.name[len(self.path.name) :])
                if not dst.exists():
                    shutil.copy2(p, dst)
                    os.chmod(dst, 0o600)
        except OSError as e:
            log.error("cannot copy the damaged ledger aside: %s", e)
            return ""
        return name

    def _unavailable(self, e: BaseException) -> LedgerUnavailable:
        code = _primary(e) if isinstance(e, sqlite3.Error) else 0
        if code in (5, 6):
            return LedgerUnavailable(
                f"ledger busy: {self.path} is locked by another process (a backup or an open sqlite3 "
                f"shell?) for more than {self.busy_timeout_s:g} s; nothing changed: retry"
            )
        if code == 13 or getattr(e, "errno", None) == errno.ENOSPC:
            return LedgerUnavailable(
                f"ledger full: no space left in {self.path.parent} for the ledger; nothing changed: "
                "free space there and retry"
            )
        return LedgerUnavailable(f"ledger unavailable: {self.path}: {e}; nothing changed: retry")

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
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(self.busy_timeout_s + 5)
        self.db.close()

    # ------------------------------------------------------------------------------ writing
    def submit(self, *ops: Op) -> concurrent.futures.Future:
        """Queue ``ops`` for the writer thread (one atomic unit); the future resolves once committed."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(_Write(ops, fut))
        return fut

    def submit_then(self, then: Callable[[BaseException | None], None], *ops: Op) -> None:
        """``submit`` from the event loop, without a future: ``then(error)`` runs on the loop once ``ops``
        are committed (``error`` None) or not (LedgerUnavailable: nothing written). The answers to all
        such writes of one writer batch come back in one wake-up of the loop (the grant and release
        paths: one ``call_soon_threadsafe`` per batch, not one per write)."""
        self._queue.put(_Write(ops, None, then, asyncio.get_running_loop()))

    async def write(self, *ops: Op) -> None:
        """Commit ``ops`` atomically without blocking the loop. Raises LedgerUnavailable (nothing written).
        A caller cancelled before the writer thread takes its write leaves it unwritten."""
        await asyncio.wrap_future(self.submit(*ops))

    def write_sync(self, *ops: Op) -> None:
        """``write`` for threads other than the loop (start-up, tests)."""
        self.submit(*ops).result()

    def flush(self) -> None:
        """Wait until everything queued so far is committed (or failed); not for the loop."""
        self.submit().result()

    def _run(self) -> None:
        try:
            db = self._connect()
        except sqlite3.Error as e:
            err = self._unavailable(e)
            log.error("the ledger's writer cannot open %s: %s", self.path, e)
            db = None
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                break
            batch = [item]
            while len(batch) < GROUP_MAX and not self._queue.empty():  # (this thread alone takes from it)
                nxt = self._queue.get_nowait()
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            # A write whose caller was cancelled before this point is dropped: its caller changed
            # nothing. Taken, it can no longer be cancelled (its result is then always set).
            batch = [w for w in batch if w.future is None or w.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            if db is None:
                self._finish(batch, [err] * len(batch))
            else:
                self._commit(db, batch)
        if db is not None:
            db.close()

    def _commit(self, db: sqlite3.Connection, batch: list[_Write]) -> None:
        """The batch in one transaction. Without savepoints first (nothing fails in the common case, and
        each is two more statements per write); when a write fails on its own (a constraint), the batch
        is rolled back and done again with a savepoint per write, so that it fails alone."""
        guarded = False
        while True:
            results: list[BaseException | None] = []
            try:
                db.execute("BEGIN IMMEDIATE")
                for w in batch:
                    if guarded:
                        db.execute("SAVEPOINT w")
                    try:
                        for o in w.ops:
                            for sql, args in o.statements:
                                db.execute(sql, args)
                    except sqlite3.Error as e:
                        if guarded and _primary(e) not in _ENVIRONMENT:
                            db.execute("ROLLBACK TO w")
                            results.append(self._unavailable(e))
                        elif len(batch) > 1 and _primary(e) not in _ENVIRONMENT:
                            raise _Again from None
                        else:
                            raise
                    else:
                        results.append(None)
                    if guarded:
                        db.execute("RELEASE w")
                db.execute("COMMIT")
            except _Again:
                guarded = True
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                continue
            except (sqlite3.Error, OSError) as e:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                err = self._unavailable(e)
                if _primary(e) in _ENVIRONMENT:
                    log.error("%s", err)
                self._finish(batch, [err] * len(batch))
                return
            break
        self._finish(batch, results)

    def _finish(self, batch: list[_Write], results: Sequence[BaseException | None]) -> None:
        answers: dict[asyncio.AbstractEventLoop, list] = {}
        for w, err in zip(batch, results, strict=True):
            if err is None:
                for o in w.ops:
                    if o.effect is not None:
                        o.effect()
            if w.future is not None:
                if err is None:
                    w.future.set_result(None)
                else:
                    w.future.set_exception(err)
            elif w.then is not None:
                assert w.loop is not None  # submit_then always names its loop
                answers.setdefault(w.loop, []).append((w.then, err))
        for loop, calls in answers.items():
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for the answers
                loop.call_soon_threadsafe(_answer, calls)

    # reservations -------------------------------------------------------------------------------
    def save_reservation_op(self, r: ReservationRecord) -> Op:
        return op(
            "INSERT OR REPLACE INTO reservations (job, attempt, coordinator, lease_id, cards, ttl_s, created,"
            " expires, state, ended) VALUES (?,?,?,?,?,?,?,?,?,NULL)",
            r.job,
            r.attempt,
            r.coordinator,
            r.lease_id,
            json.dumps(list(r.cards)),
            r.ttl_s,
            r.created,
            r.expires,
            r.state,
        )

    def end_reservation_op(self, job: str, attempt: int, state: str, when: float) -> Op:
        return op(
            "UPDATE reservations SET state=?, ended=?"
            " WHERE job=? AND attempt=? AND state IN ('held','committed')",
            state,
            when,
            job,
            attempt,
        )

    def set_rank_pid_op(self, job: str, attempt: int, pid: int) -> Op:
        return op("UPDATE reservations SET rank_pid=? WHERE job=? AND attempt=?", pid, job, attempt)

    def live_reservations(self) -> list[ReservationRecord]:
        """Held and committed reservations (restored at start)."""
        rows = self.db.execute(
            "SELECT * FROM reservations WHERE state IN ('held','committed') ORDER BY created"
        ).fetchall()
        return [
            ReservationRecord(
                r["job"],
                r["attempt"],
                r["coordinator"],
                r["lease_id"],
                tuple(json.loads(r["cards"])),
                r["ttl_s"],
                r["created"],
                r["expires"],
                r["state"],
                r["rank_pid"],
            )
            for r in rows
        ]

    # leases -------------------------------------------------------------------------------------
    def insert_lease_op(self, lease: Lease, token: str) -> Op:
        token_hash = hash_token(token)

        def effect() -> None:
            self._tokens[lease.id] = token_hash

        self._ids.add(lease.id)  # taken from now on, whether or not the insert commits
        return op(
            "INSERT INTO leases (id, token_hash, mode, owner_uid, cards, card_uuids, slices, env,"
            " priority, restartable, holder_pid, command, created, state, restart_count, mark, name, anchor,"
            " account) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            lease.id,
            token_hash,
            lease.mode.value,
            lease.owner_uid,
            *_lease_json(lease),
            lease.priority,
            int(lease.restartable),
            lease.holder_pid,
            lease.command,
            lease.created,
            lease.state.value,
            lease.restart_count,
            lease.mark,
            lease.name,
            lease.anchor,
            lease.account,
            effect=effect,
        )

    def update_placement_op(self, lease: Lease) -> Op:
        """A lease's new cards/slices/env (after a move), and its size (a right-sizing move changes it)."""
        return op(
            "UPDATE leases SET mode=?, cards=?, card_uuids=?, slices=?, env=?, restart_count=?, mark=? "
            "WHERE id=?",
            str(lease.mode),
            *_lease_json(lease),
            lease.restart_count,
            lease.mark,
            lease.id,
        )

    def set_mark_op(self, lease_id: str, mark: str) -> Op:
        return op("UPDATE leases SET mark=? WHERE id=?", mark, lease_id)

    def end_lease_op(
        self,
        lease_id: str,
        state: LeaseState,
        reason: str = "",
        when: float | None = None,
        end: CommandEnd | None = None,
    ) -> Op:
        """End an active lease; ``end``: how its command ended. Its mark (a note for the holder) goes."""

        def effect() -> None:
            self._tokens.pop(lease_id, None)

        end = end or CommandEnd()
        return op(
            "UPDATE leases SET state=?, ended=?, end_reason=?, mark='', started=?, exit_code=?,"
            " exit_signal=? WHERE id=? AND state='active'",
            state.value,
            when or time.time(),
            reason,
            end.started,
            end.exit_code,
            end.exit_signal,
            lease_id,
            effect=effect,
        )

    def insert_lease(self, lease: Lease, token: str) -> None:
        self.write_sync(self.insert_lease_op(lease, token))

    def update_placement(self, lease: Lease) -> None:
        self.write_sync(self.update_placement_op(lease))

    def set_mark(self, lease_id: str, mark: str) -> None:
        self.write_sync(self.set_mark_op(lease_id, mark))

    def end_lease(
        self,
        lease_id: str,
        state: LeaseState,
        reason: str = "",
        when: float | None = None,
        end: CommandEnd | None = None,
    ) -> None:
        self.write_sync(self.end_lease_op(lease_id, state, reason, when, end))

    def active_leases(self) -> list[Lease]:
        rows = self.db.execute("SELECT * FROM leases WHERE state='active' ORDER BY created").fetchall()
        return [_lease_from_row(r) for r in rows]

    def recent_leases(self, limit: int = 100) -> list[Lease]:
        rows = self.db.execute("SELECT * FROM leases ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [_lease_from_row(r) for r in rows]

    def find_lease(self, prefix: str) -> list[Lease]:
        """Leases, active or ended, whose id starts with ``prefix`` (at most two: enough to tell)."""
        rows = self.db.execute(
            "SELECT * FROM leases WHERE substr(id, 1, ?) = ? ORDER BY created DESC LIMIT 2",
            (len(prefix), prefix),
        ).fetchall()
        return [_lease_from_row(r) for r in rows]

    def lease_intervals(self, since: float) -> list[tuple[str, float, float | None]]:
        """(mode, created, ended or None) of every lease alive at or after ``since``: the demand history
        that ``xpud.planning.forecast`` learns from."""
        q = "SELECT mode, created, ended FROM leases WHERE ended IS NULL OR ended >= ? ORDER BY created"
        return [
            (r[0], float(r[1]), None if r[2] is None else float(r[2])) for r in self.db.execute(q, (since,))
        ]

    def token_matches(self, lease_id: str, token: str) -> bool:
        stored = self._tokens.get(lease_id)
        if stored is None:
            row = self.db.execute("SELECT token_hash FROM leases WHERE id=?", (lease_id,)).fetchone()
            stored = row["token_hash"] if row else None
        return stored is not None and stored == hash_token(token)

    def lease_ids(self) -> set[str]:
        """Every lease id in the ledger (and every one being inserted)."""
        return self._ids

    def prune(self, older_than_days: int, now: float | None = None) -> int:
        """Drop what ended more than ``older_than_days`` ago (``prune_ops``); returns how many leases.
        Blocking: for threads other than the loop (the daemon's job awaits ``write(*prune_ops(...))``)."""
        cutoff = (now or time.time()) - older_than_days * 86400
        before = self.db.execute(
            "SELECT COUNT(*) FROM leases WHERE state!='active' AND ended < ?", (cutoff,)
        ).fetchone()[0]
        self.write_sync(*self.prune_ops(older_than_days, now))
        return before

    def prune_ops(self, older_than_days: int, now: float | None = None) -> list[Op]:
        """Ended leases, events, finished reservations and usage readings older than the cutoff; each
        card's latest health change stays (it is the state restored at the next start)."""
        cutoff = (now or time.time()) - older_than_days * 86400
        return [
            op("DELETE FROM leases WHERE state!='active' AND ended < ?", cutoff),
            op("DELETE FROM events WHERE ts < ?", cutoff),
            op("DELETE FROM reservations WHERE state NOT IN ('held','committed') AND ended < ?", cutoff),
            op("DELETE FROM usage_readings WHERE ts < ?", cutoff),
            op("DELETE FROM auto_leases WHERE lease_id NOT IN (SELECT id FROM leases WHERE state='active')"),
            # keep each card's latest change: it is the state restored at the next start
            op(
                "DELETE FROM health_changes WHERE ts < ? AND id NOT IN"
                " (SELECT MAX(id) FROM health_changes GROUP BY card_uuid)",
                cutoff,
            ),
        ]

    # right-sizing (xpud.controllers.rightsizer) -------------------------------------------------------------
    def add_readings(self, rows: Sequence[tuple[str, Reading]], keep: int) -> None:
        """Record one round of readings [(job class, reading)] and keep each class's newest ``keep``
        (queued like an event: a failure is logged, not raised; the histories are advice, not leases)."""
        if not rows:
            return
        ops = [
            op(
                "INSERT INTO usage_readings (job_class, ts, sm_pct, membw_pct, mem_bytes, cap_pct,"
                " mem_cap_bytes) VALUES (?,?,?,?,?,?,?)",
                *(cls, r.t, r.sm_pct, r.membw_pct, r.mem_bytes, r.cap_pct, r.mem_cap_bytes),
            )
            for cls, r in rows
        ]
        ops += [
            op(
                "DELETE FROM usage_readings WHERE job_class=? AND id <= (SELECT id FROM usage_readings"
                " WHERE job_class=? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                cls,
                cls,
                keep,
            )
            for cls in {cls for cls, _ in rows}
        ]
        self.save_logged(*ops)

    def forget_stale_usage(self, before: float) -> None:
        """Drop the readings of classes not seen since ``before`` (wall time) and the records of leases
        no longer active (a crash between a lease's end and its record's removal). Queued."""
        self.save_logged(
            op(
                "DELETE FROM usage_readings WHERE job_class IN (SELECT job_class FROM usage_readings"
                " GROUP BY job_class HAVING MAX(ts) < ?)",
                before,
            ),
            op("DELETE FROM auto_leases WHERE lease_id NOT IN (SELECT id FROM leases WHERE state='active')"),
        )

    def class_readings(self) -> dict[str, list[Reading]]:
        """Each job class's recorded readings, oldest first."""
        out: dict[str, list[Reading]] = {}
        for r in self.db.execute("SELECT * FROM usage_readings ORDER BY id"):
            out.setdefault(r["job_class"], []).append(
                Reading(
                    r["ts"], r["sm_pct"], r["mem_bytes"], r["cap_pct"], r["mem_cap_bytes"], r["membw_pct"]
                )
            )
        return out

    def save_auto_lease_op(self, rec: AutoLeaseRecord) -> Op:
        return op(
            "INSERT INTO auto_leases (lease_id, job_class, auto, moves, last_move, last_direction)"
            " VALUES (?,?,?,?,?,?) ON CONFLICT(lease_id) DO UPDATE SET job_class=excluded.job_class,"
            " auto=excluded.auto, moves=excluded.moves, last_move=excluded.last_move,"
            " last_direction=excluded.last_direction",
            *(rec.lease_id, rec.job_class, int(rec.auto), rec.moves, rec.last_move, rec.last_direction),
        )

    def end_auto_lease_op(self, lease_id: str) -> Op:
        return op("DELETE FROM auto_leases WHERE lease_id=?", lease_id)

    def save_logged(self, *ops: Op) -> None:
        """Queue ``ops`` without waiting; a failure is logged, not raised (right-sizing's own records)."""
        self.submit(*ops).add_done_callback(_logged(lambda: None))

    def auto_leases(self) -> dict[str, AutoLeaseRecord]:
        """The right-sizing records of the active leases."""
        rows = self.db.execute(
            "SELECT a.* FROM auto_leases a JOIN leases l ON l.id = a.lease_id WHERE l.state='active'"
        )
        return {
            r["lease_id"]: AutoLeaseRecord(
                *(r["lease_id"], r["job_class"], bool(r["auto"]), r["moves"]),
                *(r["last_move"], r["last_direction"]),
            )
            for r in rows
        }

    # pre-created slices (xpud.engine.standby) ----------------------------------------------------------
    def save_standby_op(self, card_uuid: str, s: Slice, created: float) -> Op:
        return op(
            "INSERT INTO standby (handle, card_uuid, size, slice, created) VALUES (?,?,?,?,?)",
            s.handle,
            card_uuid,
            s.size,
            json.dumps(_slice_to_json(s)),
            created,
        )

    def drop_standby_op(self, handle: str) -> Op:
        return op("DELETE FROM standby WHERE handle=?", handle)

    def standby(self) -> list[tuple[str, Slice, float]]:
        """(card uuid, slice, created) of every recorded pre-created slice, oldest first."""
        rows = self.db.execute("SELECT card_uuid, slice, created FROM standby ORDER BY created").fetchall()
        return [(r[0], Slice(**json.loads(r[1])), float(r[2])) for r in rows]

    # MIG instances made by this xpud (xpud.isolation.mig_book) ------------------------------------
    def mig_made_op(self, card_uuid: str, start: int, profile_id: int, created: float) -> Op:
        return op(
            "INSERT OR REPLACE INTO mig_made (card_uuid, start, profile_id, device_uuid, created)"
            " VALUES (?,?,?,'',?)",
            card_uuid,
            start,
            profile_id,
            created,
        )

    def mig_named_op(self, card_uuid: str, start: int, device_uuid: str) -> Op:
        return op(
            "UPDATE mig_made SET device_uuid=? WHERE card_uuid=? AND start=?", device_uuid, card_uuid, start
        )

    def mig_gone_op(self, card_uuid: str, start: int) -> Op:
        return op("DELETE FROM mig_made WHERE card_uuid=? AND start=?", card_uuid, start)

    def mig_made(self, card_uuid: str) -> list[tuple[int, int, str]]:
        """(start, profile id, device UUID or '') of each MIG instance recorded as made on the card."""
        sql = "SELECT start, profile_id, device_uuid FROM mig_made WHERE card_uuid=? ORDER BY start"
        rows = self.db.execute(sql, (card_uuid,)).fetchall()
        return [(int(r[0]), int(r[1]), str(r[2])) for r in rows]

    # cards --------------------------------------------------------------------------------------
    def save_card_op(self, rec: CardRecord) -> Op:
        return op(
            "INSERT INTO cards (uuid, mode, mode_pinned, drained, drain_reason) VALUES (?,?,?,?,?)"
            " ON CONFLICT(uuid) DO UPDATE SET mode=excluded.mode, mode_pinned=excluded.mode_pinned,"
            " drained=excluded.drained, drain_reason=excluded.drain_reason",
            rec.uuid,
            rec.mode,
            int(rec.mode_pinned),
            int(rec.drained),
            rec.drain_reason,
        )

    def save_card(self, rec: CardRecord) -> None:
        self.write_sync(self.save_card_op(rec))

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
        """Log an event (queued: it is committed with the next write; a failure is logged, not raised)."""
        ev, o = self.event_op(kind, message, card, lease_id, ts)
        self._pending_events[ev.id] = ev

        def done() -> None:
            self._pending_events.pop(ev.id, None)

        self.submit(o).add_done_callback(_logged(done))
        return ev

    def event_op(
        self, kind: str, message: str, card: int = -1, lease_id: str = "", ts: float | None = None
    ) -> tuple[EventRecord, Op]:
        """An event to commit with the change it reports (one transaction: both or neither)."""
        ev = EventRecord(next(self._next_event), ts or time.time(), kind, card, lease_id, message)
        return ev, op(
            "INSERT INTO events (id, ts, kind, card, lease_id, message) VALUES (?,?,?,?,?,?)",
            *(ev.id, ev.ts, kind, card, lease_id, message),
        )

    def events(self, limit: int = 200, card: int | None = None, lease_id: str = "") -> list[EventRecord]:
        """The latest ``limit`` events, oldest first; only those about ``card`` and/or leases whose id
        starts with ``lease_id`` when given."""
        pending = [
            e
            for e in list(self._pending_events.values())
            if (card is None or e.card == card) and e.lease_id.startswith(lease_id)
        ]
        where: list[str] = []
        args: list[object] = []
        if card is not None:
            where, args = ["card=?"], [card]
        if lease_id:
            where.append("substr(lease_id, 1, ?) = ?")
            args += [len(lease_id), lease_id]
        q = "SELECT * FROM events" + (f" WHERE {' AND '.join(where)}" if where else "")
        rows = self.db.execute(q + " ORDER BY id DESC LIMIT ?", [*args, limit]).fetchall()
        out = {
            r["id"]: EventRecord(r["id"], r["ts"], r["kind"], r["card"], r["lease_id"], r["message"])
            for r in rows
        }
        out.update((e.id, e) for e in pending)
        return [out[i] for i in sorted(out)[-limit:]]

    # health ---------------------------------------------------------------------------------------
    def add_health_change(self, rec: HealthChangeRecord) -> None:
        """Record a card's state change (queued like an event)."""
        hid = next(self._next_health)
        self._pending_health[hid] = rec

        def done() -> None:
            self._pending_health.pop(hid, None)

        o = op(
            "INSERT INTO health_changes (id, ts, card_uuid, card, from_state, to_state, score, reasons)"
            " VALUES (?,?,?,?,?,?,?,?)",
            hid,
            rec.ts,
            rec.card_uuid,
            rec.card,
            rec.from_state,
            rec.to_state,
            rec.score,
            json.dumps(rec.reasons),
            effect=done,
        )
        self.submit(o).add_done_callback(_logged(done))

    def health_changes(self, card_uuid: str, limit: int = 20) -> list[HealthChangeRecord]:
        """A card's latest state changes, oldest first."""
        pending = [(i, r) for i, r in list(self._pending_health.items()) if r.card_uuid == card_uuid]
        rows = self.db.execute(
            "SELECT * FROM health_changes WHERE card_uuid=? ORDER BY id DESC LIMIT ?", (card_uuid, limit)
        ).fetchall()
        out = {
            r["id"]: HealthChangeRecord(
                r["ts"],
                r["card_uuid"],
                r["card"],
                r["from_state"],
                r["to_state"],
                r["score"],
                tuple(json.loads(r["reasons"])),
            )
            for r in rows
        }
        out.update(pending)
        return [out[i] for i in sorted(out)[-limit:]]


_last_lost_log = -1e9


def _logged(done):
    """A done-callback for a log entry nobody waits for: forget it as pending; say when it was lost."""

    def callback(fut: concurrent.futures.Future) -> None:
        done()
        global _last_lost_log
        if fut.exception() is not None and time.monotonic() - _last_lost_log > 60:
            _last_lost_log = time.monotonic()  # at most one line a minute while the ledger is unavailable
            log.warning(
                "log entries (events, health changes, usage readings) are not recorded: %s", fut.exception()
            )

    return callback


def _statements(script: str) -> list[str]:
    """Split a migration script into statements (no semicolons inside our statements)."""
    lines = [ln.split("--", 1)[0] for ln in script.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


WAL_MAGIC = (0x377F0682, 0x377F0683)  # checksums little-endian, big-endian


def _wal_sum(data: bytes, big: bool, s0: int = 0, s1: int = 0) -> tuple[int, int]:
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def wal_damage(data: bytes) -> str:
    """What is wrong with a WAL file's bytes ("" when nothing): a damaged header, or a damaged frame with
    frames of the same log after it (SQLite would drop all of them silently). A zero header or a torn
    last frame is what a crash leaves, and not damage."""
    if len(data) < 32 or not any(data[:32]):
        return "" if not any(data[:32]) else f"{len(data)} bytes, shorter than a WAL header"
    magic, version, page_size, _seq, salt1, salt2, c0, c1 = struct.unpack(">8I", data[:32])
    if magic not in WAL_MAGIC:
        return f"bad magic number {magic:#x}"
    big = magic & 1 == 1
    if (c0, c1) != _wal_sum(data[:24], big):
        return "header checksum wrong"
    if version != 3007000 or page_size < 512 or page_size > 65536 or page_size & (page_size - 1):
        return f"header version {version} / page size {page_size} invalid"
    s = (c0, c1)
    frame = 24 + page_size
    off, broken_at = 32, None
    while off + frame <= len(data):
        _pg, _commit, f1, f2, fc0, fc1 = struct.unpack(">6I", data[off : off + 24])
        ours = (f1, f2) == (salt1, salt2)
        if broken_at is None:
            if ours:
                s = _wal_sum(data[off : off + 8] + data[off + 24 : off + frame], big, *s)
            if not ours or s != (fc0, fc1):
                broken_at = off
        elif ours:
            n = (broken_at - 32) // frame
            return f"frame {n} is damaged and frames of the same log follow it"
        off += frame
    return ""
