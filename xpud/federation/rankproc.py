"""One rank of a multi-host job on this host: the process the daemon starts for ``Peer.Launch``.

``run_rank(spec, inputs, on_end)`` starts ``spec.argv`` as the submitter, in ``spec.cwd``, with exactly
``spec.env``, in a process group (and session) of its own, and yields ``LaunchEvent``s: ``started``, the
output as it comes, then one ``ended``. ``inputs`` carries stdin and signals for the group.

Invariants: a rank whose pid is not durable never runs (the command is exec'd only after ``on_start``
returned); ``on_end`` is called exactly once, after the process is reaped and before ``ended``; no Python
code runs between fork and exec, and no user's environment reaches a root process (the switch first, then
the environment); under systemd the rank is a transient unit outside xpud.service's sandbox (``sysunit``).

Signals and stop sequences, backpressure, refusals and the systemd path: see docs/federation.md, Ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import pwd
import shutil
import signal
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import XpudError
from xpud.federation import sysunit
from xpud.isolation import scope, switch_user

log = logging.getLogger("xpud.federation")

CHUNK_BYTES = 64 * 1024  # the most one RankOutput carries
HIGH_WATER = 1 << 20  # output bytes waiting for the caller before the pipes stop being read
STDIN_HIGH_WATER = 1 << 20  # stdin bytes waiting for the rank before inputs stop being read
KILL_GRACE_S = 10.0  # forwarded INT/TERM/HUP/QUIT -> SIGKILL (single-host `xpu run --kill-grace`)
STOP_GRACE_S = 3.0  # the stream broke: SIGTERM -> SIGKILL
DRAIN_S = 1.0  # after the rank ended: how long to read pipes an escaped process still holds open
TERMINATING = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
ENV = sysunit.ENV  # coreutils env: --chdir after the uid switch
SH = "/bin/sh"
GATE = 'IFS= read -r go && [ "$go" = go ] || exit 125; exec "$@"'  # POSIX sh reads a pipe byte by byte
GATE_EXIT = 125

_RUNNING: dict[asyncio.Task, Rank] = {}  # supervisors, kept alive until their clean-up is done
ENV_FILE_KEEP_S = 30.0  # the longest an env file waits for its unit's process to start
_detected: list[sysunit.Units | None] = []


def default_units() -> sysunit.Units | None:
    """Ranks as systemd units here (xpud is a systemd service running as root), or None: as children."""
    if not _detected:
        _detected.append(sysunit.Units.detect())
    return _detected[0]


class Refused(XpudError):
    """The rank was not started: ``exit_code`` is what a shell would return (127 not found, 126
    otherwise). One that leaves ``hostjobs.launch`` (a rank that cannot be fenced) is answered INTERNAL,
    as before it was an XpudError."""

    code = "INTERNAL"

    def __init__(self, message: str, code: int = 126):
        super().__init__(message)
        self.exit_code = code


def remote_launch_allowed(config) -> bool:
    """``[cluster] remote_launch`` (true unless a config says false; read defensively: the key may be
    absent from an older config object)."""
    cluster = getattr(config, "cluster", None)
    return bool(getattr(cluster, "remote_launch", True))


def _host() -> str:
    return socket.gethostname()


def _argv_and_creds(
    spec: pb.LaunchSpec, gate: list[str] = (), paths: bool = True
) -> tuple[list[str], list[str], dict]:
    """``(switch, command, creds)`` for ``spec``: as root, ``switch`` is ``switch_user``'s prefix (uid, and
    gid and groups from this host's user database) and ``command`` (``env --chdir``, ``gate``, the argv) gets
    the spec's environment through switch_user's handover, after the switch; not root, ``switch`` is []
    and ``command`` runs as this daemon with the environment as it is. ``creds``: the keyword arguments of
    the process's start (its directory). Raises Refused.
    ``paths``: check the directory and the command here (not when the rank is a unit: the daemon's own
    view of the file system is its sandbox's, e.g. a private /tmp, and ``env --chdir`` in the unit says
    what is missing)."""
    argv, cwd, env = list(spec.argv), spec.cwd, dict(spec.env)
    if not argv or not argv[0]:
        raise Refused("no command given", 127)
    if not os.path.isabs(cwd):
        raise Refused(f"working directory {cwd!r}: give an absolute path")
    if paths and not os.path.isdir(cwd):
        raise Refused(
            f"working directory {cwd} does not exist on {_host()}: "
            "create it there, or run from a directory every host has (a shared file system)"
        )
    try:
        pw = pwd.getpwuid(spec.uid)
    except KeyError:
        who = f"uid {spec.uid}" + (f" ({spec.user})" if spec.user else "")
        raise Refused(
            f"{who} does not exist on {_host()}: add the user there with the same uid "
            "(or run the job from an account every host has)"
        ) from None
    if spec.user and pw.pw_name != spec.user:
        log.warning("rank of job %s: uid %d is %s here, %s on the submitting host", spec.job, spec.uid,
                    pw.pw_name, spec.user)  # fmt: skip
    program = os.path.join(cwd, argv[0]) if "/" in argv[0] else argv[0]
    if paths and shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise Refused(f"{argv[0]}: command not found on {_host()}", 127)
    euid = os.geteuid()
    if euid != 0:
        if spec.uid != euid or spec.gid not in (os.getegid(), *os.getgroups()):
            raise Refused(
                f"this daemon runs as uid {euid}, not root: it can start ranks only as itself, "
                f"not as uid {spec.uid} gid {spec.gid}"
            )
        return [], [*gate, *argv], {"cwd": cwd}
    gid, groups = host_groups(pw, spec.gid)
    if gid != spec.gid:
        log.warning("rank of job %s: gid %d asked for uid %d, not one of its groups here: gid %d instead",
                    spec.job, spec.gid, spec.uid, gid)  # fmt: skip
    switch = switch_user.argv(None if spec.uid == 0 else spec.uid, gid, groups)
    return switch, [ENV, f"--chdir={cwd}", "--", *gate, *argv], {"cwd": "/"}


def host_groups(pw: pwd.struct_passwd, asked: int) -> tuple[int, list[int]]:
    """The gid and the supplementary groups of ``pw``'s user by this host's user database: ``asked`` (the
    submitter's gid) when the user is in that group here, else the user's primary group. Never the
    caller's word alone: a peer's certificate buys no group."""
    groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    return (asked if asked in groups else pw.pw_gid), groups


def _kill_started(starting: asyncio.Future) -> None:
    """A start whose caller was cancelled: kill the group it made."""
    if not starting.cancelled() and starting.exception() is None:
        transport, _ = starting.result()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(transport.get_pid(), signal.SIGKILL)
        transport.close()


class _Pipes(asyncio.SubprocessProtocol):
    def __init__(self, rank: Rank):
        self.rank = rank

    def connection_made(self, transport) -> None:
        # before any pipe_data_received: ``started`` is always the first event
        self.rank.pgid = transport.get_pid()
        self.rank._put(pb.LaunchEvent(started=pb.LaunchStarted(pid=self.rank.pgid)))

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.rank._output(fd, data)

    def pipe_connection_lost(self, fd: int, exc) -> None:
        self.rank._pipe_closed(fd)

    def process_exited(self) -> None:
        self.rank._exited.set()

    def pause_writing(self) -> None:
        self.rank._stdin_ok.clear()

    def resume_writing(self) -> None:
        self.rank._stdin_ok.set()


class Rank:
    """One rank here. Built in a running loop: the process starts at once; ``events()`` yields its
    LaunchEvents (once), ``kill()`` stops it from outside (an abort) and waits for its end."""

    def __init__(
        self,
        spec: pb.LaunchSpec,
        inputs: AsyncIterator[pb.LaunchInput],
        on_end: Callable[[pb.RankEnded], object] | None = None,
        *,
        on_start: Callable[[int], object] | None = None,
        remote_launch: bool = True,
        attempt: int = 0,
        kill_grace_s: float = KILL_GRACE_S,
        stop_grace_s: float = STOP_GRACE_S,
        units: sysunit.Units | str | None = "detect",
        devices: Sequence[str] = (),
    ):
        self.spec, self.on_end, self.on_start = spec, on_end, on_start
        self.attempt = attempt  # the job's attempt on this host (in the unit's name)
        self._released = asyncio.Event()  # events are seen once on_start has returned (or failed)
        self._failed = ""  # on_start failed: the rank ran nothing; its end says why
        self.units = default_units() if units == "detect" else units
        self.unit = ""  # the rank's unit name, once started as one
        self.devices = tuple(devices)  # DeviceAllow= of its unit (isolation/scope.py): () = not fenced
        self._env_file: str | None = None
        self._ctl_lock = asyncio.Lock()  # systemctl calls in the order they were asked
        self._ctl_tasks: set[asyncio.Task] = set()
        self.remote_launch = remote_launch
        self.kill_grace_s, self.stop_grace_s = kill_grace_s, stop_grace_s
        self._queue: deque[pb.LaunchEvent] = deque()
        self.buffered = 0  # output bytes in ``events``
        self.paused = False
        self.ready = asyncio.Event()  # an event is waiting
        self.abandoned = asyncio.Event()  # the caller is gone or inputs broke: its output is dropped
        self._stop = asyncio.Event()  # stop the rank: SIGTERM, SIGKILL after stop_grace_s
        self._exited = asyncio.Event()
        self._stdin_ok = asyncio.Event()
        self._stdin_ok.set()
        self._open_pipes = {1, 2}
        self._pipes_closed = asyncio.Event()
        self.transport: asyncio.SubprocessTransport | None = None
        self.pgid = 0
        self._escalation: asyncio.TimerHandle | None = None
        self.task = asyncio.ensure_future(self._supervise(inputs))
        _RUNNING[self.task] = self
        self.task.add_done_callback(lambda t: _RUNNING.pop(t, None))

    # ----------------------------------------------------------------------------------- events
    def _put(self, ev: pb.LaunchEvent) -> None:
        self._queue.append(ev)
        self.ready.set()

    def _output(self, fd: int, data: bytes) -> None:
        if self.abandoned.is_set():
            return  # nobody listens: keep the pipes flowing so that the rank can die
        for i in range(0, len(data), CHUNK_BYTES):
            chunk = data[i : i + CHUNK_BYTES]
            self._put(pb.LaunchEvent(output=pb.RankOutput(rank=self.spec.rank, fd=fd, data=chunk)))
            self.buffered += len(chunk)
        if self.buffered > HIGH_WATER and not self.paused:
            self._pause(True)

    def _pause(self, pause: bool) -> None:
        self.paused = pause
        for fd in (1, 2):
            pipe = self.transport.get_pipe_transport(fd) if self.transport else None
            if pipe is not None and not pipe.is_closing():
                with contextlib.suppress(RuntimeError):  # already in that state
                    pipe.pause_reading() if pause else pipe.resume_reading()

    def _pipe_closed(self, fd: int) -> None:
        if fd == 0:
            self._stdin_ok.set()  # nothing more to wait for
        self._open_pipes.discard(fd)
        if not self._open_pipes:
            self._pipes_closed.set()

    async def next_event(self) -> pb.LaunchEvent:
        await self._released.wait()
        while not self._queue:
            self.ready.clear()
            await self.ready.wait()
        ev = self._queue.popleft()
        if ev.HasField("output"):
            self.buffered -= len(ev.output.data)
            if self.paused and self.buffered <= HIGH_WATER // 2:
                self._pause(False)
        return ev

    async def events(self) -> AsyncIterator[pb.LaunchEvent]:
        """The rank's LaunchEvents, ``ended`` last. Closing or cancelling this generator before the end
        stops the rank (the caller is gone)."""
        try:
            while True:
                ev = await self.next_event()
                yield ev
                if ev.HasField("ended"):
                    return
        finally:
            self.abandon()  # nothing if it ended; otherwise the caller is gone: stop the rank

    async def kill(self) -> None:
        """Stop the rank (SIGTERM, SIGKILL after the grace) and wait until it is reaped and ``on_end``
        has run."""
        self._stop.set()
        await asyncio.shield(self.task)

    def abandon(self) -> None:
        """The caller is gone: stop the rank; its output is dropped from now on."""
        self._stop.set()
        if not self.abandoned.is_set():
            self.abandoned.set()
            self._queue.clear()
            self.buffered = 0
            if self.paused:
                self._pause(False)

    # ----------------------------------------------------------------------------------- the process
    def signal(self, sig: int) -> None:
        """``sig`` to the rank's group (its unit); a termination signal starts the SIGKILL countdown."""
        if not 1 <= sig < signal.NSIG or not self.pgid:
            return
        if self.unit:
            self._ctl(sysunit.signal_argv(self.unit, sig))
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)
        if sig in TERMINATING and self._escalation is None:
            self._escalation = asyncio.get_running_loop().call_later(
                self.kill_grace_s, self.signal, signal.SIGKILL
            )

    async def _feed(self, inputs: AsyncIterator[pb.LaunchInput]) -> None:
        """Stdin and signals from the caller, until inputs end (stdin's end) or break (stop the rank)."""
        try:
            async for msg in inputs:
                kind = msg.WhichOneof("what")
                if kind == "stdin":
                    self._write_stdin(msg.stdin)
                    await self._stdin_ok.wait()
                elif kind == "stdin_eof":
                    self._close_stdin()
                elif kind == "signal":
                    self.signal(msg.signal)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream broke (a gRPC error): the coordinator is gone
            log.info("job %s rank %d: the launch stream broke (%s)", self.spec.job, self.spec.rank, e)
            self._stop.set()
            return
        self._close_stdin()

    def _stdin(self):
        pipe = self.transport.get_pipe_transport(0) if self.transport else None
        return None if pipe is None or pipe.is_closing() else pipe

    def _write_stdin(self, data: bytes) -> None:
        pipe = self._stdin()
        if pipe is not None and data:
            pipe.write(data)

    def _close_stdin(self) -> None:
        pipe = self._stdin()
        if pipe is not None:
            pipe.close()  # after what is buffered is written

    # ----------------------------------------------------------------------------------- as a unit
    def _ctl(self, argv: list[str]) -> None:
        """Run a systemctl command for the unit in the background, after those asked before it."""

        async def go() -> None:
            async with self._ctl_lock:
                rc, _ = await self.units.runner(argv)
            if rc != 0:
                log.info("job %s rank %d: %s: exit %d", self.spec.job, self.spec.rank, " ".join(argv[:2]), rc)

        task = asyncio.ensure_future(go())
        self._ctl_tasks.add(task)
        task.add_done_callback(self._ctl_tasks.discard)

    def _unit_argv(self, argv: list[str]) -> list[str]:
        """The systemd-run line for the rank, its env file written; raises Refused."""
        spec = self.spec
        try:
            unit = sysunit.unit_name(spec.job, spec.rank, self.attempt)
            text, dropped = sysunit.env_file_text(dict(spec.env))
            self._env_file = str(sysunit.write_env_file(self.units.env_dir, unit, text))
        except (ValueError, OSError) as e:
            raise Refused(f"cannot start the rank as a systemd unit on {_host()}: {e}") from None
        if dropped:
            log.warning("job %s rank %d: environment names systemd does not take, left out: %s",
                        spec.job, spec.rank, ", ".join(sorted(dropped))[:500])  # fmt: skip
        self.unit = unit
        names = set(spec.env) - set(dropped)
        gid = host_groups(pwd.getpwuid(spec.uid), spec.gid)[0]  # the uid exists: _argv_and_creds checked
        line = sysunit.run_argv(unit, argv, spec.uid, gid, spec.cwd, self._env_file, self.stop_grace_s, names)
        fence = scope.unit_properties(self.devices) if self.devices else []  # before "--pipe"
        return [self.units.systemd_run, *line[1:2], *fence, *line[2:]]

    async def _forget_env(self) -> None:
        """Remove the env file once systemd has read it (the unit's process started), or the rank ended,
        or after ``ENV_FILE_KEEP_S`` at the latest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ENV_FILE_KEEP_S
        for i in range(10_000):
            if self._exited.is_set() or loop.time() >= deadline:
                break
            async with self._ctl_lock:
                rc, out = await self.units.runner(sysunit.show_argv(self.unit))
            if rc == 0 and sysunit.parse_show(out).get("ExecMainPID", "0") not in ("", "0"):
                break
            polls = self.units.poll_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exited.wait(), polls[min(i, len(polls) - 1)])
        self._drop_env()

    def _drop_env(self) -> None:
        if self._env_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._env_file)
            self._env_file = None

    async def _unit_ended(self, code: int) -> pb.RankEnded:
        """The rank's end from systemd-run's exit code ``code`` (not 0: ``systemctl show`` says how the
        unit's process ended; then the failed unit is unloaded)."""
        how = None
        if code != 0:
            async with self._ctl_lock:
                rc, out = await self.units.runner(sysunit.show_argv(self.unit))
                how = sysunit.ended(sysunit.parse_show(out)) if rc == 0 else None
                await self.units.runner(sysunit.reset_argv(self.unit))
        if how is None:
            return _ended(self.spec.rank, code)
        exit_code, sig = how
        return pb.RankEnded(rank=self.spec.rank, exit_code=exit_code, signal=sig)

    async def _reaped(self, exited: asyncio.Future) -> None:
        """Wait for the process after SIGKILL. As a unit, the SIGKILL went through systemd: if systemd-run
        does not end within the grace anyway, its own session is killed (and the unit stopped)."""
        if not self.unit:
            await exited
            return
        try:
            await asyncio.wait_for(asyncio.shield(exited), self.stop_grace_s)
        except TimeoutError:
            log.error("job %s rank %d: unit %s did not stop; killing systemd-run and stopping the unit",
                      self.spec.job, self.spec.rank, self.unit)  # fmt: skip
            self._ctl(sysunit.stop_argv(self.unit))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            await exited

    # ----------------------------------------------------------------------------------- start
    async def _start(self) -> int:
        if not self.remote_launch:
            raise Refused(
                f"remote launch is disabled on {_host()} ([cluster] remote_launch = false in its xpud.toml)"
            )
        gate = [SH, "-c", GATE, "xpu-rank"] if self.on_start is not None else []
        switch, argv, creds = _argv_and_creds(self.spec, gate, paths=self.units is None)
        env, env_fd = dict(self.spec.env), None
        if self.units is not None:  # systemd switches the user and enters the directory
            argv = await asyncio.to_thread(self._unit_argv, [*gate, *self.spec.argv])  # writes the env file
            creds, env = {"cwd": "/"}, dict(sysunit.CLEAN_ENV)
        elif switch:  # setpriv runs as root: a clean environment; the user's after the switch
            try:
                env_fd = switch_user.env_file(env)
            except (OSError, ValueError) as e:
                raise Refused(f"{self.spec.argv[0]}: cannot start on {_host()}: {e}") from None
            argv = [*switch, *switch_user.handover_argv(env_fd, argv[0]), *argv[1:]]
            creds, env = {**creds, "pass_fds": (env_fd,)}, dict(switch_user.CLEAN_ENV)
        loop = asyncio.get_running_loop()
        starting = asyncio.ensure_future(
            loop.subprocess_exec(lambda: _Pipes(self), *argv, env=env, start_new_session=True, **creds)
        )
        if env_fd is not None:  # closed once the process has it (not before: its number could be reused)
            starting.add_done_callback(lambda _: os.close(env_fd))
        try:
            # shielded: asyncio's own clean-up of a cancelled start waits for the whole group's pipes
            transport, _ = await asyncio.shield(starting)
        except asyncio.CancelledError:
            self.signal(signal.SIGKILL)  # when the process exists already
            starting.add_done_callback(_kill_started)
            raise
        except FileNotFoundError as e:
            if switch_user.missing(e):
                raise Refused(f"cannot start the rank on {_host()}: {switch_user.INSTALL}") from None
            if e.filename == creds.get("cwd"):
                raise Refused(f"working directory {e.filename}: {e.strerror}") from None
            raise Refused(f"{self.spec.argv[0]}: command not found on {_host()}", 127) from None
        except PermissionError as e:
            raise Refused(f"{self.spec.argv[0]}: permission denied on {_host()} ({e.strerror})") from None
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in argv or env
            raise Refused(f"{self.spec.argv[0]}: cannot start on {_host()}: {e}") from None
        self.transport = transport
        stdin = transport.get_pipe_transport(0)
        stdin.set_write_buffer_limits(high=STDIN_HIGH_WATER)
        self.pgid = transport.get_pid()
        if self.unit:
            task = asyncio.ensure_future(self._forget_env())
            self._ctl_tasks.add(task)
            task.add_done_callback(self._ctl_tasks.discard)
        await self._open_gate()
        return self.pgid

    async def _open_gate(self) -> None:
        """``on_start(pid)``, then ``go`` to the gate; if it fails, stdin ends (the process exits having run
        nothing) and the rank is stopped with the reason. Cancelled: the caller's clean-up stops it."""
        try:
            if self.on_start is not None:
                try:
                    result = self.on_start(self.pgid)
                    if inspect.isawaitable(result):
                        await result
                except Exception as e:
                    log.error("job %s rank %d: not started: %s", self.spec.job, self.spec.rank, e)
                    self._failed = f"the rank was not started on {_host()}: {e}"[:1000]
                    self._close_stdin()
                    self._stop.set()
                    return
                self._write_stdin(b"go\n")
        finally:
            self._released.set()

    async def _supervise(self, inputs: AsyncIterator[pb.LaunchInput]) -> None:
        feeder = None
        try:
            try:
                await self._start()
            except Refused as e:
                self._released.set()
                await self._end(pb.RankEnded(rank=self.spec.rank, exit_code=e.exit_code, error=str(e)))
                return
            feeder = asyncio.ensure_future(self._feed(inputs))
            exited = asyncio.ensure_future(self._exited.wait())
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not self._exited.is_set():
                self.signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(exited), self.stop_grace_s)
                except TimeoutError:
                    self.signal(signal.SIGKILL)
                    await self._reaped(exited)
            if not self.unit:  # a unit's leftovers are systemd's (KillMode=control-group)
                self.signal(signal.SIGKILL)  # what is left of the group
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pipes_closed.wait(), DRAIN_S)
            code = self.transport.get_returncode()
            ended = await self._unit_ended(code) if self.unit else _ended(self.spec.rank, code)
            if self._failed:
                ended.error = self._failed
            await self._end(ended)
        finally:
            if self._escalation is not None:
                self._escalation.cancel()
            if feeder is not None:
                feeder.cancel()
            if self.transport is not None:
                if not self._exited.is_set():  # only when this clean-up itself was cancelled
                    self.signal(signal.SIGKILL)
                    if self.unit:
                        self._ctl(sysunit.stop_argv(self.unit))
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(self.pgid, signal.SIGKILL)  # systemd-run's own session
                self.transport.close()
            self._drop_env()
            if self._ctl_tasks:  # the last systemctl calls (a stop, a kill) finish before the rank is over
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(set(self._ctl_tasks), timeout=sysunit.RUN_TIMEOUT_S)

    async def _end(self, ended: pb.RankEnded) -> None:
        if self.on_end is not None:
            try:
                result = self.on_end(ended)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("job %s rank %d: the end hook failed", self.spec.job, self.spec.rank)
        self._put(pb.LaunchEvent(ended=ended))


def _ended(rank: int, code: int) -> pb.RankEnded:
    """A process's end from its return code (negative: killed by that signal)."""
    if code < 0:
        return pb.RankEnded(rank=rank, exit_code=128 - code, signal=-code)
    return pb.RankEnded(rank=rank, exit_code=code)


def run_rank(
    spec: pb.LaunchSpec,
    inputs: AsyncIterator[pb.LaunchInput],
    on_end: Callable[[pb.RankEnded], object] | None = None,
    **kw,
) -> AsyncIterator[pb.LaunchEvent]:
    """Run one rank (see the module's docstring); yields its LaunchEvents, ``ended`` last. ``kw``:
    ``remote_launch``, ``kill_grace_s``, ``stop_grace_s``. Call in a running loop."""
    return Rank(spec, inputs, on_end, **kw).events()


async def stop_all(timeout_s: float = STOP_GRACE_S + DRAIN_S + 2.0) -> None:
    """Stop every rank still running here and wait (up to ``timeout_s``) for their clean-up: for the
    daemon's shutdown."""
    for rank in _RUNNING.values():
        rank.abandon()
    if _RUNNING:
        await asyncio.wait(set(_RUNNING), timeout=timeout_s)
