"""A faithful fake of the NVIDIA tools xpud runs: ``nvidia-cuda-mps-control`` and ``nvidia-smi -r``.

``FakeNvidiaTools(fake_nvml)`` is a ``Runner``: the simulated daemon and the tests use it where a real
host runs the binaries. It records every call (``calls``) and plays the documented behaviour
(``man nvidia-cuda-mps-control``; ../shared/REFERENCE.md, MPS). Process ids are made up: nothing here
touches real processes.

The commands and behaviours played, and how state survives daemon restarts: see docs/isolation.md, The
fake NVIDIA tools.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pynvml as N

from xpud.isolation.runner import Completed

MPS_CONTROL, SMI = "nvidia-cuda-mps-control", "nvidia-smi"
DEFAULT_PIPE, DEFAULT_LOG = "/tmp/nvidia-mps", "/var/log/nvidia-mps"
SERVER_MIB = 256  # device memory an MPS server's context takes on its card
_pids = itertools.count(5_000_000 + 100 * os.getpid())


@dataclass
class Server:
    pid: int
    uid: int
    clients: set[int] = field(default_factory=set)
    stopping: bool = False  # shut down once its clients are done
    active_thread_pct: float = 100.0


@dataclass
class ControlDaemon:
    pid: int
    pipe_dir: str
    log_dir: str
    devices: str  # CUDA_VISIBLE_DEVICES it was started with
    servers: dict[int, Server] = field(default_factory=dict)
    waiting: list[tuple[int, int]] = field(default_factory=list)  # (client pid, uid), first come first
    default_pct: float = 100.0
    default_mem: dict[str, str] = field(default_factory=dict)  # device -> "24G"
    killed: list[int] = field(default_factory=list)  # client pids cut off by a forced shutdown or quit


class FakeNvidiaTools:
    """A ``Runner`` that simulates ``nvidia-cuda-mps-control`` and ``nvidia-smi -r`` (thread-safe)."""

    def __init__(self, nvml=None, missing: Sequence[str] = ()):
        self.nvml = nvml  # a FakeNvml, or None (no card effects)
        self.missing = set(missing)  # tools this host lacks (not installed): they answer 127
        self.calls: list[tuple[tuple[str, ...], dict[str, str], str | None]] = []
        self.daemons: dict[str, ControlDaemon] = {}  # pipe dir -> daemon
        self.on_change: Callable[[], None] | None = None  # after each change of the daemons (simstate)
        self._last: dict | None = None
        self._lock = threading.RLock()

    def _changed(self) -> None:
        if self.on_change is not None and (now := self.dump()) != self._last:
            self._last = now
            self.on_change()

    # ------------------------------------------------------------------------------ Runner
    def run(self, argv: Sequence[str], *, env=None, input=None, timeout_s=30.0, detach=False) -> Completed:
        argv = tuple(argv)
        env = dict(env or {})
        with self._lock:
            self.calls.append((argv, {k: v for k, v in env.items() if k.startswith("CUDA_")}, input))
            tool = Path(argv[0]).name
            if tool in self.missing:
                return Completed(argv, 127, "", f"{argv[0]}: not found")
            if tool == MPS_CONTROL:
                try:
                    return self._mps(argv, env, input or "")
                finally:
                    self._changed()
            if tool == SMI:
                return self._smi(argv)
            return Completed(argv, 127, "", f"{argv[0]}: not found")

    def which(self, tool: str) -> str | None:
        """Where the simulated ``tool`` is installed, or None when it is missing."""
        return None if tool in self.missing or tool not in (MPS_CONTROL, SMI) else f"/usr/bin/{tool}"

    # ----------------------------------------------------------------------------- MPS
    def _mps(self, argv, env: Mapping[str, str], text: str) -> Completed:
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE)
        log = env.get("CUDA_MPS_LOG_DIRECTORY", DEFAULT_LOG)
        if "-d" in argv[1:]:
            if pipe in self.daemons:
                return Completed(argv, 1, "", "An instance of this daemon is already running")
            for d in (pipe, log):
                if not Path(d).is_dir():
                    return Completed(argv, 1, "", f"{d}: No such file or directory")
            daemon = ControlDaemon(next(_pids), pipe, log, env.get("CUDA_VISIBLE_DEVICES", ""))
            self.daemons[pipe] = daemon
            Path(pipe, "control").write_text(f"{daemon.pid}\n")
            self._log(daemon, "Startup")
            return Completed(argv, 0)
        daemon = self.daemons.get(pipe)
        if daemon is None:
            return Completed(argv, 1, "", "Cannot find MPS control daemon process")
        out, errors = [], []
        for line in text.splitlines():
            words = line.split()
            if not words:
                continue
            try:
                out.extend(self._command(daemon, words))
            except _Refused as e:
                errors.append(str(e))
            if pipe not in self.daemons:
                break  # quit: the rest of the input goes nowhere
        return Completed(argv, 1 if errors else 0, "".join(f"{o}\n" for o in out), "\n".join(errors))

    def _command(self, d: ControlDaemon, words: list[str]) -> list[str]:
        cmd, args = words[0], words[1:]
        self._log(d, f"Command: {' '.join(words)}")
        if cmd == "get_server_list":
            return [str(pid) for pid in sorted(d.servers)]
        if cmd == "get_client_list":
            return [str(c) for c in sorted(self._server(d, args).clients)]
        if cmd == "start_server":
            if len(args) != 2 or args[0] != "-uid" or not args[1].isdigit():
                raise _Refused("usage: start_server -uid UID")
            uid = int(args[1])
            if any(s.uid == uid for s in d.servers.values()):
                return []
            if d.servers:
                raise _Refused(f"a server for another user is running; uid {uid} has to wait")
            self._start_server(d, uid)
            return []
        if cmd == "shutdown_server":
            s = self._server(d, args[:1])
            if "-f" in args[1:] or not s.clients:
                self._stop_server(d, s)
            else:
                s.stopping = True
            return []
        if cmd == "quit":
            for s in list(d.servers.values()):
                self._stop_server(d, s, start_next=False)
            d.killed.extend(pid for pid, _ in d.waiting)
            d.waiting.clear()
            self._log(d, "Exit")
            del self.daemons[d.pipe_dir]
            Path(d.pipe_dir, "control").unlink(missing_ok=True)
            return []
        if cmd == "set_default_active_thread_percentage":
            d.default_pct = _pct(args)
            return [f"{d.default_pct:g}"]
        if cmd == "get_default_active_thread_percentage":
            return [f"{d.default_pct:.1f}"]
        if cmd == "set_active_thread_percentage":
            s = self._server(d, args[:1])
            s.active_thread_pct = _pct(args[1:])
            return [f"{s.active_thread_pct:g}"]
        if cmd == "get_active_thread_percentage":
            return [f"{self._server(d, args).active_thread_pct:.1f}"]
        if cmd == "set_default_device_pinned_mem_limit":
            if len(args) != 2:
                raise _Refused("usage: set_default_device_pinned_mem_limit DEV VALUE")
            d.default_mem[args[0]] = args[1]
            return []
        if cmd == "get_default_device_pinned_mem_limit":
            return [d.default_mem.get(args[0] if args else "0", "0")]
        raise _Refused(f"Unrecognized command: {cmd}")

    def _server(self, d: ControlDaemon, args: list[str]) -> Server:
        if not args or not args[0].isdigit() or int(args[0]) not in d.servers:
            raise _Refused(f"Server {args[0] if args else '?'} not found")
        return d.servers[int(args[0])]

    def _start_server(self, d: ControlDaemon, uid: int) -> Server:
        s = Server(next(_pids), uid, active_thread_pct=d.default_pct)
        d.servers[s.pid] = s
        card = self._card(d.devices)
        if card is not None:
            self.nvml.add_process(card, s.pid, SERVER_MIB << 20)
        self._log(d, f"Starting new server {s.pid} for user {uid}")
        return s

    def _stop_server(self, d: ControlDaemon, s: Server, start_next: bool = True) -> None:
        d.killed.extend(sorted(s.clients))
        del d.servers[s.pid]
        card = self._card(d.devices)
        if card is not None:
            self.nvml.remove_process(card, s.pid)
        self._log(d, f"Server {s.pid} exited")
        if start_next and d.waiting:
            uid = d.waiting[0][1]
            nxt = self._start_server(d, uid)
            nxt.clients |= {pid for pid, u in d.waiting if u == uid}
            d.waiting = [(pid, u) for pid, u in d.waiting if u != uid]

    def _log(self, d: ControlDaemon, message: str) -> None:
        try:
            with open(Path(d.log_dir, "control.log"), "a") as f:
                f.write(f"[{d.pid}] {message}\n")
        except OSError:
            pass  # the log directory went away: logging is best effort, as for the real daemon

    def _card(self, devices: str) -> int | None:
        """The fake NVML's index of the (first) card in CUDA_VISIBLE_DEVICES."""
        if self.nvml is None or not devices:
            return None
        first = devices.split(",")[0].strip()
        for spec in self.nvml.machine.cards:
            if first in (spec.uuid, str(spec.index)):
                return spec.index
        return None

    # ------------------------------------------------------------- CUDA clients (test hooks)
    def connect(self, pipe_dir: str, pid: int, uid: int) -> str:
        """A CUDA program of ``uid`` initialises under MPS. Returns "served", "waiting" or "no-daemon"
        (then it runs without MPS, as the real driver does)."""
        with self._lock:
            try:
                return self._connect(pipe_dir, pid, uid)
            finally:
                self._changed()

    def _connect(self, pipe_dir: str, pid: int, uid: int) -> str:
        d = self.daemons.get(pipe_dir)
        if d is None:
            return "no-daemon"
        same = next((s for s in d.servers.values() if s.uid == uid and not s.stopping), None)
        if same is not None:
            same.clients.add(pid)
            return "served"
        if not d.servers:
            self._start_server(d, uid).clients.add(pid)
            return "served"
        d.waiting.append((pid, uid))
        for s in list(d.servers.values()):  # ask the other user's server to go once its clients are done
            s.stopping = True
            if not s.clients:
                self._stop_server(d, s)
        return "served" if pid not in {p for p, _ in d.waiting} else "waiting"

    def disconnect(self, pipe_dir: str, pid: int) -> None:
        """A client process exits."""
        with self._lock:
            d = self.daemons.get(pipe_dir)
            if d is None:
                return
            d.waiting = [(p, u) for p, u in d.waiting if p != pid]
            for s in list(d.servers.values()):
                s.clients.discard(pid)
                if s.stopping and not s.clients:
                    self._stop_server(d, s)
            self._changed()

    # ------------------------------------------------------------------------- nvidia-smi
    def _smi(self, argv) -> Completed:
        args = list(argv[1:])
        if ("-r" in args or "--gpu-reset" in args) and "-i" in args:
            target = args[args.index("-i") + 1] if args.index("-i") + 1 < len(args) else ""
            card = self._find(target)
            if card is None:
                return Completed(argv, 6, "", f"No devices were found matching {target!r}")
            bus = self.nvml.machine.cards[card].bus_id
            try:
                self.nvml.reset(card)
            except N.NVMLError:
                return Completed(
                    argv,
                    255,
                    "",
                    f"GPU {bus} is currently in use by another process.\n"
                    "1 device is currently being used by one or more other processes "
                    "(e.g., Fabric Manager, CUDA application, graphics application such as an X server, "
                    "or a monitoring application such as another instance of nvidia-smi).",
                )
            return Completed(argv, 0, f"GPU {bus} was successfully reset.\nAll done.\n")
        return Completed(argv, 2, "", f"nvidia-smi (simulated): unsupported arguments {' '.join(args)}")

    def _find(self, target: str) -> int | None:
        if self.nvml is None:
            return None
        for spec in self.nvml.machine.cards:
            if target in (str(spec.index), spec.uuid) or target.upper().endswith(spec.bus_id.upper()[-12:]):
                return spec.index
        return None

    # ------------------------------------------------------------------------- inspection
    def snapshot(self) -> dict[str, dict]:
        """Pipe dir -> {"pid", "devices", "servers": {pid: (uid, sorted clients)}, "waiting"} (a copy)."""
        with self._lock:
            return {
                pipe: {
                    "pid": d.pid,
                    "devices": d.devices,
                    "servers": {s.pid: (s.uid, sorted(s.clients)) for s in d.servers.values()},
                    "waiting": list(d.waiting),
                    "default_pct": d.default_pct,
                }
                for pipe, d in self.daemons.items()
            }

    # ------------------------------------------------------------------------- persistence
    def dump(self) -> dict:
        """Everything the control daemons hold, as JSON-ready data (``restore`` reads it back)."""
        with self._lock:
            return {
                "daemons": [
                    {
                        "pid": d.pid,
                        "pipe_dir": d.pipe_dir,
                        "log_dir": d.log_dir,
                        "devices": d.devices,
                        "default_pct": d.default_pct,
                        "default_mem": dict(sorted(d.default_mem.items())),
                        "waiting": [list(w) for w in d.waiting],
                        "killed": list(d.killed[-MAX_KILLED:]),
                        "servers": [
                            {
                                "pid": s.pid,
                                "uid": s.uid,
                                "clients": sorted(s.clients),
                                "stopping": s.stopping,
                                "active_thread_pct": s.active_thread_pct,
                            }
                            for s in sorted(d.servers.values(), key=lambda s: s.pid)
                        ],
                    }
                    for _, d in sorted(self.daemons.items())
                ]
            }

    def restore(self, data: Mapping) -> None:
        """Take over control daemons that outlived the previous daemon (``dump``'s output). Raises
        ValueError, KeyError or TypeError for values the tools could not have produced."""
        global _pids
        daemons: dict[str, ControlDaemon] = {}
        saved = data["daemons"]
        if not isinstance(saved, list) or len(saved) > MAX_DAEMONS:
            raise ValueError(f"daemons: expected a list of at most {MAX_DAEMONS}")
        for x in saved:
            d = ControlDaemon(
                _num(x["pid"], "pid", 1, _MAX_PID, int),
                _text(x["pipe_dir"], "pipe_dir"),
                _text(x["log_dir"], "log_dir"),
                _text(x["devices"], "devices"),
                default_pct=_num(x["default_pct"], "default_pct", 0.0, 100.0, float),
            )
            mem = x["default_mem"]
            if not isinstance(mem, dict) or len(mem) > 64:
                raise ValueError("default_mem: expected a table of at most 64 devices")
            d.default_mem = {_text(k, "device"): _text(v, "memory limit") for k, v in mem.items()}
            d.waiting = [
                (_num(p, "pid", 1, _MAX_PID, int), _num(u, "uid", 0, _MAX_PID, int)) for p, u in x["waiting"]
            ]
            d.killed = [_num(p, "pid", 1, _MAX_PID, int) for p in x["killed"]][-MAX_KILLED:]
            for s in x["servers"]:
                server = Server(
                    _num(s["pid"], "pid", 1, _MAX_PID, int),
                    _num(s["uid"], "uid", 0, _MAX_PID, int),
                    {_num(c, "pid", 1, _MAX_PID, int) for c in s["clients"]},
                    bool(s["stopping"]),
                    _num(s["active_thread_pct"], "active_thread_pct", 0.0, 100.0, float),
                )
                d.servers[server.pid] = server
            if d.pipe_dir in daemons:
                raise ValueError(f"two control daemons on {d.pipe_dir}")
            daemons[d.pipe_dir] = d
        with self._lock:
            self.daemons = daemons
            top = max((p for d in daemons.values() for p in (d.pid, *d.servers)), default=0)
            _pids = itertools.count(max(next(_pids), top + 1))
            for d in daemons.values():
                card = self._card(d.devices)
                for s in d.servers.values():
                    if card is not None:
                        self.nvml.add_process(card, s.pid, SERVER_MIB << 20)
            self._last = self.dump()


MAX_DAEMONS = 1024
MAX_KILLED = 256  # killed client pids kept per control daemon (tests read the last few)
_MAX_PID = (1 << 31) - 1


def _num(value, what: str, lo, hi, kind):
    allowed = int if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed) or not lo <= value <= hi:  # NaN fails too
        raise ValueError(f"{what} = {value!r}: expected a number {lo}..{hi}")
    return kind(value)


def _text(value, what: str) -> str:
    if not isinstance(value, str) or len(value) > 4096:
        raise ValueError(f"{what}: expected a string of at most 4096 characters")
    return value


class _Refused(Exception):
    """One command the control daemon answered with an error (the session goes on)."""


def _pct(args: list[str]) -> float:
    try:
        value = float(args[0])
    except (IndexError, ValueError):
        raise _Refused("expected a percentage 1..100") from None
    if not 0 < value <= 100:
        raise _Refused(f"{value:g}: expected a percentage 1..100")
    return value
