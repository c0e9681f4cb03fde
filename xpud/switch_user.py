"""Start a child process as another user: ``setpriv`` (util-linux) in front of its command line.

Not Popen's ``user``/``group``/``extra_groups``: uvloop's subprocesses refuse them ("unexpected kwargs"),
so with ``[daemon] event_loop = uvloop`` (or ``auto`` with uvloop installed) no rank and no warm command
could start. One way for both loops. setpriv sets the real, effective and saved ids (the child cannot
take root back) and the supplementary groups before it execs the command.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"


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
