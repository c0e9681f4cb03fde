"""Start a child process as another user: ``setpriv`` (util-linux) in front of its command line.

Not Popen's ``user``/``group``/``extra_groups``: uvloop's subprocesses refuse them ("unexpected kwargs"),
so with ``[daemon] event_loop = uvloop`` (or ``auto`` with uvloop installed) no rank and no warm command
could start. One way for both loops. setpriv sets the real, effective and saved ids (the child cannot
take root back) and the supplementary groups before it execs the command.

**The user's environment never reaches a process that runs as root.** setpriv starts as uid 0, and the
dynamic loader honours ``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ``GCONV_PATH`` ... of a root process that is not
set-uid: handed the user's environment, setpriv would load the user's library as root. So setpriv gets
``CLEAN_ENV`` only, and the user's environment travels in a memory file (``env_file``, an inherited fd, never
argv: argv is world-readable in /proc) to ``handover_argv``'s small Python program, which runs after the
switch (as the user), reads it, closes every fd above 2 (uvloop's subprocesses have no ``close_fds``: an
fd the daemon holds without close-on-exec would otherwise reach the user) and execs the command with
exactly that environment.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}  # what a root helper starts with


def reachable(path: str) -> bool:
    """Whether any user may reach ``path``: it and every directory above it open to others (o+x)."""
    p = Path(path)
    try:
        return all(q.stat().st_mode & 0o001 for q in (p, *p.parents))
    except OSError:
        return False


def readable(path: str) -> bool:
    """Whether any user may read the file ``path``: it readable by others (o+r) and every directory above it
    open to others (o+x)."""
    p = Path(path)
    try:
        return bool(p.stat().st_mode & 0o004) and all(q.stat().st_mode & 0o001 for q in p.parents)
    except OSError:
        return False


def _interpreter() -> str:
    """The Python that runs ``HANDOVER`` as the user: this daemon's own (not a venv's link to it), where
    every user may run it and read its library; else the system's ``python3`` (e.g. a Python under /root)."""
    own = os.path.realpath(sys.executable)
    if reachable(own) and reachable(sysconfig.get_paths()["stdlib"]):
        return own
    return next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if reachable(p)), own)


# -I -S: no PYTHON* variables, no site, no user directory: nothing of the caller's is imported. Python 3.6+.
PYTHON = _interpreter()

HANDOVER = """\
import os, sys
fd, off, parts = int(sys.argv[1]), 0, []
while True:
    chunk = os.pread(fd, 1 << 16, off)
    if not chunk:
        break
    parts.append(chunk)
    off += len(chunk)
os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the env file, and what uvloop let through (no close_fds)
env = dict(e.split(b"=", 1) for e in b"".join(parts).split(b"\\0") if b"=" in e)
try:
    os.execve(sys.argv[2], sys.argv[2:], env)
except OSError as e:
    sys.stderr.write(f"xpu: cannot start {sys.argv[2]}: {e.strerror}\\n")
    sys.exit(127 if isinstance(e, FileNotFoundError) else 126)
"""


def argv(uid: int | None, gid: int, groups: Sequence[int]) -> list[str]:
    """The prefix that runs a command with group ``gid`` and supplementary ``groups`` (none: cleared), and
    as ``uid`` unless it is None (the groups only)."""
    line = [SETPRIV]
    if uid is not None:
        line.append(f"--reuid={uid}")
    line.append(f"--regid={gid}")
    line.append(f"--groups={','.join(str(g) for g in dict.fromkeys(groups))}" if groups else "--clear-groups")
    return [*line, "--"]


def missing(e: OSError) -> bool:
    """Whether ``e`` (from starting a process) says setpriv itself is not installed."""
    return isinstance(e, FileNotFoundError) and e.filename == SETPRIV


INSTALL = "setpriv is not installed here (util-linux): install it to run commands as other users"


def env_bytes(env: Mapping[str, str]) -> bytes:
    """``env`` as NUL-separated ``NAME=value`` entries. Raises ValueError for a NUL byte, an empty name or a
    name with ``=`` (as starting a process with such an environment would)."""
    out = []
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ValueError(f"environment variable {k[:40]!r}: embedded null byte or bad name")
        out.append(f"{k}={v}".encode(errors="surrogateescape"))
    return b"".join(e + b"\0" for e in out)


def env_file(env: Mapping[str, str]) -> int:
    """An fd (a memory file, gone with its last fd) holding ``env`` for ``handover_argv``: pass it to the
    process (``pass_fds``), then close it. Raises ValueError as ``env_bytes``."""
    data = memoryview(env_bytes(env))
    fd = os.memfd_create("xpu-env", os.MFD_CLOEXEC)
    try:
        while data:
            data = data[os.write(fd, data) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def handover_argv(fd: int, program: str) -> list[str]:
    """What follows setpriv's prefix: exec ``program`` (an absolute path; its arguments follow) with the
    environment in ``fd`` (``env_file``), as the switched user."""
    return [PYTHON, "-I", "-S", "-c", HANDOVER, str(fd), program]
