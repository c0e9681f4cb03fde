"""One host's side of multi-host jobs (xpud/federation/hostjobs.py) in a real in-process daemon: real
engine, real SQLite ledger, the daemon's own reaper as the only timer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time

import pytest

from tests.conftest import wait_until
from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import BadRequest, Conflict, Forbidden, NoCapacity
from xpud.ledger.ledger import Op
from xpud.model import Mode, Request

MACHINE = "pcie-4x-h100"
UID = os.getuid()


def res(job="j1", attempt=0, count=2, ttl=30.0, mode="xpu", uid=UID):
    return pb.ReserveRequest(job=job, attempt=attempt, mode=mode, count=count, ttl_s=ttl, uid=uid, user="u")


def rows(d, job):
    return d.daemon.ledger.db.execute(
        "SELECT state, lease_id FROM reservations WHERE job=? ORDER BY created", (job,)
    ).fetchall()


def lease_state(d, lease_id):
    return d.daemon.ledger.db.execute("SELECT state FROM leases WHERE id=?", (lease_id,)).fetchone()[0]


def test_reserve_is_idempotent_and_holds_cards_from_the_engine(inproc):
    d = inproc(MACHINE, "[leases]\ngrace_s = 1.0\n")
    hj = d.daemon.hostjobs
    a = d.call(hj.reserve, res(count=3))
    b = d.call(hj.reserve, res(count=3))  # a retried message
    assert list(a.cards) == list(b.cards) and len(a.cards) == 3
    assert len(d.engine.leases) == 1
    (lease,) = d.engine.leases.values()
    assert lease.owner_uid == UID and "reserved for job j1" in lease.mark
    # the local engine cannot grant the reserved cards: 2 whole cards asked, 1 free
    with pytest.raises(NoCapacity):
        d.call(d.engine.acquire, Request(Mode.XPU, gpus=2, owner_uid=UID))
    # nor another job on this host
    with pytest.raises(NoCapacity):
        d.call(hj.reserve, res(job="j2", count=2))
    # an older attempt is refused; the same attempt with another outcome too
    d.call(hj.reserve, res(attempt=2, count=3))
    with pytest.raises(Conflict, match="older than attempt 2"):
        d.call(hj.reserve, res(attempt=1, count=3))
    # the reaper (grace 1 s) leaves the reservation's lease alone: the host holds it
    time.sleep(1.6)
    assert len(d.engine.leases) == 1
    assert [r["state"] for r in rows(d, "j1")] == ["held"]


def test_a_reservation_expires_by_its_ttl_with_nobodys_help(inproc):
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    t0 = time.monotonic()
    r = d.call(hj.reserve, res(ttl=0.6))
    assert len(r.cards) == 2
    (lid,) = d.engine.leases
    wait_until(lambda: not d.engine.leases, timeout=5)
    assert time.monotonic() - t0 >= 0.6
    assert rows(d, "j1")[0]["state"] == "expired" and lease_state(d, lid) == "reclaimed"
    with pytest.raises(Conflict, match="expired"):
        d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))
    assert not d.call(hj.abort, pb.AbortRequest(job="j1", attempt=0)).dropped
    # the cards are free again
    d.call(d.engine.acquire, Request(Mode.XPU, gpus=4, owner_uid=UID))


def test_a_late_commit_is_refused_even_before_the_reaper_runs(inproc):
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    d.daemon.jobs.stop()  # no reaper: the commit itself must see the TTL is past
    d.call(hj.reserve, res(ttl=0.5))
    time.sleep(0.7)
    assert d.engine.leases  # nobody expired it yet
    with pytest.raises(Conflict, match="expired"):
        d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))
    assert not d.engine.leases and rows(d, "j1")[0]["state"] == "expired"


def test_commit_makes_the_job_lease_and_abort_kills_the_rank_then_releases(inproc):
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    d.call(hj.reserve, res(ttl=0.8))
    c = d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))
    again = d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))  # retried: same lease
    assert c.lease_id == again.lease_id and 1024 <= c.free_port <= 65535
    assert c.env["CUDA_VISIBLE_DEVICES"] and c.env["XPU_LEASE_ID"] == c.lease_id
    lease = d.engine.leases[c.lease_id]
    assert lease.mark == "job j1 (multi-host)" and lease.owner_uid == UID
    assert d.daemon.ledger.db.execute("SELECT mark FROM leases WHERE id=?", (c.lease_id,)).fetchone()[0]
    killed = []

    async def kill():
        await asyncio.sleep(0.05)
        killed.append(d.engine.leases.get(c.lease_id) is not None)  # still held while the rank dies

    d.call(hj.launching, "j1", kill)
    time.sleep(1.2)  # past the TTL: a launched job is not released by it
    assert c.lease_id in d.engine.leases
    assert d.call(hj.abort, pb.AbortRequest(job="j1", attempt=0)).dropped
    assert killed == [True]
    assert not d.engine.leases and lease_state(d, c.lease_id) == "released"
    assert rows(d, "j1")[0]["state"] == "released"
    assert not d.call(hj.abort, pb.AbortRequest(job="j1", attempt=0)).dropped  # idempotent


def test_a_committed_job_never_launched_is_released_after_one_ttl(inproc):
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    d.call(hj.reserve, res(ttl=0.5))
    d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))
    wait_until(lambda: not d.engine.leases, timeout=5)
    assert rows(d, "j1")[0]["state"] == "released"
    with pytest.raises(Conflict, match="not committed"):
        d.call(hj.launching, "j1", None)


def test_a_restarted_host_keeps_its_reservation_and_its_expiry(inproc):
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    kept = d.call(hj.reserve, res(job="keep", count=1, ttl=60))
    short = d.call(hj.reserve, res(job="short", count=1, ttl=2.0))
    committed = d.call(hj.reserve, res(job="done", count=1, ttl=60))
    d.call(hj.commit, pb.CommitRequest(job="done", attempt=0))
    fake, base = d.fake, d.runtime_dir.parent
    d.stop()
    from tests.daemons import InProcDaemon

    d3 = InProcDaemon(base, MACHINE, "", fake)  # the same state directory and cards: a restart
    try:
        hj3 = d3.daemon.hostjobs
        again = d3.call(hj3.reserve, res(job="keep", count=1, ttl=60))
        assert list(again.cards) == list(kept.cards)  # the same reservation, answered again
        assert {lz.mark for lz in d3.engine.leases.values()} >= {"job done (multi-host)"}
        assert d3.call(hj3.commit, pb.CommitRequest(job="done", attempt=0)).cards == committed.cards
        # the short one still expires by its TTL on the restarted host
        wait_until(lambda: rows(d3, "short")[0]["state"] == "expired", timeout=5)
        wait_until(lambda: not any(lz.cards == tuple(short.cards) for lz in d3.engine.leases.values()))
        assert d3.call(hj3.commit, pb.CommitRequest(job="keep", attempt=0)).lease_id
    finally:
        d3.stop()


def test_an_unknown_uid_and_bad_requests_are_refused_with_one_line(inproc):
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    with pytest.raises(Forbidden, match=r"uid 3999999 .*does not exist on host"):
        d.call(hj.reserve, res(uid=3999999))
    with pytest.raises(BadRequest, match="ttl"):
        d.call(hj.reserve, res(ttl=0.1))
    with pytest.raises(BadRequest, match="one slice per host"):
        d.call(hj.reserve, res(mode="vxpu-half", count=2))
    with pytest.raises(BadRequest, match="--gpus 9"):
        d.call(hj.reserve, res(count=9))
    assert not d.engine.leases


def test_a_slice_replica_is_reserved_and_committed(inproc):
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    r = d.call(hj.reserve, res(mode="vxpu-half", count=1))
    c = d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))
    (lease,) = d.engine.leases.values()
    assert lease.mode == "vxpu-half" and list(c.cards) == list(r.cards) == list(lease.cards)


def test_slices_of_different_jobs_share_a_card(inproc):
    """issue #28 item 4: the second job's slice lease was granted on the first one's card and its row
    written "held", then the table refused the card as taken: "internal error in Reserve", the lease
    untracked until grace_s and the row held until a restart."""
    d = inproc(MACHINE, "[leases]\ngrace_s = 1.0\n")
    hj = d.daemon.hostjobs
    a = d.call(hj.reserve, res(job="j1", mode="vxpu-quarter", count=1))
    b = d.call(hj.reserve, res(job="j2", mode="vxpu-quarter", count=1))
    assert list(a.cards) == list(b.cards)  # packed on one card
    assert [r["state"] for r in rows(d, "j2")] == ["held"] and len(d.engine.leases) == 2
    for job in ("j1", "j2"):
        c = d.call(hj.commit, pb.CommitRequest(job=job, attempt=0))
        assert d.engine.leases[c.lease_id].mode == "vxpu-quarter"
    time.sleep(1.6)  # the reaper (grace 1 s) leaves both leases alone: the host holds them
    assert len(d.engine.leases) == 2


def test_a_reservation_the_table_refuses_undoes_its_lease_and_row(inproc, monkeypatch):
    """A refusal after the grant (here the table's) ends the lease and the row it wrote, in one line."""
    from xpud.federation import reserve

    d = inproc(MACHINE)
    hj = d.daemon.hostjobs

    def refuse(*a, **kw):
        raise reserve.Refused("card(s) 0 not free here")

    monkeypatch.setattr(hj.table, "reserve", refuse)
    with pytest.raises(Conflict, match="not free here"):
        d.call(hj.reserve, res(job="j1", mode="vxpu-quarter", count=1))
    assert not d.engine.leases
    assert [r["state"] for r in rows(d, "j1")] == ["aborted"]


def test_an_evicted_job_lease_ends_the_reservation(inproc):
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    d.call(hj.reserve, res())
    (lid,) = d.engine.leases
    d.call(d.engine.evict, lid, "test")
    wait_until(lambda: rows(d, "j1")[0]["state"] == "aborted", timeout=5)
    with pytest.raises(Conflict):
        d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))


