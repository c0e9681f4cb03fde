"""`xpu run`: lease, hold, run the command with the lease's environment, pass its exit code on, release.

The child runs in its own process group. SIGINT, SIGTERM and SIGHUP sent to the wrapper go to that
group; if the child is still alive ``--kill-grace`` seconds later it gets SIGKILL. On a terminal the
child's group becomes the foreground group, so Ctrl-C, Ctrl-Z and reading stdin behave as if the command
ran directly. The exit code is the child's (128 + signal number when a signal ended it). If the wrapper
itself is killed, the child gets SIGKILL too (PR_SET_PDEATHSIG) and the daemon reclaims the lease after
its grace period.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time

import grpc

from xpud.api.client import Client
from xpud.errors import NoCapacity, NotFound, XpudError

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec: a syscall, nothing else
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Holder(threading.Thread):
    """Keeps the lease's Hold stream open (reconnecting across daemon restarts); queues its events."""

    def __init__(self, client: Client, lease_id: str, token: str, first_call=None, reconnect_s=120.0):
        super().__init__(daemon=True, name="xpu-hold")
        self.client, self.lease_id, self.token = client, lease_id, token
        self.reconnect_s = reconnect_s
        self.events: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._call = first_call  # the Acquire stream, which goes on as the hold

    def _consume(self, call, unwrap: bool) -> bool:
        """Queue the stream's events; True when the lease ended (stop reconnecting)."""
        for item in call:
            ev = item.event if unwrap else item
            if unwrap and not item.HasField("event"):
                continue
            self.events.put((ev.kind, ev))
            if ev.kind == "released":
                return True
        return False

    def run(self) -> None:
        backoff, lost_since = 0.1, None
        first = self._call
        while not self._stopping.is_set():
            try:
                if first is not None:
                    call, first = first, None
                    if self._consume(call, unwrap=True):
                        return
                else:
                    self._call = self.client.hold(self.lease_id, self.token)
                    if self._consume(self._call, unwrap=False):
                        return
                backoff, lost_since = 0.1, None
            except grpc.RpcError as e:
                if self._stopping.is_set():
                    return
                code = e.code()
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
                    self.events.put(("lost", e.details()))
                    return
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    with contextlib.suppress(XpudError):
                        self.client._metadata(renew=True)
            except XpudError:  # the handshake failed: the daemon is down or restarting; keep trying
                if self._stopping.is_set():
                    return
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since > self.reconnect_s:
                self.events.put(("lost", f"the daemon was unreachable for {self.reconnect_s:g} s"))
                return
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, 1.0)

    def stop(self) -> None:
        self._stopping.set()
        if self._call is not None:
            self._call.cancel()


