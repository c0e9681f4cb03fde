"""A lease's processes in a systemd scope whose device program allows only the lease's nodes (issue #32).

Under systemd (PID 1) on cgroup v2, ``DevicePolicy=closed`` + ``DeviceAllow=`` (``isolation/devices.py``)
on a unit become a BPF device program on its cgroup: an ``open()`` of any other device node fails with
EPERM, whoever owns the process and whatever the node's mode. One transient scope per lease,
``xpu-lease-<id>.scope``:

- ``place(lease, pid)``: the first process goes in with ``StartTransientUnit`` (``PIDs=``), later ones with
  ``AttachProcessesToUnit``; either way the call returns once ``/proc/<pid>/cgroup`` shows the scope (a
  scope's start is a queued job: a child forked before it ran would stay outside). A process's children
  inherit its cgroup, so placing the holder before it forks covers all it starts.
- ``follow(lease)``: a lease moved to other cards; ``SetUnitProperties`` (runtime) resets ``DeviceAllow=``
  and sets the new list on the running scope (``systemctl set-property --runtime`` does the same).
- ``unit_properties(await scopes.allow_async(lease))``: the same two properties as ``systemd-run
  --property=`` arguments, for a unit systemd starts itself (a rank's service, a detached job's unit);
  ``follow(lease, unit)`` changes that unit's list after a move.
- ``end_later(lease_id)``: the lease ended; its scope is stopped a little later (what escaped the
  command's process group included). The daemon calls it for every end (``engine.on_ended``).
- ``reconcile(active, known)``: daemon start-up; the scopes of this daemon's leases that ended while no
  daemon could stop them (a SIGKILL between an end and its stop) are stopped; active leases' are kept.
  So are this daemon's warm commands' scopes (``warm_id``: ``xpu-lease-warm-<owner>-<card>-<hex>.scope``,
  ``owner`` a tag of the daemon's state directory, so that two daemons under one systemd never stop each
  other's): whatever still runs there lost its watcher (the time limit) with the last daemon, and its slice
  is no longer marked warming, so it could be handed out while the command still uses it.

The calls go through ``busctl`` (systemd's own D-Bus client: no D-Bus library in the daemon) off the event
loop, with the fixed clean environment. Where this cannot work, ``detect`` says why and isolation is
advisory: the lease still has its ``CUDA_VISIBLE_DEVICES``, but nothing stops a process opening other nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xpud.errors import XpudError
from xpud.hw.devnodes import DevNodeError, DevTree
from xpud.isolation.devices import allow_list, grant_of

log = logging.getLogger(__name__)

BUSCTL = "busctl"
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
DEST = ("org.freedesktop.systemd1", "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager")
CALL_TIMEOUT_S = 10.0
PLACED_WITHIN_S = 5.0  # how long a started scope may take to hold the process
END_AFTER_S = 3.0  # a released lease's scope is stopped this much later (its holder exits first)

Runner = Callable[[Sequence[str]], Awaitable[tuple[int, str]]]  # argv -> (exit code, stdout + stderr)


class ScopeError(XpudError):
    """The lease's scope could not be made or changed; one line that says why."""


@dataclass(frozen=True)
class Enforcement:
    """Whether device isolation is enforced here, and if not, why (``xpu info``, ``xpud doctor``)."""

    enforced: bool
    why: str = ""  # for advisory: the reason, as one short phrase
    warn: bool = True  # whether `xpu run` should say so (not for a simulated machine with no nodes)

    @property
    def text(self) -> str:
        """``enforced`` or ``advisory (why)``."""
        return "enforced" if self.enforced else f"advisory ({self.why})"