def test_remote_launch_off_refuses_other_hosts_but_not_this_ones_own_jobs(inproc):
    d = inproc(MACHINE, '[cluster]\nname = "h1"\nremote_launch = false\n')
    hj = d.daemon.hostjobs
    with pytest.raises(
        Forbidden, match=r"host h1 takes no jobs from other hosts \(\[cluster\] remote_launch"
    ):
        d.call(hj.reserve, res(), "h2")
    assert not d.engine.leases
    assert len(d.call(hj.reserve, res(), None).cards) == 2  # coordinated here: not remote


def test_this_hosts_limits_apply_to_the_submitter_a_reservation_counts_as_a_lease(inproc):
    """[limits] max_leases_per_uid holds for a reservation as for a lease (before: granted as exempt)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    d = inproc(MACHINE, "[limits]\nmax_leases_per_uid = 1\n")
    hj = d.daemon.hostjobs
    d.call(hj.reserve, res(job="j1", count=1, uid=nobody.pw_uid))
    with pytest.raises(NoCapacity, match=r"uid 65534 has 1 lease\(s\).*max_leases_per_uid \(1\)"):
        d.call(hj.reserve, res(job="j2", count=1, uid=nobody.pw_uid))
    assert len(d.engine.leases) == 1
    # this daemon's own uid is an operator here: not limited
    d.call(hj.reserve, res(job="j3", count=1))
    d.call(hj.reserve, res(job="j4", count=1))
    assert len(d.engine.leases) == 3


def _launch_marker(d, tmp_path, on_pid_write):
    """j1 committed, and its rank (``echo ran > marker; cat``) specified; the ledger's write of the rank's
    pid goes through ``on_pid_write(submit, ops)``. Returns the marker's path and the spec."""
    hj, ledger = d.daemon.hostjobs, d.daemon.ledger
    d.call(hj.reserve, res(count=1))
    d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))
    submit = ledger.submit
    ledger.submit = lambda *ops: (
        on_pid_write(submit, ops) if any("rank_pid" in str(o) for o in ops) else submit(*ops)
    )
    marker = tmp_path / "marker"
    spec = pb.LaunchSpec(job="j1", rank=0, argv=["sh", "-c", f"echo ran > {marker}; cat"], cwd="/",
                         env={"PATH": os.environ["PATH"]}, uid=UID, gid=os.getgid())  # fmt: skip
    return marker, spec