class Child:
    """The supervised command: own process group, signal forwarding, escalation, terminal hand-off."""

    def __init__(self, argv: list[str], env: dict[str, str], kill_grace_s: float):
        self.kill_grace_s = kill_grace_s
        self._tty = None
        self.proc = subprocess.Popen(argv, env=env, process_group=0, preexec_fn=_die_with_parent)
        self._escalate_at: float | None = None
        self._give_terminal(self.proc.pid)

    def _give_terminal(self, pgrp: int) -> None:
        try:
            fd = sys.stdin.fileno()
            if not os.isatty(fd):
                return
            if self._tty is None and os.tcgetpgrp(fd) != os.getpgrp():
                return  # we run in the background: leave the terminal alone
        except (OSError, ValueError):
            return
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # we may write to the tty from the background
        try:
            os.tcsetpgrp(fd, pgrp)
            self._tty = fd
        except OSError:
            pass
        finally:
            signal.signal(signal.SIGTTOU, old)

    def restore_terminal(self) -> None:
        if self._tty is not None:
            self._give_terminal(os.getpgrp())
            self._tty = None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
        if self._escalate_at is None:
            self._escalate_at = time.monotonic() + self.kill_grace_s

    def stop(self) -> int:
        """SIGTERM the group, SIGKILL after the grace; wait. Returns the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        while self.poll(0.05) is None:
            pass
        return self.exit_code()

    def poll(self, timeout: float) -> int | None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if self._escalate_at is not None and time.monotonic() >= self._escalate_at:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            return None
        self.restore_terminal()
        # The leader is gone; make sure nothing of its group outlives it once we were asked to stop.
        if self._escalate_at is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def exit_code(self) -> int:
        rc = self.proc.returncode
        return 128 - rc if rc is not None and rc < 0 else (rc or 0)


def _say(msg: str) -> None:
    sys.stderr.write(f"xpu: {msg}\n")
    sys.stderr.flush()


def _wait_for_grant(
    client: Client, mode: str, gpus: int, wait_s: float, priority: int, restartable: bool, command: str
):
    """Acquire with hold: returns (grant, the stream call, which goes on as the lease's hold)."""
    tty = sys.stderr.isatty()
    shown = False
    call = client.acquire(
        mode, gpus=gpus, priority=priority, wait_s=wait_s, restartable=restartable, command=command, hold=True
    )
    try:
        for update in client.iterate(call):
            if update.HasField("granted"):
                if shown and tty:
                    sys.stderr.write("\r\033[K")
                return update.granted, call
            if not update.HasField("queued"):
                continue
            q = update.queued
            left = max(0, q.deadline - time.time())
            line = f"queued: position {q.position} of {q.queue_length}, giving up in {left:.0f} s"
            if tty:
                sys.stderr.write(f"\r\033[K{line}")
                sys.stderr.flush()
            elif not shown:
                _say(line)
            shown = True
    except KeyboardInterrupt:
        call.cancel()
        if tty:
            sys.stderr.write("\n")
        raise
    raise NoCapacity("the daemon ended the request without a grant")


def env_for(lease) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    return {**env, **dict(lease.env), "XPU_RESTART_COUNT": str(lease.restart_count)}


def run(
    client: Client,
    argv: list[str],
    mode: str,
    gpus: int = 1,
    wait_s: float = 0.0,
    priority: int = 0,
    restartable: bool = False,
    kill_grace_s: float = 10.0,
) -> int:
    """Lease, run ``argv`` under supervision, release. Returns the exit code to pass on."""
    if not argv:
        raise NotFound("no command given: xpu run --mode MODE -- COMMAND [ARGS...]")
    grant, call = _wait_for_grant(client, mode, gpus, wait_s, priority, restartable, shlex.join(argv))
    lease, token = grant.lease, grant.token
    holder = Holder(client, lease.id, token, first_call=call)
    holder.start()
    try:
        return _supervise(client, holder, lease, token, argv, kill_grace_s)
    finally:
        holder.stop()
        with contextlib.suppress(XpudError):
            client.release(lease.id, token)


def _start(argv: list[str], lease, kill_grace_s: float) -> Child:
    try:
        return Child(argv, env_for(lease), kill_grace_s)
    except FileNotFoundError:
        raise _StartFailed(127, f"{argv[0]}: command not found") from None
    except PermissionError:
        raise _StartFailed(126, f"{argv[0]}: permission denied") from None


class _StartFailed(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _supervise(
    client: Client, holder: Holder, lease, token: str, argv: list[str], kill_grace_s: float
) -> int:
    try:
        child = _start(argv, lease, kill_grace_s)
    except _StartFailed as e:
        _say(str(e))
        return e.code
    received: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _f: received.append(sig)) for s in FORWARDED}
    try:
        while True:
            while received:
                child.signal(received.pop(0))
            if child.poll(0.05) is not None:
                return child.exit_code()
            try:
                kind, ev = holder.events.get_nowait()
            except queue.Empty:
                continue
            if kind == "move" and lease.restartable:
                _say(f"lease {lease.id} is moving: {ev.message}; restarting the command")
                child.stop()
                lease = client.ack_move(lease.id, token)
                child = _start(argv, lease, kill_grace_s)
            elif kind in ("revoke", "released", "lost"):
                msg = ev if isinstance(ev, str) else ev.message
                _say(f"lease {lease.id} ended by the daemon ({msg}); stopping the command")
                return child.stop()
            elif kind == "mark":
                _say(f"lease {lease.id}: {ev.message}")
    except _StartFailed as e:
        _say(str(e))
        return e.code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
