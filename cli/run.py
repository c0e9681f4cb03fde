"""`xpu run`: lease, hold, run the command with the lease's environment, pass its outcome on, release.

One stream carries everything: the Acquire request (``hold=True``) yields queue positions, then the grant,
then goes on as the lease's Hold stream (move, revoke, mark, released events). A thread reads it and, if it
breaks after the grant (the daemon restarts), keeps the lease held through new Hold streams. The main
thread sleeps on one self-pipe that signals, SIGCHLD and that thread all poke.

- Queueing (``--wait``): on a terminal the ticket, the position in the queue, the time waited and the time
  left are shown on one line, redrawn every second; otherwise a line is printed when the position changes
  (at most every 5 s). A signal while queued (Ctrl-C) leaves the queue ("left the queue") and ends the
  wrapper by that signal.
- Release: the wrapper tells the daemon how the command ended (exit status or signal) and when it
  started; `xpu leases --all` shows it.
- Running: see ``xpu_cli.child``. The wrapper ends as the command ended: the same exit code, or death by
  the same signal (a shell shows 128 + n), after releasing the lease.
- ``--restartable``: on a ``move`` event the command is stopped (SIGTERM, SIGKILL after the grace), the
  move acknowledged (the daemon answers with the new placement) and the command started again with the
  new environment; ``XPU_RESTART_COUNT`` counts the restarts. On a ``reclaim`` event (fair share between
  accounts, xpud.controllers.accounts) the command is stopped the same way, the lease released, and the
  request queued again (as long as the daemon allows); once granted the command starts again.
- ``--json-env``: no command; once granted, one line of JSON (lease id, mode, cards, environment with the
  lease's token: ``xpu confine -- COMMAND`` under it confines the launcher's work, ``xpu_cli.confine``) to
  stdout, and the wrapper keeps holding the lease until its stdin reaches end of file or it gets SIGINT,
  SIGTERM or SIGHUP; then it releases the lease and exits 0. If the daemon ends the lease first, it says
  so on stderr and exits 1 (its stdout closes: a launcher reading it sees end of file). For launchers:
  ``coproc xpu run -m vxpu-half --json-env``, read one line, start the work with that environment, and
  close the coprocess's stdin when the work is done.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import select
import shlex
import signal
import sys
import threading
import time
from datetime import datetime

import grpc
from xpu_cli.child import (
    FORWARDED,
    Child,
    Outcome,
    StartFailed,
    controlling_tty,
    inherited_ignored,
    ttou_blocked,
)

from xpud.api.client import Client, to_error
from xpud.errors import BadRequest, Unavailable, XpudError


def _say(msg: str) -> None:
    with contextlib.suppress(OSError, ValueError), ttou_blocked():  # we may be behind the command
        sys.stderr.write(f"xpu: {msg}\n")
        sys.stderr.flush()


class Wakeup:
    """A self-pipe the main thread sleeps on; signals (``set_wakeup_fd``) and the stream thread poke it."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def poke(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.w, b"\0")

    def wait(self, timeout: float | None, extra: tuple[int, ...] = ()) -> list[int]:
        """Sleep until poked, ``timeout`` seconds (None: no limit) or one of ``extra`` is readable.
        Returns the readable ``extra`` descriptors."""
        ready, _, _ = select.select([self.r, *extra], [], [], timeout)
        if self.r in ready:
            with contextlib.suppress(OSError):
                while os.read(self.r, 4096):
                    pass
        return [fd for fd in ready if fd != self.r]

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class Signals:
    """While active: forwarded signals are recorded for the main loop (not acted on where they land) and
    SIGCHLD wakes the loop. Signals inherited as ignored stay ignored (and so reach the command ignored)."""

    def __init__(self, wake: Wakeup):
        self.wake = wake
        self.received: list[int] = []
        self._old: dict[int, object] = {}
        self._old_fd = -1

    def __enter__(self) -> Signals:
        for s in FORWARDED:
            if not inherited_ignored(s):
                self._old[s] = signal.signal(s, self._record)
        self._old[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)
        self._old_fd = signal.set_wakeup_fd(self.wake.w, warn_on_full_buffer=False)
        return self

    def _record(self, sig: int, _frame) -> None:
        self.received.append(sig)

    def pop(self) -> list[int]:
        """The signals received so far, in order. One at a time: the handler runs between any two of our
        bytecodes, so copying the list and then clearing it lost a signal that landed in between (a
        Ctrl-C never passed on: the command ran on and the wrapper with it)."""
        out = []
        while self.received:
            out.append(self.received.pop(0))  # one C call: a handler's append is never lost
        return out

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for s, h in self._old.items():
            signal.signal(s, h)