def test_a_rank_runs_nothing_until_its_pid_is_durable(inproc, tmp_path):
    """The rank waits at a gate while its pid's ledger write is pending (before: it ran at once, and a
    daemon killed in that window left it running untracked: test_federation_jobrun's restart test failed
    once under load, and always with the write slowed by 1.5 s)."""
    d = inproc(MACHINE)
    release = threading.Event()

    def slow(submit, ops):
        submit(Op((), effect=lambda: release.wait(10)))  # the writer thread is busy until released
        return submit(*ops)

    marker, spec = _launch_marker(d, tmp_path, slow)

    async def run():
        async def inputs():
            yield pb.LaunchInput(start=spec)
            yield pb.LaunchInput(stdin=b"input\n")
            yield pb.LaunchInput(stdin_eof=True)

        stream = d.daemon.hostjobs.launch(inputs(), None, None)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.5)
        ran_early = marker.exists() or first.done()
        release.set()
        events = [await first] + [ev async for ev in stream]
        return ran_early, events

    ran_early, events = d.call(run)
    assert not ran_early
    assert events[0].HasField("started") and marker.read_text() == "ran\n"
    out = b"".join(e.output.data for e in events if e.HasField("output"))
    assert out == b"input\n" and events[-1].ended.exit_code == 0  # the gate's line is not the rank's stdin
    wait_until(lambda: not d.engine.leases, timeout=10)


