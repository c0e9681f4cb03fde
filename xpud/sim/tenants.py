"""Accounts sharing a cluster, replayed in time (``xpu simulate --tenants``, issue #33).

The trace's GPU tasks arrive at their ``creation_time`` and run for ``deletion_time - creation_time``
seconds once started. Each task belongs to one of N accounts, drawn Zipf-skewed (exponent ``skew``,
seeded); the accounts have equal quotas summing to the cluster and weight 1. Tasks of QoS ``BE``
(best effort) are restartable; the others are not.

The cluster is a pool of ``gpus`` cards, hosts not modelled: a whole-card task takes that many idle cards,
a fractional one ``gpu_milli`` of the fullest card it fits on (best fit); CPU, memory and GPU models are
ignored, so every task fits an empty cluster.

Policies, all backfilling (a task that fits starts even if one before it does not):

- ``fifo``: the oldest waiting task first; accounts are not looked at.
- ``fairshare``: the queue ordered by ``xpud.planning.fairshare.queue_key`` (the account furthest below
  its deserved share first, then age); an account below its share reclaims restartable tasks of accounts
  above theirs for its oldest waiting task, never taking them below their share (reclaim "fair-share").
- ``quota``: the same order; reclaim only for an account below its quota, down to the victims' quotas
  (KAI's behaviour).

A reclaimed task loses its progress and waits again, with its first arrival time.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xpud.planning import fairshare as fs
from xpud.sim import tenant_report
from xpud.sim.tenant_report import TenantResult
from xpud.sim.trace import TraceError, _int, _rows

POLICIES = ("fairshare", "quota", "fifo")
RECLAIM_MODE = {"fairshare": "fair-share", "quota": "quota", "fifo": "off"}
CARD = 1000
TIME_COLUMNS = ("name", "num_gpu", "gpu_milli", "creation_time", "deletion_time")


@dataclass(frozen=True)
class TimedTask:
    """A GPU task of the trace: ``cards`` whole cards, or (``cards`` 0) ``milli`` of one card."""

    name: str
    cards: int
    milli: int
    created: float  # seconds
    duration: float  # seconds it runs once started
    restartable: bool

    @property
    def gpus(self) -> float:
        """GPU-equivalents: whole cards, or the fraction of one."""
        return float(self.cards) if self.cards else self.milli / CARD


def load_timed(path: str | Path) -> list[TimedTask]:
    """The GPU tasks of an openb pod list with its time columns, by creation time."""
    path = Path(path)
    out = []
    for line, row in _rows(path, TIME_COLUMNS, "trace"):
        gpus, milli = _int(path, line, row, "num_gpu"), _int(path, line, row, "gpu_milli")
        if gpus == 0:
            continue
        if not 0 < milli <= CARD:
            raise TraceError(f"{path}:{line}: gpu_milli must be 1..{CARD} for a GPU task, got {milli}")
        created = _int(path, line, row, "creation_time")
        deleted = _int(path, line, row, "deletion_time")
        whole = gpus > 1 or milli == CARD
        out.append(
            TimedTask(
                (row.get("name") or f"task-{line}").strip(),
                gpus if whole else 0,
                CARD if whole else milli,
                float(created),
                float(max(deleted - created, 1)),
                (row.get("qos") or "").strip() == "BE",
            )
        )
    if not out:
        raise TraceError(f"{path}: no GPU task with creation and deletion times")
    out.sort(key=lambda t: t.created)
    return out


def zipf_accounts(n_tasks: int, tenants: int, skew: float, seed: int) -> np.ndarray:
    """Each task's account (0..tenants-1), drawn with probability proportional to ``1 / (k+1) ** skew``:
    account 0 the busiest. ``skew`` 0 = uniform."""
    p = 1.0 / np.arange(1, tenants + 1, dtype=float) ** skew
    rng = np.random.default_rng([seed, 0xACC7])
    return rng.choice(tenants, size=n_tasks, p=p / p.sum())


class Pool:
    """``gpus`` cards, each with its free thousandths."""

    def __init__(self, gpus: int):
        self.free = np.full(gpus, CARD, dtype=np.int64)

    def where(self, t: TimedTask, free: np.ndarray | None = None) -> np.ndarray | None:
        """The cards ``t`` would take (best fit for a fraction, the first idle cards for whole ones)."""
        free = self.free if free is None else free
        if t.cards:
            idle = np.flatnonzero(free == CARD)
            return idle[: t.cards] if len(idle) >= t.cards else None
        ok = np.flatnonzero(free >= t.milli)
        if not len(ok):
            return None
        return ok[np.argmin(free[ok])][None]

    def take(self, t: TimedTask, cards: np.ndarray) -> None:
        self.free[cards] -= t.milli

    def give(self, t: TimedTask, cards: np.ndarray) -> None:
        self.free[cards] += t.milli


def replay(
    tasks: Sequence[TimedTask],
    owners: Sequence[int],
    *,
    tenants: int,
    gpus: int,
    policy: str,
    grace_s: float = 300.0,
    seed: int = 0,
    skew: float = 0.0,
    end: float | None = None,
) -> TenantResult:
    """Replay ``tasks`` (by creation time; ``owners[i]`` is task i's account) on ``gpus`` cards under
    ``policy``, measured from the first arrival until ``end`` (default: the trace's last deletion time, the
    same horizon for every policy)."""
    t_start = time.perf_counter()
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    mode = RECLAIM_MODE[policy]
    names = [f"t{k}" for k in range(tenants)]
    specs = {n: fs.AccountSpec(n, quota=gpus / tenants) for n in names}
    horizon_end = end if end is not None else max(t.created + t.duration for t in tasks)
    pool = Pool(gpus)
    waiting: list[list[tuple[float, int]]] = [[] for _ in range(tenants)]  # per account, by age
    queue: list[tuple[float, int]] = []  # every waiting task by age (fifo)
    running: dict[int, tuple[float, np.ndarray, int]] = {}  # task -> (started, cards, epoch)
    epoch = [0] * len(tasks)
    alloc = np.zeros(tenants)
    wanting = np.zeros(tenants)  # GPU-equivalents waiting
    first_start: dict[int, float] = {}
    under_share: set[int] = set()  # tasks that arrived while their account's share admitted them
    reclaimed: set[int] = set()
    reclaims = 0
    protected: dict[str, float] = {}
    received = np.zeros(tenants)
    deserved_t = np.zeros(tenants)
    used_time = 0.0
    shares = np.zeros(tenants)
    quota = gpus / tenants
    # (time, kind, task, epoch): kind 0 = a run ends (stale when the task was reclaimed since), 1 = arrival
    events: list[tuple[float, int, int, int]] = [(t.created, 1, i, 0) for i, t in enumerate(tasks)]
    heapq.heapify(events)
    now = tasks[0].created if tasks else 0.0
    start_time = now

    def recompute() -> None:
        got = fs.deserved(specs, {names[k]: alloc[k] + wanting[k] for k in range(tenants)}, float(gpus))
        shares[:] = [got[n] for n in names]

    def enqueue(i: int) -> None:
        a, key = owners[i], (tasks[i].created, i)
        bisect.insort(waiting[a], key)
        bisect.insort(queue, key)
        wanting[a] += tasks[i].gpus

    def room() -> tuple[int, int]:
        """Idle cards, and the most free on one card: a task fits exactly when these admit it."""
        return int(np.count_nonzero(pool.free == CARD)), int(pool.free.max())

    def could(t: TimedTask, idle: int, most: int) -> bool:
        return t.cards <= idle if t.cards else t.milli <= most

    def start(i: int) -> None:
        t = tasks[i]
        cards = pool.where(t)
        assert cards is not None
        pool.take(t, cards)
        a = owners[i]
        key = (t.created, i)
        waiting[a].remove(key)
        queue.remove(key)
        wanting[a] -= t.gpus
        alloc[a] += t.gpus
        epoch[i] += 1
        running[i] = (now, cards, epoch[i])
        first_start.setdefault(i, now)
        heapq.heappush(events, (now + t.duration, 0, i, epoch[i]))

    def end_run(i: int) -> None:
        t = tasks[i]
        _, cards, _ = running.pop(i)
        pool.give(t, cards)
        alloc[owners[i]] -= t.gpus

    def try_reclaim(i: int) -> bool:
        nonlocal reclaims
        t, a = tasks[i], owners[i]
        victims = [
            fs.Running(str(j), names[owners[j]], tasks[j].gpus, True, st)
            for j, (st, _, _) in running.items()
            if owners[j] != a and tasks[j].restartable
        ]

        def fits(stopped: Sequence[fs.Running]) -> bool:
            free = pool.free.copy()
            for r in stopped:
                j = int(r.id)
                free[running[j][1]] += tasks[j].milli
            return pool.where(t, free) is not None

        plan = fs.plan_reclaim(
            fs.Waiter(str(i), names[a], t.gpus),
            victims,
            specs=specs,
            shares=dict(zip(names, shares, strict=True)),
            allocated=dict(zip(names, alloc, strict=True)),
            mode=mode,
            now=now,
            protected_until=protected,
            fits=fits,
        )
        if not plan:
            return False
        for r in plan:
            j = int(r.id)
            end_run(j)
            enqueue(j)
            reclaimed.add(j)
            reclaims += 1
        protected[names[a]] = now + grace_s
        start(i)
        return True

    def schedule() -> None:
        idle, most = room()
        if policy == "fifo":
            for _, i in list(queue):
                if not most:
                    break
                if could(tasks[i], idle, most):
                    start(i)
                    idle, most = room()
            return
        done: set[int] = set()
        while True:
            live = [k for k in range(tenants) if waiting[k] and k not in done]
            if not live:
                return
            k = min(live, key=lambda k: fs.queue_key(alloc[k], shares[k], 0, waiting[k][0][0]))
            i = next((i for _, i in waiting[k] if could(tasks[i], idle, most)), None)
            if i is not None:
                start(i)
                idle, most = room()
                continue
            bound = quota if mode == "quota" else shares[k]
            want = waiting[k][0][1] if alloc[k] < bound - 1e-9 else None  # its oldest task
            if want is not None and try_reclaim(want):
                idle, most = room()
            else:
                done.add(k)

    while events and events[0][0] <= horizon_end:
        t_next = events[0][0]
        if t_next > now:
            dt = t_next - now
            received += alloc * dt
            deserved_t += shares * dt
            used_time += (gpus * CARD - int(pool.free.sum())) / CARD * dt
            now = t_next
        arrived = []
        while events and events[0][0] == now:
            _, kind, i, ep = heapq.heappop(events)
            if kind == 1:
                enqueue(i)
                arrived.append(i)
            elif i in running and running[i][2] == ep:
                end_run(i)
        recompute()  # demand (held + waiting) changes only here: starts and reclaims move it, not change it
        for i in arrived:
            if alloc[owners[i]] + tasks[i].gpus <= shares[owners[i]] + 1e-9:
                under_share.add(i)
        schedule()
    span = max(horizon_end - start_time, 1e-9)
    waits = []
    for i in under_share:
        if tasks[i].created > horizon_end:
            continue
        waits.append(first_start.get(i, horizon_end) - tasks[i].created)
    ratios = [float(received[k] / deserved_t[k]) for k in range(tenants) if deserved_t[k] > 1e-9]
    return TenantResult(
        policy=policy,
        seed=seed,
        tenants=tenants,
        skew=skew,
        gpus=gpus,
        jain_fairness=tenant_report.jain(ratios),
        alloc_pct=100.0 * used_time / (gpus * span),
        p95_wait_s=tenant_report.p95(waits),
        reclaimed_pct=100.0 * len(reclaimed) / max(len(tasks), 1),
        tasks=len(tasks),
        reclaims=reclaims,
        ratios=ratios,
        wall_s=time.perf_counter() - t_start,
    )


RESTARTABLE = ("be", "all", "none")


def with_restartable(tasks: Sequence[TimedTask], which: str) -> list[TimedTask]:
    """``tasks`` with the restartable ones chosen: ``be`` = QoS BE (as loaded), ``all``, ``none``."""
    if which == "be":
        return list(tasks)
    return [dataclasses.replace(t, restartable=which == "all") for t in tasks]


def run(
    tasks: Sequence[TimedTask],
    *,
    tenants: int,
    skew: float,
    gpus: int,
    policies: Sequence[str],
    seeds: Sequence[int],
    grace_s: float = 300.0,
    progress=None,
) -> list[TenantResult]:
    """Every policy on every seed; the same accounts (drawn from the seed) for every policy of a seed."""
    out = []
    for seed in seeds:
        owners = zipf_accounts(len(tasks), tenants, skew, seed)
        for policy in policies:
            r = replay(
                tasks,
                owners,
                tenants=tenants,
                gpus=gpus,
                policy=policy,
                grace_s=grace_s,
                seed=seed,
                skew=skew,
            )
            out.append(r)
            if progress is not None:
                progress(f"seed {seed} {policy}: jain {r.jain_fairness:.4f} in {r.wall_s:.1f} s")
    return out
