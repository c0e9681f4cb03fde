"""The MPS keeper: owns the MPS control daemons so that they outlive xpud (``xpud mps-keeper``).

On bare metal the control daemons outlive a restart of xpud because its unit has ``KillMode=process``.
In a container they would be the xpud container's children and end with its pod, and with them every
MPS client. With ``[cards] mps_keeper = true`` xpud's MPS backend starts no control daemon itself: it
asks a keeper, a small process of its own (on Kubernetes its own DaemonSet, which is not rolled with
xpud's), through files in the directory both share, ``<dir>/<card index>/`` (``<runtime dir>/mps``):

- ``want``: written by xpud (atomically): ``{"env": {...}}`` with the daemon's ``CUDA_MPS_PIPE_DIRECTORY``,
  ``CUDA_MPS_LOG_DIRECTORY`` and ``CUDA_VISIBLE_DEVICES``. The keeper starts ``nvidia-cuda-mps-control -d``
  with that environment, unless a daemon already answers on that pipe directory (adopted: a restarted
  keeper never starts a second one). xpud waits until the pipe answers. xpud removes ``want`` to have the
  daemon quit: the keeper sends ``quit``.
- ``kept``: written by the keeper: the ``want`` it acts on, so that a keeper restarted after xpud removed
  ``want`` still quits that daemon.
- ``failed``: written by the keeper when a start failed (one line: what the tool said); xpud reports it
  instead of waiting out its time.

The keeper scans every ``SCAN_S`` (stdlib only, no inotify); it asks a daemon it keeps whether it still
answers every ``CHECK_S`` and starts one that died again. It runs the tools through a ``Runner``, the same
commands as the backend (the fake tools in tests).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from xpud.isolation.runner import Runner

log = logging.getLogger("xpud.isolation.mps_keeper")

MPS_CONTROL = "nvidia-cuda-mps-control"
WANT, KEPT, FAILED = "want", "kept", "failed"
ENV_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_VISIBLE_DEVICES")
MAX_FILE_BYTES = 4096
SCAN_S = 0.2  # how often the keeper reads the want files
CHECK_S = 5.0  # how often it asks a daemon it keeps whether it still answers
_DEVICES = re.compile(r"[A-Za-z0-9,_/:.-]{1,1000}")


def write_want(card_dir: Path, env: dict[str, str]) -> None:
    """Ask the keeper for the control daemon of ``env`` (written whole: a reader never sees half of it)."""
    _write(Path(card_dir) / WANT, json.dumps({"env": {k: env[k] for k in ENV_KEYS}}, sort_keys=True))


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def read_env(path: Path, root: Path) -> dict[str, str] | None:
    """The daemon environment in a ``want`` or ``kept`` file; None when there is none. ValueError (one
    line) for a file that is not one: too long, not JSON, other keys, or directories outside ``root``."""
    try:
        raw = path.read_bytes()[: MAX_FILE_BYTES + 1]
    except FileNotFoundError:
        return None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: longer than {MAX_FILE_BYTES} bytes")
    try:
        env = json.loads(raw)["env"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f'{path}: not {{"env": {{...}}}} JSON') from None
    if not isinstance(env, dict) or sorted(env) != sorted(ENV_KEYS):
        raise ValueError(f"{path}: env must have exactly {', '.join(ENV_KEYS)}")
    if not all(isinstance(v, str) for v in env.values()):
        raise ValueError(f"{path}: env values must be strings")
    for key in ENV_KEYS[:2]:
        d = env[key]
        if not os.path.isabs(d) or os.path.normpath(d) != d or not Path(d).is_relative_to(root):
            raise ValueError(f"{path}: {key} {d!r} is not a directory under {root}")
    if not _DEVICES.fullmatch(env["CUDA_VISIBLE_DEVICES"]):
        raise ValueError(f"{path}: CUDA_VISIBLE_DEVICES {env['CUDA_VISIBLE_DEVICES']!r} is not a device list")
    return env


@dataclass
class _Kept:
    stamp: tuple[int, int]  # the want file's (inode, mtime_ns): a rewritten want is acted on at once
    env: dict[str, str]
    next_check: float  # when the keeper asks the daemon again (time.monotonic)


class Keeper:
    """Keeps one control daemon per ``<root>/<card>/want``; ``scan`` once, or ``run`` until stopped."""

    def __init__(self, root: Path, runner: Runner, clock=time.monotonic):
        self.root = Path(os.path.normpath(os.path.abspath(root)))
        self.runner = runner
        self.clock = clock
        self._kept: dict[str, _Kept] = {}  # card dir name -> what this keeper keeps there
        self._said: dict[str, str] = {}  # card dir name -> the last problem logged (logged once)

    def _control(self, env: dict[str, str], *commands: str):
        return self.runner.run([MPS_CONTROL], env=env, input="".join(f"{c}\n" for c in commands))

    def answers(self, env: dict[str, str]) -> bool:
        """Whether a control daemon answers on ``env``'s pipe directory (the backend's check)."""
        return self._control(env, "get_server_list").ok

    def run(self, stop: threading.Event, interval_s: float = SCAN_S) -> None:
        while not stop.is_set():
            self.scan()
            stop.wait(interval_s)

    def scan(self) -> list[str]:
        """One pass over the card directories; what it did, one line each."""
        notes: list[str] = []
        try:
            cards = sorted(p for p in self.root.iterdir() if p.name.isdigit() and p.is_dir())
        except OSError as e:
            self._say("", f"{self.root}: {e.strerror}")
            return notes
        for d in cards:
            try:
                notes += self._keep(d)
            except (OSError, ValueError) as e:
                self._say(d.name, str(e))
        for note in notes:
            log.info("%s", note)
        return notes

    def _say(self, card: str, problem: str) -> None:
        if self._said.get(card) != problem:
            self._said[card] = problem
            log.warning("%s", problem)

    def _keep(self, d: Path) -> list[str]:
        name, want_p, kept_p = d.name, d / WANT, d / KEPT
        try:
            st = want_p.stat()
        except FileNotFoundError:
            return self._quit(d)
        stamp = (st.st_ino, st.st_mtime_ns)
        k = self._kept.get(name)
        now = self.clock()
        if k is not None and k.stamp == stamp and now < k.next_check:
            return []
        try:
            env = read_env(want_p, self.root)
        except ValueError as e:
            _write(d / FAILED, str(e))
            raise
        if env is None:
            return self._quit(d)
        notes = []
        try:
            old = read_env(kept_p, self.root)
        except ValueError:
            old = None
        if old is not None and old != env and self.answers(old):  # xpud wants another daemon here
            self._control(old, "quit")
            notes.append(f"card {name}: MPS control daemon on {old[ENV_KEYS[0]]} quit for a new want")
        if self.answers(env):
            if k is None or k.env != env:
                notes.append(f"card {name}: MPS control daemon on {env[ENV_KEYS[0]]} adopted")
        else:
            for key in ENV_KEYS[:2]:
                Path(env[key]).mkdir(parents=True, exist_ok=True)
            done = self.runner.run([MPS_CONTROL, "-d"], env=env, detach=True)
            if not done.ok:
                said = (done.stderr or done.stdout).strip().replace("\n", "; ")
                problem = f"card {name}: `{MPS_CONTROL} -d` failed (status {done.returncode}): {said}"
                _write(d / FAILED, problem)
                self._kept[name] = _Kept(stamp, env, now + CHECK_S)  # tried again then, or on a new want
                self._say(name, problem)
                return notes
            notes.append(f"card {name}: MPS control daemon started on {env[ENV_KEYS[0]]}")
        if old != env:
            _write(kept_p, json.dumps({"env": env}, sort_keys=True))
        (d / FAILED).unlink(missing_ok=True)
        self._said.pop(name, None)
        self._kept[name] = _Kept(stamp, env, now + CHECK_S)
        return notes

    def _quit(self, d: Path) -> list[str]:
        """No want: the daemon this keeper kept there (in memory or in ``kept``) is told to quit."""
        k = self._kept.get(d.name)
        kept_p = d / KEPT
        if k is None and not kept_p.exists():
            return []
        try:
            env = k.env if k is not None else read_env(kept_p, self.root)
        except ValueError:
            env = None
        notes = []
        if env is not None and self.answers(env):
            done = self._control(env, "quit")
            if not done.ok and self.answers(env):
                self._say(d.name, f"card {d.name}: MPS control daemon did not quit: {done.stderr.strip()}")
                return []
            notes.append(f"card {d.name}: MPS control daemon on {env[ENV_KEYS[0]]} quit")
        kept_p.unlink(missing_ok=True)
        (d / FAILED).unlink(missing_ok=True)
        self._kept.pop(d.name, None)
        self._said.pop(d.name, None)
        return notes