def test_a_rank_whose_pid_cannot_be_recorded_never_runs(inproc, tmp_path):
    from xpud.ledger.ledger import LedgerUnavailable

    d = inproc(MACHINE)

    def failing(submit, ops):
        fut = concurrent.futures.Future()
        fut.set_exception(LedgerUnavailable("the disk is full"))
        return fut

    marker, spec = _launch_marker(d, tmp_path, failing)

    async def run():
        async def inputs():
            yield pb.LaunchInput(start=spec)
            await asyncio.sleep(60)

        return [ev async for ev in d.daemon.hostjobs.launch(inputs(), None, None)]

    events = d.call(run)
    ended = events[-1].ended
    assert "not started" in ended.error and "the disk is full" in ended.error, ended
    assert not marker.exists()
    wait_until(lambda: not d.engine.leases, timeout=10)


def test_the_rank_pid_is_durable_before_the_rank_is_reported_started(inproc):
    """Ledger first: the ``started`` event comes only once the pid row is committed (the writer thread is
    busy when it is queued; before, the pid was queued and ``started`` went out at once)."""
    d = inproc(MACHINE)
    hj, ledger = d.daemon.hostjobs, d.daemon.ledger
    d.call(hj.reserve, res(count=1))
    d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))
    submit = ledger.submit

    def slow_submit(*ops):
        if any("rank_pid" in str(o) for o in ops):  # the writer thread is busy for 0.5 s first
            submit(Op((), effect=lambda: time.sleep(0.5)))
        return submit(*ops)

    ledger.submit = slow_submit
    spec = pb.LaunchSpec(job="j1", rank=0, argv=["sleep", "30"], cwd="/", env={"PATH": os.environ["PATH"]},
                         uid=UID, gid=os.getgid())  # fmt: skip

    async def first_event():
        async def inputs():
            yield pb.LaunchInput(start=spec)
            await asyncio.sleep(60)

        stream = hj.launch(inputs(), None, None)
        ev = await anext(stream)
        pid_now = ledger.db.execute("SELECT rank_pid FROM reservations WHERE job='j1'").fetchone()[0]
        await stream.aclose()
        return ev, pid_now

    ev, pid_now = d.call(first_event)
    assert ev.HasField("started") and pid_now == ev.started.pid
    wait_until(lambda: not d.engine.leases, timeout=10)


