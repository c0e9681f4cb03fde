"""One rank of a multi-host job, started by the daemon (xpud.federation.rankproc): real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time

import grpc
import pytest

from tests.conftest import alive, wait_until
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.federation import rankproc
from xpud.federation.rankproc import run_rank

pytestmark = pytest.mark.timeout(60)

PY = sys.executable


class Inputs:
    """The rest of a Launch stream, fed by the test: ``send`` messages, ``end`` it, or ``fail`` it."""

    def __init__(self):
        self.q: asyncio.Queue = asyncio.Queue()

    def send(self, **kw) -> None:
        self.q.put_nowait(pb.LaunchInput(**kw))

    def end(self) -> None:
        self.q.put_nowait(None)

    def fail(self) -> None:
        self.q.put_nowait(RuntimeError("stream broke"))

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.q.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item


def spec(argv, cwd="/", env=None, uid=None, gid=None, rank=0) -> pb.LaunchSpec:
    env = {"PATH": os.environ["PATH"]} if env is None else env
    return pb.LaunchSpec(
        job="j1",
        rank=rank,
        argv=argv,
        env=env,
        cwd=str(cwd),
        uid=os.getuid() if uid is None else uid,
        gid=os.getgid() if gid is None else gid,
    )


async def collect(gen, feed=None):
    """Every event of ``gen``; ``feed(event)`` is called on each (to send input as a real caller would)."""
    out = []
    async for ev in gen:
        out.append(ev)
        if feed is not None:
            feed(ev)
    return out


def outputs(events, fd):
    return b"".join(e.output.data for e in events if e.HasField("output") and e.output.fd == fd)


def ended(events):
    assert events[-1].HasField("ended"), events[-1]
    assert sum(e.HasField("ended") for e in events) == 1
    return events[-1].ended


def run(argv, feed=None, **kw):
    """Run a rank to its end; (events, RankEnded passed to on_end). Without ``feed`` the inputs end at
    once (stdin at end of file); ``feed(inputs, event)`` sends input as a caller would."""
    seen = []

    async def main():
        ins = Inputs()
        if feed is None:
            ins.end()
        evs = await collect(run_rank(spec(argv, **kw), ins, seen.append), feed and (lambda e: feed(ins, e)))
        return evs

    events = asyncio.run(main())
    assert len(seen) == 1 and seen[0] == ended(events)
    return events, seen[0]


def test_the_environment_is_exactly_the_given_one_and_the_directory_is_the_given_one(tmp_path):
    env = {"PATH": os.environ["PATH"], "A": "1", "EMPTY": "", "RANK": "3"}
    events, end = run([PY, "-c", "import os; print(sorted(os.environ.items())); print(os.getcwd())"],
                      cwd=tmp_path, env=env)  # fmt: skip
    lines = outputs(events, 1).decode().splitlines()
    got = dict(eval(lines[0]))
    got.pop("LC_CTYPE", None)  # Python's own C-locale coercion, not the launcher's
    assert got == env
    assert lines[1] == str(tmp_path)
    assert events[0].HasField("started") and events[0].started.pid > 0
    assert (end.exit_code, end.signal, end.error) == (0, 0, "")


def test_output_comes_in_order_per_stream_in_bounded_chunks_and_the_exit_code_passes():
    code = (
        "import sys\n"
        "for i in range(2000):\n"
        "    sys.stdout.write(f'out {i}\\n'); sys.stderr.write(f'err {i}\\n')\n"
        "sys.stdout.write('x' * 300000); sys.exit(7)\n"
    )
    events, end = run([PY, "-c", code])
    out, err = outputs(events, 1).decode(), outputs(events, 2).decode()
    assert out.splitlines()[:2000] == [f"out {i}" for i in range(2000)]
    assert out.endswith("x" * 300000)
    assert err.splitlines() == [f"err {i}" for i in range(2000)]
    assert max(len(e.output.data) for e in events if e.HasField("output")) <= rankproc.CHUNK_BYTES
    assert all(e.output.rank == 0 for e in events if e.HasField("output"))
    assert (end.exit_code, end.signal) == (7, 0)


def test_stdin_reaches_the_rank_and_its_end_closes_it():
    def feed(ins, ev):
        if ev.HasField("started"):
            ins.send(stdin=b"hello ")
            ins.send(stdin=b"world\n")
            ins.send(stdin_eof=True)

    events, end = run(["sh", "-c", "cat; echo done"], feed=feed)
    assert outputs(events, 1) == b"hello world\ndone\n"
    assert end.exit_code == 0


def test_a_signal_reaches_the_whole_group_and_the_code_is_128_plus_n():
    def feed(ins, ev):
        if ev.HasField("output") and b"ready" in ev.output.data:
            ins.send(signal=signal.SIGUSR1)

    # the shell and its child both get it; the shell then dies by it
    inner = "trap 'echo child got USR1; exit 0' USR1; echo ready; while :; do sleep 0.05; done"
    outer = f'trap "echo shell got USR1" USR1; sh -c "{inner}" & wait; wait; trap - USR1; kill -s USR1 $$'
    events, end = run(["sh", "-c", outer], feed=feed)
    assert sorted(outputs(events, 1).splitlines()) == [b"child got USR1", b"ready", b"shell got USR1"]
    assert (end.exit_code, end.signal) == (128 + signal.SIGUSR1, signal.SIGUSR1)


def test_a_forwarded_sigterm_ignored_by_the_rank_ends_in_sigkill_after_the_grace():
    def feed(ins, ev):
        if ev.HasField("output") and b"ready" in ev.output.data:
            ins.send(signal=signal.SIGTERM)

    async def main():
        ins = Inputs()
        gen = run_rank(
            spec(["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.05; done"]),
            ins,
            kill_grace_s=0.3,
        )
        t0 = time.monotonic()
        evs = await collect(gen, lambda e: feed(ins, e))
        return evs, time.monotonic() - t0

    events, took = asyncio.run(main())
    assert ended(events).signal == signal.SIGKILL and ended(events).exit_code == 137
    assert took < 5


def gone(pids) -> None:
    """Every pid is dead within a moment (a SIGKILLed process closes its pipes a little before /proc
    shows it exited)."""
    wait_until(lambda: not [p for p in pids if alive(p)], timeout=5)


def _grandchild_pids(events) -> list[int]:
    return [int(x) for x in outputs(events, 1).split()]


def test_when_the_caller_goes_away_the_whole_group_is_killed_and_the_end_hook_runs(tmp_path):
    """The rank, its child and a grandchild that ignores SIGTERM: all gone after the grace."""
    script = "sh -c 'trap \"\" TERM; sleep 600 & echo $!; wait' & echo $!; echo $$; wait"
    seen = []

    async def main():
        ins = Inputs()
        gen = run_rank(spec(["sh", "-c", script]), ins, seen.append, stop_grace_s=0.5)
        got = []
        async for ev in gen:
            got.append(ev)
            if len(outputs(got, 1).split()) == 3:
                break  # the caller leaves (the coordinator died): the generator is closed
        await gen.aclose()
        pids = _grandchild_pids(got)
        assert all(alive(p) for p in pids)
        await rankproc.stop_all(10)
        return pids

    pids = asyncio.run(main())
    gone(pids)
    assert len(seen) == 1 and seen[0].signal in (signal.SIGTERM, signal.SIGKILL), seen


def test_a_cancelled_caller_and_a_broken_input_stream_stop_the_rank():
    for how in ("cancel", "break"):
        seen = []

        async def main(how=how, seen=seen):
            ins = Inputs()
            got = []

            async def consume():
                async for ev in run_rank(spec(["sh", "-c", "echo $$; exec sleep 600"]), ins, seen.append):
                    got.append(ev)

            task = asyncio.ensure_future(consume())
            while not outputs(got, 1):
                await asyncio.sleep(0.01)
            pid = int(outputs(got, 1))
            if how == "cancel":
                task.cancel()
            else:
                ins.fail()
            with pytest.raises(asyncio.CancelledError) if how == "cancel" else _nothing():
                await task
            await rankproc.stop_all(10)
            return pid, got

        pid, got = asyncio.run(main())
        assert not alive(pid), how
        assert len(seen) == 1 and seen[0].signal == signal.SIGTERM, how
        if how == "break":  # the caller still listens: it hears the end
            assert ended(got).exit_code == 128 + signal.SIGTERM


def test_kill_from_outside_stops_the_group_waits_for_the_end_and_the_caller_hears_it():
    seen = []

    async def main():
        ins = Inputs()
        rank = rankproc.Rank(spec(["sh", "-c", "sleep 600 & echo $!; echo $$; wait"]), ins, seen.append)
        got = []

        async def consume():
            async for ev in rank.events():
                got.append(ev)

        task = asyncio.ensure_future(consume())
        while len(outputs(got, 1).split()) < 2:
            await asyncio.sleep(0.01)
        pids = _grandchild_pids(got)
        await rank.kill()
        assert len(seen) == 1
        gone(pids)
        await task
        return got

    got = asyncio.run(main())
    assert ended(got).signal == signal.SIGTERM and seen[0] == ended(got)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_clean_end_of_inputs_only_closes_stdin():
    events, end = run(["sh", "-c", "cat >/dev/null; echo still here"])
    assert outputs(events, 1) == b"still here\n" and end.exit_code == 0


@pytest.mark.parametrize(
    ("argv", "kw", "code", "words"),
    [
        (["no-such-command-xyz"], {}, 127, "no-such-command-xyz: command not found on"),
        (["true"], {"cwd": "/no/such/dir"}, 126, "working directory /no/such/dir does not exist on"),
        (["true"], {"cwd": "relative"}, 126, "give an absolute path"),
        (["true"], {"uid": 4_000_000_000}, 126, "uid 4000000000 does not exist on"),
        ([], {}, 127, "no command given"),
    ],
)
def test_refusals_are_one_clear_line(argv, kw, code, words):
    events, end = run(argv, **kw)
    assert [e.WhichOneof("what") for e in events] == ["ended"]
    assert end.exit_code == code and words in end.error and "\n" not in end.error


def test_remote_launch_disabled_is_refused():
    async def main():
        ins = Inputs()
        ins.end()
        return await collect(run_rank(spec(["true"]), ins, remote_launch=False))

    end = ended(asyncio.run(main()))
    assert "remote launch is disabled" in end.error and "remote_launch = false" in end.error

    class Cfg:
        class cluster:
            remote_launch = False

    assert rankproc.remote_launch_allowed(Cfg) is False
    assert rankproc.remote_launch_allowed(object()) is True  # no [cluster] attribute: the default


def test_output_waits_for_a_slow_caller_instead_of_piling_up():
    """The rank writes 16 MiB; the caller takes nothing for a while: at most about HIGH_WATER (plus a
    pipe read) waits in memory, and the writer is held back."""

    async def main():
        ins = Inputs()
        ins.end()
        gen = run_rank(spec(["sh", "-c", "head -c 16777216 /dev/zero; echo done >&2"]), ins)
        first = await gen.__anext__()
        assert first.HasField("started")
        await asyncio.sleep(1.0)
        rank = next(iter(rankproc._RUNNING.values()))
        held = rank.buffered
        total, err = 0, b""
        async for ev in gen:
            if ev.HasField("output") and ev.output.fd == 1:
                total += len(ev.output.data)
            elif ev.HasField("output"):
                err += ev.output.data
        return held, total, err

    held, total, err = asyncio.run(main())
    assert held <= rankproc.HIGH_WATER + 2 * 256 * 1024
    assert total == 16 << 20 and err == b"done\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_as_root_the_rank_runs_as_the_submitters_uid_gid_and_groups():
    import pwd

    nobody = pwd.getpwnam("nobody")
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        events, end = run(["sh", "-c", "id -u; id -g; id -G; pwd"], cwd=d, uid=nobody.pw_uid,
                          gid=nobody.pw_gid)  # fmt: skip
        uid, gid, groups, cwd = outputs(events, 1).decode().splitlines()
        assert (int(uid), int(gid)) == (nobody.pw_uid, nobody.pw_gid), outputs(events, 2)
        assert sorted(map(int, groups.split())) == sorted(set(os.getgrouplist("nobody", nobody.pw_gid)))
        assert cwd == d and end.exit_code == 0
        # a directory only root may enter is not entered for the user
        os.chmod(d, 0o700)
        events, end = run(["true"], cwd=d, uid=nobody.pw_uid, gid=nobody.pw_gid)
        assert end.exit_code != 0 and b"Permission denied" in outputs(events, 2)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_the_gid_and_groups_come_from_this_hosts_user_database_never_from_the_caller():
    import pwd

    nobody = pwd.getpwnam("nobody")
    assert 0 not in os.getgrouplist("nobody", nobody.pw_gid)
    # a peer asks for gid 0 (root's group) for a user who is not in it here: the user's own group it is
    events, end = run(["sh", "-c", "id -g; id -G"], uid=nobody.pw_uid, gid=0)
    gid, groups = outputs(events, 1).decode().splitlines()
    assert int(gid) == nobody.pw_gid and 0 not in map(int, groups.split()), outputs(events, 2)
    assert end.exit_code == 0


# ------------------------------------------------------------------------------ over a real gRPC stream
class _Peer(pbg.PeerServicer):
    def __init__(self, ends):
        self.ends = ends

    async def Launch(self, request_iterator, context):
        first = await request_iterator.__anext__()
        async for ev in run_rank(first.start, request_iterator, self.ends.append, stop_grace_s=0.5):
            yield ev


def test_over_grpc_a_coordinator_that_goes_away_leaves_no_process(short_tmp):
    """A real Peer.Launch stream on a unix socket: the client cancels; the server's rank dies."""
    sock = f"unix:{short_tmp}/peer.sock"
    ends = []

    async def main():
        server = grpc.aio.server()
        pbg.add_PeerServicer_to_server(_Peer(ends), server)
        server.add_insecure_port(sock)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(sock) as ch:
                stub = pbg.PeerStub(ch)
                q: asyncio.Queue = asyncio.Queue()
                q.put_nowait(pb.LaunchInput(start=spec(["sh", "-c", "sleep 600 & echo $!; echo $$; wait"])))

                async def reqs():
                    while True:
                        yield await q.get()

                call = stub.Launch(reqs())
                got = []
                async for ev in call:
                    got.append(ev)
                    if len(outputs(got, 1).split()) == 2:
                        break
                pids = _grandchild_pids(got)
                assert all(alive(p) for p in pids)
                call.cancel()
            for _ in range(200):
                if not any(alive(p) for p in pids) and ends:
                    break
                await asyncio.sleep(0.05)
            return pids
        finally:
            await server.stop(1)
            await rankproc.stop_all(5)

    pids = asyncio.run(main())
    gone(pids)
    assert len(ends) == 1


def test_stdin_is_not_taken_faster_than_the_rank_reads_it():
    """20 MiB of stdin for a rank that reads nothing for a while: the launcher takes only about
    STDIN_HIGH_WATER of it off the stream (the rest waits upstream); then all of it arrives."""

    async def main():
        ins = Inputs()
        for _ in range(20):
            ins.send(stdin=b"y" * (1 << 20))
        ins.send(stdin_eof=True)
        ins.end()
        gen = run_rank(spec(["sh", "-c", "read -r go </dev/null; sleep 1; wc -c"]), ins)
        await gen.__anext__()
        await asyncio.sleep(0.6)
        left = ins.q.qsize()
        rest = await collect(gen)
        return left, rest

    left, rest = asyncio.run(main())
    assert left >= 22 - 1 - 2  # at most ~2 MiB taken (1 MiB buffered + the pipe + one in hand)
    assert outputs(rest, 1).strip() == str(20 << 20).encode()
