"""`xpu run` supervision: signals passed on to the command's group, SIGKILL after the grace, nothing left of
the group after the end, and on a terminal: Ctrl-C, reading, Ctrl-Z and `fg`, the queue position line."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from tests.conftest import BIN, alive, wait_until, xpu_env

XPU = str(BIN / "xpu")


def start(daemon, script: str, *opts: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [XPU, "run", "-m", "vxpu-quarter", *opts, "--", "sh", "-c", script],
        env=xpu_env(daemon.runtime_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


TRAPPER = 'trap "echo got-{name}; exit {code}" {name}; echo ready; while :; do sleep 0.05; done'


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGTERM, 41), (signal.SIGINT, 42), (signal.SIGHUP, 43), (signal.SIGUSR1, 44)]
)
def test_signals_to_the_wrapper_reach_the_command(daemon, sig, code):
    name = sig.name.removeprefix("SIG")
    p = start(daemon, TRAPPER.format(name=name, code=code))
    assert p.stdout.readline() == b"ready\n"
    p.send_signal(sig)
    out, err = p.communicate(timeout=20)
    assert (p.returncode, out) == (code, f"got-{name}\n".encode()), err


def test_a_command_that_ignores_sigterm_gets_sigkill_after_the_grace(daemon):
    p = start(daemon, 'trap "" TERM; echo ready; while :; do sleep 0.05; done', "--kill-grace", "0.6")
    assert p.stdout.readline() == b"ready\n"
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    p.wait(20)
    took = time.monotonic() - t
    assert p.returncode == -signal.SIGKILL and 0.6 <= took < 2.0, took
    with daemon.client() as c:
        assert list(c.leases().leases) == []


def test_nothing_of_the_command_s_group_outlives_it(daemon):
    p = start(daemon, "sleep 300 & echo $!; sleep 300 & echo $!; exit 5")
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 5
    pids = [int(x) for x in out.split()]
    wait_until(lambda: not any(alive(x) for x in pids), timeout=3)


def test_a_killed_wrapper_takes_the_whole_group_with_it(daemon):
    p = start(daemon, "sleep 300 & echo $!; echo $$; wait")
    grandchild, child = int(p.stdout.readline()), int(p.stdout.readline())
    assert alive(child) and alive(grandchild)
    p.kill()
    p.wait()
    # both by the guard that leads their process group and outlives the wrapper
    wait_until(lambda: not alive(child) and not alive(grandchild), timeout=3)


# ------------------------------------------------------------------------------------- a terminal
TAKE_TTY = (
    "import fcntl, os, sys, termios\n"
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


class Terminal:
    """The wrapper as the session leader of a new pseudo-terminal, as a login shell would start it."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.master, slave = os.openpty()
        # NOFLSH: on Ctrl-C the line discipline signals the foreground group and then, without NOFLSH,
        # discards the output not yet read (linux drivers/tty/n_tty.c, isig()). Under load the command's
        # handler can write "got-int" before that flush runs, and the test lost it (seen in CI); the
        # terminal's signals, which are what is tested here, are the same with the flag.
        attrs = termios.tcgetattr(slave)
        attrs[3] |= termios.NOFLSH
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        # The new session takes the terminal in a tiny exec'd helper, not in a preexec_fn: a fork that runs
        # Python code in the child of this multi-threaded test process (gRPC) was seen to hang.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TAKE_TTY, *argv],
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        self.seen = b""

    def expect(self, text: bytes, timeout: float = 15.0) -> bytes:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not seen; got {self.seen!r}; {self.session()}")
            r, _, _ = select.select([self.master], [], [], left)
            if r:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:  # the other side closed
                    code = self.proc.poll()
                    raise AssertionError(
                        f"{text!r} not seen (terminal closed, exit {code}); got {self.seen!r}"
                    ) from None
        return self.seen

    def session(self) -> str:
        """The processes of the terminal's session: pid, name, state, group and the terminal's
        foreground group, as /proc shows them (what a failure needs to be understood)."""
        rows = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session tty_nr tpgid ...
            if int(fields[3]) == self.proc.pid:
                masks = ""
                with contextlib.suppress(OSError), open(f"/proc/{entry}/status") as f:
                    masks = " ".join(
                        line.split()[0] + line.split()[1].lstrip("0")
                        for line in f
                        if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
                    )
                rows.append(f"{entry} {name} {fields[0]} pgrp={fields[2]} tpgid={fields[5]} {masks}")
        return "session: " + ", ".join(rows)

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminal():
    made = []

    def make(argv, env):
        t = Terminal(argv, env)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