def detect(
    setting: str,
    simulated: bool,
    systemd_dir: Path = Path("/run/systemd/system"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    which: Callable = shutil.which,
    euid: Callable[[], int] = os.geteuid,
) -> Enforcement:
    """Whether scopes can be enforced here under ``[isolation] devices = setting``. ``auto`` enforces on
    real cards only; ``enforced`` also on a simulated machine (tests, demos); ``advisory`` never."""
    if setting == "advisory":
        return Enforcement(False, '[isolation] devices = "advisory"')
    if setting == "auto" and simulated:
        return Enforcement(False, "a simulated machine has no device nodes to fence", warn=False)
    if euid() != 0:
        return Enforcement(False, "xpud does not run as root")
    if not systemd_dir.is_dir():
        return Enforcement(False, f"systemd is not PID 1 (no {systemd_dir})")
    if not (cgroup_root / "cgroup.controllers").exists():
        return Enforcement(False, f"no cgroup v2 hierarchy at {cgroup_root}")
    if which(BUSCTL) is None:
        return Enforcement(False, f"no {BUSCTL} (systemd's D-Bus client) in PATH")
    return Enforcement(True)


def owner_tag(state_dir: Path) -> str:
    """This daemon's mark in the names of the scopes it makes for itself (warm commands'): 8 hex digits of
    its state directory's absolute path (two daemons on one host never share one: their ledgers would)."""
    return hashlib.sha256(str(Path(state_dir).absolute()).encode()).hexdigest()[:8]


def unit_name(lease_id: str) -> str:
    """``xpu-lease-<id>.scope``; the id is checked (it becomes part of a unit name)."""
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,64}", lease_id):
        raise ScopeError(f"lease {lease_id!r}: not usable in a unit name")
    return f"xpu-lease-{lease_id}.scope"


def _allow_args(allow: Sequence[str]) -> list[str]:
    """``DeviceAllow`` as busctl's ``a(ss)`` arguments."""
    out = ["DeviceAllow", "a(ss)", str(len(allow))]
    for entry in allow:
        spec, _, perms = entry.partition(" ")
        out += [spec, perms or "rw"]
    return out


def start_argv(unit: str, pids: Sequence[int], allow: Sequence[str], description: str) -> list[str]:
    """``StartTransientUnit`` of scope ``unit`` holding ``pids``, closed to all devices but ``allow``."""
    props = [
        *("Description", "s", description),
        *("PIDs", "au", str(len(pids)), *map(str, pids)),
        *("DevicePolicy", "s", "closed"),
        *_allow_args(allow),
        *("CollectMode", "s", "inactive-or-failed"),
    ]
    return [BUSCTL, "call", *DEST, "StartTransientUnit", "ssa(sv)a(sa(sv))", unit, "fail", "5", *props, "0"]


def attach_argv(unit: str, pid: int) -> list[str]:
    """``AttachProcessesToUnit``: ``pid`` into the running ``unit``."""
    return [BUSCTL, "call", *DEST, "AttachProcessesToUnit", "ssau", unit, "", "1", str(pid)]


def stop_argv(unit: str) -> list[str]:
    """``StopUnit``: SIGTERM to every process left in ``unit`` (then SIGKILL after its stop time-out)."""
    return [BUSCTL, "call", *DEST, "StopUnit", "ss", unit, "replace"]


def list_argv() -> list[str]:
    """``ListUnitsByPatterns``: the loaded lease scopes (any state), as JSON."""
    pattern = ("asas", "0", "1", "xpu-lease-*.scope")  # no state filter, one name pattern
    return [BUSCTL, "--json=short", "call", *DEST, "ListUnitsByPatterns", *pattern]


def listed_leases(out: str) -> list[str]:
    """The lease ids in ``list_argv``'s answer (``{"type": "a(ssssssouso)", "data": [[[name, ...], ...]]}``,
    systemd's ``org.freedesktop.systemd1.Manager.ListUnitsByPatterns``); ValueError when it is not that."""
    data = json.loads(out)["data"][0]
    names = [row[0] for row in data if isinstance(row, list) and row and isinstance(row[0], str)]
    return [n[len("xpu-lease-") : -len(".scope")] for n in names if re.fullmatch(r"xpu-lease-.+\.scope", n)]


