"""A real systemd for tests: ``/lib/systemd/systemd`` as PID 1 of new pid, mount, cgroup, uts and ipc
namespaces (the network and the file system are the host's), with a D-Bus system bus (``systemd-run
--pipe``/``--wait`` need one) and *none* of the host's units.

That last point matters: a systemd that boots the host's ``sysinit.target`` runs ``systemd-tmpfiles
--boot`` against the shared file system, which empties the real ``/tmp``. So the boot script hides every
unit and generator directory under a tmpfs of the private mount namespace and boots a target of its own
that pulls in only ``dbus.socket``; ``sysinit``/``basic``/``shutdown.target`` exist but are empty (a
transient service's default dependencies name them). Its own ``/run`` is a tmpfs; cgroup2 is mounted on
``/sys/fs/cgroup``, rooted (cgroup namespace) at a fresh child of the test process's cgroup2 cgroup.

Needs root, systemd, dbus-daemon, util-linux's ``unshare``/``nsenter`` and a cgroup2 hierarchy we may
write to; ``Systemd.unavailable()`` says what is missing (tests skip with that reason). Commands reach
it through ``nsenter`` (``Systemd.prefix``).

    with Systemd() as sd:
        sd.run(["systemctl", "is-system-running"])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SYSTEMD = "/lib/systemd/systemd"
PROGRAMS = ("unshare", "nsenter", "systemctl", "systemd-run", "dbus-daemon", "mount")

BOOT = r"""set -e
mount --make-rprivate /
mount -t tmpfs -o mode=755 tmpfs /run
for d in /etc/systemd/system /lib/systemd/system /usr/lib/systemd/system /usr/local/lib/systemd/system \
         /lib/systemd/system-generators /usr/lib/systemd/system-generators /etc/systemd/system-generators \
         /usr/lib/systemd/system-environment-generators /etc/systemd/system-environment-generators; do
  if [ -d "$d" ] && [ ! -L "$d" ]; then mount -t tmpfs -o mode=755 tmpfs "$d"; fi
done
mkdir -p /run/systemd/system
cd /run/systemd/system
for t in sysinit basic shutdown; do printf '[Unit]\nDefaultDependencies=no\n' > $t.target; done
printf '[Unit]\nDefaultDependencies=no\nWants=dbus.socket\n' > xpu-test.target
printf '[Unit]\nDefaultDependencies=no\n[Socket]\nListenStream=/run/dbus/system_bus_socket\n' > dbus.socket
printf '[Unit]\nDefaultDependencies=no\nRequires=dbus.socket\n[Service]\nType=notify\n%s\n%s\n' \
  'NotifyAccess=main' \
  'ExecStart=DBUS --system --address=systemd: --nofork --nopidfile --systemd-activation --syslog-only' \
  > dbus.service
umount -l /sys/fs/cgroup 2>/dev/null || true
mount -t cgroup2 cgroup2 /sys/fs/cgroup
export container=xpu-test
exec SYSTEMD --system --unit=xpu-test.target --log-target=console
"""


def _cgroup2_root() -> Path | None:
    """Where the cgroup2 hierarchy is mounted (pure v2, or hybrid's ``unified``), or None."""
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                return Path(fields[1])
    return None


def _own_cgroup2() -> str:
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return "/"


class Systemd:
    def __init__(self, boot_s: float = 20.0):
        self.boot_s = boot_s
        self.proc: subprocess.Popen | None = None
        self.pid = 0  # systemd's pid, as this namespace sees it
        self.cgroup: Path | None = None
        self.log = b""

    @staticmethod
    def unavailable() -> str:
        """Why a systemd cannot run here ('' when it can, as far as can be told without starting one)."""
        if os.geteuid() != 0:
            return "needs root (new pid/mount/cgroup namespaces and a cgroup of its own)"
        if not os.access(SYSTEMD, os.X_OK):
            return f"no {SYSTEMD}"
        missing = [p for p in PROGRAMS if shutil.which(p) is None]
        if missing:
            return "missing " + ", ".join(missing)
        root = _cgroup2_root()
        if root is None:
            return "no cgroup2 hierarchy mounted (systemd needs one it may write to)"
        if not os.access(root / _own_cgroup2().lstrip("/"), os.W_OK):
            return f"the cgroup2 hierarchy at {root} is not writable here"
        return ""

    @property
    def prefix(self) -> tuple[str, ...]:
        """The command prefix that runs a program in systemd's namespaces (its /run, its pid 1)."""
        return ("nsenter", "-t", str(self.pid), "-m", "-p", "--")

    def run(self, argv, timeout: float = 10.0) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
        argv, quiet = [*self.prefix, *argv], subprocess.DEVNULL
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=quiet)

    def __enter__(self) -> Systemd:
        root = _cgroup2_root()
        assert root is not None, self.unavailable()
        name = f"xpu-systemd-test-{os.getpid()}-{time.monotonic_ns()}"
        self.cgroup = root / _own_cgroup2().lstrip("/") / name
        self.cgroup.mkdir()
        script = BOOT.replace("DBUS", shutil.which("dbus-daemon")).replace("SYSTEMD", SYSTEMD)
        enter = f'echo $$ > "{self.cgroup}/cgroup.procs" && exec unshare --pid --fork --mount --mount-proc ' \
                f'--cgroup --uts --ipc sh -c "$0"'  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                ["sh", "-c", enter, script],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._wait_running()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_running(self) -> None:
        deadline = time.monotonic() + self.boot_s
        state = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log = self.proc.stdout.read()
                said = self.log.decode(errors="replace")
                raise RuntimeError(f"systemd exited ({self.proc.returncode}): {said}")
            if not self.pid:
                with contextlib.suppress(OSError, ValueError):
                    kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
                    if kids and os.readlink(f"/proc/{kids[0]}/exe") == os.path.realpath(SYSTEMD):
                        self.pid = int(kids[0])
            if self.pid:
                state = self.run(["systemctl", "is-system-running"]).stdout.strip()
                if state == "running":
                    return
            time.sleep(0.05)
        raise RuntimeError(f"systemd did not reach 'running' within {self.boot_s} s (state {state!r})")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            if self.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)  # pid 1 of the namespace: every process in it dies
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.proc.stdout.close()
        if self.cgroup is not None and self.cgroup.exists():
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    for d in sorted(self.cgroup.rglob("*"), key=lambda p: -len(p.parts)):
                        if d.is_dir():
                            d.rmdir()
                    self.cgroup.rmdir()
                    break
                except OSError:  # a process still leaving
                    time.sleep(0.05)
