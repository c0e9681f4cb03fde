"""Right-sizing in the daemon: measure every lease each ``[auto] sample_s``, keep the history
(``xpud.planning.usage``), decide (``xpud.planning.sizing``) and act: an ``--mode auto`` restartable lease is
moved to
its new size (``Moves.start`` with ``mode``); any other lease gets the decision as a recommendation.
Every decision is an ``auto`` event (and a ``mark`` for the lease's holder) carrying its evidence.

Hardware reads and /proc walks run in a worker thread (``Engine.run_blocking``), never on the loop.

What must outlive a restart is in the ledger (schema 6): each class's newest ``[auto] history``
readings (written once per round, queued like events) and each tracked lease's class, ``--mode auto``
flag and move state (written at its grant and at each move). ``restore`` reads them back at start, so
``--mode auto`` starts a class from its history and a restored auto lease keeps its budget and hysteresis.
A lease's own readings are not kept: they start afresh (the up/down windows need new evidence anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from xpud.errors import Conflict, NoCapacity
from xpud.ledger.ledger import AutoLeaseRecord
from xpud.model import Mode, Request
from xpud.placement.colocate import overlap
from xpud.planning.runfiles import publish_json
from xpud.planning.sizing import AutoState, Decision, caps, decide, first_mode
from xpud.planning.usage import Reading, UsageBook, job_class, lease_pids, measure

LOAD_DIR = "load"
CLASS_KEPT_S = 30 * 86400.0  # a class not seen for this long is forgotten at the next start


def publish_loads(runtime_dir, loads: dict[str, dict]) -> None:
    """Write ``runtime_dir/load/<lease id>.json`` per lease (atomically) and remove ended leases' files.
    Blocking: off the loop."""
    d = Path(runtime_dir) / LOAD_DIR
    d.mkdir(mode=0o755, exist_ok=True)
    for lease_id, load in loads.items():
        publish_json(load, d, f"{lease_id}.json")
    for f in d.glob("*.json"):
        if f.stem not in loads:
            f.unlink(missing_ok=True)


if TYPE_CHECKING:
    from xpud.engine.engine import Engine

log = logging.getLogger("xpud.controllers.rightsizer")


@dataclass
class Tracked:
    cls: str
    auto: bool  # --mode auto: may be moved
    state: AutoState
    last: Decision | None = None  # the newest decision (a recommendation or a move)
    saved: bool = False  # it has a record in the ledger (auto_leases)


class Rightsizer:
    def __init__(self, engine: Engine, nvml):
        self.engine = engine
        self.nvml = nvml
        self.cfg = engine.cfg.auto
        self.book = UsageBook(self.cfg.history)
        self.tracked: dict[str, Tracked] = {}
        self._since: dict[int, int] = {}  # per card: newest sample timestamp read (µs)
        self._watchers: dict[str, set[asyncio.Queue]] = {}  # lease id -> its WatchLease streams

    # ------------------------------------------------------------------ starting size
    def choose(self, command: str, given_class: str = "") -> tuple[str, str, str]:
        """(mode, class, why) for a new ``--mode auto`` request."""
        cls = job_class(command, given_class)
        mem = max((c.info.memory_total_bytes for c in self.engine.cards.values()), default=0)
        mode, why = first_mode(self.book, cls, self.cfg, self.engine.cfg.slices, mem)
        return mode, cls, why

    def track(self, lease_id: str, cls: str, auto: bool) -> None:
        self.tracked[lease_id] = t = Tracked(cls, auto, AutoState())
        self.book.class_of[lease_id] = cls  # its class's profile stands for it until it is measured
        lease = self.engine.leases.get(lease_id)
        if auto or (lease is not None and cls != job_class(lease.command)):
            self._save(lease_id, t)  # else a restart derives the same from the command: no write

    def class_of(self, lease_id: str) -> str:
        """The job class a lease is measured under ("" when it is not tracked)."""
        t = self.tracked.get(lease_id)
        return t.cls if t is not None else ""

    def _save(self, lease_id: str, t: Tracked) -> None:
        t.saved = True
        s = t.state
        rec = AutoLeaseRecord(lease_id, t.cls, t.auto, s.moves, s.last_move_t, s.last_direction)
        self.engine.ledger.save_logged(self.engine.ledger.save_auto_lease_op(rec))

    def restore(self) -> None:
        """After a start: each class's recorded readings (``--mode auto`` starts from them) and, for the
        leases restored from the ledger, their class, ``--mode auto`` flag and moves so far (so the
        budget and the hysteresis hold across a restart). Each lease's own readings start afresh. Reads
        the ledger once (start-up, before serving)."""
        led = self.engine.ledger
        led.forget_stale_usage(self.engine.clock() - CLASS_KEPT_S)
        by_newest = sorted(led.class_readings().items(), key=lambda kv: kv[1][-1].t)
        for cls, readings in by_newest:  # the most recently measured last: kept if over the cap
            if readings[-1].t < self.engine.clock() - CLASS_KEPT_S:
                continue
            self.book.keep_class(cls, deque(readings, maxlen=self.book.keep))
        for lid, rec in led.auto_leases().items():
            if lid in self.engine.leases:
                state = AutoState(rec.moves, rec.last_move, rec.last_direction)
                self.tracked[lid] = Tracked(rec.job_class, rec.auto, state, saved=True)
                self.book.class_of[lid] = rec.job_class

    # ------------------------------------------------------------------ co-location (issue 16 item 4)
    def colocation(self, req: Request) -> Callable[[int], float] | None:
        """A tie-breaker for the slice placement of ``req``: per card, the contention its class's profile
        expects beside the card's leases (``placement.colocate.overlap``), on MPS cards only (a MIG
        instance has its own memory bandwidth and cache). Reads only the kept usage history: no hardware
        call on the grant path, and nothing at all unless cards tie. A class with no profile (no history)
        gives 0 everywhere: placement as without it."""
        e, book = self.engine, self.book
        mine: list = []  # the class's profile, looked up at the first tie only

        def cost(card: int) -> float:
            if not mine:
                mine.append(book.class_profile(req.job_class or job_class(req.command)))
            c = e.cards.get(card)
            if mine[0] is None or c is None or e.isolation_name(card) != "mps":
                return 0.0
            return overlap(mine[0], [p for lid in c.slices if (p := book.lease_profile(lid)) is not None])

        return cost

    # ------------------------------------------------------------------ one round
    def _read(self, plan: list[tuple[str, int, int | None]]) -> dict:
        """Worker thread: per card the samples and memory, per lease its pids."""
        cards = {card for _, card, _ in plan}
        util = {i: self.nvml.process_utilization(i, self._since.get(i, 0)) for i in cards}
        memory = {i: self.nvml.process_memory(i) for i in cards}
        pids = {lid: lease_pids(pid) for lid, _, pid in plan}
        return {"util": util, "memory": memory, "pids": pids}

    async def poll(self) -> list[Decision]:
        e = self.engine
        leases = [x for x in e.leases.values() if len(x.cards) == 1 and x.id not in e.moves.pending]
        if not leases:
            return []
        got = await e.run_blocking(self._read, [(x.id, x.cards[0], x.holder_pid) for x in leases])
        now = e.clock()
        out, taken = [], []
        for i, samples in got["util"].items():
            if samples:
                self._since[i] = max(self._since.get(i, 0), *(s[1] for s in samples))
        for lease in leases:
            if lease.id not in e.leases or lease.id in e.moves.pending:
                continue  # ended or started moving while the read ran
            card = lease.cards[0]
            cap, mem_frac = caps(str(lease.mode), e.cfg.slices)
            total = e.cards[card].info.memory_total_bytes
            r = measure(
                now, got["pids"][lease.id], got["util"][card], got["memory"][card], cap, int(mem_frac * total)
            )
            t = self.tracked.setdefault(lease.id, Tracked(job_class(lease.command), False, AutoState()))
            self.book.add(lease.id, t.cls, r)
            taken.append((t.cls, r))
            d = decide(
                lease.id,
                str(lease.mode),
                lease.restartable,
                self.book.history(lease.id),
                t.state,
                now,
                self.cfg,
                e.cfg.slices,
                total,
            )
            if d is not None:
                out.append(await self._act(lease.id, t, d, r))
        e.ledger.add_readings(taken, self.cfg.history)  # the class histories outlive a restart
        return out

    async def _act(self, lease_id: str, t: Tracked, d: Decision, r: Reading) -> Decision:
        e = self.engine
        if d.move and not t.auto:  # measured only: xpud never moves a lease that did not ask for auto
            d = Decision(d.lease_id, d.direction, d.current, d.to, False, f"{d.evidence}; not --mode auto")
        if d.move:
            try:
                await e.moves.start(lease_id, f"right-sizing: {d.evidence}", mode=Mode(d.to))
            except (NoCapacity, Conflict) as err:
                d = Decision(
                    d.lease_id, d.direction, d.current, d.to, False, f"{d.evidence}; not moved: {err}"
                )
            else:
                t.state.moves += 1
                t.state.last_move_t, t.state.last_direction = e.clock(), d.direction
                self.book.moved(lease_id)
                self._save(lease_id, t)
        changed = t.last is None or (t.last.to, t.last.move) != (d.to, d.move)
        t.last = d
        if changed or d.move:  # a standing recommendation is said once, not every sample
            e.event("auto", d.line(), card=-1, lease_id=lease_id)
            if not d.move and lease_id in e.leases:
                e.mark(lease_id, f"right-sizing recommends {d.to}: {d.evidence}")
        return d

    async def poll_logged(self) -> None:
        """The scheduler's job: a failed round is logged, never raised; ended leases are forgotten."""
        for lid in [x for x in self.tracked if x not in self.engine.leases]:
            self.ended(lid)
        for lid in [x for x in self._watchers if x not in self.engine.leases]:
            self._tell(lid, None)  # its WatchLease streams end
        try:
            await self.poll()
            loads = self.loads()
            for lid in self._watchers:
                if lid in loads:
                    self._tell(lid, loads[lid])
            await self.engine.run_blocking(publish_loads, self.engine.cfg.runtime_dir, loads)
        except Exception:
            log.exception("right-sizing round failed")

    def _waiting(self) -> dict[str, int]:
        waiting: dict[str, int] = {}
        for q in self.engine.queue_view():
            waiting[str(q.request.mode)] = waiting.get(str(q.request.mode), 0) + 1
        return waiting

    def load(self, lease, waiting: dict[str, int]) -> dict:
        """A lease's live load, for its server to adapt to (file and ``WatchLease``)."""
        hist = self.book.leases.get(lease.id)
        last = hist[-1] if hist else None
        return {
            "lease_id": lease.id,
            "mode": str(lease.mode),
            "t": time.time(),
            "cap_pct": last.cap_pct if last else None,
            "used_pct": last.sm_pct if last else None,
            "mem_used_bytes": last.mem_bytes if last else None,
            "throttled": bool(last and last.throttled(self.cfg.at_cap)),
            "waiting_for_size": waiting.get(str(lease.mode), 0),
            "moving": lease.id in self.engine.moves.pending,
        }

    def loads(self) -> dict[str, dict]:
        """Each active lease's live load (``load/<lease id>.json``)."""
        waiting = self._waiting()
        return {lease.id: self.load(lease, waiting) for lease in self.engine.leases.values()}

    async def watch(self, lease_id: str) -> AsyncIterator[dict]:
        """``WatchLease``: the lease's load now, then after every round until the lease has ended (told
        at the next round). A slow reader gets the newest load only (one is kept)."""
        q: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._watchers.setdefault(lease_id, set()).add(q)
        try:
            yield self.load(self.engine.leases[lease_id], self._waiting())
            while (got := await q.get()) is not None:
                yield got
        finally:
            qs = self._watchers.get(lease_id, set())
            qs.discard(q)
            if not qs:
                self._watchers.pop(lease_id, None)

    def _tell(self, lease_id: str, load: dict | None) -> None:
        for q in self._watchers.get(lease_id, ()):
            if q.full():
                q.get_nowait()  # the reader has not taken the last one: the newest replaces it
            q.put_nowait(load)

    def ended(self, lease_id: str) -> None:
        t = self.tracked.pop(lease_id, None)
        if t is not None and t.saved:
            self.engine.ledger.save_logged(self.engine.ledger.end_auto_lease_op(lease_id))
        self.book.end(lease_id)


