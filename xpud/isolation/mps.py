"""MPS slices: one MPS control daemon per card, per-client limits in the child's environment.

Invariants: one server uid per card is a placement rule, not a hidden wait (a card whose live MPS slices
belong to uid A takes no slice for uid B: ``fits`` says no, ``why_not`` says why); the card's compute mode
is saved before it is set to EXCLUSIVE_PROCESS and restored when it leaves sliced mode, after a crash too;
the limits bound well-behaved programs, not a hostile user (MIG is the hard isolation).

The life of a card under MPS, what the backend knows of the control daemon, and the keeper: see
docs/isolation.md, MPS.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from xpud.errors import Conflict
from xpud.hw.types import NvmlError
from xpud.isolation import mps_keeper
from xpud.isolation.base import Held, Reconciled, shares_fit, usable_memory
from xpud.isolation.runner import Runner, ToolError, check
from xpud.model import CardInfo, CardMode, Slice, SliceSpec

log = logging.getLogger("xpud.isolation.mps")

MPS_CONTROL = "nvidia-cuda-mps-control"
MAX_CLIENTS = 48  # clients per card since Volta
# Left out of slices when [cards] reserved_memory_mib = 0: the driver's own reservation (~512 MiB on an
# idle card) plus the MPS server's context (~300-500 MiB, unverified), rounded up.
RESERVED_ESTIMATE = 1024 << 20
MIB = 1 << 20
CHECK_INTERVAL_S = 5.0  # how often tidy asks whether a control daemon the backend started still answers
KEEPER_WAIT_S = 20.0  # how long the backend waits for the MPS keeper to start or quit a control daemon
KEEPER_POLL_S = 0.1


class MpsIsolation:
    """MPS for one card."""

    name = "mps"

    def __init__(
        self,
        card: CardInfo,
        hw,
        runner: Runner,
        runtime_dir: Path,
        reserved_bytes: int = 0,
        idle_keep_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        keeper: bool = False,
    ):
        self.card = card
        self.hw = hw
        self.runner = runner
        self.reserved_bytes = reserved_bytes or RESERVED_ESTIMATE
        self.base = Path(runtime_dir) / "mps" / str(card.index)
        self.pipe_dir = self.base / "pipe"
        self.log_dir = self.base / "log"
        self._saved_mode = self.base / "compute-mode"  # the mode to restore when MPS stops
        self._owners: dict[str, int] = {}  # lease id -> uid of its slice on this card (live slices)
        self.idle_keep_s = idle_keep_s  # [cards] mps_idle_keep_s
        self.clock = clock
        # (uid, since): the server kept after the last slice of ``uid`` ended, at ``since`` (clock seconds)
        self._idle: tuple[int, float] | None = None
        self._known_running = False  # the control daemon answered (or was started) and was not told to quit
        self._next_check = 0.0  # when tidy asks the control daemon again (time.monotonic)
        self.keeper = keeper  # [cards] mps_keeper: `xpud mps-keeper` starts and quits the control daemon

    # ---------------------------------------------------------------------------- control daemon
    def _env(self) -> dict[str, str]:
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
            "CUDA_VISIBLE_DEVICES": self.card.uuid,
        }

    def _control(self, *commands: str):
        return self.runner.run([MPS_CONTROL], env=self._env(), input="".join(f"{c}\n" for c in commands))

    def _ask(self):
        """``get_server_list``: whether the control daemon answers is learnt from it."""
        done = self._control("get_server_list")
        self._known_running = done.ok
        return done

    def running(self) -> bool:
        """Whether this card's control daemon answers (asked now)."""
        return self._ask().ok

    def servers(self) -> list[int]:
        """PIDs of the MPS servers the control daemon runs now ([] when it does not run)."""
        done = self._ask()
        return [int(x) for x in done.lines() if x.isdigit()] if done.ok else []

    def needs_tool(self, op: str, lease_id: str = "", owner_uid: int = -1) -> bool:
        """Whether ``prepare`` (``op`` "prepare") of a slice for ``owner_uid`` or ``teardown`` of
        ``lease_id``'s slice ("teardown") would run the control tool now; when not, it is bookkeeping only
        (no I/O)."""
        if op == "prepare":
            return not self._known_running or self._idle_other(owner_uid)
        if op == "teardown":  # the last slice: its server is shut down unless kept idle
            return self.idle_keep_s <= 0 and not set(self._owners) - {lease_id}
        return True

    def idle_server(self) -> int | None:
        """The uid whose server is kept idle on this card (no slice left), or None."""
        return None if self._idle is None else self._idle[0]

    def _idle_other(self, owner_uid: int) -> bool:
        """Whether an idle server of another uid than ``owner_uid`` is kept (a prepare shuts it down)."""
        return self._idle is not None and self._idle[0] != owner_uid

    def _start(self) -> None:
        if self._known_running:
            return
        if self.running():
            self._hand_to_keeper()
            return
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o755)  # clients of every user find the pipe; only root writes here
        try:
            mode = self.hw.compute_mode(self.card.index) or "DEFAULT"
            if not self._saved_mode.exists():
                self._saved_mode.write_text(f"{mode}\n")
            if mode != "EXCLUSIVE_PROCESS":
                self.hw.set_compute_mode(self.card.index, "EXCLUSIVE_PROCESS")
        except NvmlError as e:
            raise Conflict(f"card {self.card.index}: cannot set EXCLUSIVE_PROCESS for MPS: {e}") from None
        if self.keeper:
            self._ask_keeper(start=True)
        else:
            check(self.runner.run([MPS_CONTROL, "-d"], env=self._env(), detach=True))
        self._known_running = True
        log.info("card %d: MPS control daemon started (pipe %s)", self.card.index, self.pipe_dir)

    def _stop(self) -> None:
        if self.keeper:
            self._ask_keeper(start=False)
        elif self.running():
            check(self._control("quit"))
            self._known_running = False
            log.info("card %d: MPS control daemon stopped", self.card.index)
        self._restore_compute_mode()

    def _hand_to_keeper(self) -> None:
        """With a keeper: a running daemon without a ``want`` (xpud started it before mps_keeper was set)
        is asked for, so that the keeper adopts it and keeps it."""
        if self.keeper and not (self.base / mps_keeper.WANT).exists():
            mps_keeper.write_want(self.base, self._env())

    def _ask_keeper(self, start: bool) -> None:
        """Have the MPS keeper start (``want`` written) or quit (``want`` removed) this card's control
        daemon, and wait until its pipe answers or stops answering; ToolError after KEEPER_WAIT_S, or at
        once when the keeper reports that the start failed. Off the event loop (the engine's hardware
        thread), as every tool run."""
        failed = self.base / mps_keeper.FAILED
        if start:
            failed.unlink(missing_ok=True)
            mps_keeper.write_want(self.base, self._env())
        else:
            (self.base / mps_keeper.WANT).unlink(missing_ok=True)
        deadline = time.monotonic() + KEEPER_WAIT_S
        while self.running() != start:
            if start and failed.exists():
                said = failed.read_text()[:500].strip()
                raise ToolError(
                    f"card {self.card.index}: the MPS keeper could not start the control daemon: {said}"
                )
            if time.monotonic() >= deadline:
                raise ToolError(
                    f"card {self.card.index}: no MPS keeper {'started' if start else 'quit'} the control "
                    f"daemon on {self.pipe_dir} within {KEEPER_WAIT_S:g} s ([cards] mps_keeper = true): run "
                    f"`xpud mps-keeper --dir {self.base.parent}` on this host (on Kubernetes: the "
                    "xpud-mps-keeper DaemonSet, deploy/kubernetes/mps-keeper.yaml)"
                )
            time.sleep(KEEPER_POLL_S)
        if not start:
            log.info("card %d: MPS control daemon stopped by the MPS keeper", self.card.index)

    def _restore_compute_mode(self) -> None:
        if not self._saved_mode.exists():
            return
        mode = self._saved_mode.read_text().strip() or "DEFAULT"
        try:
            self.hw.set_compute_mode(self.card.index, mode)
        except NvmlError as e:
            raise Conflict(f"card {self.card.index}: cannot restore compute mode {mode}: {e}") from None
        self._saved_mode.unlink()

    def _shutdown_servers(self) -> None:
        for pid in self.servers():
            check(self._control(f"shutdown_server {pid} -f"))

    # ------------------------------------------------------------------------------- Isolation
    def fits(self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec, owner_uid: int = -1) -> bool:
        return (
            len(held) < MAX_CLIENTS
            and shares_fit(held, card, self.reserved_bytes, spec)
            and not self._other_user(owner_uid)
        )

    def why_not(self, card, held, spec, owner_uid=-1) -> str:
        other = self._other_user(owner_uid)
        if other is not None:
            return (
                f"card {card.index}'s MPS server serves uid {other} (one user per MPS server): "
                "it takes your slice once that user's slices there end"
            )
        if len(held) >= MAX_CLIENTS:
            return f"card {card.index} has {MAX_CLIENTS} MPS clients, the most MPS allows"
        return ""

    def serves_other_user(self, owner_uid: int) -> bool:
        return self._other_user(owner_uid) is not None

    def _other_user(self, owner_uid: int) -> int | None:
        uids = set(self._owners.values())
        return next(iter(uids)) if owner_uid >= 0 and uids and uids != {owner_uid} else None

    def prepare(self, card, held, spec, lease_id, owner_uid):
        self._start()
        if self._idle_other(owner_uid):  # never join another user's server: shut it down first
            uid = self._idle[0]
            self._shutdown_servers()
            log.info("card %d: idle MPS server of uid %d shut down for uid %d", card.index, uid, owner_uid)
        self._idle = None
        s, env = self.limits(card, spec, lease_id)
        self._owners[lease_id] = owner_uid
        return s, {**env, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir)}

    def limits(self, card: CardInfo, spec: SliceSpec, key: str) -> tuple[Slice, dict[str, str]]:
        """The ``spec`` slice a client ``key`` would get, and its limits as environment (no pipe directory:
        that makes a process an MPS client). Bookkeeping only."""
        mem_mib = int(usable_memory(card, self.reserved_bytes) * spec.memory_fraction) // MIB
        s = Slice(card.index, spec.name, mem_mib * MIB, spec.compute_pct, handle=f"mps:{card.index}:{key}")
        env = {
            "CUDA_VISIBLE_DEVICES": card.uuid,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(spec.compute_pct),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={mem_mib}M",
            "XPU_MEMORY_LIMIT_BYTES": str(s.memory_bytes),
            "XPU_COMPUTE_PCT": str(spec.compute_pct),
        }
        return s, env

    def teardown(self, card, s) -> None:
        uid = self._owners.pop(s.handle.rpartition(":")[2], None)
        if self._owners:
            return
        if self.idle_keep_s > 0:  # kept for the next slice of the same uid (an unknown one: -1, any
            self._idle = (-1 if uid is None else uid, self.clock())  # slice's prepare shuts it down)
            return
        self._idle = None
        self._shutdown_servers()

    def enter_sliced(self, card) -> None:
        self._start()

    def leave_sliced(self, card) -> None:
        self._owners.clear()
        self._idle = None  # quit stops the servers too
        self._stop()

    def switch_blocker(self, card, sliced: bool) -> str:
        return ""

    def reconcile(self, card, mode: CardMode, held: Sequence[Held]) -> Reconciled:
        self._owners = {h.lease_id: h.owner_uid for h in held}
        self._idle = None  # a server without slices is shut down below
        notes = []
        running = self.running()
        if held or mode is CardMode.SLICED:
            if not running:
                self._start()
                notes.append(f"card {card.index}: MPS control daemon started again for its slices")
            elif not held and self.servers():
                self._shutdown_servers()
                notes.append(f"card {card.index}: MPS server without slices shut down")
            else:
                notes.append(f"card {card.index}: MPS control daemon adopted")
            self._hand_to_keeper()
            return Reconciled(CardMode.SLICED, [], notes)
        if running:
            self._stop()
            notes.append(f"card {card.index}: orphaned MPS control daemon stopped, compute mode restored")
        else:
            if self.keeper:  # a start asked for before a crash is asked no longer
                (self.base / mps_keeper.WANT).unlink(missing_ok=True)
            if self._saved_mode.exists():
                self._restore_compute_mode()
                notes.append(f"card {card.index}: compute mode restored after MPS")
        return Reconciled(mode, [], notes)

    def _idle_expired(self, now: float) -> bool:
        return self._idle is not None and now - self._idle[1] >= self.idle_keep_s

    def tidy_due(self, now: float) -> bool:
        """Whether ``tidy`` has anything to do at ``now`` (time.monotonic): the engine claims the card
        for it only then."""
        return self._idle_expired(now) or (self._known_running and now >= self._next_check)

    def tidy(self, now: float) -> list[str]:
        """An idle server kept ``mps_idle_keep_s`` is shut down (forced: no lease of its uid remains).
        Every CHECK_INTERVAL_S, while the card is sliced: a control daemon that stopped answering is
        started again (the slices' next clients need it)."""
        notes = []
        if self._idle_expired(now) and self._idle is not None:
            uid = self._idle[0]
            try:
                self._shutdown_servers()
            except ToolError as e:  # it stays idle; tried again in CHECK_INTERVAL_S
                self._idle = (uid, now + CHECK_INTERVAL_S - self.idle_keep_s)
                log.warning("card %d: idle MPS server of uid %d not shut down: %s", self.card.index, uid, e)
            else:
                self._idle = None
                notes.append(f"card {self.card.index}: idle MPS server of uid {uid} shut down")
        if not (self._known_running and now >= self._next_check):
            return notes
        self._next_check = now + CHECK_INTERVAL_S
        if self.running():
            return notes
        self._start()
        return [*notes, f"card {self.card.index}: MPS control daemon had stopped answering; started again"]