def _cancel_mid_write(d, call, marker: str):
    """Start ``call`` on the daemon's loop, hold the ledger's writer inside the write whose SQL contains
    ``marker`` (taken and committed: it can no longer be undone), cancel the caller there, then let the
    writer go. The write is the first one matching; returns once the writer is free."""
    ledger = d.daemon.ledger
    submit = ledger.submit
    inside, release = threading.Event(), threading.Event()
    armed = [True]

    def held(*ops):
        if armed[0] and any(marker in str(o) for o in ops):
            armed[0] = False
            return submit(*ops, Op((), effect=lambda: (inside.set(), release.wait(10))))
        return submit(*ops)

    ledger.submit = held

    async def run():
        task = asyncio.ensure_future(call())
        await asyncio.to_thread(inside.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)  # the caller is gone before the write answers
        release.set()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return task.cancelled()

    try:
        assert d.call(run), "the caller was not cancelled inside the write"
    finally:
        ledger.submit = submit
        release.set()


def test_a_reserve_whose_caller_is_cancelled_mid_write_still_ends_by_its_ttl(inproc):
    """A coordinator cancelled (or a Peer call broken) while the reservation's row was being written: the
    reservation is held in the table as in the ledger and ends by its TTL (before: the lease was reclaimed
    but the row stayed ``held`` for ever, and ``xpu`` saw a live reservation nobody could end)."""
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    _cancel_mid_write(d, lambda: hj.reserve(res(ttl=2.0)), "INSERT OR REPLACE INTO reservations")
    wait_until(lambda: hj.table.get("j1") is not None, timeout=5)  # the reserve ran on to its end
    assert hj.table.get("j1").state.value == "held" and [r["state"] for r in rows(d, "j1")] == ["held"]
    wait_until(lambda: [r["state"] for r in rows(d, "j1")] == ["expired"] and not d.engine.leases, timeout=10)
    d.call(d.engine.acquire, Request(Mode.XPU, gpus=4, owner_uid=UID))  # every card free again


def test_a_commit_whose_caller_is_cancelled_mid_write_is_committed_in_the_table_too(inproc):
    """Cancelled while the commit's row was written: the table says committed as the ledger does, so the
    job is released after one TTL unlaunched (before: the table went back to held while the row said
    committed; the reaper then expired a committed row)."""
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    d.call(hj.reserve, res(ttl=2.0))
    _cancel_mid_write(d, lambda: hj.commit(pb.CommitRequest(job="j1", attempt=0)), "'committed'")
    wait_until(lambda: hj.jobs["j1"].launch_by > 0, timeout=5)  # the commit ran on to its end
    assert hj.table.get("j1").state.value == "committed"
    assert [r["state"] for r in rows(d, "j1")] == ["committed"]
    released = lambda: [r["state"] for r in rows(d, "j1")] == ["released"]  # noqa: E731
    wait_until(lambda: released() and not d.engine.leases, timeout=10)


