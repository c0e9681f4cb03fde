"""Ranks as transient systemd units, outside xpud.service's sandbox (ProtectSystem=strict, PrivateTmp,
DevicePolicy=closed, NoNewPrivileges, RestrictAddressFamilies...), which a child process would inherit.

``systemd-run --pipe --wait`` makes a *service* unit: systemd (pid 1) starts it with the unit's own
(default, unsandboxed) settings, and ``--pipe`` hands it systemd-run's stdin/stdout/stderr, so the rank's
output still reaches us through systemd-run's pipes and its exit code comes back as systemd-run's.
(``--scope`` would not do: a scope only moves a process we forked into a cgroup, sandbox and all.)
Its processes are the unit's cgroup, not one process group: signals go by ``systemctl kill --signal``,
the stop by ``systemctl stop`` (KillMode=control-group: every process of the rank).

Pure argv builders; the caller runs them (tests record them, as tests/test_install.py does)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence

SYSTEMD_RUN = "systemd-run"
SYSTEMCTL = "systemctl"


def under_systemd(environ: Mapping[str, str] = os.environ, which: Callable = shutil.which) -> bool:
    """Whether xpud runs as a systemd service (``INVOCATION_ID`` set) and ``systemd-run`` is there."""
    return bool(environ.get("INVOCATION_ID")) and which(SYSTEMD_RUN) is not None


def unit_name(job: str, rank: int) -> str:
    """``xpu-job-JOB-rRANK.service``; the job id is hex (``secrets.token_hex``), checked here anyway."""
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,64}", job) or rank < 0:
        raise ValueError(f"job {job!r} rank {rank}: not a unit name")
    return f"xpu-job-{job}-r{rank}.service"


def run_argv(
    unit: str, argv: Sequence[str], uid: int, gid: int, cwd: str, env: Mapping[str, str]
) -> list[str]:
    """``systemd-run`` starting ``argv`` as ``uid``/``gid`` in ``cwd`` with exactly ``env``."""
    return [
        SYSTEMD_RUN,
        f"--unit={unit}",
        f"--uid={uid}",
        f"--gid={gid}",
        f"--working-directory={cwd}",
        "--property=KillMode=control-group",
        "--collect",
        "--pipe",
        "--quiet",
        "--wait",
        *(f"--setenv={k}={v}" for k, v in sorted(env.items())),
        "--",
        *argv,
    ]


def signal_argv(unit: str, sig: int) -> list[str]:
    """``sig`` to every process of the rank's unit."""
    return [SYSTEMCTL, "kill", f"--signal={int(sig)}", unit]


def stop_argv(unit: str) -> list[str]:
    """Stop the rank's unit (SIGTERM, then SIGKILL after the unit's TimeoutStopSec)."""
    return [SYSTEMCTL, "stop", unit]
