"""The ledger: durable, versioned, committed before the reply."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from xpud.errors import ConfigError, Unavailable
from xpud.ledger.ledger import SCHEMA_VERSION, CardRecord, Ledger
from xpud.model import Lease, LeaseState, Mode, Slice


def _lease(lid="aaaa0001", **kw):
    base = dict(
        id=lid,
        mode=Mode.VXPU_HALF,
        owner_uid=1000,
        cards=(2,),
        card_uuids=("GPU-2",),
        slices=(Slice(2, "vxpu-half", 40 << 30, 30, "mps:2"),),
        env={"A": "1"},
        created=100.0,
    )
    base.update(kw)
    return Lease(**base)


def test_grant_is_visible_to_another_connection_at_once(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    led.insert_lease(_lease(), "tok")
    other = sqlite3.connect(tmp_path / "l.sqlite")
    assert other.execute("SELECT id, state FROM leases").fetchall() == [("aaaa0001", "active")]
    assert led.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_lease_round_trip_and_end(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    lease = _lease()
    led.insert_lease(lease, "tok")
    led.close()
    led = Ledger(tmp_path / "l.sqlite")
    assert led.active_leases() == [lease]
    assert led.token_matches("aaaa0001", "tok") and not led.token_matches("aaaa0001", "tok2")
    raw = led.db.execute("SELECT token_hash FROM leases").fetchone()[0]
    assert "tok" not in raw  # only the hash is stored
    led.end_lease("aaaa0001", LeaseState.RELEASED, "done", when=200.0)
    assert led.active_leases() == []
    assert led.recent_leases()[0].state is LeaseState.RELEASED
    assert led.prune(older_than_days=1, now=200.0 + 2 * 86400) == 1


def test_a_token_is_checked_alike_before_and_after_a_restart_and_refused_once_ended(tmp_path):
    # granted here or restored after a restart, the token is compared by its hash (only the hash is kept)
    led = Ledger(tmp_path / "l.sqlite")
    led.insert_lease(_lease(), "tok")
    for _ in range(2):
        assert led.token_matches("aaaa0001", "tok")
        assert not led.token_matches("aaaa0001", "tok2") and not led.token_matches("aaaa0001", "")
        assert not led.token_matches("aaaa0001", "tök")  # not ASCII: refused, not an error
        assert not led.token_matches("aaaa0002", "tok")
        led.close()
        led = Ledger(tmp_path / "l.sqlite")
    led.end_lease("aaaa0001", LeaseState.RELEASED, "done", when=200.0)
    assert led.token_matches("aaaa0001", "tok")  # an ended lease's row keeps its hash (AckMove, listings)
    led.close()


def test_a_lease_rows_json_columns_are_the_text_json_dumps_writes(tmp_path):
    # the row's encoder is built once (not one per json.dumps call); what it writes must not change
    led = Ledger(tmp_path / "l.sqlite")
    env = {"CUDA_VISIBLE_DEVICES": "GPU-2", "NOTE": 'é "q"\n\u2028', "EMPTY": ""}
    s = Slice(2, "vxpu-half", 40 << 30, 30, "MIG-x", placement=4)
    part = _lease(slices=(s,), env=env)
    whole = _lease("bbbb0002", mode=Mode.XPU, cards=(3, 4), card_uuids=("GPU-3", "GPU-4"), slices=(), env={})
    for lease in (part, whole):
        led.insert_lease(lease, "tok")
    rows = led.db.execute("SELECT cards, card_uuids, slices, env FROM leases ORDER BY id").fetchall()
    s_json = {"card_index": 2, "size": "vxpu-half", "memory_bytes": 40 << 30, "compute_pct": 30,
              "handle": "MIG-x", "placement": 4}  # fmt: skip
    assert [tuple(r) for r in rows] == [
        (json.dumps([2]), json.dumps(["GPU-2"]), json.dumps([s_json]), json.dumps(env)),
        (json.dumps([3, 4]), json.dumps(["GPU-3", "GPU-4"]), "[]", "{}"),
    ]
    led.close()
    assert Ledger(tmp_path / "l.sqlite").active_leases() == [part, whole]


def test_card_records_and_events(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    led.save_card(CardRecord("GPU-1", "sliced", True, True, "bad fan"))
    led.save_card(CardRecord("GPU-1", "whole", False, False, ""))
    assert led.cards() == {"GPU-1": CardRecord("GPU-1", "whole", False, False, "")}
    led.add_event("drain", "card 1 drained", card=1)
    led.add_event("grant", "lease x", lease_id="x")
    assert [e.kind for e in led.events()] == ["drain", "grant"]
    assert [e.kind for e in led.events(card=1)] == ["drain"]


def test_schema_version_and_refuses_a_newer_ledger(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    assert led.schema_version == SCHEMA_VERSION
    led.db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    led.close()
    with pytest.raises(ConfigError, match="newer than this xpud"):
        Ledger(tmp_path / "l.sqlite")


def test_group_commit_fails_a_bad_write_alone(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    led.insert_lease(_lease("dup00001"), "tok")
    bad = led.submit(led.insert_lease_op(_lease("dup00001"), "tok"))  # the same id again
    good = led.submit(led.insert_lease_op(_lease("new00001"), "tok2"))
    with pytest.raises(Unavailable):
        bad.result(5)
    good.result(5)
    assert {x.id for x in led.active_leases()} == {"dup00001", "new00001"}
    assert led.token_matches("new00001", "tok2")


def test_a_locked_ledger_fails_writes_without_blocking_the_caller_thread(tmp_path):
    led = Ledger(tmp_path / "l.sqlite", busy_timeout_s=0.3)
    other = sqlite3.connect(tmp_path / "l.sqlite", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    t0 = time.monotonic()
    fut = led.submit(led.insert_lease_op(_lease(), "tok"))
    assert time.monotonic() - t0 < 0.1  # queued, not written here
    with pytest.raises(Unavailable, match="ledger busy"):
        fut.result(5)
    other.execute("ROLLBACK")
    assert led.active_leases() == []
    led.insert_lease(_lease(), "tok")
    assert [x.id for x in led.active_leases()] == ["aaaa0001"]


def test_a_cancelled_write_is_dropped_and_the_writer_thread_goes_on(tmp_path):
    """A caller cancelled while its write waits in the queue (a gRPC call whose client went away): the
    write is not made (the caller changed nothing) and later writes commit. Before, the writer thread
    died on the cancelled future (InvalidStateError) and every later write waited forever."""
    import asyncio

    led = Ledger(tmp_path / "l.sqlite")
    busy, gate = _busy_writer(led)

    async def main() -> None:
        await asyncio.to_thread(busy.wait)
        cancelled = asyncio.ensure_future(led.write(led.insert_lease_op(_lease("gone0001"), "tok")))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(led.write(led.insert_lease_op(_lease("next0001"), "tok")), 5)

    asyncio.run(main())
    assert led._writer.is_alive()
    assert [x.id for x in led.active_leases()] == ["next0001"]


def test_submit_then_answers_a_batch_on_the_loop_in_one_wake_up(tmp_path):
    """The grant and release paths' writes: each answer runs on the loop (error None when committed, the
    LedgerUnavailable otherwise), the writes queued while the writer was busy committed in one batch
    and answered with one ``call_soon_threadsafe``."""
    import asyncio
    import threading

    from xpud.ledger.ledger import _answer

    led = Ledger(tmp_path / "l.sqlite")
    led.insert_lease(_lease("dup00001"), "tok")
    answers, wakeups = [], []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **kw: wakeups.append(a) or real(*a, **kw)
        done = loop.create_future()

        def then(name):
            def answer(err):
                assert threading.current_thread() is threading.main_thread()
                answers.append((name, type(err).__name__ if err else None))
                if len(answers) == 3:
                    done.set_result(None)

            return answer

        busy, gate = _busy_writer(led)  # the three below wait and go in one batch
        await asyncio.to_thread(busy.wait)
        led.submit_then(then("a"), led.insert_lease_op(_lease("new00001"), "tok"))
        led.submit_then(then("dup"), led.insert_lease_op(_lease("dup00001"), "tok"))
        led.submit_then(then("b"), led.end_lease_op("new00001", LeaseState.RELEASED, "done"))
        gate.set()
        await asyncio.wait_for(done, 5)

    asyncio.run(main())
    assert answers == [("a", None), ("dup", "LedgerUnavailable"), ("b", None)]
    assert [a[0] for a in wakeups if a[0] is _answer] == [_answer]  # one wake-up for the three
    assert [x.id for x in led.active_leases()] == ["dup00001"]
    assert {x.id: x.state for x in led.recent_leases()}["new00001"] is LeaseState.RELEASED


def _busy_writer(led):
    """Keep the writer thread busy (in a committed write's effect) until ``gate`` is set; ``busy`` is set
    once it is."""
    import threading

    from xpud.ledger.ledger import Op

    busy, gate = threading.Event(), threading.Event()
    led.submit(Op((), effect=lambda: busy.set() or gate.wait(10)))
    return busy, gate


def test_usage_readings_keep_each_class_newest_and_auto_leases_follow_their_lease(tmp_path):
    from xpud.ledger.ledger import AutoLeaseRecord
    from xpud.planning.usage import Reading

    led = Ledger(tmp_path / "l.sqlite")
    for t in range(10):
        a, b = Reading(float(t), 5.0, 1, 15.0, 2, 40.0), Reading(float(t), None, 1, 15.0, 2)
        led.add_readings([("a", a), ("b", b)], 4)
    led.flush()
    got = led.class_readings()
    assert [r.t for r in got["a"]] == [6.0, 7.0, 8.0, 9.0] and got["a"][0].membw_pct == 40.0
    assert got["b"][-1].sm_pct is None and len(got["b"]) == 4
    led.insert_lease(_lease("l1"), "tok")
    led.write_sync(led.save_auto_lease_op(AutoLeaseRecord("l1", "a", True, 2, 5.0, "up")))
    led.write_sync(led.save_auto_lease_op(AutoLeaseRecord("gone", "a", True)))
    assert led.auto_leases() == {"l1": AutoLeaseRecord("l1", "a", True, 2, 5.0, "up")}  # active leases only
    led.prune(older_than_days=1, now=7.5 + 86400)
    assert [r.t for r in led.class_readings()["a"]] == [8.0, 9.0]
    n = led.db.execute("SELECT count(*) FROM auto_leases").fetchone()[0]
    assert n == 1  # the record of a lease that is no longer active went


def test_classes_not_seen_for_long_are_forgotten(tmp_path):
    from xpud.ledger.ledger import AutoLeaseRecord
    from xpud.planning.usage import Reading

    led = Ledger(tmp_path / "l.sqlite")
    led.add_readings([("old", Reading(10.0, 5.0, 1, 15.0, 2)), ("new", Reading(10.0, 5.0, 1, 15.0, 2))], 4)
    led.add_readings([("new", Reading(100.0, 5.0, 1, 15.0, 2))], 4)
    led.write_sync(led.save_auto_lease_op(AutoLeaseRecord("ended", "new", True)))
    led.forget_stale_usage(before=50.0)
    led.flush()
    assert list(led.class_readings()) == ["new"] and len(led.class_readings()["new"]) == 2
    assert led.db.execute("SELECT count(*) FROM auto_leases").fetchone()[0] == 0


@pytest.mark.parametrize(
    ("config_text", "kept"),
    [
        ("[leases]\nhistory_days = 1\n", False),
        ("[leases]\nhistory_days = 0\n", True),  # 0: kept forever
        ("[leases]\nhistory_days = 1\n[forecast]\nenabled = true\nhistory_days = 28\n", True),
    ],
)
def test_the_daemon_prunes_ended_leases_past_history_days(inproc, config_text, kept):
    """[leases] history_days is enforced by the daemon's prune job (through the ledger's writer), raised to
    the forecast's history when the forecast is on; an active lease is never pruned."""
    from xpud.api.client import Client

    d = inproc("pcie-8x-l40s", config_text)
    with Client(d.runtime_dir) as c:
        old = c.acquire_lease("vxpu-quarter", command="old")
        live = c.acquire_lease("vxpu-quarter", command="live")
        c.release(old.lease.id, old.token)
    d.call(lambda: d.engine.ledger.write())  # flush
    path = d.engine.ledger.path
    with sqlite3.connect(path) as db:
        db.execute("UPDATE leases SET ended = ended - 3 * 86400 WHERE id = ?", (old.lease.id,))
        db.execute("UPDATE events SET ts = ts - 3 * 86400 WHERE lease_id = ?", (old.lease.id,))
    d.call(d.daemon.jobs.prune)
    with sqlite3.connect(path) as db:
        ids = {r[0] for r in db.execute("SELECT id FROM leases")}
        events = db.execute("SELECT COUNT(*) FROM events WHERE lease_id = ?", (old.lease.id,)).fetchone()[0]
    assert live.lease.id in ids
    assert (old.lease.id in ids) is kept and (events > 0) is kept