def test_an_abort_that_overtakes_its_reserve_makes_the_reserve_refused(inproc):
    """A coordinator cancelled while its Reserve was on the way aborts at once; that abort may arrive
    first. The reserve that follows is refused instead of holding the cards for its whole TTL (before:
    held 30 s here); other attempts and jobs are unaffected."""
    d = inproc(MACHINE)
    hj = d.daemon.hostjobs
    assert not d.call(hj.abort, pb.AbortRequest(job="j1", attempt=3)).dropped
    with pytest.raises(Conflict, match="attempt 3 is aborted"):
        d.call(hj.reserve, res(attempt=3, ttl=30.0))
    assert not d.engine.leases and rows(d, "j1") == []
    assert len(d.call(hj.reserve, res(attempt=4, ttl=30.0)).cards) == 2  # the next attempt is a new one
    assert not d.call(hj.abort, pb.AbortRequest(job="j1", attempt=5)).dropped  # a newer one: not ours to end
    assert [r["state"] for r in rows(d, "j1")] == ["held"] and len(d.engine.leases) == 1


# ------------------------------------------------------------------------------ what a certificate buys
def test_a_root_job_from_another_host_is_refused_unless_this_host_allows_root_jobs(inproc):
    import pwd

    d = inproc(MACHINE, '[cluster]\nname = "h1"\n')
    hj = d.daemon.hostjobs
    with pytest.raises(Forbidden) as err:
        d.call(hj.reserve, res(uid=0), "h2")
    assert str(err.value).count("\n") == 0 and "allow_root_jobs = false" in str(err.value)
    assert not d.engine.leases and rows(d, "j1") == []  # nothing held, nothing written
    launch = pb.LaunchSpec(job="j1", argv=["id"], cwd="/", uid=0, gid=0)
    with pytest.raises(Forbidden, match="no root"):
        d.call(_first_event, hj.launch(_once(pb.LaunchInput(start=launch)), "h2"))
    # a user's job from that host, and this host's own root job, are taken
    nobody = pwd.getpwnam("nobody").pw_uid
    assert len(d.call(hj.reserve, res(job="j2", count=1, uid=nobody), "h2").cards) == 1
    assert len(d.call(hj.reserve, res(job="j3", count=1, uid=0), None).cards) == 1
    # and with allow_root_jobs = true, root's from other hosts too
    d2 = inproc(MACHINE, '[cluster]\nname = "h1"\nallow_root_jobs = true\n')
    assert len(d2.call(d2.daemon.hostjobs.reserve, res(uid=0), "h2").cards) == 2


async def _once(msg):
    yield msg


async def _first_event(gen):
    return await anext(gen)


def test_only_the_host_that_reserved_a_job_may_commit_launch_abort_or_replace_it(inproc, tmp_path):
    import pwd

    nobody = pwd.getpwnam("nobody")
    d = inproc(MACHINE, '[cluster]\nname = "h1"\n')
    hj = d.daemon.hostjobs
    d.call(hj.reserve, res(count=1, uid=nobody.pw_uid), "h2")  # h2 coordinates j1
    lease = next(iter(d.engine.leases))

    def refused(call, *args) -> str:
        with pytest.raises(Forbidden) as err:
            d.call(call, *args)
        said = str(err.value)
        assert "\n" not in said and "reserved by host h2: host h3 may not" in said, said
        return said

    refused(hj.commit, pb.CommitRequest(job="j1", attempt=0), "h3")
    refused(hj.abort, pb.AbortRequest(job="j1", attempt=0), "h3")
    refused(hj.abort, pb.AbortRequest(job="j1", attempt=1), "h3")  # an abort "overtaking" a newer attempt
    refused(hj.reserve, res(attempt=1, count=1, uid=nobody.pw_uid), "h3")  # would replace h2's
    with pytest.raises(Forbidden, match="reserved by host h2: host h1 may not abort"):
        d.call(hj.abort, pb.AbortRequest(job="j1", attempt=0), None)  # nor this host's own coordinator
    # nothing lost: h2's reservation holds; h2 commits it, and a launch from h3 is refused
    assert [r["state"] for r in rows(d, "j1")] == ["held"] and list(d.engine.leases) == [lease]
    assert d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0), "h2").lease_id == lease
    spec = pb.LaunchSpec(job="j1", argv=["sh", "-c", f"touch {tmp_path}/ran"], cwd="/",
                         env={"PATH": os.environ["PATH"]}, uid=nobody.pw_uid, gid=nobody.pw_gid)  # fmt: skip
    said = refused(_first_event, hj.launch(_once(pb.LaunchInput(start=spec)), "h3"))
    assert "may not launch" in said and not (tmp_path / "ran").exists()
    assert [r["state"] for r in rows(d, "j1")] == ["committed"] and list(d.engine.leases) == [lease]
    assert d.call(hj.abort, pb.AbortRequest(job="j1", attempt=0), "h2").dropped  # its coordinator may
    assert not d.engine.leases


