"""Shared fixtures: real daemons on temp sockets, the real CLI as a subprocess."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from xpud.api.client import Client
from xpud.errors import XpudError

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _default_signal_dispositions() -> None:
    """The terminating signals back to their defaults where this run inherited them ignored (under
    ``nohup``, or as a background job of a script: SIGHUP, or SIGINT and SIGQUIT): every process the tests
    start inherits what this one has, and `xpu run` rightly keeps a signal its caller ignores ignored, so
    the tests of signals passed on to a command failed there. A test that wants one ignored says so."""
    for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        if signal.getsignal(s) is signal.SIG_IGN:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)


_default_signal_dispositions()


def xpu_env(runtime_dir: Path, **extra: str) -> dict[str, str]:
    # COLUMNS/LINES out too: tables fit a width only where one is set (tests that want one set it)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("XPUD_", "CUDA_", "XPU_")) and k not in ("COLUMNS", "LINES")
    }
    env.update(XPUD_RUNTIME_DIR=str(runtime_dir), PYTHONUNBUFFERED="1", **extra)
    return env


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


class DaemonProc:
    """A real ``xpud --simulate`` subprocess with its own runtime and state directories."""

    def __init__(
        self,
        base: Path,
        machine: str,
        config: str = "",
        args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),  # e.g. ("ip", "netns", "exec", NS): run it in a network namespace
    ):
        self.base = base
        self.prefix = prefix
        self.machine = machine
        self.runtime_dir = base / "run"
        self.state_dir = base / "state"
        self.config = base / "xpud.toml"
        self.config.write_text(config)
        self.args = args
        self.log = base / "xpud.log"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> DaemonProc:
        cmd = [
            *self.prefix,
            str(BIN / "xpud"),
            "--config",
            str(self.config),
            "--simulate",
            self.machine,
            "--runtime-dir",
            str(self.runtime_dir),
            "--state-dir",
            str(self.state_dir),
            *self.args,
        ]
        with open(self.log, "ab") as log:  # the child keeps its own copy of the descriptor
            env = xpu_env(self.runtime_dir)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"xpud exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with Client(self.runtime_dir) as c:
                    c.info()
                return
            except XpudError:
                time.sleep(0.05)
        raise TimeoutError(f"xpud not ready after {timeout} s: {self.log.read_text()[-2000:]}")

    def client(self, admin: bool = False) -> Client:
        return Client(self.runtime_dir, admin=admin)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def xpu(self, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "xpu"), *args],
            env=xpu_env(self.runtime_dir),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def xpu_popen(self, *args: str, **kw) -> subprocess.Popen:
        return subprocess.Popen([str(BIN / "xpu"), *args], env=xpu_env(self.runtime_dir), **kw)


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
    for d in made:
        d.kill(signal.SIGTERM)
    stop_job_supervisors(short_tmp)  # detached jobs outlive their daemon


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


@pytest.fixture
def inproc(short_tmp):
    """In-process daemons (``tests.inproc.InProcDaemon``): ``inproc(machine, config_text="", fake=None)``;
    all stopped at the end of the test."""
    from tests.inproc import InProcDaemon

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
