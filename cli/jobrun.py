"""`xpu run --nodes N` / `--replicas R --spread`: a job across hosts, launched like srun.

The local daemon coordinates (``Node.RunJob``): it places the job, reserves and commits on each host and
starts one rank per host (with ``--tasks-per-node T``, a launcher that runs the command T times there).
This side sends the command (argv, our environment and working directory), then our stdin (to rank 0)
and signals, and prints what comes back:

- The ranks' output goes to our stdout and stderr as it comes. With ``--label`` each line is prefixed
  ``RANK: `` (as ``srun --label``); lines are buffered per rank and stream, so a prefix never splits a
  line (a line longer than ``LINE_MAX`` is cut into labelled pieces). With ``--tasks-per-node`` each
  host's launcher labels its tasks' lines by their ``RANK`` instead (``xpud.federation.tasks``).
- Placement and queueing go to stderr as ``xpu:`` lines (``-q`` silences them), as do ranks that fail.
- Ctrl-C (SIGINT) is passed to every rank; a second one within ``DOUBLE_INTERRUPT_S`` sends SIGKILL and
  leaves (the daemon then kills what is left on every host). TERM, HUP, QUIT, USR1 and USR2 are passed
  on too. Interrupted before the job is placed, we leave the queue.
- We end as the job ended: ``JobEnded.exit_code`` (the first failing rank's), or by the same signal
  when that rank died by one (a shell shows 128 + n). ``--json`` prints a summary as the last line of
  stdout (job, hosts, ranks with their exit codes).

Backpressure: events from the daemon wait in a bounded queue; while we cannot write our output the
daemon's stream, and so the ranks, are held back. Stdin is read only while few messages wait to go out.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time

import grpc
from xpu_cli.child import Outcome
from xpu_cli.run import Signals, Wakeup, _say

from xpud.api.client import Client, to_error
from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import BadRequest, Unavailable, XpudError
from xpud.federation.launch import label

DOUBLE_INTERRUPT_S = 1.0  # a second Ctrl-C within this: SIGKILL every rank and leave
LINE_MAX = 64 * 1024  # --label: a longer line is printed in labelled pieces of this size
EVENTS_WAITING = 64  # events read from the daemon and not yet printed
STDIN_WAITING = 16  # stdin messages not yet sent
STDIN_CHUNK = 64 * 1024
NOT_IN_CLUSTER = (
    "this host is not in a cluster: configure [cluster] in xpud.toml (see README 'A cluster of hosts')"
)


def check_options(
    mode: str,
    nodes: int | None,
    gpus_per_node: int | None,
    replicas: int | None,
    spread: bool,
    gpus_given: bool = False,
    priority: int = 0,
    json_env: bool = False,
    kill_grace_given: bool = False,
    tasks_per_node: int | None = None,
) -> None:
    """Refuse bad combinations of `xpu run`'s multi-host options with one line (BadRequest)."""
    if gpus_per_node is not None and nodes is None:
        raise BadRequest("--gpus-per-node needs --nodes N (the hosts to spread the job over)")
    if tasks_per_node is not None and nodes is None:
        raise BadRequest("--tasks-per-node needs --nodes N (the hosts to run the tasks on)")
    if spread and replicas is None:
        raise BadRequest("--spread needs --replicas R (slices on R distinct hosts)")
    if nodes is not None and mode != "xpu":
        raise BadRequest(
            f"--nodes takes whole cards (--mode xpu), not {mode}: "
            f"for {mode} slices on several hosts give --replicas R --spread"
        )
    if replicas is not None and mode == "xpu":
        raise BadRequest(
            "--replicas places slices: give a slice mode (e.g. --mode vxpu-half --replicas 2 --spread)"
        )
    if nodes is not None and replicas is not None:
        raise BadRequest("--nodes and --replicas do not go together: whole cards per host, or slices")
    if gpus_given:
        raise BadRequest("--gpus counts cards on one host: with --nodes give --gpus-per-node G")
    if priority:
        raise BadRequest("--priority applies to one-host runs only (multi-host jobs queue in order)")
    if json_env:
        raise BadRequest("--json-env is for one-host runs: a multi-host job is launched by xpud itself")
    if kill_grace_given:
        raise BadRequest("--kill-grace applies to one-host runs (each host gives a rank 10 s after SIGTERM)")


