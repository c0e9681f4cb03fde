"""Ranks as transient systemd units, outside xpud.service's sandbox (ProtectSystem=strict, PrivateTmp,
DevicePolicy=closed, NoNewPrivileges, RestrictAddressFamilies...), which a child process would inherit.

Invariants: the rank gets exactly the submitter's environment, through a 0600 ``EnvironmentFile=`` that is
removed once the unit's process runs (never on a command line, never in systemd-run's own environment); a
death by a signal is reported as one (``Type=oneshot``, read back with ``systemctl show``). Argv builders
and the file format are pure; the commands run through a ``Runner`` (``run`` by default) that tests
replace.

Why ``systemd-run --pipe --wait``, a oneshot unit, the environment file and ``env --chdir``, and how the
tests run it against a real systemd: see docs/federation.md, Ranks as systemd units.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMD_RUN = "systemd-run"
SYSTEMCTL = "systemctl"
RUN_TIMEOUT_S = 10.0  # one systemctl call
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}  # systemd-run's own environment
ENV = "/usr/bin/env"  # coreutils env: --chdir, then the PATH lookup
SET_BY_SYSTEMD = ("INVOCATION_ID", "SYSTEMD_EXEC_PID", "USER", "LOGNAME", "HOME", "SHELL", "PATH", "LANG",
                  "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_TIME", "LC_COLLATE", "LC_MONETARY",
                  "LC_MESSAGES", "LC_PAPER", "LC_NAME", "LC_ADDRESS", "LC_TELEPHONE", "LC_MEASUREMENT",
                  "LC_IDENTIFICATION")  # fmt: skip
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Runner = Callable[[Sequence[str]], Awaitable[tuple[int, str]]]  # argv -> (exit code, stdout)


def under_systemd(environ: Mapping[str, str] = os.environ, which: Callable = shutil.which) -> bool:
    """Whether xpud runs as a systemd service (``INVOCATION_ID`` set) and ``systemd-run`` is there."""
    return bool(environ.get("INVOCATION_ID")) and which(SYSTEMD_RUN) is not None


def unit_name(job: str, rank: int, attempt: int = 0) -> str:
    """``xpu-job-JOB-aATTEMPT-rRANK.service``; the job id is hex (``secrets.token_hex``), checked here
    anyway. The attempt is in the name so that a restarted job's next attempt on this host never
    collides with the unit of its last attempt while that one is still loaded (running or stopping)."""
    _check_job(job)
    if rank < 0 or attempt < 0:
        raise ValueError(f"job {job!r} attempt {attempt} rank {rank}: not a unit name")
    return f"xpu-job-{job}-a{attempt}-r{rank}.service"


def _check_job(job: str) -> None:
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,64}", job):
        raise ValueError(f"job {job!r}: not a unit name")


def run_argv(
    unit: str,
    argv: Sequence[str],
    uid: int,
    gid: int,
    cwd: str,
    env_file: str,
    stop_s: float = 3.0,
    names: Collection[str] = (),
) -> list[str]:
    """``systemd-run`` starting ``argv`` as ``uid``/``gid`` in ``cwd`` (``env --chdir``) with exactly the
    environment in ``env_file``, whose variables are ``names``; ``systemctl stop`` gives it ``stop_s``
    after SIGTERM before SIGKILL."""
    unset = [n for n in SET_BY_SYSTEMD if n not in names]
    return [
        SYSTEMD_RUN,
        f"--unit={unit}",
        f"--uid={uid}",
        f"--gid={gid}",
        f"--property=EnvironmentFile={env_file}",
        *([f"--property=UnsetEnvironment={' '.join(unset)}"] if unset else []),
        "--property=Type=oneshot",
        "--property=TimeoutStartSec=infinity",
        f"--property=TimeoutStopSec={max(int(stop_s * 1000), 1)}ms",
        "--property=KillMode=control-group",
        "--pipe",
        "--quiet",
        "--wait",
        "--",
        ENV,
        f"--chdir={cwd}",
        "--",
        *argv,
    ]


def signal_argv(unit: str, sig: int) -> list[str]:
    """``sig`` to every process of the rank's unit."""
    return [SYSTEMCTL, "kill", f"--signal={int(sig)}", unit]


def stop_argv(unit: str) -> list[str]:
    """Stop the rank's unit (SIGTERM, then SIGKILL after the unit's TimeoutStopSec)."""
    return [SYSTEMCTL, "stop", unit]