def test_an_abort_from_another_host_that_comes_first_does_not_block_the_coordinators_reserve(inproc):
    d = inproc(MACHINE, '[cluster]\nname = "h1"\nallow_root_jobs = true\n')
    hj = d.daemon.hostjobs
    assert not d.call(hj.abort, pb.AbortRequest(job="j1", attempt=0), "h3").dropped
    assert len(d.call(hj.reserve, res(), "h2").cards) == 2  # h3's abort is not h2's
    # h2's own abort that came first still refuses h2's reserve of that attempt
    assert not d.call(hj.abort, pb.AbortRequest(job="j9", attempt=0), "h2").dropped
    with pytest.raises(Conflict, match="attempt 0 is aborted"):
        d.call(hj.reserve, res(job="j9", count=1), "h2")


def test_a_callers_gid_buys_no_exemption_from_this_hosts_limits(inproc):
    """[limits] exempt_groups is checked against the user's groups here, not the gid a peer sends."""
    import grp
    import pwd

    nobody = pwd.getpwnam("nobody")
    root_group = grp.getgrgid(0).gr_name
    d = inproc(
        MACHINE,
        f'[cluster]\nname = "h1"\n[limits]\nmax_leases_per_uid = 1\nexempt_groups = ["{root_group}"]\n',
    )
    hj = d.daemon.hostjobs
    asked = dict(count=1, uid=nobody.pw_uid)
    d.call(hj.reserve, pb.ReserveRequest(job="j1", attempt=0, mode="xpu", ttl_s=30.0, gid=0, **asked), "h2")
    with pytest.raises(NoCapacity, match="max_leases_per_uid"):
        d.call(
            hj.reserve, pb.ReserveRequest(job="j2", attempt=0, mode="xpu", ttl_s=30.0, gid=0, **asked), "h2"
        )
    assert len(d.engine.leases) == 1


def test_a_commit_whose_row_is_slow_to_write_is_not_taken_for_unlaunched_by_the_reaper(inproc):
    """The table says committed before the commit's row is durable; the job's launch deadline was set only
    after that write, so a reaper pass in between saw a deadline of 0 and released the job 3 ms after its
    commit ("not launched within its TTL after the commit": test_federation_jobs_daemons' Ctrl-C test
    lost a rank this way under load). Here the write is held 1.5 s, over the reaper's passes."""
    d = inproc(MACHINE)
    hj, ledger = d.daemon.hostjobs, d.daemon.ledger
    d.call(hj.reserve, res(ttl=30.0))
    submit = ledger.submit

    def slow(*ops):
        if any("'committed'" in str(o) for o in ops):
            return submit(*ops, Op((), effect=lambda: time.sleep(1.5)))
        return submit(*ops)

    ledger.submit = slow
    d.call(hj.commit, pb.CommitRequest(job="j1", attempt=0))
    ledger.submit = submit
    time.sleep(1.0)  # more reaper passes after the commit
    assert [r["state"] for r in rows(d, "j1")] == ["committed"]
    assert hj.table.get("j1").state.value == "committed" and len(d.engine.leases) == 1
    d.call(hj.abort, pb.AbortRequest(job="j1", attempt=0))
