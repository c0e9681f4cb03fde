"""The command `xpu run` supervises: started, watched and ended so that it behaves as if run directly.

- It runs in a process group of its own. Signals sent to the wrapper are passed on to that group; after a
  termination signal (INT, TERM, HUP, QUIT) the group gets SIGKILL if it still lives ``kill_grace_s``
  seconds later. Signals the wrapper inherited as ignored stay ignored in the command.
- On a terminal where the wrapper is in the foreground, the command's group becomes the foreground group
  (so Ctrl-C, Ctrl-Z and reading the terminal reach it directly). When the command stops (Ctrl-Z) the
  wrapper takes the terminal back and stops itself, so the shell sees the job stop; ``fg`` resumes both.
- File descriptors the wrapper inherited (``3<file``) are passed on; its own are not.
- When the command ends, whatever is left of its process group is killed: nothing started under the lease
  outlives it. If the wrapper itself dies, even by SIGKILL, a guard kills the whole group at once, so the
  slice's MIG instance or MPS client is free when the daemon reclaims the lease. The guard is a tiny
  ``/bin/sh``, started first, that leads the process group the command then joins (and that is already the
  terminal's foreground group when the command starts); it ignores the usual signals and waits for the end
  of a pipe only the wrapper holds. So the group is never unguarded, not even while the command starts.
- No Python code runs between fork and exec (no ``preexec_fn``): the wrapper has gRPC threads, and a fork
  that runs Python hooks in a threaded process can deadlock. That is also why there is no parent-death
  signal: the guard does that job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from xpud.errors import XpudError

TERMINATING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
FORWARDED = (*TERMINATING, signal.SIGUSR1, signal.SIGUSR2)
# Dispositions as the wrapper inherited them (Python turns an inherited SIG_DFL for SIGINT into its
# KeyboardInterrupt handler, which means "default" here).
INHERITED = {s: signal.getsignal(s) for s in (*FORWARDED, signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP)}
_GUARD = 'trap "" INT TERM HUP QUIT TSTP USR1 USR2; read -r _; kill -s KILL -- "-$$" 2>/dev/null; exit 0'


def inherited_ignored(sig: int) -> bool:
    return INHERITED.get(sig) is signal.SIG_IGN


@contextlib.contextmanager
def ttou_blocked():
    """Hold SIGTTOU back while the wrapper (perhaps in the background) sets the terminal's foreground
    group or writes to it; blocked, not ignored, so the command still inherits the disposition we got."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTTOU])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass(frozen=True)
class Outcome:
    """How the command ended: ``code`` as a shell shows it (128 + n when signal n ended it)."""

    code: int
    signal: int | None = None
    # the wrapper gave up (not the command's own end): nothing to report to the daemon
    by_wrapper: bool = field(default=False, compare=False)


class StartFailed(XpudError):
    """The command could not be started; ``exit_code`` is what a shell returns (127 not found, 126 not
    executable)."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def controlling_tty() -> int | None:
    """A descriptor of our controlling terminal when our process group is its foreground group."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _inherited_fds() -> list[int]:
    """Descriptors above 2 that the wrapper inherited and would pass on if it exec'd the command itself."""
    out = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    out.append(fd)
    return sorted(out)


