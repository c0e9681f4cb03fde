"""`xpu run --nodes N` (xpu_cli.jobrun) against a stand-in daemon: a real gRPC server on a temp unix
socket speaking the real proto (Node.GetCluster and Node.RunJob, the real credential handshake), whose
RunJob plays a script. The CLI runs as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time

import grpc
import pytest

from tests.conftest import BIN, wait_until, xpu_env
from xpud.api.auth import CredentialIssuer
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg

pytestmark = pytest.mark.timeout(60)


class StandIn(pbg.NodeServicer):
    """``script(standin, inputs)``: an async generator of JobEvents; ``inputs`` the JobInputs after start."""

    def __init__(self, runtime_dir, script, enabled: bool = True):
        self.dir, self.script, self.enabled = runtime_dir, script, enabled
        self.spec: pb.JobSpec | None = None
        self.inputs: list[pb.JobInput] = []
        self.cancelled = threading.Event()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self):
        self._stop = asyncio.Event()
        cred = await CredentialIssuer().serve(str(self.dir / "cred.sock"))
        server = grpc.aio.server()
        pbg.add_NodeServicer_to_server(self, server)
        server.add_insecure_port(f"unix:{self.dir / 'xpud.sock'}")
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)
        cred.close()

    async def GetCluster(self, request, context):
        return pb.ClusterReply(enabled=self.enabled, name="h0")

    async def RunJob(self, request_iterator, context):
        first = await anext(request_iterator)
        self.spec = first.start
        q: asyncio.Queue = asyncio.Queue()

        async def pump():
            async for m in request_iterator:
                self.inputs.append(m)
                q.put_nowait(m)

        task = asyncio.ensure_future(pump())
        try:
            async for ev in self.script(self, q):
                yield ev
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            task.cancel()


def placed(n=2):
    return pb.JobEvent(
        placed=pb.JobPlaced(
            job="j1",
            attempts=1,
            ranks=[pb.JobRank(rank=i, host=f"h{i}", addr=f"127.0.0.{i + 2}", cards=[i]) for i in range(n)],
        )
    )


def out(rank, data, fd=1):
    return pb.JobEvent(output=pb.RankOutput(rank=rank, fd=fd, data=data))


def rank_ended(rank, code=0, sig=0, error=""):
    return pb.JobEvent(rank_ended=pb.RankEnded(rank=rank, exit_code=code, signal=sig, error=error))


def job_ended(code=0, reason=""):
    return pb.JobEvent(ended=pb.JobEnded(exit_code=code, reason=reason))


@pytest.fixture
def standin(short_tmp):
    made = []

    def make(script, enabled=True):
        s = StandIn(short_tmp, script, enabled).__enter__()
        made.append(s)
        return s

    yield make
    for s in made:
        s.__exit__()


def xpu(runtime_dir, *args, **kw):
    return subprocess.run([str(BIN / "xpu"), *args], env=xpu_env(runtime_dir, MARK="m1"), capture_output=True,
                          timeout=30, **kw)  # fmt: skip


async def interleaved(s, q):
    yield placed()
    for ev in (out(0, b"hel"), out(1, b"a\nb"), out(0, b"lo\nwor"), out(1, b"\n"), out(0, b"ld")):
        yield ev
    yield out(1, b"oops\n", fd=2)
    yield rank_ended(0)
    yield rank_ended(1, 3)
    yield job_ended(3, "rank 1 exited 3")


def test_labelled_lines_are_never_split_and_the_exit_code_is_the_jobs(standin, short_tmp):
    s = standin(interleaved)
    r = xpu(short_tmp, "run", "--nodes", "2", "--gpus-per-node", "1", "--label", "--", "train", "--x")
    assert r.stdout == b"1: a\n0: hello\n1: b\n0: world\n"
    err = r.stderr.decode()
    assert "1: oops\n" in err and "xpu: job j1: rank 0 on h0 (cards 0), rank 1 on h1 (cards 1)\n" in err
    assert "xpu: rank 1 on h1 ended with exit code 3\n" in err
    assert r.returncode == 3
    spec = s.spec
    assert list(spec.argv) == ["train", "--x"] and spec.mode == "xpu"
    assert (spec.nodes, spec.gpus_per_node, spec.replicas, spec.kill_on_bad_exit) == (2, 1, 0, True)
    assert spec.tasks_per_node == 0 and not spec.label_tasks  # not given: one launcher per host
    assert spec.env["MARK"] == "m1" and spec.cwd == os.getcwd()


def test_without_label_output_passes_as_it_comes_and_quiet_hides_the_placement(standin, short_tmp):
    s = standin(interleaved)
    r = xpu(
        short_tmp, "run", "-N", "2", "-q", "--no-kill-on-bad-exit", "--tasks-per-node", "4", "--", "train"
    )
    assert r.stdout == b"hela\nblo\nwor\nld"
    assert s.spec.tasks_per_node == 4 and not s.spec.kill_on_bad_exit
    assert b"job j1" not in r.stderr and r.returncode == 3


def test_with_tasks_per_node_each_host_labels_its_tasks_lines(standin, short_tmp):
    """--label --tasks-per-node: the hosts' launchers label by task RANK (xpud.federation.tasks), so the
    CLI adds no host label of its own."""
    s = standin(interleaved)
    r = xpu(short_tmp, "run", "-N", "2", "--tasks-per-node", "2", "--label", "-q", "--", "train")
    assert r.stdout == b"hela\nblo\nwor\nld" and r.returncode == 3  # as it came
    assert s.spec.label_tasks and s.spec.tasks_per_node == 2


def test_json_summary_is_the_last_line(standin, short_tmp):
    standin(interleaved)
    r = xpu(short_tmp, "run", "--nodes", "2", "--json", "--", "train")
    last = r.stdout.decode().splitlines()[-1]
    summary = json.loads(last)
    assert summary["job"] == "j1" and summary["exit_code"] == 3 and summary["hosts"] == ["h0", "h1"]
    assert [(x["rank"], x["host"], x["exit_code"]) for x in summary["ranks"]] == [(0, "h0", 0), (1, "h1", 3)]
    assert r.stdout.decode().endswith("ld\n" + last + "\n")


async def echo_stdin(s, q):
    yield placed(1)
    data = b""
    while True:
        m = await q.get()
        if m.WhichOneof("what") == "stdin_eof":
            break
        data += m.stdin
    yield out(0, data)
    yield rank_ended(0)
    yield job_ended(0)


def test_stdin_goes_to_the_daemon_until_its_end(standin, short_tmp):
    s = standin(echo_stdin)
    big = os.urandom(300_000)
    r = xpu(short_tmp, "run", "--nodes", "1", "--", "cat", input=big)
    assert r.returncode == 0 and r.stdout == big
    assert s.inputs[-1].stdin_eof


async def until_signals(s, q, wanted=1):
    yield placed()
    yield out(0, b"ready\n")
    sigs = []
    while len(sigs) < wanted:
        m = await q.get()
        if m.WhichOneof("what") == "signal":
            sigs.append(m.signal)
    last = sigs[-1]
    yield rank_ended(0, 128 + last, last)
    yield rank_ended(1, 128 + last, last)
    yield job_ended(128 + last, "interrupted")


def _start(runtime_dir, *args):
    return subprocess.Popen([str(BIN / "xpu"), *args], env=xpu_env(runtime_dir), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _wait_ready(p):
    line = p.stdout.readline()
    assert line == b"ready\n", (line, p.stderr.read() if p.poll() is not None else b"")


def test_ctrl_c_reaches_every_rank_and_we_end_by_the_same_signal(standin, short_tmp):
    s = standin(until_signals)
    p = _start(short_tmp, "run", "--nodes", "2", "--", "train")
    _wait_ready(p)
    p.send_signal(signal.SIGINT)
    assert p.wait(20) == -signal.SIGINT  # as single-host `xpu run`: dies by the signal (shell: 130)
    assert [m.signal for m in s.inputs if m.WhichOneof("what") == "signal"] == [signal.SIGINT]


def test_other_signals_are_passed_on_and_the_code_follows(standin, short_tmp):
    s = standin(until_signals)
    p = _start(short_tmp, "run", "--nodes", "2", "--", "train")
    _wait_ready(p)
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == -signal.SIGTERM
    assert [m.signal for m in s.inputs if m.WhichOneof("what") == "signal"] == [signal.SIGTERM]


async def ignores_sigint(s, q):
    yield placed()
    yield out(0, b"ready\n")
    while True:
        await q.get()


def test_a_second_ctrl_c_within_a_second_kills_every_rank_and_leaves(standin, short_tmp):
    s = standin(ignores_sigint)
    p = _start(short_tmp, "run", "--nodes", "2", "--", "train")
    _wait_ready(p)
    p.send_signal(signal.SIGINT)
    wait_until(lambda: any(m.signal == signal.SIGINT for m in s.inputs), 10)
    p.send_signal(signal.SIGINT)
    assert p.wait(20) == -signal.SIGINT
    assert [m.signal for m in s.inputs if m.WhichOneof("what") == "signal"] == [signal.SIGINT, signal.SIGKILL]
    assert s.cancelled.wait(10)  # we left: the daemon stops the job on every host


async def queued_forever(s, q):
    yield pb.JobEvent(queued=pb.JobQueued(reason="2 hosts with 8 free cards wanted, 1 free", position=2))
    while True:
        await q.get()


def test_queued_shows_the_position_and_ctrl_c_leaves_the_queue(standin, short_tmp):
    s = standin(queued_forever)
    p = _start(short_tmp, "run", "--nodes", "2", "--gpus-per-node", "8", "--wait", "600", "--", "train")
    line = p.stderr.readline()
    assert line == b"xpu: queued: position 2 (2 hosts with 8 free cards wanted, 1 free)\n"
    p.send_signal(signal.SIGINT)
    assert p.wait(20) == -signal.SIGINT
    assert s.cancelled.wait(10) and s.spec.wait_s == 600


async def never(s, q):
    raise AssertionError("RunJob should not be called")
    yield


def test_a_daemon_without_cluster_is_one_clear_line(standin, short_tmp):
    standin(never, enabled=False)
    r = xpu(short_tmp, "run", "--nodes", "2", "--", "train")
    assert r.returncode == 1
    assert r.stderr.decode() == (
        "xpu: this host is not in a cluster: configure [cluster] in xpud.toml "
        "(see README 'A cluster of hosts')\n"
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nodes", "2", "-m", "vxpu-half"], "--nodes takes whole cards (--mode xpu), not vxpu-half"),
        (["--replicas", "2", "--spread"], "--replicas places slices: give a slice mode"),
        (["--gpus-per-node", "2"], "--gpus-per-node needs --nodes N"),
        (["--spread"], "--spread needs --replicas R"),
        (["--label"], "--label applies to jobs across hosts"),
        (["--json"], "--json applies to jobs across hosts"),
        (["--nodes", "2", "--gpus", "4"], "with --nodes give --gpus-per-node G"),
        (["--nodes", "2", "--json-env"], "--json-env is for one-host runs"),
        (["--nodes", "2", "--replicas", "2", "-m", "vxpu-half"], "--nodes takes whole cards"),
        (["--tasks-per-node", "2"], "--tasks-per-node needs --nodes N"),
        (["--replicas", "2", "--spread", "-m", "vxpu-half", "--tasks-per-node", "2"], "needs --nodes N"),
        (["--nodes", "2", "--tasks-per-node", "513"], "--tasks-per-node 513: outside 1..512"),
    ],
)
def test_bad_combinations_are_one_line_without_a_daemon(short_tmp, args, words):
    for fast in (True, False):  # the fast path and Typer's (given an option only Typer parses)
        extra = [] if fast else ["--gpus", " 1"] if "--gpus" not in args else []
        r = xpu(short_tmp, "run", *args, *extra, "--", "train")
        assert r.returncode == 1 and r.stderr.decode().count("\n") == 1, r.stderr
        assert words in r.stderr.decode(), r.stderr


def test_stream_lost_mid_job_is_one_line(standin, short_tmp):
    async def dies(s, q):
        yield placed()
        yield out(0, b"ready\n")
        await asyncio.sleep(0.2)
        raise RuntimeError("boom")

    standin(dies)
    t0 = time.monotonic()
    r = xpu(short_tmp, "run", "--nodes", "2", "--", "train")
    assert r.returncode == 1 and r.stdout == b"ready\n" and time.monotonic() - t0 < 20
    assert r.stderr.decode().count("\n") == 2 and r.stderr.decode().startswith("xpu: job j1")


def test_a_job_across_hosts_names_the_argument_or_variable_that_is_not_utf8(monkeypatch):
    """Its command and environment travel as text: bytes that are not UTF-8 get one line naming them
    (protobuf would raise an encoding error from deep inside the request)."""
    from xpu_cli.jobrun import _check_text

    from xpud.errors import BadRequest

    _check_text(["python", "train.py", "héllo"], {"A": "ü"})  # UTF-8 is fine
    bad = b"caf\xe9".decode(errors="surrogateescape")  # how Python holds such an argv/environ entry
    with pytest.raises(BadRequest, match="argument 2 of the command is not UTF-8"):
        _check_text(["python", "train.py", bad], {})
    with pytest.raises(BadRequest, match="environment variable 'LABEL' is not UTF-8"):
        _check_text(["true"], {"LABEL": bad})