# What NVIDIA's MPS documents for its control commands (nvidia-cuda-mps-control, "MPS v2 interface"):
# set_default_active_thread_percentage only affects the next MPS server; set_active_thread_percentage
# <server PID> and set_device_pinned_mem_limit <server PID> apply to clients that connect to that server
# afterwards, and clients already running keep the limits they started with (NVIDIA's forum: "you cannot
# edit the percentage assigned to a process today"). A MIG instance cannot be resized at all. So no limit
# of a running job changes in place: a resize restarts the job on the new size, as a move does.
IN_PLACE = "none: MPS thread % and pinned-memory limits apply to new clients only; MIG cannot resize"


async def resize(engine: Engine, lease_id: str, mode: str, caller, token: str = ""):
    """``xpu resize``: the owner or an operator changes a running lease's size. Returns (lease as it will
    be, how). A job that is not restartable is refused: its limits cannot change while it runs."""
    lease = engine.leases.get(lease_id) or engine.resolve_lease(lease_id)
    engine.check_authority(lease, caller, token)
    new = Mode(mode)
    if new == lease.mode:
        raise Conflict(f"lease {lease.id} is already {new}")
    if not lease.restartable:
        raise Conflict(
            f"lease {lease.id} is not restartable: its size cannot change while it runs (no backend "
            "changes a running job's limits); release it and run it again with --mode "
            f"{new}, or run it with --restartable"
        )
    moved = await engine.moves.start(lease.id, f"resize from {lease.mode} to {new}", mode=new)
    how = f"restarting on {new} (card {','.join(map(str, moved.cards))}); in place: {IN_PLACE}"
    engine.notify_holder(moved, "resize", f"resizing from {lease.mode} to {new}: {how}")
    engine.event("resize", f"lease {lease.id}: {how}", lease_id=lease.id)
    rs = engine.rightsizer
    if rs is not None:
        rs.book.moved(lease.id)
    return moved, how