class Child:
    """One run of the command."""

    def __init__(self, argv: list[str], env: dict[str, str], kill_grace_s: float, tty: int | None):
        self.kill_grace_s = kill_grace_s
        self.tty = tty  # our controlling terminal, when we may hand it over
        self._escalate_at: float | None = None
        self.outcome: Outcome | None = None
        self._guard = self._start_guard()
        self.pgid = self._guard[0].pid if self._guard else 0  # 0: a group of its own (no /bin/sh)
        if self.pgid:
            self._give_terminal(self.pgid)  # foreground before the command exists: it never reads from behind
        try:
            self.proc = subprocess.Popen(argv, env=env, process_group=self.pgid, pass_fds=_inherited_fds())
        except OSError as e:
            self._finish()
            if isinstance(e, FileNotFoundError):
                raise StartFailed(127, f"{argv[0]}: command not found") from None
            if isinstance(e, PermissionError | IsADirectoryError):
                raise StartFailed(126, f"{argv[0]}: permission denied") from None
            raise StartFailed(126, f"{argv[0]}: {e.strerror}") from None
        self.pid = self.proc.pid
        self.pgid = self.pgid or self.pid
        self._give_terminal(self.pgid)

    @staticmethod
    def _start_guard():
        """The group's leader: a /bin/sh that SIGKILLs the group when the wrapper is gone (its stdin, a
        pipe only we hold, reaches end of file). None when it cannot start."""
        r, w = os.pipe()
        try:
            guard = subprocess.Popen(
                ["/bin/sh", "-c", _GUARD, "xpu-guard"],
                stdin=r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                process_group=0,  # a group of its own, which the command joins
            )
        except OSError:
            os.close(w)
            return None
        finally:
            os.close(r)
        return guard, w

    def _give_terminal(self, pgrp: int) -> None:
        if self.tty is None:
            return
        with contextlib.suppress(OSError), ttou_blocked():
            os.tcsetpgrp(self.tty, pgrp)

    # ---------------------------------------------------------------------------------- signals
    def signal(self, sig: int) -> None:
        """Pass ``sig`` to the command's group; a termination signal starts the SIGKILL countdown."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)
        if sig in TERMINATING and self._escalate_at is None:
            self._escalate_at = time.monotonic() + self.kill_grace_s

    def seconds_to_escalation(self) -> float | None:
        return None if self._escalate_at is None else max(0.0, self._escalate_at - time.monotonic())

    # ---------------------------------------------------------------------------------- waiting
    def reap(self) -> Outcome | None:
        """Non-blocking: the outcome once the command ended (None while it runs). Mirrors a stop."""
        if self.outcome is not None:
            return self.outcome
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG | os.WUNTRACED)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            if self._escalate_at is not None and time.monotonic() >= self._escalate_at:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pgid, signal.SIGKILL)
            return None
        if os.WIFSTOPPED(status):
            self._mirror_stop()
            return None
        code = os.waitstatus_to_exitcode(status)
        self.proc.returncode = code  # we reaped it; tell Popen so it does not wait again
        self.outcome = Outcome(128 - code, -code) if code < 0 else Outcome(code)
        self._finish()
        return self.outcome

    def _mirror_stop(self) -> None:
        """The command stopped (Ctrl-Z): stop too, so our shell regains the terminal; resume it with us."""
        if self.tty is None:
            return  # stopped by someone else's signal, not by the terminal: leave it to them
        self._give_terminal(os.getpgrp())
        os.kill(os.getpid(), signal.SIGSTOP)
        # ... continued (fg or bg): hand the terminal back if we are in the foreground again.
        with contextlib.suppress(OSError):
            if os.tcgetpgrp(self.tty) == os.getpgrp():
                self._give_terminal(self.pgid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGCONT)

    def _finish(self) -> None:
        """The command ended: kill what is left of its group (the guard too), take the terminal back."""
        if self.pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        self._give_terminal(os.getpgrp())
        if self._guard is not None:
            guard, w = self._guard
            os.close(w)
            with contextlib.suppress(subprocess.TimeoutExpired):
                guard.wait(1.0)
            self._guard = None

    def stop(self, wake) -> Outcome:
        """SIGTERM the group, SIGKILL after the grace, wait for the end. ``wake``: the loop's Wakeup."""
        if self.reap() is None:
            self.signal(signal.SIGTERM)
        while (outcome := self.reap()) is None:
            wake.wait(0.05)  # SIGCHLD wakes us sooner
        return outcome


def die_like(outcome: Outcome) -> int:
    """End the wrapper as the command ended: by the same signal (so a parent sees exactly what it would
    have seen), without a core file of our own. Returns the exit code if the signal does not end us."""
    if outcome.signal:
        import resource
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(outcome.signal, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [outcome.signal])
        os.kill(os.getpid(), outcome.signal)
        time.sleep(0.1)  # delivery to ourselves is immediate; this is belt and braces
    return outcome.code
