"""The per-job supervisor: a small root process that outlives the daemon, runs one job and records its end.

``launch`` writes the job's spec (its environment included) to a 0600 file in the daemon's state
directory and starts ``SUPERVISOR`` (``python -I -S``: nothing of a user's is imported) with a clean,
fixed environment, in a session of its own. Outside systemd it double-forks (the daemon's child exits once
the supervisor has recorded itself), so no signal to the daemon's group and no death of the daemon reaches
it; under systemd it is started as a transient unit (``systemd-run``) instead, so that stopping or
restarting xpud.service (KillMode=control-group) does not stop it either.

The supervisor reads and removes the spec, then starts the job in a session of its own: ``setpriv`` to the
user's uid, gid and groups (``xpud.isolation.switch_user``; as root only), then ``JOB_HANDOVER`` *as the
user*: it enters the job's directory, opens the output file(s) (so a path the user may not write is never
written), puts /dev/null on stdin and execs the command with the user's environment (read from a memory
file: the environment never passes through a process that runs as root, and never through argv).

The supervisor's status file (``<id>.status``, JSON, replaced atomically with fsync) says ``running`` with
the job's pid, then the end: ``completed`` (exit 0), ``failed`` (exit code or signal), ``cancelled``
(SIGTERM to the supervisor: TERM to the job's group, KILL after the grace) or ``timeout`` (its time
limit: the same). The daemon reads it while it runs and after a restart; a status file that never reached
an end, with its supervisor gone, is a lost job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from xpud.isolation import switch_user

CLEAN_ENV = switch_user.CLEAN_ENV
START_TIMEOUT_S = 10.0  # the longest the daemon waits for a supervisor to record itself

JOB_HANDOVER = r"""
import os, sys
fd, how, out, err, cwd = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
argv = sys.argv[6:]
off, parts = 0, []
while True:
    chunk = os.pread(fd, 1 << 16, off)
    if not chunk:
        break
    parts.append(chunk)
    off += len(chunk)
os.close(fd)
env = dict(e.split(b"=", 1) for e in b"".join(parts).split(b"\0") if b"=" in e)
def fail(msg, code):
    os.write(2, (msg + "\n").encode(errors="replace"))
    os._exit(code)
try:
    os.chdir(cwd)
except OSError as e:
    fail(f"cannot enter {cwd}: {e.strerror}", 126)
flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if how == "a" else os.O_TRUNC)  # a: a restart
try:
    o = os.open(out, flags, 0o644)
    e = os.open(err, flags, 0o644) if err else o
except OSError as x:
    fail(f"cannot write {x.filename}: {x.strerror}", 126)
nul = os.open("/dev/null", os.O_RDONLY)
report = os.dup(2)  # close-on-exec: the supervisor hears of a command that cannot start
os.dup2(nul, 0)
os.dup2(o, 1)
os.dup2(e, 2)
os.closerange(3, report)
os.closerange(report + 1, os.sysconf("SC_OPEN_MAX"))
try:
    os.execvpe(argv[0], argv, env)
except OSError as x:
    msg = f"xpu: cannot start {argv[0]}: {x.strerror}\n".encode(errors="replace")
    os.write(2, msg)
    os.write(report, msg)
    os._exit(127 if isinstance(x, FileNotFoundError) else 126)
"""

SUPERVISOR = r"""
import json, os, signal, sys, time
def write(path, doc):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(doc).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    d = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(d)
    finally:
        os.close(d)
spec_path = sys.argv[1]
with open(spec_path) as f:
    spec = json.load(f)
os.unlink(spec_path)  # it holds the user's environment: gone once read
status = spec["status"]
if spec["detach"]:
    r, w = os.pipe()
    if os.fork():
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
doc = {"supervisor": os.getpid(), "state": "starting"}
write(status, doc)
if spec["detach"]:
    os.write(w, b"x")
    os.close(w)
    nul = os.open("/dev/null", os.O_RDWR)
    for n in (0, 1, 2):
        os.dup2(nul, n)
watched = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
signal.pthread_sigmask(signal.SIG_BLOCK, watched)
env = spec["env"]
data = b"".join(f"{k}={v}".encode(errors="surrogateescape") + b"\0" for k, v in env.items())
env_fd = os.memfd_create("xpu-env", 0)
while data:
    data = data[os.write(env_fd, data):]
rep_r, rep_w = os.pipe()
argv = [*spec["prefix"], spec["python"], "-I", "-S", "-c", spec["handover"], str(env_fd),
        "a" if spec.get("append") else "w", spec["output"], spec["error"], spec["cwd"], *spec["argv"]]
started = time.time()
pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        for s in (signal.SIGPIPE, signal.SIGXFSZ, *watched):
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        nul = os.open("/dev/null", os.O_RDWR)
        os.dup2(nul, 0)
        os.dup2(nul, 1)
        os.dup2(rep_w, 2)
        os.set_inheritable(env_fd, True)
        os.closerange(3, env_fd)
        os.closerange(env_fd + 1, os.sysconf("SC_OPEN_MAX"))
        os.execv(argv[0], argv)
    except BaseException as e:
        os.write(2, f"xpu: cannot start the job: {e}\n".encode(errors="replace"))
    os._exit(126)
