"""The lease ledger: the daemon's only durable state (leases, card states, events, health changes,
reservations, right-sizing and MIG records), as typed operations over ``store.Store``.

Durability (the guarantee xpud chooses). ``journal_mode=WAL`` with ``synchronous=NORMAL``: a commit
survives a crash or kill of the daemon at any instant (it is in the WAL file, which the kernel writes out
whatever happens to the process); a power loss or kernel panic may lose the last commits since the last
WAL sync, and never corrupts the file. That is the durability a host-local lease needs: its holders die
with the host, so a grant lost that way has no holder left, a release lost that way is reclaimed within
the grace period after the restart, and the hardware's slices are gone too (start-up reconciles them).
What a caller is told about is always committed first: no reply before its commit.

Writing, damage and migrations: ``xpud.ledger.store``; the tables: ``xpud.ledger.schema``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import logging
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from xpud.ledger.schema import MIGRATIONS, SCHEMA_VERSION
from xpud.ledger.schema import statements as _statements
from xpud.ledger.store import (
    BUSY_TIMEOUT_S,
    LedgerDamaged,
    LedgerUnavailable,
    Op,
    Store,
    _answer,
    op,
    wal_damage,
)
from xpud.model import CommandEnd, Lease, LeaseState, Mode, Slice
from xpud.planning.usage import Reading

__all__ = [  # today's import surface (callers import these from here)
    "BUSY_TIMEOUT_S",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "AutoLeaseRecord",
    "CardRecord",
    "EventRecord",
    "HealthChangeRecord",
    "Ledger",
    "LedgerDamaged",
    "LedgerUnavailable",
    "Op",
    "ReservationRecord",
    "_answer",
    "_statements",
    "hash_token",
    "op",
    "wal_damage",
]

log = logging.getLogger("xpud.ledger.ledger")


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


class Ledger(Store):
    """Durable leases, card states and an event log. Writes from any thread go through the writer thread
    (``write`` from the loop, ``write_sync`` elsewhere); reads use ``db`` on the caller's thread."""

    def __init__(self, path: str | Path, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self._pending_events: dict[int, EventRecord] = {}
        self._pending_health: dict[int, HealthChangeRecord] = {}
        super().__init__(path, busy_timeout_s)

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
        self._next_event = itertools.count(self._max_id("events") + 1)
        self._next_health = itertools.count(self._max_id("health_changes") + 1)

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

    def set_anchor_op(self, lease_id: str, anchor: str) -> Op:
        return op("UPDATE leases SET anchor=? WHERE id=?", anchor, lease_id)

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
