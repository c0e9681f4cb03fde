"""``[forecast] warm_command``: run once for a pre-provisioned slice, as ``[forecast] warm_user``, with the
slice's environment and a time limit; the outcome is one line for a "forecast" event.

The command runs with /bin/sh in ``/``, in a session of its own (a timeout kills the whole session, not
only the shell), with a small environment: PATH and LANG from the daemon, HOME/USER/LOGNAME of the user,
and the slice's variables, handed over after the user switch (``switch_user``). It never runs as root
unless ``warm_user`` says root: the default is the unprivileged ``nobody``. A daemon that is not root cannot
switch users: it runs the command as itself and the outcome says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from xpud.isolation import switch_user


@dataclass(frozen=True)
class RunAs:
    uid: int
    gid: int
    name: str
    home: str
    note: str  # "" or why it is not the configured user / that it is root


def run_as(user: str) -> RunAs:
    """Who a warm_command runs as under ``warm_user = user``. Raises LookupError for an unknown user."""
    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, OverflowError):
        raise LookupError(f"[forecast] warm_user {user!r} is not a user on this host") from None
    me = os.geteuid()
    if me != 0 and pw.pw_uid != me:
        own = pwd.getpwuid(me)
        return RunAs(me, os.getegid(), own.pw_name, own.pw_dir, f"as {own.pw_name}: xpud is not root")
    return RunAs(pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir, "as root" if pw.pw_uid == 0 else "")


# The command waits on its stdin (a pipe) until ``fence`` has put it in its slice's device scope; an end of
# file instead (the fence failed) ends it before it ran.
GATE = 'read -r _ || exit 0; exec "$@" </dev/null'


async def run(
    command: str,
    user: str,
    env: dict[str, str],
    timeout_s: float,
    fence: Callable[[int], Awaitable[object]] | None = None,
) -> str:
    """Run ``command`` and return its outcome in one line (exit status, kill, or why it did not start).
    ``fence(pid)``: put the process in the slice's device scope (``isolation/scope.py``) before the
    command starts; raising stops it unrun."""
    try:
        who = run_as(user)
    except LookupError as e:
        return f"warm_command not run: {e}"
    full = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": who.home,
        "USER": who.name,
        "LOGNAME": who.name,
        **env,
    }
    tag = f" ({who.note})" if who.note else ""
    argv, extra, env_fd = ["/bin/sh", "-c", command], {}, None
    gate_r, gate_w = os.pipe() if fence is not None else (None, None)
    if fence is not None:
        argv = ["/bin/sh", "-c", GATE, "xpu-gate", *argv]
    try:
        if who.uid != os.geteuid():  # setpriv runs as root: a clean environment; the command's after it
            env_fd = switch_user.env_file(full)
            switch = switch_user.argv(who.uid, who.gid, ())
            argv = [*switch, *switch_user.handover_argv(env_fd, argv[0]), *argv[1:]]
            full, extra = dict(switch_user.CLEAN_ENV), {"pass_fds": (env_fd,)}
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=full,
            cwd="/",
            stdin=asyncio.subprocess.DEVNULL if gate_r is None else gate_r,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            **extra,
        )
    except (OSError, ValueError) as e:
        why = switch_user.INSTALL if switch_user.missing(e) else e
        if gate_w is not None:
            os.close(gate_w)
        return f"warm_command could not start{tag}: {why}"
    finally:
        for fd in (env_fd, gate_r):
            if fd is not None:
                os.close(fd)
    if fence is not None:
        try:
            await fence(proc.pid)
        except Exception as e:
            os.close(gate_w)  # end of file: the gate exits without running the command
            await proc.wait()
            return f"warm_command not run{tag}: device isolation: {e}"
        with contextlib.suppress(OSError):
            os.write(gate_w, b"go\n")
        os.close(gate_w)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError) as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if isinstance(e, asyncio.CancelledError):
            raise
        return f"warm_command killed after {timeout_s:g} s{tag}"
    tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
    said = f": {tail[0][:200]}" if tail and proc.returncode else ""
    return f"warm_command exited {proc.returncode}{tag}{said}"
