"""Node.RunJob, the coordinator of multi-host jobs (xpud/federation/jobrun.py), on real daemons: real
gRPC, real engines and ledgers, real rank processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.conftest import wait_until
from xpud.api.client import Client, to_error
from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import BadRequest, NoCapacity

MACHINE = "pcie-4x-h100"


def spec(argv, **kw):
    kw.setdefault("mode", "xpu")
    kw.setdefault("nodes", 1)
    kw.setdefault("gpus_per_node", 2)
    kw.setdefault("kill_on_bad_exit", True)
    return pb.JobSpec(argv=argv, cwd=os.getcwd(), env={"PATH": os.environ["PATH"], "KEEP": "me"}, **kw)


def run_job(runtime, s, more=(), hold: threading.Event | None = None, timeout=60):
    """Events of one RunJob call; ``more`` are sent after start; ``hold`` keeps the request side open."""
    c = Client(runtime)

    def inputs():
        yield pb.JobInput(start=s)
        yield from more
        if hold is not None:
            hold.wait(timeout)

    call = c.node.RunJob(inputs(), metadata=c._metadata(), timeout=timeout)
    return c, call


def collect(call, where="d"):
    out = []
    try:
        for ev in call:
            out.append(ev)
    except Exception as e:  # grpc.RpcError
        raise to_error(e, where) from None
    return out


def start_sleeper(runtime, tmp_path):
    """A one-host job whose rank sleeps; returns (call, hold, the rank's pid) once it runs."""
    pidfile = tmp_path / "pid"
    hold = threading.Event()
    _, call = run_job(runtime, spec(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"]), hold=hold)
    assert next(iter(call)).HasField("placed")
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=10)
    return call, hold, int(pidfile.read_text())


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def text(events, fd=1):
    return b"".join(e.output.data for e in events if e.HasField("output") and e.output.fd == fd).decode()


def test_a_one_host_job_runs_with_the_torchrun_environment_and_its_exit_code(inproc):
    d = inproc(MACHINE)
    script = (
        "echo $NODE_RANK/$PET_NNODES $NODE_RANK $MASTER_ADDR:$MASTER_PORT $CUDA_VISIBLE_DEVICES $KEEP; exit 3"
    )
    _, call = run_job(d.runtime_dir, spec(["sh", "-c", script]))
    events = collect(call)
    kinds = [e.WhichOneof("what") for e in events]
    assert kinds[0] == "placed" and kinds[-1] == "ended"
    placed = events[0].placed
    assert len(placed.ranks) == 1 and len(placed.ranks[0].cards) == 2
    line = text(events).strip()
    rank_world, node, master, cvd, keep = line.split(" ")
    assert rank_world == "0/1" and node == "0" and keep == "me"
    assert master.startswith("127.0.0.1:") and int(master.split(":")[1]) > 1024
    assert cvd.count("GPU-") == 2
    assert events[-1].ended.exit_code == 3
    # the job's lease was released at the end, its reservation row too
    wait_until(lambda: not d.engine.leases, timeout=5)
    rows = d.daemon.ledger.db.execute("SELECT state FROM reservations").fetchall()
    assert [r[0] for r in rows] == ["released"]


def test_stdin_goes_to_rank_0_and_a_signal_stops_the_job(inproc):
    d = inproc(MACHINE)
    _, call = run_job(d.runtime_dir, spec(["sh", "-c", "read x; echo got $x"]), [pb.JobInput(stdin=b"hi\n")])
    events = collect(call)
    assert text(events) == "got hi\n" and events[-1].ended.exit_code == 0
    hold = threading.Event()
    _, call = run_job(
        d.runtime_dir,
        spec(["sh", "-c", "echo up; sleep 30"]),
        [pb.JobInput(signal=signal.SIGTERM)],
        hold=hold,
    )
    t0 = time.monotonic()
    events = collect(call)
    hold.set()
    assert events[-1].ended.exit_code == 128 + signal.SIGTERM and time.monotonic() - t0 < 15
    wait_until(lambda: not d.engine.leases, timeout=5)


def test_tasks_per_node_runs_the_command_that_many_times_with_each_tasks_rank(inproc):
    d = inproc(MACHINE)
    script = (
        'echo "$RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $CUDA_VISIBLE_DEVICES"; exit $((RANK * 2))'
    )
    events = collect(
        run_job(
            d.runtime_dir,
            spec(["sh", "-c", script], tasks_per_node=3, label_tasks=True, kill_on_bad_exit=False),
        )[1]
    )
    cards = next(e.output.data for e in events if e.HasField("output")).decode().split()[-1]
    assert len(cards.split(",")) == 2  # every task sees the host's two cards
    assert sorted(text(events).splitlines()) == [f"{r}: {r}/3 {r}/3 {cards}" for r in range(3)]
    assert events[-1].ended.exit_code in (2, 4)  # the first failing task's
    wait_until(lambda: not d.engine.leases, timeout=10)


def test_the_client_going_away_stops_the_rank_and_releases_the_lease(inproc, tmp_path):
    d = inproc(MACHINE)
    call, hold, pid = start_sleeper(d.runtime_dir, tmp_path)
    assert d.engine.leases
    call.cancel()  # Ctrl-C, or the client died
    hold.set()
    wait_until(lambda: not d.engine.leases, timeout=15)

    wait_until(lambda: gone(pid), timeout=10)


def test_bad_specs_are_refused_with_one_line_and_no_room_says_why(inproc):
    d = inproc(MACHINE)
    with pytest.raises(BadRequest, match="--gpus-per-node"):
        collect(run_job(d.runtime_dir, spec(["true"], gpus_per_node=0))[1])
    with pytest.raises(BadRequest, match="--spread"):
        collect(run_job(d.runtime_dir, spec(["true"], mode="vxpu-half", nodes=0, replicas=1))[1])
    for wait in (0, 600):  # waiting cannot help: refused at once, and no --wait suggested (#28 item 10)
        with pytest.raises(NoCapacity, match="federation is off") as refused:
            collect(run_job(d.runtime_dir, spec(["true"], nodes=2, wait_s=wait), timeout=10)[1])
        assert "--wait" not in str(refused.value)
    with pytest.raises(BadRequest, match="--tasks-per-node goes with --nodes"):
        slices = {"mode": "vxpu-half", "nodes": 0, "gpus_per_node": 1, "replicas": 1, "spread": True}
        collect(run_job(d.runtime_dir, spec(["true"], tasks_per_node=2, **slices))[1])
    with pytest.raises(BadRequest, match="tasks_per_node"):
        collect(run_job(d.runtime_dir, spec(["true"], tasks_per_node=513))[1])
    with pytest.raises(NoCapacity, match="--wait"):
        collect(run_job(d.runtime_dir, spec(["true"], gpus_per_node=5))[1])
    hold = threading.Event()
    with pytest.raises(BadRequest, match="signal"):  # a bad input mid-job ends it, released
        collect(run_job(d.runtime_dir, spec(["sleep", "30"]), [pb.JobInput(signal=99)], hold=hold)[1])
    hold.set()
    wait_until(lambda: not d.engine.leases, timeout=10)


def test_a_queued_job_runs_when_the_cards_free(inproc):
    d = inproc(MACHINE)
    _, first = run_job(d.runtime_dir, spec(["sh", "-c", "sleep 1.5"], gpus_per_node=3))
    it = iter(first)
    assert next(it).HasField("placed")
    _, second = run_job(d.runtime_dir, spec(["echo", "ran"], gpus_per_node=2, wait_s=30))
    events = collect(second)
    assert events[0].HasField("queued") and events[0].queued.position == 1
    assert any(e.HasField("placed") for e in events) and text(events) == "ran\n"
    assert events[-1].ended.exit_code == 0
    list(it)


HEALTH = """
[leases]
grace_s = 30.0
[health]
poll_interval_s = 0.2
event_window_s = 0.5
move_ack_timeout_s = 10.0
"""


def test_a_failed_card_under_a_restartable_job_restarts_the_whole_job_on_healthy_cards(inproc):
    d = inproc(MACHINE, HEALTH)
    hold = threading.Event()
    script = 'echo "start $XPU_RESTART_COUNT $CUDA_VISIBLE_DEVICES"; exec sleep 60'
    _, call = run_job(d.runtime_dir, spec(["sh", "-c", script], restartable=True), hold=hold)
    it = iter(call)
    first = next(it).placed
    assert next(it).output.data.startswith(b"start 0 ")
    bad = first.ranks[0].cards[0]
    bad_uuid = d.engine.cards[bad].info.uuid
    with Client(d.runtime_dir, admin=True) as admin:
        admin.inject_fault(str(bad), "xid", 79)
    events = []
    for ev in it:
        events.append(ev)
        if ev.HasField("output"):
            break
    kinds = [e.WhichOneof("what") for e in events]
    assert kinds == ["rank_ended", "placed", "output"], events
    assert events[0].rank_ended.error.startswith("restart: ") and "unhealthy" in events[0].rank_ended.error
    again = events[1].placed
    assert bad not in again.ranks[0].cards and again.job == first.job and again.attempts > first.attempts
    line = events[2].output.data.decode().split()
    assert line[0:2] == ["start", "1"] and bad_uuid not in line[2] and line[2].count("GPU-") == 2
    # only the new placement is held now
    assert [tuple(lz.cards) for lz in d.engine.leases.values()] == [tuple(again.ranks[0].cards)]
    call.cancel()
    hold.set()
    wait_until(lambda: not d.engine.leases, timeout=15)


def test_a_daemon_killed_under_a_running_rank_stops_it_and_frees_the_cards_when_it_restarts(
    daemon_factory, tmp_path
):
    d = daemon_factory(MACHINE)
    _, hold, pid = start_sleeper(d.runtime_dir, tmp_path)
    d.kill(signal.SIGKILL)
    hold.set()
    os.kill(pid, 0)  # the rank outlived its daemon
    d.start()
    wait_until(lambda: gone(pid), timeout=20)  # at start-up, well before any TTL or grace
    with d.client() as c:
        wait_until(lambda: not c.leases().leases, timeout=10)


def test_the_coordinator_holds_the_submitter_to_this_hosts_limits(inproc):
    """[limits] max_leases_per_uid: a uid at its cap here is refused before any host is asked."""
    import pwd

    from xpud.federation.jobrun import JobRun
    from xpud.model import Caller, Mode, Request

    nobody = pwd.getpwnam("nobody")
    d = inproc(MACHINE, "[limits]\nmax_leases_per_uid = 1\n")
    d.call(d.engine.acquire, Request(Mode.XPU, gpus=1, owner_uid=nobody.pw_uid))
    run = JobRun(
        d.daemon.hostjobs, d.daemon.federation, spec(["true"]), Caller(uid=nobody.pw_uid, gid=nobody.pw_gid)
    )
    with pytest.raises(NoCapacity, match=r"max_leases_per_uid \(1\)"):
        d.call(run.check)
    # an operator is not held to it
    d.call(
        JobRun(
            d.daemon.hostjobs,
            d.daemon.federation,
            spec(["true"]),
            Caller(uid=nobody.pw_uid, gid=nobody.pw_gid, admin=True),
        ).check
    )


def test_a_restarted_rank_0_gets_eof_when_the_clients_stdin_had_ended(inproc):
    """The client closed stdin before the restart: the new rank 0 reads EOF at once (before, it waited
    for input that would never come)."""
    d = inproc(MACHINE, HEALTH)
    hold = threading.Event()
    script = (
        'if [ "$XPU_RESTART_COUNT" = 0 ]; then echo up; exec sleep 60; fi; cat; echo "eof $XPU_RESTART_COUNT"'
    )
    _, call = run_job(
        d.runtime_dir, spec(["sh", "-c", script], restartable=True), [pb.JobInput(stdin_eof=True)], hold=hold
    )
    it = iter(call)
    first = next(it).placed
    assert next(it).output.data == b"up\n"
    with Client(d.runtime_dir, admin=True) as admin:
        admin.inject_fault(str(first.ranks[0].cards[0]), "xid", 79)
    try:
        events = collect(it)
    finally:
        hold.set()
    assert text(events) == "eof 1\n" and events[-1].ended.exit_code == 0, events
    wait_until(lambda: not d.engine.leases, timeout=15)


def test_input_sent_while_a_restart_has_no_ranks_reaches_the_new_ones(inproc):
    """Between two placements: signals are kept for the new ranks, stdin waits for the new rank 0 (before:
    an IndexError ended the feeder, and nothing the client sent reached the job again)."""
    import asyncio

    from xpud.federation.jobrun import JobRun, _Rank
    from xpud.model import Caller

    d = inproc(MACHINE)
    run = JobRun(
        d.daemon.hostjobs, d.daemon.federation, spec(["true"]), Caller(uid=os.getuid(), gid=os.getgid())
    )

    async def inputs():
        yield pb.JobInput(signal=signal.SIGINT)
        yield pb.JobInput(stdin=b"x")

    async def gap_then_start():
        feeder = asyncio.ensure_future(run._forward(inputs()))  # no ranks: a restart in progress
        await asyncio.sleep(0.05)
        assert not feeder.done()  # stdin waits for the new rank 0
        run.ranks = [_Rank(0, "a", ""), _Rank(1, "b", "")]
        run._deliver_early()
        await asyncio.wait_for(feeder, 5)
        return [[r.inputs.get_nowait() for _ in range(r.inputs.qsize())] for r in run.ranks]

    rank0, rank1 = d.call(gap_then_start)
    sigint = pb.LaunchInput(signal=signal.SIGINT)
    assert rank0 == [sigint, pb.LaunchInput(stdin=b"x"), pb.LaunchInput(stdin_eof=True)]
    assert rank1 == [sigint]
