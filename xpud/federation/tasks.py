"""The task launcher of ``xpu run --nodes N --tasks-per-node T``: one host's rank runs its command T times.

A host runs one rank process per job; with ``LaunchSpec.tasks_per_node`` that process is this launcher
(``wrap``): ``python -I -S tasks.py T NODE_RANK [--keep-going] [--label] -- COMMAND...``, the host's own
Python and this very file, started as the user (after the switch) with the rank's environment. Standard
library only.

Invariants: each signal for the rank reaches every task once (the launcher forwards none); the launcher
exits with the first failing task's status (its exit code, or 128 + N for signal N), 0 when all exited 0.

Task environments, stdin, labelled output, kill-on-bad-exit: see docs/federation.md, Tasks per node.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

MAX_TASKS = 512  # = xpud.api.validate.MAX_TASKS_PER_NODE (Slurm's MaxTasksPerNode default)
MAX_NODE_RANK = 1023  # = the LaunchSpec.rank limit
KILL_GRACE_S = 10  # SIGTERM -> SIGKILL when one task failed (as a rank's forwarded signals)
CAUGHT = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
TERMINATING = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
LINE_MAX = 64 * 1024  # --label: a longer line is written in labelled pieces of this size
DRAIN_S = 1.0  # --label: after the last task ended, how long to read pipes a leftover still holds open
USAGE = "usage: tasks.py TASKS NODE_RANK [--keep-going] [--label] -- COMMAND [ARGS...]"


def task_env(env: dict[str, str], node_rank: int, tasks: int, local_rank: int) -> dict[str, str]:
    """Task ``local_rank``'s environment on the host of ``node_rank``: ``env`` with its ``RANK`` and
    ``LOCAL_RANK``."""
    return {**env, "RANK": str(node_rank * tasks + local_rank), "LOCAL_RANK": str(local_rank)}


def argv_for(
    tasks: int, node_rank: int, command: list[str], keep_going: bool = False, label: bool = False
) -> list[str]:
    """The command line that runs ``command`` as ``tasks`` tasks, as the user (after the switch): a Python
    every user may run (``switch_user.PYTHON``, isolated from the user's ``PYTHON*`` variables and site
    packages) on this file, or on its text (``-c``) where the user cannot read the file (a venv under a 0700
    home, as the daemon's own may be)."""
    from xpud.isolation.switch_user import PYTHON, readable  # the daemon's side only: this file runs alone

    flags = [*(["--keep-going"] if keep_going else []), *(["--label"] if label else [])]
    here = os.path.abspath(__file__)
    if readable(here):
        program = [here]
    else:
        with open(here, encoding="utf-8") as f:
            program = ["-c", f.read()]
    return [PYTHON, "-I", "-S", *program, str(tasks), str(node_rank), *flags, "--", *command]


def wrap(spec):
    """The LaunchSpec this host runs for ``spec``: with ``tasks_per_node``, its argv under this launcher
    (a copy); otherwise ``spec`` itself."""
    if not spec.tasks_per_node:
        return spec
    out = type(spec)()
    out.CopyFrom(spec)
    del out.argv[:]
    out.argv.extend(argv_for(spec.tasks_per_node, spec.rank, list(spec.argv), spec.keep_going, spec.label))
    return out


def _number(text: str, what: str, lo: int, hi: int) -> int:
    if not (text.isascii() and text.isdigit()) or not lo <= int(text) <= hi:
        raise ValueError(f"{what} {text[:20]!r}: give a whole number {lo}..{hi}")
    return int(text)


def parse(args: list[str]) -> tuple[int, int, set[str], list[str]]:
    """``(tasks, node_rank, flags, command)`` from the launcher's arguments; ValueError says why not."""
    if len(args) < 2:
        raise ValueError(USAGE)
    tasks = _number(args[0], "tasks", 1, MAX_TASKS)
    node_rank = _number(args[1], "node rank", 0, MAX_NODE_RANK)
    rest = args[2:]
    flags: set[str] = set()
    while rest[:1] and rest[0] in ("--keep-going", "--label") and rest[0] not in flags:
        flags.add(rest.pop(0))
    if rest[:1] != ["--"] or len(rest) < 2 or not rest[1]:
        raise ValueError(USAGE)
    return tasks, node_rank, flags, rest[1:]


def _status(code: int) -> int:
    """A shell's view of a return code: a death by signal N is 128 + N."""
    return 128 - code if code < 0 else code


class Launcher:
    def __init__(self, tasks: int, node_rank: int, keep_going: bool, command: list[str], label: bool = False):
        self.tasks, self.node_rank, self.keep_going, self.command = tasks, node_rank, keep_going, command
        self.label = label
        self.rank_of: dict[int, int] = {}  # pid -> the task's RANK
        self.partial: dict[tuple[int, int], bytes] = {}  # --label: (rank, fd) -> a line not yet ended
        self.running: dict[int, subprocess.Popen] = {}  # pid -> its task (held: a Popen dropped
        # while running would be reaped by subprocess's own clean-up, and its status lost)
        self.first = 0  # the first failing task's status
        self.signalled = 0  # the first terminating signal that came
        self.received: set[int] = set()  # every signal the group got (each task got it too)
        self.stopping = False
        self.started = 0

    def _caught(self, sig: int, _frame) -> None:
        self.received.add(sig)
        if sig in TERMINATING and not self.signalled:
            self.signalled = sig

    def _kill_rest(self, _sig: int, _frame) -> None:
        for pid in list(self.running):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _stop(self) -> None:
        """Stop the tasks still running: SIGTERM to the group (their children too), SIGKILL later."""
        if self.stopping:
            return
        self.stopping = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgrp(), signal.SIGTERM)  # this process too: caught
        signal.alarm(KILL_GRACE_S)

    def _reaped(self, pid: int, status: int) -> None:
        task = self.running.pop(pid, None)
        if task is not None:
            task.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by the Popen
            self._failed(_status(task.returncode))

    # --------------------------------------------------------------------------------------- --label
    def _write(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except OSError:
                return  # nobody reads (the rank's caller is gone): the tasks are being stopped anyway

    def _relay(self, rank: int, fd: int, data: bytes, end: bool = False) -> None:
        """``data`` from task ``rank``'s ``fd``: its complete lines, labelled (``end``: all of it)."""
        data = self.partial.pop((rank, fd), b"") + data
        lines = data.split(b"\n")
        rest = lines.pop()
        while len(rest) >= LINE_MAX:
            lines.append(rest[:LINE_MAX])
            rest = rest[LINE_MAX:]
        if rest and end:
            lines.append(rest)
        elif rest:
            self.partial[(rank, fd)] = rest
        prefix = f"{rank}: ".encode()
        if lines:
            self._write(fd, b"".join(prefix + line + b"\n" for line in lines))

    def _relay_until_done(self) -> None:
        """Read every task's pipes and reap the tasks as they end, until all ended and their pipes closed
        (or ``DRAIN_S`` after the last end, when a leftover of a task holds a pipe open)."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end wakes the select (wakeup fd)
        signal.set_wakeup_fd(wake_w)
        sel = selectors.DefaultSelector()
        sel.register(wake_r, selectors.EVENT_READ, None)
        for pid, task in self.running.items():
            for fd, pipe in ((1, task.stdout), (2, task.stderr)):
                sel.register(pipe, selectors.EVENT_READ, (self.rank_of[pid], fd))
        deadline = None
        while True:
            while self.running:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                self._reaped(pid, status)
            timeout = None
            if not self.running:
                if len(sel.get_map()) == 1:
                    break
                deadline = deadline or time.monotonic() + DRAIN_S
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
            for key, _ in sel.select(timeout):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 512)
                    continue
                rank, fd = key.data
                data = os.read(key.fd, 65536)
                if data:
                    self._relay(rank, fd, data)
                else:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self._relay(rank, fd, b"", end=True)
        for key in list(sel.get_map().values()):
            if key.data is not None:
                self._relay(*key.data, b"", end=True)
        signal.set_wakeup_fd(-1)

    def _failed(self, status: int) -> None:
        if status and not self.first:
            self.first = status
            # a task that ended by (or on) a signal every task got is no bad exit: the others are
            # handling it themselves (as the coordinator treats ranks, and srun its tasks)
            if not self.keep_going and status - 128 not in self.received:
                self._stop()

    def _start(self, local_rank: int, env: dict[str, str]) -> bool:
        rank = self.node_rank * self.tasks + local_rank
        try:
            p = subprocess.Popen(
                self.command,
                env=task_env(env, self.node_rank, self.tasks, local_rank),
                stdin=None if rank == 0 else subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.label else None,
                stderr=subprocess.PIPE if self.label else None,
            )
        except OSError as e:
            code = 127 if isinstance(e, FileNotFoundError) else 126
            why = "command not found" if code == 127 else (e.strerror or str(e))
            print(f"xpu: {self.command[0]}: {why} on {socket.gethostname()}", file=sys.stderr, flush=True)
            self.first = self.first or code
            self._stop()
            return False
        self.running[p.pid] = p
        self.rank_of[p.pid] = rank
        self.started += 1
        return True

    def run(self) -> int:
        """Start the tasks, wait for all of them; the launcher's exit status (see the module)."""
        if os.getpgrp() != os.getpid():
            with contextlib.suppress(OSError):  # a session leader already leads its group
                os.setpgid(0, 0)
        for sig in CAUGHT:
            signal.signal(sig, self._caught)
        signal.signal(signal.SIGALRM, self._kill_rest)
        env = dict(os.environ)
        for local_rank in range(self.tasks):
            if self.signalled or self.stopping or not self._start(local_rank, env):
                break
        if self.label:
            self._relay_until_done()
        while self.running:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            self._reaped(pid, status)
        signal.alarm(0)
        if self.first:
            return self.first
        return 128 + self.signalled if self.signalled and not self.started else 0


def main(args: list[str] | None = None) -> int:
    try:
        tasks, node_rank, flags, command = parse(sys.argv[1:] if args is None else args)
    except ValueError as e:
        print(f"xpu tasks: {e}", file=sys.stderr, flush=True)
        return 2
    return Launcher(tasks, node_rank, "--keep-going" in flags, command, "--label" in flags).run()


if __name__ == "__main__":
    sys.exit(main())