# The commands on the terminal are Python, not sh: dash vforks for each command, and a terminal signal that
# lands between its vfork and exec is lost (Ctrl-C) or hangs the shell in vfork (Ctrl-Z), with or without
# xpu in between.
PY_INT = (
    "import signal, sys, time\n"
    "def bye(*_):\n"
    "    print('got-int', flush=True)\n"
    "    sys.exit(EXIT)\n"
    "signal.signal(signal.SIGINT, bye)\n"
    "print('ready', flush=True)\n"
)
# The command waits in short sleeps, never one long one: CPython runs a Python signal handler between
# bytecodes, and time.sleep() does not look for one before it starts to sleep. A Ctrl-C that landed after
# the last look and before the sleep began waited out the whole sleep. That is what the failures in CI and
# here under load looked like: every process asleep, the terminal's foreground group the command's.
WAIT = "while True:\n    time.sleep(0.05)\n"


def test_ctrl_c_and_reading_the_terminal_reach_the_command_directly(daemon, terminal):
    code = PY_INT.replace("EXIT", "5") + "print('read:' + input(), flush=True)\n" + WAIT
    argv = [XPU, "run", "-m", "vxpu-quarter", "--", sys.executable, "-c", code]
    t = terminal(argv, xpu_env(daemon.runtime_dir))
    t.expect(b"ready")
    t.send(b"hello\n")  # the command reads the terminal: it is the foreground group (no SIGTTIN stop)
    t.expect(b"read:hello")
    t.send(b"\x03")  # Ctrl-C: the terminal signals the foreground group, the command's
    t.expect(b"got-int")
    assert t.proc.wait(15) == 5


def test_ctrl_z_stops_wrapper_and_command_and_continue_resumes_both(daemon, terminal):
    code = PY_INT.replace("EXIT", "6") + WAIT
    argv = [XPU, "run", "-m", "vxpu-quarter", "--", sys.executable, "-c", code]
    t = terminal(argv, xpu_env(daemon.runtime_dir))
    t.expect(b"ready")
    t.send(b"\x1a")  # Ctrl-Z
    _, status = os.waitpid(t.proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status)  # a job-control shell would now show "Stopped"
    os.killpg(t.proc.pid, signal.SIGCONT)  # `fg`: the wrapper's group continues; it resumes the command
    time.sleep(0.3)
    t.send(b"\x03")
    t.expect(b"got-int")
    assert t.proc.wait(15) == 6


def test_the_queue_position_is_shown_on_a_terminal(daemon, terminal):
    with daemon.client() as c:
        g = c.acquire_lease("xpu", gpus=8)
        t = terminal(
            [XPU, "run", "-m", "vxpu-half", "--wait", "60", "--", "echo", "ran"], xpu_env(daemon.runtime_dir)
        )
        t.expect(b"queued for vxpu-half: position 1 of 1")
        t.expect(b"waited 1 s")  # redrawn every second
        c.release(g.lease.id, g.token)
    t.expect(b"ran")
    assert t.proc.wait(15) == 0
    assert b"\r\x1b[K" in t.seen  # the line was cleared before the command ran


def test_queue_progress_without_a_terminal_and_ctrl_c_while_queued(daemon):
    with daemon.client() as c:
        g = c.acquire_lease("xpu", gpus=8)
        p = start(daemon, "echo ran", "--wait", "60")
        line = p.stderr.readline()
        assert line.startswith(b"xpu: queued for vxpu-quarter: position 1 of 1"), line
        p.send_signal(signal.SIGINT)  # leave the queue, end as interrupted
        assert p.wait(15) == -signal.SIGINT
        assert b"xpu: left the queue (ticket " in p.stderr.read()
        wait_until(lambda: list(c.leases().queue) == [], timeout=5)
        c.release(g.lease.id, g.token)


class _Racy(list):
    """The handler's list, where a second signal lands (the handler runs between any two bytecodes) while
    ``pop`` is reading it: once, at the first read, whichever way it reads."""

    fired = False

    def _land(self) -> None:
        if not self.fired:
            self.fired = True
            self.append(signal.SIGINT)

    def __iter__(self):
        items = list(super().__iter__())
        self._land()
        return iter(items)

    def pop(self, i=-1):
        value = super().pop(i)
        self._land()
        return value


def test_a_signal_that_lands_while_the_loop_collects_signals_is_not_lost():
    """`pop` copied the list then cleared it: a Ctrl-C landing in between was never passed on (the
    command ran on, so did the wrapper; seen once in CI as a 20 s hang after SIGINT)."""
    from xpu_cli.run import Signals, Wakeup

    wake = Wakeup()
    try:
        s = Signals(wake)
        s.received = _Racy([signal.SIGTERM])
        assert s.pop() + s.pop() == [signal.SIGTERM, signal.SIGINT]
    finally:
        wake.close()
