"""The one test-daemon helper: a real xpud on simulated hardware in its own directories, in two flavours.

- ``DaemonProc``: ``xpud --simulate`` as a subprocess (what an operator runs; signals, restarts, crashes).
- ``InProcDaemon``: the same ``Daemon`` class on its own event loop in a thread of the test process, so a
  test can read the fake NVML and the simulated NVIDIA tools it drives, or run code on its loop (``call``).

Both lay out ``base/`` alike (``run/`` the runtime directory with the sockets, ``state/`` the ledger,
``xpud.toml`` the config), take the config as TOML text, and hand out clients and ``xpu`` subprocesses the
same way. The fixtures ``daemon``, ``daemon_factory`` and ``inproc`` (tests/conftest.py) make and stop them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from xpud import config
from xpud.api.client import Client
from xpud.errors import XpudError

BIN = Path(sys.executable).parent


def xpu_env(runtime_dir: Path, **extra: str) -> dict[str, str]:
    # COLUMNS/LINES out too: tables fit a width only where one is set (tests that want one set it)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("XPUD_", "CUDA_", "XPU_")) and k not in ("COLUMNS", "LINES")
    }
    env.update(XPUD_RUNTIME_DIR=str(runtime_dir), PYTHONUNBUFFERED="1", **extra)
    return env


class _TestDaemon:
    """What both flavours share: the directories, the config file, clients and ``xpu`` subprocesses."""

    def __init__(self, base: Path, machine: str, config_text: str):
        self.base = base
        self.machine = machine
        self.runtime_dir = base / "run"
        self.state_dir = base / "state"
        self.config = base / "xpud.toml"
        self.config.write_text(config_text)

    def client(self, admin: bool = False) -> Client:
        return Client(self.runtime_dir, admin=admin)

    def xpu(self, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """The real ``xpu`` CLI against this daemon, to completion."""
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


class DaemonProc(_TestDaemon):
    """A real ``xpud --simulate`` subprocess; ``start()`` it (and waits until it answers)."""

    def __init__(
        self,
        base: Path,
        machine: str,
        config: str = "",
        args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),  # e.g. ("ip", "netns", "exec", NS): run it in a network namespace
    ):
        super().__init__(base, machine, config)
        self.prefix = prefix
        self.args = args
        self.log = base / "xpud.log"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> DaemonProc:
        assert not self.alive(), f"{self.base}: its xpud runs already (a second start would leak the first)"
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

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def stop_all(daemons, sig: int = signal.SIGTERM) -> None:
    """Stop several daemons at once: every one is signalled before any is waited for."""
    for d in daemons:
        if d.proc and d.proc.poll() is None:
            d.proc.send_signal(sig)
    for d in daemons:
        if d.proc is not None:
            d.proc.wait(10)


class InProcDaemon(_TestDaemon):
    """A real daemon in this process, started at construction on its own loop in a background thread.

    ``fake``: the simulated cards of a previous daemon (a restart without a reboot); by default the
    machine's fresh ones. ``stop()`` it (the ``inproc`` fixture does)."""

    def __init__(self, base: Path, machine: str, config_text: str = "", fake=None):
        from xpud.daemon.app import Daemon, open_hardware

        super().__init__(base, machine, config_text)
        cfg = config.parse(config_text, str(self.config))
        cfg = cfg.replace("devices", backend="simulated", machine=machine)
        self.cfg = cfg.replace("daemon", runtime_dir=str(self.runtime_dir), state_dir=str(self.state_dir))
        if fake is None:
            self.hw, self.fake = open_hardware(self.cfg)
        else:
            from xpud.hw.nvml import Nvml

            self.fake = fake
            self.hw = Nvml(fake)
            self.hw.open()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=f"xpud {machine}")
        self.thread.start()
        self.daemon = Daemon(self.cfg, self.hw, self.fake)
        self.call_async(self.daemon.start())

    @property
    def engine(self):
        return self.daemon.engine

    @property
    def tools(self):
        return self.daemon.tools

    def call_async(self, coro, timeout: float = 30.0):
        """Run the coroutine on the daemon's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args, timeout: float = 30.0):
        """Run ``fn(*args)`` on the daemon's loop (engine state is only consistent there); a coroutine it
        returns is awaited there."""

        async def go():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return self.call_async(go(), timeout)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.call_async(self.daemon.stop())

            async def settle():  # let cancelled streams finish before the loop goes
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            self.call_async(settle())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
