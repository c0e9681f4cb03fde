"""Shared fixtures: real daemons on temp sockets (tests/daemons.py), the real CLI as a subprocess."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from tests.daemons import BIN, DaemonProc, InProcDaemon, stop_all, xpu_env

__all__ = ["BIN", "ROOT", "alive", "poll", "wait_until", "xpu_env"]  # BIN, xpu_env: from tests.daemons

ROOT = Path(__file__).resolve().parents[1]


def _default_signal_dispositions() -> None:
    """The terminating signals back to their defaults where this run inherited them ignored (under
    ``nohup``, or as a background job of a script: SIGHUP, or SIGINT and SIGQUIT): every process the tests
    start inherits what this one has, and `xpu run` rightly keeps a signal its caller ignores ignored, so
    the tests of signals passed on to a command failed there. A test that wants one ignored says so."""
    for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        if signal.getsignal(s) is signal.SIG_IGN:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)


_default_signal_dispositions()


def poll(pred, timeout: float, step: float = 0.02):
    """``pred()``'s first true value within ``timeout`` seconds, else its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return pred()


def wait_until(pred, timeout: float = 10.0, step: float = 0.02):
    """Like ``poll``, but a condition still false at the end fails the test."""
    v = poll(pred, timeout, step)
    if not v:
        raise AssertionError(f"condition not met in {timeout} s")
    return v


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def short_tmp():
    """A short temporary directory (Unix socket paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="xpu-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def stop_job_supervisors(under: Path) -> None:
    """SIGTERM to the supervisors of detached jobs (``xpud.jobs.supervisor``) whose daemon's state is under
    ``under``: they outlive their daemon by design, so a test's jobs are ended with the test (each
    supervisor TERMs its job's group, then KILLs it after the job's grace)."""
    marker = f"{under}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and b"/jobs/" in cmdline and cmdline.rstrip(b"\0").endswith(b".spec"):
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGTERM)


@pytest.fixture
def daemon_factory(short_tmp):
    made: list[DaemonProc] = []

    def make(
        machine: str = "pcie-8x-l40s",
        config: str = "[leases]\ngrace_s = 30.0\n",
        start: bool = True,
        name: str = "d",
        args: tuple[str, ...] = (),
    ) -> DaemonProc:
        base = short_tmp / f"{name}{len(made)}"
        base.mkdir()
        d = DaemonProc(base, machine, config, args)
        made.append(d)
        return d.start() if start else d

    yield make
    stop_all(made)
    stop_job_supervisors(short_tmp)  # detached jobs outlive their daemon


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


@pytest.fixture
def inproc(short_tmp):
    """In-process daemons (``tests.daemons.InProcDaemon``): ``inproc(machine, config_text="", fake=None)``;
    all stopped at the end of the test."""
    made = []

    def make(machine, config_text="", fake=None, name="d"):
        base = short_tmp / f"{name}{len(made)}"
        base.mkdir()
        d = InProcDaemon(base, machine, config_text, fake)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