@dataclass(frozen=True)
class UsageRow:
    """One lease's requested vs used (``LeaseUsage``; ``xpud.api.convert.usage_row_pb``): -1 where
    nothing was measured yet."""

    lease_id: str
    mode: str
    job_class: str
    auto: bool
    cap_pct: float
    used_pct: float
    peak_pct: float
    mem_cap_bytes: int
    mem_used_bytes: int
    throttled: bool
    readings: int
    recommendation: str
    auto_moves: int


def usage_rows(engine: Engine, rs: Rightsizer) -> list[UsageRow]:
    """``LeaseUsage`` rows: requested vs used for each active lease, newest recommendation."""
    from xpud.planning.usage import summarize

    rows = []
    for lease in engine.leases.values():
        t = rs.tracked.get(lease.id)
        hist = rs.book.history(lease.id)
        last = hist[-1] if hist else None
        s = summarize(hist, rs.cfg.at_cap)
        cap, mem_frac = caps(str(lease.mode), engine.cfg.slices) if len(lease.cards) == 1 else (100.0, 1.0)
        total = sum(engine.cards[i].info.memory_total_bytes for i in lease.cards)
        rows.append(
            UsageRow(
                lease_id=lease.id,
                mode=str(lease.mode),
                job_class=t.cls if t else job_class(lease.command),
                auto=bool(t and t.auto),
                cap_pct=cap,
                used_pct=-1.0 if last is None or last.sm_pct is None else last.sm_pct,
                peak_pct=-1.0 if s.sm_peak is None else s.sm_peak,
                mem_cap_bytes=int(mem_frac * total),
                mem_used_bytes=-1 if last is None or last.mem_bytes is None else last.mem_bytes,
                throttled=bool(last and last.throttled(rs.cfg.at_cap)),
                readings=len(hist),
                recommendation=t.last.line() if t and t.last else "",
                auto_moves=t.state.moves if t else 0,
            )
        )
    return rows