SOCKET_POLL_S = 0.05  # how often a wrapper cut off from its daemon looks for the socket's return


def _label(argv: list[str]) -> str:
    """The command as a label for listings: arguments that are not UTF-8 (a file name may not be) shown
    with U+FFFD, since the request carries text; the command itself runs with its exact bytes."""
    return shlex.join(argv).encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class LeaseStream(threading.Thread):
    """Reads the Acquire stream into ``events`` (kind, payload), then keeps the lease held.

    Kinds: "queued" (pb.Queued), "granted" (pb.Granted), "error" (an XpudError: no grant), then the lease's
    events ("held", "move", "revoke", "mark", "released": pb.LeaseEvent) and "lost" (str: the daemon
    stayed unreachable, or no longer knows the lease).
    """

    def __init__(self, client: Client, request: dict, wake: Wakeup, reconnect_s: float = 120.0):
        super().__init__(daemon=True, name="xpu-lease")
        self.client, self.request, self.wake = client, request, wake
        self.reconnect_s = reconnect_s
        self.events: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._call = None

    def _put(self, kind: str, payload) -> None:
        self.events.put((kind, payload))
        self.wake.poke()

    def next(self):
        """The next (kind, payload), or None."""
        try:
            return self.events.get_nowait()
        except queue.Empty:
            return None

    def run(self) -> None:
        granted = None
        try:
            self._call = self.client.acquire(**self.request, hold=True)
            for update in self._call:
                if update.HasField("queued"):
                    self._put("queued", update.queued)
                elif update.HasField("granted"):
                    granted = update.granted
                    self._put("granted", granted)
                elif update.HasField("event"):
                    self._put(update.event.kind, update.event)
                    if update.event.kind == "released":
                        return
        except grpc.RpcError as e:
            if self._stopping.is_set():
                return
            if granted is None:
                self._put("error", to_error(e, str(self.client.socket)))
                return
        except XpudError as e:  # the credential handshake failed: no daemon
            self._put("error", e)
            return
        except Exception as e:  # e.g. a value the request cannot hold: an error, never a silent hang
            if granted is None:
                self._put("error", BadRequest(f"the request could not be sent: {e}"))
                return  # (after a grant: held through Hold streams below, as when the stream breaks)
        if granted is None:
            if not self._stopping.is_set():
                self._put("error", Unavailable("the daemon ended the request without a grant"))
            return
        self._hold(granted.lease.id, granted.token)

    def _hold(self, lease_id: str, token: str) -> None:
        """The Acquire stream broke after the grant: hold through Hold streams, reconnecting.

        A restarted daemon gives restored leases a grace period from when it serves again: reconnect
        well within it. The wait between attempts (0.1 s doubling to 1 s; the client's channel retries as
        often) ends early when the socket file reappears, and an expired credential is renewed at once."""
        backoff, lost_since, renewed = 0.1, time.monotonic(), False
        while not self._stopping.is_set():
            try:
                self._call = self.client.hold(lease_id, token)
                for ev in self._call:
                    lost_since, backoff, renewed = None, 0.1, False
                    self._put(ev.kind, ev)
                    if ev.kind == "released":
                        return
            except grpc.RpcError as e:
                if self._stopping.is_set():
                    return
                if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
                    self._put("lost", e.details())
                    return
                if e.code() == grpc.StatusCode.UNAUTHENTICATED and not renewed:
                    with contextlib.suppress(XpudError):  # a new daemon: a new credential, and try again now
                        self.client._metadata(renew=True)
                        renewed = True
                        continue
            except XpudError:  # the handshake failed: the daemon is down or restarting; keep trying
                if self._stopping.is_set():
                    return
            renewed = False
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since > self.reconnect_s:
                self._put("lost", f"the daemon was unreachable for {self.reconnect_s:g} s")
                return
            self._pause(backoff)
            backoff = min(backoff * 2, 1.0)

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` before the next Hold, or less when the daemon's socket reappears."""
        deadline = time.monotonic() + seconds
        while not self._stopping.wait(min(SOCKET_POLL_S, max(0.0, deadline - time.monotonic()))):
            if self.client.reconnect_if_restarted() or time.monotonic() >= deadline:
                return

    def stop(self) -> None:
        self._stopping.set()
        if self._call is not None:
            self._call.cancel()


class Progress:
    """The queue position while a request waits (stderr)."""

    def __init__(self, what: str, quiet: bool = False):
        self.what = what
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.q = None
        self.shown = False
        self._printed: tuple[int, float] | None = None  # (position, when), without a terminal

    @property
    def interval(self) -> float | None:
        return 1.0 if self.tty and self.q is not None else None

    def update(self, q) -> None:
        if self.q is None and q.not_before > time.time() and not self.quiet:  # deferred (a green start)
            at = datetime.fromtimestamp(q.not_before).astimezone().isoformat(timespec="minutes")
            _say(f"waiting until {at}, {q.not_before_reason} (ticket {q.ticket})")
        elif self.q is None and q.not_before_reason and not self.quiet:
            _say(q.not_before_reason)
        self.q = q
        self.show()

    def show(self) -> None:
        q = self.q
        if q is None or self.quiet:
            return
        waited = time.monotonic() - self.started
        left = max(0.0, q.deadline - time.time())
        line = (
            f"queued for {self.what}: position {q.position} of {q.queue_length}, "
            f"waited {waited:.0f} s, giving up in {left:.0f} s (ticket {q.ticket})"
        )
        if self.tty:
            with contextlib.suppress(OSError):
                sys.stderr.write(f"\r\033[Kxpu: {line}")
                sys.stderr.flush()
            self.shown = True
        elif self._printed is None or (
            q.position != self._printed[0] and time.monotonic() - self._printed[1] >= 5.0
        ):
            _say(line)
            self._printed = (q.position, time.monotonic())

    def clear(self) -> None:
        if self.tty and self.shown:
            with contextlib.suppress(OSError):
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
            self.shown = False


def _wait_for_grant(stream: LeaseStream, signals: Signals, wake: Wakeup, what: str, quiet: bool = False):
    """The grant (pb.Granted), or the Outcome of a signal that ended the wait. Raises the daemon's error."""
    progress = Progress(what, quiet)
    while True:
        for sig in signals.pop():
            stream.stop()
            progress.clear()
            if progress.q is not None:
                _say(
                    f"left the queue (ticket {progress.q.ticket}, position {progress.q.position}, "
                    f"waited {time.monotonic() - progress.started:.0f} s)"
                )
            return Outcome(128 + sig, sig)
        item = stream.next()
        if item is None:
            wake.wait(progress.interval)
            if progress.tty:
                progress.show()
            continue
        kind, payload = item
        if kind == "queued":
            progress.update(payload)
        elif kind == "granted":
            progress.clear()
            return payload
        elif kind == "error":
            progress.clear()
            raise payload


def env_for(lease, restarts: int = 0) -> dict[str, str]:
    """The command's environment: ours, the lease's, and the restart count."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    count = max(int(lease.restart_count), restarts)
    return {**env, **dict(lease.env), "XPU_RESTART_COUNT": str(count)}


def _supervise(
    client: Client,
    stream: LeaseStream,
    signals: Signals,
    wake: Wakeup,
    grant,
    argv: list[str],
    kill_grace_s: float,
    requeue=None,
) -> Outcome:
    """Run ``argv`` under the lease, following moves; on a ``reclaim`` (fair share between accounts) a
    --restartable command is stopped, the lease released and ``requeue()`` asked for a new (stream,
    grant), on which the command starts again."""
    lease, token = grant.lease, grant.token
    tty = controlling_tty()
    restarts = 0
    try:
        child = Child(argv, env_for(lease), kill_grace_s, tty)
        while True:
            for sig in signals.pop():
                child.signal(sig)
            outcome = child.reap()
            if outcome is not None:
                return outcome
            item = stream.next()
            if item is None:
                wake.wait(min(max(child.seconds_to_escalation() or 1.0, 0.01), 1.0))
                continue
            kind, ev = item
            if kind == "move" and lease.restartable:
                _say(f"lease {lease.id} is moving ({ev.message}); stopping the command")
                child.stop(wake)
                try:
                    lease = client.ack_move(lease.id, token)
                except XpudError as e:
                    _say(f"the move of lease {lease.id} failed: {e}")
                    return Outcome(1, by_wrapper=True)
                restarts += 1
                where = ",".join(map(str, lease.cards))
                _say(f"restarting the command on card {where} (restart {restarts})")
                child = Child(argv, env_for(lease, restarts), kill_grace_s, tty)
            elif kind == "reclaim" and lease.restartable and requeue is not None:
                _say(f"lease {lease.id} is reclaimed ({ev.message}); stopping the command and queueing again")
                child.stop(wake)
                try:
                    stream, grant = requeue()
                except XpudError as e:
                    _say(f"queueing again after the reclaim of lease {lease.id} failed: {e}")
                    return Outcome(1, by_wrapper=True)
                if isinstance(grant, Outcome):
                    return grant
                lease, token = grant.lease, grant.token
                restarts += 1
                where = ",".join(map(str, lease.cards))
                _say(f"restarting the command on card {where} (restart {restarts})")
                child = Child(argv, env_for(lease, restarts), kill_grace_s, tty)
            elif kind == "move":
                _say(f"lease {lease.id}: the daemon asked to move it, but it is not --restartable")
            elif kind in ("revoke", "released", "lost"):
                msg = ev if isinstance(ev, str) else ev.message
                _say(f"lease {lease.id} ended by the daemon ({msg}); stopping the command")
                return child.stop(wake)
            elif kind in ("resize", "mark"):  # a resize's restart comes as its move: said here
                _say(f"lease {lease.id}: {ev.message}")
    except StartFailed as e:
        _say(str(e))
        return Outcome(e.exit_code)
    finally:
        if tty is not None:
            os.close(tty)


def _confine(client: Client, grant, signals: Signals, wake: Wakeup, reconnect_s: float) -> Outcome | None:
    """Put this wrapper in the lease's device scope before it starts anything (README "Isolation"): the
    command and all it starts inherit the scope and can open only the lease's device nodes. Where the
    daemon cannot enforce that it says why, and we say so once (the daemon decides how often). None to go
    on; an Outcome (126, as a command that cannot run) when the daemon should have confined us and failed.

    A daemon that is down or restarting between the grant and this call (a crash, an upgrade) is waited
    for, as the lease's Hold stream waits for it (up to ``reconnect_s``; a signal ends the wait): giving up
    here left a granted lease without its command, reclaimed after the restart's grace."""
    backoff, since = 0.1, time.monotonic()
    while True:
        try:
            reply = client.confine(grant.lease.id, grant.token)
            break
        except Unavailable as e:
            if time.monotonic() - since > reconnect_s:
                _say(f"not starting the command: {e}")
                return Outcome(126, by_wrapper=True)
        except XpudError as e:
            if "unimplemented" in str(e).lower() or "method not found" in str(e).lower():
                return None  # a daemon from before device isolation
            _say(f"not starting the command: {e}")
            return Outcome(126, by_wrapper=True)
        deadline = time.monotonic() + backoff
        while (left := deadline - time.monotonic()) > 0:
            for sig in signals.pop():
                return Outcome(128 + sig, sig)
            if client.reconnect_if_restarted():
                break
            wake.wait(min(SOCKET_POLL_S, left))
        backoff = min(backoff * 2, 1.0)
    if not reply.enforced and reply.warn:
        _say(f"device isolation is {reply.isolation}: the command can open any card's device node")
    return None


def _hold_for_launcher(stream: LeaseStream, signals: Signals, wake: Wakeup, grant) -> int:
    """--json-env: print the environment, hold until stdin closes or a signal; 0, or 1 if the daemon
    ended the lease."""
    lease = grant.lease
    record = {
        "lease_id": lease.id,
        "mode": lease.mode,
        "cards": list(lease.cards),
        # the token: `xpu confine -- COMMAND` with this env puts COMMAND in the lease's device scope
        # (xpu_cli.confine; not imported here: it brings Typer, which run's fast path keeps out)
        "env": {
            **dict(lease.env),
            "XPU_RESTART_COUNT": str(lease.restart_count),
            "XPU_LEASE_TOKEN": grant.token,
        },
    }
    with contextlib.suppress(OSError):
        sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
        sys.stdout.flush()
    try:
        stdin: tuple[int, ...] = (0,) if os.fstat(0) else ()
    except OSError:
        stdin = ()
    while True:
        if signals.pop():
            return 0
        item = stream.next()
        if item is not None:
            kind, ev = item
            if kind in ("revoke", "released", "lost"):
                _say(f"lease {lease.id} ended by the daemon ({ev if isinstance(ev, str) else ev.message})")
                return 1
            if kind in ("mark", "move"):
                _say(f"lease {lease.id}: {ev.message}")
            continue
        if not stdin:
            wake.wait(None)
            continue
        if 0 in wake.wait(None, stdin):
            try:
                data = os.read(0, 65536)
            except OSError:
                data = b""
            if not data:
                return 0


def _reported(outcome: Outcome | None) -> tuple[int | None, int | None]:
    """(exit code, signal) to report at release; (None, None) when the command's end is not known."""
    if outcome is None or outcome.by_wrapper:
        return None, None
    return (None, outcome.signal) if outcome.signal else (outcome.code, None)


def run(
    client: Client,
    argv: list[str],
    mode: str,
    gpus: int = 1,
    wait_s: float | None = 0.0,
    priority: int = 0,
    restartable: bool = False,
    kill_grace_s: float = 10.0,
    json_env: bool = False,
    job_class: str = "",
    name: str = "",
    quiet: bool = False,
    green_deadline: float = 0.0,
    account: str = "",
) -> Outcome:
    """Lease, run ``argv`` under supervision (or hold for another launcher with ``json_env``), release
    (telling the daemon how the command ended, for `xpu leases --all`). ``wait_s``: None for the daemon's
    default, ``math.inf`` for the longest it allows. Returns how the command ended
    (``xpu_cli.child.die_like`` ends the wrapper the same way)."""
    if json_env and argv:
        raise BadRequest("--json-env prints the environment for another launcher: give no command")
    if json_env and restartable:
        raise BadRequest("--json-env cannot be --restartable: xpu cannot restart another launcher's work")
    if not json_env and not argv:
        raise BadRequest("no command given: xpu run --mode MODE -- COMMAND [ARGS...] (or --json-env)")
    request = dict(
        mode=mode.lower(),  # --mode VXPU-HALF is vxpu-half: mode names are lower case
        gpus=gpus,
        priority=priority,
        wait_s=wait_s,
        restartable=restartable,
        command=_label(argv) if argv else "(xpu run --json-env)",
        job_class=job_class,
        name=name,
        account=account,
        **({"when_green": True, "green_deadline": green_deadline} if green_deadline else {}),
    )
    wake = Wakeup()
    try:
        with Signals(wake) as signals:
            stream = LeaseStream(client, request, wake)
            stream.start()
            grant, ended, started = None, None, 0.0
            try:
                what = mode if mode != "xpu" else f"{gpus} card(s)"
                got = _wait_for_grant(stream, signals, wake, what, quiet)
                if isinstance(got, Outcome):
                    return got
                grant = got
                if json_env:
                    return Outcome(_hold_for_launcher(stream, signals, wake, grant))
                refused = _confine(client, grant, signals, wake, stream.reconnect_s)
                if refused is not None:
                    return refused
                started = time.time()

                def requeue():  # after a reclaim: release, queue again (as long as allowed), hold anew
                    nonlocal stream, grant, started
                    stream.stop()
                    with contextlib.suppress(XpudError):
                        client.release(grant.lease.id, grant.token, started=started)
                    grant = None
                    stream = LeaseStream(client, {**request, "wait_s": math.inf}, wake)
                    stream.start()
                    got = _wait_for_grant(stream, signals, wake, what, quiet)
                    if not isinstance(got, Outcome):
                        grant, started = got, time.time()
                    return stream, got

                ended = _supervise(client, stream, signals, wake, grant, argv, kill_grace_s, requeue)
                return ended
            finally:
                stream.stop()
                if grant is not None:
                    with contextlib.suppress(XpudError):
                        client.release(grant.lease.id, grant.token, *_reported(ended), started=started)
    finally:
        wake.close()
