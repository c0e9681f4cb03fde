"""A simulated daemon for the benchmarks: ``xpud --simulate MACHINE`` on temp sockets, started and stopped.

Imported by the scripts beside it (``python bench/X.py`` puts this folder on the path)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from xpud.api.client import Client
from xpud.errors import XpudError

BIN = Path(sys.executable).parent


def clean_env(runtime: Path) -> dict[str, str]:
    """This environment without xpud's, CUDA's and a lease's variables, pointed at ``runtime``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUD_", "CUDA_", "XPU_"))}
    return {**env, "XPUD_RUNTIME_DIR": str(runtime)}


def start(machine: str, base: Path, config: str = "", log: Path | None = None) -> subprocess.Popen:
    """Start a daemon with ``config`` as its xpud.toml, sockets in ``base/run`` and state in ``base/state``
    (its stderr to ``log``, or nowhere); return once it serves."""
    runtime = base / "run"
    (base / "xpud.toml").write_text(config)
    cmd = [str(BIN / "xpud"), "--config", str(base / "xpud.toml"), "--simulate", machine]
    cmd += ["--runtime-dir", str(runtime), "--state-dir", str(base / "state"), "--log-level", "warning"]
    err = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (the daemon keeps it)
    proc = subprocess.Popen(cmd, env=clean_env(runtime), stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 30
    while True:
        try:
            with Client(runtime) as c:
                c.info()
            return proc
        except XpudError:
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exit {proc.returncode}" if proc.returncode is not None else "30 s"
                stop(proc)
                raise SystemExit(f"xpud --simulate {machine} did not start ({why})") from None
            time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