class Printer:
    """The ranks' output to our stdout/stderr, labelled or not; a summary of who ended how."""

    def __init__(self, labelled: bool):
        self.labelled = labelled
        self.partial: dict[tuple[int, int], bytes] = {}  # (rank, fd) -> a line not yet ended
        self.last_byte: dict[int, bytes] = {}

    def _write(self, fd: int, data: bytes) -> None:
        if not data:
            return
        self.last_byte[fd] = data[-1:]
        view = memoryview(data)
        while view:
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            except OSError:
                return  # a reader gone (EPIPE): the job goes on; its exit code is what counts
            view = view[n:]

    def output(self, out: pb.RankOutput) -> None:
        fd = 2 if out.fd == 2 else 1
        if not self.labelled:
            self._write(fd, out.data)
            return
        key = (out.rank, fd)
        data = self.partial.pop(key, b"") + out.data
        prefix = label(out.rank, "").encode()
        lines = data.split(b"\n")
        rest = lines.pop()
        while len(rest) >= LINE_MAX:
            lines.append(rest[:LINE_MAX])
            rest = rest[LINE_MAX:]
        if lines:
            self._write(fd, b"".join(prefix + line + b"\n" for line in lines))
        if rest:
            self.partial[key] = rest

    def flush_rank(self, rank: int) -> None:
        """A rank ended: its unfinished lines are printed (with a newline, so no label is split)."""
        for fd in (1, 2):
            rest = self.partial.pop((rank, fd), b"")
            if rest:
                self._write(fd, label(rank, "").encode() + rest + b"\n")

    def flush_all(self) -> None:
        for rank, _ in list(self.partial):
            self.flush_rank(rank)

    def newline_if_needed(self) -> None:
        if self.last_byte.get(1, b"\n") != b"\n":
            self._write(1, b"\n")


class JobStream(threading.Thread):
    """Reads the RunJob stream into a bounded queue of (kind, payload): "event" (pb.JobEvent), "error"
    (XpudError), "closed" (None)."""

    def __init__(self, client: Client, start: pb.JobSpec, wake: Wakeup):
        super().__init__(daemon=True, name="xpu-job")
        self.client, self.wake = client, wake
        self.events: queue.Queue = queue.Queue(maxsize=EVENTS_WAITING)
        self.outbox: queue.Queue = queue.Queue()
        self.outbox.put(pb.JobInput(start=start))
        self._stopping = threading.Event()
        self._call = None

    def send(self, **kw) -> None:
        self.outbox.put(pb.JobInput(**kw))

    def _requests(self):
        while True:
            item = self.outbox.get()
            if item is None:
                return
            self.wake.poke()  # room in the outbox: the main loop may read stdin again
            yield item

    def _put(self, kind: str, payload) -> None:
        while not self._stopping.is_set():
            try:
                self.events.put((kind, payload), timeout=0.1)
                self.wake.poke()
                return
            except queue.Full:
                self.wake.poke()

    def next(self):
        try:
            return self.events.get_nowait()
        except queue.Empty:
            return None

    def run(self) -> None:
        try:
            self._call = self.client.node.RunJob(self._requests(), metadata=self.client._metadata())
            for ev in self._call:
                self._put("event", ev)
        except grpc.RpcError as e:
            if not self._stopping.is_set():
                self._put("error", to_error(e, str(self.client.socket)))
            return
        except XpudError as e:
            self._put("error", e)
            return
        self._put("closed", None)

    def stop(self) -> None:
        """Leave: the daemon stops the job on every host when our stream ends."""
        self._stopping.set()
        self.outbox.put(None)
        if self._call is not None:
            self._call.cancel()


def _placed_line(p: pb.JobPlaced) -> str:
    where = ", ".join(
        f"rank {r.rank} on {r.host}" + (f" (cards {','.join(map(str, r.cards))})" if r.cards else "")
        for r in p.ranks
    )
    extra = f" after {p.attempts} attempts" if p.attempts > 1 else ""
    return f"job {p.job}: {where}{extra}"


def _stdin_readable() -> bool:
    """Whether to forward our stdin: not when it is a terminal we do not have (we run in the background:
    reading it would stop us)."""
    try:
        if os.isatty(0):
            return os.tcgetpgrp(0) == os.getpgrp()
        os.fstat(0)
        return True
    except OSError:
        return False


def _check_text(argv: list[str], env: dict[str, str]) -> None:
    """A job across hosts sends its command and environment as text: bytes that are not UTF-8 (which
    Python keeps as surrogates) cannot travel; say which one instead of failing inside protobuf."""
    from xpu_cli.runopts import is_text

    for i, arg in enumerate(argv):
        if not is_text(arg):
            raise BadRequest(f"argument {i} of the command is not UTF-8 text: a job across hosts sends text")
    for k, v in env.items():
        if not (is_text(k) and is_text(v)):
            raise BadRequest(
                f"environment variable {k.encode(errors='replace').decode()!r} is not UTF-8 text: a job "
                "across hosts sends its environment as text; unset it or fix its value"
            )
    if not is_text(os.getcwd()):
        raise BadRequest("the working directory's path is not UTF-8 text: a job across hosts sends text")


