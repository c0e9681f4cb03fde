"""The ledger's file: SQLite in WAL mode, its writer thread, its damage checks and its migrations.

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
import hashlib
import logging
import os
import queue
import shutil
import sqlite3
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from xpud.errors import ConfigError, Unavailable, XpudError
from xpud.ledger.schema import MIGRATIONS, REPAIRS, SCHEMA_VERSION, statements, tables

log = logging.getLogger("xpud.ledger.store")

BUSY_TIMEOUT_S = 2.0  # how long a write waits for another process's lock before it fails (off the loop)
READ_BUSY_TIMEOUT_MS = 100  # WAL readers wait for nobody, except in rare recovery cases: bound those
GROUP_MAX = 512  # writes committed in one transaction at most


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


class Store:
    """One SQLite file with its writer thread. Writes from any thread go through the writer thread
    (``write`` from the loop, ``write_sync`` elsewhere); reads use ``db`` on the caller's thread. A subclass
    reads what it keeps in memory back in ``_load`` (at open, before the writer starts)."""

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
        except sqlite3.Error as e:
            code = _primary(e)
            if code in (11, 26):  # CORRUPT, NOTADB
                raise self._damaged(str(e)) from None
            if code == 1 and str(e).startswith(("no such table", "no such column")):  # e.g. migrating
                raise self._damaged(str(e)) from None
            raise self._unavailable(e) from None
        self.db.execute(f"PRAGMA busy_timeout={READ_BUSY_TIMEOUT_MS}")  # reads run on the loop
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
        for table, columns in tables().items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if not have:
                raise self._damaged(f"table {table} is missing")
            missing = sorted(columns - have)
            if missing:
                raise self._damaged(f"table {table} has no column {', '.join(missing)}")

    def _load(self) -> None:
        """Read back what is kept in memory (a bad row raises ``self._damaged``): nothing here."""

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
                for stmt in statements(MIGRATIONS[n]):
                    self.db.execute(stmt)
                self.db.execute(f"PRAGMA user_version={n + 1}")
        for table, column, add in REPAIRS:
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if have and column not in have:
                with self.db:
                    self.db.execute("BEGIN")
                    self.db.execute(add)

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
