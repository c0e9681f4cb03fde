"""The one way xpud runs NVIDIA command-line tools (``nvidia-cuda-mps-control``, ``nvidia-smi``).

Isolation backends never spawn processes themselves: they call a ``Runner``. On real hardware it is
``CommandRunner`` (subprocess, with a timeout); in simulated mode and in tests it is
``xpud.isolation.faketools.FakeNvidiaTools``, which plays the tools' documented behaviour against the fake
NVML and records every call.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from xpud.errors import Conflict


@dataclass(frozen=True)
class Completed:
    """What a tool run gave: its exit status (127: not found, 124: timed out) and its output."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def lines(self) -> list[str]:
        return [line.strip() for line in self.stdout.splitlines() if line.strip()]


class ToolError(Conflict):
    """An NVIDIA tool failed; the message has the command, its status and what it said."""


class Runner(Protocol):
    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
        timeout_s: float = 30.0,
        detach: bool = False,
    ) -> Completed:
        """Run ``argv`` with ``env`` added to the daemon's environment and ``input`` on stdin.

        ``detach``: the tool starts a daemon of its own (``nvidia-cuda-mps-control -d``); its output is not
        captured, so the daemon it leaves behind cannot hold our pipes open.
        """


def check(done: Completed) -> Completed:
    """``done`` if it succeeded; otherwise raise ToolError with what the tool said."""
    if done.ok:
        return done
    said = (done.stderr or done.stdout).strip().replace("\n", "; ")
    raise ToolError(f"`{' '.join(done.argv)}` failed (status {done.returncode}){': ' + said if said else ''}")


class CommandRunner:
    """Runs the real tools with subprocess."""

    def which(self, tool: str) -> str | None:
        """Where ``tool`` is on PATH, or None (``xpud doctor``)."""
        return shutil.which(tool)

    def run(self, argv, *, env=None, input=None, timeout_s=30.0, detach=False) -> Completed:
        argv = tuple(argv)
        full_env = {**os.environ, **(env or {})}
        try:
            if detach:
                # The tool forks its daemon and exits; the daemon must not inherit our pipes or our
                # process group (a signal to the daemon's group must not reach it).
                with tempfile.TemporaryFile("w+") as err:
                    rc = subprocess.run(
                        argv,
                        env=full_env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        timeout=timeout_s,
                        start_new_session=True,
                    ).returncode
                    err.seek(0)
                    return Completed(argv, rc, "", err.read())
            done = subprocess.run(
                argv, env=full_env, input=input, capture_output=True, text=True, timeout=timeout_s
            )
            return Completed(argv, done.returncode, done.stdout, done.stderr)
        except FileNotFoundError:
            return Completed(argv, 127, "", f"{argv[0]}: not found: install the NVIDIA driver's utilities")
        except subprocess.TimeoutExpired:
            return Completed(argv, 124, "", f"{argv[0]}: no answer in {timeout_s:g} s")