def run_job(
    client: Client,
    argv: list[str],
    mode: str = "xpu",
    nodes: int = 0,
    gpus_per_node: int = 1,
    replicas: int = 0,
    tasks_per_node: int = 0,
    spread: bool = False,
    wait_s: float = 0.0,
    labelled: bool = False,
    kill_on_bad_exit: bool = True,
    restartable: bool = False,
    quiet: bool = False,
    as_json: bool = False,
    name: str = "",
    account: str = "",
) -> Outcome:
    """Run ``argv`` across hosts through the local daemon; returns how the job ended."""
    if not argv:
        raise BadRequest("no command given: xpu run --nodes N --gpus-per-node G -- COMMAND [ARGS...]")
    try:
        cluster = client.cluster()
    except XpudError as e:
        if "UNIMPLEMENTED" in str(e) or "Method not found" in str(e):
            raise BadRequest(NOT_IN_CLUSTER) from None
        raise
    if not cluster.enabled:
        raise BadRequest(NOT_IN_CLUSTER)
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    _check_text(argv, env)
    spec = pb.JobSpec(
        mode=mode,
        nodes=nodes,
        gpus_per_node=gpus_per_node if nodes else 0,
        tasks_per_node=tasks_per_node if nodes else 0,
        label_tasks=labelled and bool(tasks_per_node and nodes),  # each host labels its tasks' lines
        replicas=replicas,
        spread=spread,
        argv=argv,
        env=env,
        cwd=os.getcwd(),
        wait_s=wait_s,
        kill_on_bad_exit=kill_on_bad_exit,
        restartable=restartable,
        name=name,
        account=account,
    )
    wake = Wakeup()
    printer = Printer(labelled and not spec.label_tasks)
    summary: dict = {"job": "", "exit_code": None, "reason": "", "hosts": [], "ranks": []}
    ranks: dict[int, dict] = {}
    first_bad: pb.RankEnded | None = None
    try:
        with Signals(wake) as signals:
            stream = JobStream(client, spec, wake)
            stream.start()
            placed = False
            stdin_open = False
            last_int = 0.0
            last_queued = None
            try:
                while True:
                    for sig in signals.pop():
                        if not placed:
                            return Outcome(128 + sig, sig)  # leave the queue
                        now = time.monotonic()
                        if sig == signal.SIGINT and now - last_int < DOUBLE_INTERRUPT_S:
                            stream.send(signal=signal.SIGKILL)
                            _say("second interrupt: killing every rank")
                            time.sleep(0.05)  # let the SIGKILL go out before the stream ends
                            return Outcome(128 + sig, sig)
                        if sig == signal.SIGINT:
                            last_int = now
                        stream.send(signal=sig)
                    item = stream.next()
                    if item is None:
                        extra = (0,) if stdin_open and stream.outbox.qsize() < STDIN_WAITING else ()
                        ready = wake.wait(None, extra)
                        if 0 in ready:
                            try:
                                data = os.read(0, STDIN_CHUNK)
                            except OSError:
                                data = b""
                            if data:
                                stream.send(stdin=data)
                            else:
                                stream.send(stdin_eof=True)
                                stdin_open = False
                        continue
                    kind, payload = item
                    if kind == "error":
                        raise payload
                    if kind == "closed":
                        raise Unavailable("the daemon ended the job's stream without its end: see its log")
                    what = payload.WhichOneof("what")
                    if what == "output":
                        printer.output(payload.output)
                    elif what == "queued":
                        q = payload.queued
                        if not quiet and (q.position, q.reason) != last_queued:
                            _say(f"queued: position {q.position}" + (f" ({q.reason})" if q.reason else ""))
                            last_queued = (q.position, q.reason)
                    elif what == "placed":
                        p = payload.placed
                        placed = True
                        summary["job"] = p.job
                        summary["attempts"] = p.attempts
                        summary["hosts"] = [r.host for r in p.ranks]
                        for r in p.ranks:
                            ranks[r.rank] = {"rank": r.rank, "host": r.host, "addr": r.addr,
                                             "cards": list(r.cards), "exit_code": None}  # fmt: skip
                        if not quiet:
                            _say(_placed_line(p))
                        if not stdin_open and _stdin_readable():
                            stdin_open = True
                        else:
                            stream.send(stdin_eof=True)
                    elif what == "rank_ended":
                        e = payload.rank_ended
                        printer.flush_rank(e.rank)
                        info = ranks.setdefault(e.rank, {"rank": e.rank, "host": "", "cards": []})
                        info.update(exit_code=e.exit_code, signal=e.signal, error=e.error)
                        where = f"rank {e.rank}" + (f" on {info['host']}" if info.get("host") else "")
                        if e.error:
                            _say(f"{where}: {e.error}")
                        elif e.exit_code:
                            if first_bad is None:
                                first_bad = e
                            how = f"signal {e.signal}" if e.signal else f"exit code {e.exit_code}"
                            _say(f"{where} ended with {how}")
                    elif what == "ended":
                        printer.flush_all()
                        ended = payload.ended
                        summary.update(exit_code=ended.exit_code, reason=ended.reason)
                        if ended.exit_code and not quiet and ended.reason:
                            _say(f"job {summary['job']}: {ended.reason}")
                        sig = first_bad.signal if first_bad is not None else 0
                        if sig and ended.exit_code == 128 + sig:
                            return Outcome(ended.exit_code, sig)
                        return Outcome(ended.exit_code)
            finally:
                stream.stop()
                printer.flush_all()
                if as_json:
                    summary["ranks"] = [ranks[k] for k in sorted(ranks)]
                    printer.newline_if_needed()
                    with contextlib.suppress(OSError):
                        sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
                        sys.stdout.flush()
    finally:
        wake.close()