def set_argv(unit: str, allow: Sequence[str]) -> list[str]:
    """``SetUnitProperties`` (runtime): ``DeviceAllow=`` reset, then ``allow``."""
    props = [*("DevicePolicy", "s", "closed"), *("DeviceAllow", "a(ss)", "0"), *_allow_args(allow)]
    return [BUSCTL, "call", *DEST, "SetUnitProperties", "sba(sv)", unit, "true", "3", *props]


def unit_properties(allow: Sequence[str]) -> list[str]:
    """The same policy as ``systemd-run --property=`` arguments, for a unit systemd starts itself."""
    return ["--property=DevicePolicy=closed", *(f"--property=DeviceAllow={e}" for e in allow)]


def in_unit(pid: int, unit: str) -> bool:
    """Whether ``pid``'s cgroup (v2) is ``unit``'s."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return any(line.startswith("0::") and line.rstrip().endswith(f"/{unit}") for line in text.splitlines())


def process_uid(pid: int) -> int | None:
    """The real uid of process ``pid`` (``/proc/<pid>/status``), or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


async def run(argv: Sequence[str], timeout_s: float = CALL_TIMEOUT_S) -> tuple[int, str]:
    """Run ``argv`` (no stdin, the clean environment): (exit code, stdout and stderr). A time-out or a
    missing program is an exit code (124, 127), never an exception."""
    try:
        p = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=CLEAN_ENV,
        )
    except OSError as e:
        return 127, str(e)
    try:
        out, _ = await asyncio.wait_for(p.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        await p.wait()
        return 124, f"{argv[0]} took more than {timeout_s:g} s"
    return p.returncode, out.decode(errors="replace").strip()


@dataclass
class Scopes:
    """The daemon's lease scopes. ``engine`` gives cards' minors and MIG ids (``devices.grant_of``);
    ``tree`` where the driver's capability files are; ``extra`` more ``DeviceAllow=`` entries; ``owner``
    this daemon's tag (``owner_tag``) in the names of its warm commands' scopes."""

    engine: object
    enforcement: Enforcement
    tree: DevTree = field(default_factory=DevTree)
    extra: tuple[str, ...] = ()
    runner: Runner = run
    owner: str = "none"
    _warned: str = ""  # the day `xpu run` was last told isolation is advisory
    _ending: set = field(default_factory=set)  # end_later's tasks

    def allow(self, lease) -> list[str]:
        """The lease's ``DeviceAllow=`` list now; ScopeError when its nodes cannot be named."""
        try:
            return allow_list(grant_of(lease, self.engine), self.tree, self.extra)
        except DevNodeError as e:
            raise ScopeError(f"lease {lease.id}: {e}") from None

    async def allow_async(self, lease) -> list[str]:
        """``allow`` off the event loop (it reads the driver's capability files)."""
        return await asyncio.to_thread(self.allow, lease)

    async def _allow(self, lease) -> list[str]:
        return await asyncio.to_thread(self.allow, lease)  # reads the driver's capability files

    async def place(self, lease, pid: int) -> str:
        """Put ``pid`` (and so all it forks from now on) in ``lease``'s scope; returns the unit's name.
        Raises ScopeError when that fails. The hook for anything that starts a lease's process itself
        (a detached job): start it held, call this before it opens a device, then let it run."""
        if not self.enforcement.enforced:
            raise ScopeError(f"device isolation is {self.enforcement.text}")
        unit = unit_name(lease.id)
        allow = await self._allow(lease)
        rc, out = await self.runner(start_argv(unit, [pid], allow, f"xpu lease {lease.id}"))
        if rc != 0 and "already" in out:  # running (another process of the lease): join it
            rc, out = await self.runner(attach_argv(unit, pid))
            if rc == 0:
                await self._set(unit, allow)
        if rc != 0:
            raise ScopeError(f"{unit}: systemd refused the scope: {out or f'exit {rc}'}")
        return await self._placed(unit, pid)

    def warm_id(self, card: int) -> str:
        """A new warm command's scope id on ``card``: ``warm-<owner>-<card>-<hex>`` (``reconcile`` finds
        this daemon's by the owner tag)."""
        return f"{self._warm_prefix}{card}-{secrets.token_hex(4)}"

    @property
    def _warm_prefix(self) -> str:
        return f"warm-{self.owner}-"

    async def _placed(self, unit: str, pid: int) -> str:
        deadline = time.monotonic() + PLACED_WITHIN_S
        while not in_unit(pid, unit):
            if time.monotonic() > deadline:
                raise ScopeError(f"{unit}: process {pid} was not in the scope {PLACED_WITHIN_S:g} s later")
            await asyncio.sleep(0.005)
        return unit

    async def follow(self, lease, unit: str = "") -> None:
        """The lease holds other cards now: its running scope's device list follows (no-op without one).
        ``unit``: another unit of the lease's processes (a detached job's or a rank's service) instead."""
        if self.enforcement.enforced:
            await self._set(unit or unit_name(lease.id), await self._allow(lease), missing_ok=True)

    async def _set(self, unit: str, allow: Sequence[str], missing_ok: bool = False) -> None:
        rc, out = await self.runner(set_argv(unit, allow))
        if rc != 0 and not (missing_ok and "not loaded" in out):
            raise ScopeError(f"{unit}: systemd refused the new device list: {out or f'exit {rc}'}")

    def end_later(self, lease_id: str, after_s: float = END_AFTER_S) -> None:
        """The lease ended: ``after_s`` later (its holder, in the scope itself, exits first) stop its scope,
        so that nothing that escaped the command's process group keeps the lease's devices. No-op
        without a scope."""
        if not self.enforcement.enforced:
            return
        try:
            unit = unit_name(lease_id)
        except ScopeError:
            return

        async def stop() -> None:
            await asyncio.sleep(after_s)
            rc, out = await self.runner(stop_argv(unit))
            if rc != 0 and "not loaded" not in out:
                log.warning("%s: could not stop it: %s", unit, out or f"exit {rc}")

        task = asyncio.ensure_future(stop())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def reconcile(self, active: Collection[str], known: Collection[str]) -> list[str]:
        """Start-up: stop the scopes of leases in ``known`` (this daemon's ledger) that are not ``active``
        any more, now, and this daemon's warm commands' (``warm_id``); those of active leases are kept
        (their jobs outlived the daemon), others' (another daemon's) left alone. Returns the stopped units;
        failures are logged."""
        if not self.enforcement.enforced:
            return []
        rc, out = await self.runner(list_argv())
        try:
            if rc != 0:
                raise ValueError(out or f"exit {rc}")
            listed = listed_leases(out)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            log.warning("could not list the lease scopes left from before: %s", e)
            return []
        stopped = []
        for lease_id in listed:
            warm = lease_id.startswith(self._warm_prefix)
            if not warm and (lease_id in active or lease_id not in known):
                continue
            unit = unit_name(lease_id)
            rc, out = await self.runner(stop_argv(unit))
            if rc != 0 and "not loaded" not in out:
                log.warning("%s: could not stop it: %s", unit, out or f"exit {rc}")
                continue
            why = (
                "a warm command's, left by the last daemon"
                if warm
                else f"lease {lease_id} ended while no daemon ran"
            )
            log.info("%s: stopped (%s)", unit, why)
            stopped.append(unit)
        return stopped

    def warn_today(self, today: Callable[[], str] = lambda: time.strftime("%Y-%m-%d")) -> bool:
        """Whether an advisory state is worth a word to `xpu run`'s user now: once per host and day."""
        if self.enforcement.enforced or not self.enforcement.warn or self._warned == today():
            return False
        self._warned = today()
        return True


def device_scopes(cfg, engine, simulated: bool) -> Scopes:
    """The daemon's ``Scopes`` from its config's ``[isolation]``."""
    iso = cfg.isolation
    proc = Path(iso.proc_root)
    tree = DevTree(Path("/dev"), proc / "driver/nvidia/capabilities", proc / "devices")
    owner = owner_tag(cfg.state_dir)
    return Scopes(engine, detect(iso.devices, simulated), tree, tuple(iso.extra_devices), owner=owner)