def stop_job_argv(job: str) -> list[str]:
    """Stop every rank unit of ``job`` on this host (a glob: after a daemon restart the rank is unknown)."""
    _check_job(job)
    return [SYSTEMCTL, "stop", *_job_globs(job)]


def reset_job_argv(job: str) -> list[str]:
    """Unload ``job``'s rank units that failed (a stopped oneshot fails; it would stay loaded for good)."""
    _check_job(job)
    return [SYSTEMCTL, "reset-failed", *_job_globs(job)]


def _job_globs(job: str) -> list[str]:
    """Every attempt's rank units of ``job`` (and ``xpu-job-JOB-rN``: the names before attempts were in
    them, of units a daemon of an older version started)."""
    return [f"xpu-job-{job}-a*-r*.service", f"xpu-job-{job}-r*.service"]


def show_argv(unit: str) -> list[str]:
    """How the unit's main process started and ended."""
    return [SYSTEMCTL, "show", "--property=ExecMainPID,ExecMainCode,ExecMainStatus", unit]


def reset_argv(unit: str) -> list[str]:
    """Unload a failed unit (a oneshot that failed stays loaded until this)."""
    return [SYSTEMCTL, "reset-failed", unit]


def parse_show(text: str) -> dict[str, str]:
    """``systemctl show``'s ``KEY=VALUE`` lines."""
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def ended(show: Mapping[str, str]) -> tuple[int, int] | None:
    """(exit code, signal) of the unit's main process from ``systemctl show`` (``ExecMainCode``: 1
    exited, 2 killed, 3 dumped core), or None when it does not say."""
    try:
        code, status = int(show.get("ExecMainCode", "")), int(show.get("ExecMainStatus", ""))
    except ValueError:
        return None
    if code == 1:
        return status, 0
    if code in (2, 3) and status > 0:
        return 128 + status, status
    return None


def env_file_text(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """An ``EnvironmentFile=`` holding ``env`` exactly: each value double-quoted, with ``\\``, ``"``,
    ``$`` and backquote escaped (systemd's rules for double quotes, as a POSIX shell's; newlines stay
    inside the quotes). Returns the text and the names left out (not a valid name). Raises ValueError for
    a value systemd cannot carry (NUL, U+FEFF, a noncharacter)."""
    lines, dropped = [], []
    for k, v in sorted(env.items()):
        if not _NAME.fullmatch(k):
            dropped.append(k)
            continue
        bad = next((c for c in v if c == "\0" or c == "\ufeff" or _noncharacter(c)), None)
        if bad is not None:
            raise ValueError(
                f"environment variable {k}: its value holds U+{ord(bad):04X}, which systemd refuses"
            )
        quoted = v.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
        lines.append(f'{k}="{quoted}"\n')
    return "".join(lines), dropped


def _noncharacter(c: str) -> bool:
    o = ord(c)
    return 0xFDD0 <= o <= 0xFDEF or (o & 0xFFFE) == 0xFFFE


def write_env_file(directory: Path, unit: str, text: str) -> Path:
    """``text`` in ``directory/UNIT.env``, 0600, the directory 0700 (made if missing); a file already
    there (a link, another job's) is refused."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    path = directory / f"{unit}.env"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path


async def run(argv: Sequence[str], timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, str]:
    """Run a systemctl command (no stdin, the clean environment); (exit code, stdout). A time-out or a
    missing program is an exit code too (124, 127), never an exception."""
    try:
        p = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=CLEAN_ENV,
        )
    except OSError:
        return 127, ""
    try:
        out, _ = await asyncio.wait_for(p.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        await p.wait()
        return 124, ""
    return p.returncode, out.decode(errors="replace")


@dataclass
class Units:
    """How ranks run as units here: the env files' directory, the programs, and the runner of
    systemctl. ``detect`` gives one when xpud is a systemd service running as root, else None."""

    env_dir: Path
    runner: Runner = run
    systemd_run: str = SYSTEMD_RUN
    poll_s: tuple[float, ...] = field(default=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5))  # ExecMainPID polls

    @classmethod
    def detect(cls, environ: Mapping[str, str] = os.environ) -> Units | None:
        if os.geteuid() != 0 or not under_systemd(environ):
            return None
        runtime = environ.get("RUNTIME_DIRECTORY", "/run/xpud").split(":")[0]
        return cls(Path(runtime) / "rank-env")