os.close(rep_w)
os.close(env_fd)
doc.update(state="running", pid=pid, started=started)
write(status, doc)
limit, grace = spec["time_limit_s"], spec["kill_grace_s"]
deadline = started + limit if limit > 0 else None
ending, kill_at = None, None
def stop(why):
    global ending, kill_at
    ending, kill_at = why, time.time() + grace
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        pass
while True:
    now = time.time()
    wake = [3600.0]
    if deadline is not None and ending is None:
        wake.append(deadline - now)
    if kill_at is not None:
        wake.append(kill_at - now)
    info = signal.sigtimedwait(watched, max(min(wake), 0.001))
    got, st = os.waitpid(pid, os.WNOHANG)
    if got:
        break
    now = time.time()
    if info is not None and info.si_signo == signal.SIGTERM and ending is None:
        stop("cancelled")
    if deadline is not None and ending is None and now >= deadline:
        stop("timeout")
    if kill_at is not None and now >= kill_at:
        kill_at = None
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
ended = time.time()
try:
    os.killpg(pid, signal.SIGKILL)  # what the job left behind in its session
except OSError:
    pass
os.set_blocking(rep_r, False)
try:
    said = os.read(rep_r, 4096).decode(errors="replace").strip().splitlines()
except OSError:
    said = []
code = os.waitstatus_to_exitcode(st)
doc.update(ended=ended)
if code < 0:
    doc["exit_signal"] = -code
else:
    doc["exit_code"] = code
doc["state"] = ending or ("completed" if code == 0 else "failed")
doc["reason"] = said[-1] if said else ""
write(status, doc)
"""


def status_path(directory: Path, job_id: str) -> Path:
    return directory / f"{job_id}.status"


def read_status(directory: Path, job_id: str) -> dict | None:
    """The supervisor's last word on ``job_id`` (None: none yet, or unreadable)."""
    try:
        doc = json.loads(status_path(directory, job_id).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def supervisor_alive(pid: int, job_id: str) -> bool:
    """Whether ``pid`` is still the supervisor of ``job_id`` (not a process that reused its pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                return False
    except OSError:
        return False
    return f"{job_id}.spec".encode() in cmdline


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode(errors="surrogateescape"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def unit_name(job_id: str) -> str:
    return f"xpu-submit-{job_id}.service"


async def launch(
    directory: Path,
    job_id: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    output: str,
    error: str,
    switch: Sequence[str],
    time_limit_s: float,
    kill_grace_s: float,
    systemd_run: str | None = None,
    properties: Sequence[str] = (),
    append: bool = False,
) -> dict:
    """Start the supervisor of ``job_id`` and wait until it has recorded itself; its status (with
    ``supervisor``, its pid). ``switch``: setpriv's prefix (as root), or [] to run as this process's user.
    ``systemd_run``: start it as a transient unit through that program, with ``properties`` (``systemd-run
    --property=`` arguments: the lease's device fence, ``isolation/scope.unit_properties``). ``append``: to
    the output file(s) (a restart), not over them. Raises OSError."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    switch_user.env_bytes(env)  # a bad environment is refused here (ValueError), not in the supervisor
    spec_path = directory / f"{job_id}.spec"
    status = status_path(directory, job_id)
    with contextlib.suppress(FileNotFoundError):
        status.unlink()
    spec = {
        "status": str(status),
        "detach": systemd_run is None,
        "env": dict(env),
        "argv": list(argv),
        "cwd": cwd,
        "output": output,
        "error": error,
        "prefix": list(switch),
        "python": switch_user.PYTHON if switch else sys.executable,
        "handover": JOB_HANDOVER,
        "time_limit_s": float(time_limit_s),
        "kill_grace_s": float(kill_grace_s),
        "append": bool(append),
    }
    _write_private(spec_path, json.dumps(spec))
    line = [sys.executable, "-I", "-S", "-c", SUPERVISOR, str(spec_path)]
    if systemd_run is not None:
        line = [systemd_run, f"--unit={unit_name(job_id)}", "--collect", "--quiet",
                "--property=KillMode=mixed", *properties, "--", *line]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *line,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env=dict(CLEAN_ENV),
        cwd="/",
    )
    _, err = await proc.communicate()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    while True:
        doc = read_status(directory, job_id)
        if doc is not None and doc.get("supervisor"):
            return doc
        if loop.time() > deadline or (proc.returncode and systemd_run is None):
            with contextlib.suppress(FileNotFoundError):
                spec_path.unlink()
            said = err.decode(errors="replace").strip().splitlines()
            raise OSError(f"the job's supervisor did not start: {said[-1] if said else proc.returncode}")
        await asyncio.sleep(0.02)
