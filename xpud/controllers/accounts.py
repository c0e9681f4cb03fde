"""Fair share between accounts on this host (issue #33): deserved shares from the cluster view, decayed
usage (kept in the ledger), the wait queue's order (``hooks.QueueOrder``: distance below the share, then
priority, then age), ``limit`` at the moment of the grant, and reclaim to fair share.

Every ``TICK_S`` (``tick``): this host's allocation per account (GPU-equivalents of its leases) and waiting
demand (its queue), plus what every peer publishes (``peers``: its cards and ``fairshare.HostAccounts``,
from the federation's summaries), give each account's demand; ``fairshare.deserved`` shares the cluster's
capacity among them. Every host computes the same shares from the same view. Usage accrues for this
host's leases (``fairshare.accrue``: exact, however often it runs) and is saved every ``SAVE_S``.

Reclaim (``[accounts] reclaim``): the first waiter in queue order whose account is below its share (its
quota with ``quota``) and within its limit gets a plan (``fairshare.plan_reclaim``: restartable leases of
accounts above their floor, the least progress lost first, only as many as it needs, on the cards that admit
it). Each victim's holder hears a ``reclaim`` event down its Hold stream: ``xpu run --restartable`` stops
its command (TERM, then KILL after its grace), releases the lease and queues again, restarting the command
with ``XPU_RESTART_COUNT`` + 1 once granted; the daemon does the same for an ``xpu submit --restartable``
job (``xpud.jobs.restarts``). A victim not released within ``STOP_S`` is ended by the daemon.
Non-restartable leases, and leases with no holder connected to restart them, are never taken. An account
that got cards by reclaim is not reclaimed from for ``reclaim_grace_s``. Each reclaim is a ``fairshare``
event in the ledger naming both accounts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from xpud.config.accounts import DEFAULT_ACCOUNT, quota_warning
from xpud.engine.accounting import account_of, allocation, lease_gpus, request_gpus
from xpud.engine.engine import Engine
from xpud.errors import XpudError
from xpud.ledger import accounts as ledger_accounts
from xpud.model import Lease, Mode, Request
from xpud.planning import fairshare
from xpud.planning.fairshare import HostAccounts

log = logging.getLogger("xpud.controllers.accounts")

TICK_S = 1.0  # how often shares, usage and reclaim are looked at
SAVE_S = 60.0  # how often the decayed usage is written to the ledger
STOP_S = 60.0  # seconds a reclaimed lease's holder has to stop its command and release it
EPS = 1e-9


@dataclass
class Row:
    """One account as ``xpu accounts`` shows it."""

    name: str
    quota: float
    limit: float | None
    weight: float
    parent: str
    share: float
    allocated: float
    usage_gpu_h: float
    waiting: float
    reclaimed_from: int
    reclaimed_for: int
    removed: bool = False  # taken out of xpud.toml by a reload; still holds or waits here or on a peer


def _add(into: dict[str, float], what: Mapping[str, float]) -> None:
    for k, v in what.items():
        into[k] = into.get(k, 0.0) + v


class Accounts:
    """The accounts controller; the engine's ``queue_order`` (``hooks.QueueOrder``)."""

    def __init__(
        self,
        engine: Engine,
        peers: Callable[[], Mapping[str, tuple[int, HostAccounts]]] = dict,
        clock: Callable[[], float] = time.time,
        config_hash: str = "",
        own: Callable[[], tuple[int, HostAccounts] | None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.specs = fairshare.specs_from_config(self.cfg.named_accounts)
        self.half_life_s = self.cfg.accounts.half_life_s
        self.peers = peers
        self.own = own  # this host's summary as its peers read it (None: no federation, or not yet)
        self.clock = clock
        self.config_hash = config_hash
        self.usage: dict[str, tuple[float, float]] = {}  # account -> (decayed GPU-seconds here, when)
        self.shares: dict[str, float] = {}
        self.cluster_alloc: dict[str, float] = {}
        self.cluster_usage: dict[str, float] = {}
        self.cluster_waiting: dict[str, float] = {}
        self.capacity = 0.0
        self.reclaimed_from: dict[str, int] = {}
        self.reclaimed_for: dict[str, int] = {}
        self.protected_until: dict[str, float] = {}
        self.stopping: dict[str, float] = {}  # lease id -> when it is ended if its holder has not released
        self._saved = 0.0
        self.peer_view: Mapping[str, tuple[int, HostAccounts]] = {}  # as of the last refresh
        self.warning: str | None = None  # quotas above the cluster's capacity (said once per change)
        self.removed: set[str] = set()  # accounts a reload took out of xpud.toml (their leases stay charged)

    def reconfigure(self, config_hash: str) -> None:
        """A reload changed ``[accounts]`` (``xpud.daemon.reload``): the engine's new config counts from
        the next decision. An account taken out keeps its running leases, charged to it (shown as removed
        while it holds or waits); new requests naming it are refused at the service (no such account)."""
        old = set(self.specs)
        self.cfg = self.engine.cfg
        self.specs = fairshare.specs_from_config(self.cfg.named_accounts)
        self.half_life_s = self.cfg.accounts.half_life_s
        self.config_hash = config_hash
        self.removed = (self.removed | old) - set(self.specs)
        self.protected_until = {a: t for a, t in self.protected_until.items() if a in self.specs}
        self.warning = None  # said again if the new quotas are still above the cluster
        self.refresh()

    # ---- state -------------------------------------------------------------------------------------

    def restore(self) -> None:
        """The decayed usage kept in the ledger (start-up)."""
        self.usage = ledger_accounts.load_usage(self.engine.ledger.db)

    def local_allocation(self) -> dict[str, float]:
        return allocation(self.cfg, self.engine.leases.values())

    def local_waiting(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for q in self.engine.queue_view():
            a = account_of(q.request)
            out[a] = out.get(a, 0.0) + request_gpus(self.cfg, q.request)
        return out

    def local_usage(self, now: float) -> dict[str, float]:
        """Decayed usage (GPU-seconds) of this host's leases per account, as of ``now``."""
        return {a: fairshare.decayed(u, now - at, self.half_life_s) for a, (u, at) in self.usage.items()}

    def published(self) -> HostAccounts:
        """What this host publishes in its summary (``federation.view.HostSummary.accounts``)."""
        return HostAccounts(
            self.config_hash, self.local_allocation(), self.local_usage(self.clock()), self.local_waiting()
        )

    def _peer_view(self) -> Mapping[str, tuple[int, HostAccounts]]:
        try:
            return self.peers()
        except XpudError as e:  # a view that cannot be read counts as no peers this time
            log.warning("accounts: the cluster view is unreadable (%s)", e)
            return {}

    def refresh(self) -> None:
        """Shares from this host and the peers' summaries.

        The shares count this host's part as it published it (``own``: what every peer reads, rounded and
        only the busiest accounts that fit the summary), not as it stands here now: every host then
        computes the same shares from the same numbers, however many accounts there are. What is shown,
        the queue's distance below the share, limits and reclaim read this host's own part live."""
        now = self.clock()
        alloc, waiting, usage = self.local_allocation(), self.local_waiting(), self.local_usage(now)
        own = self.own()
        if own is not None:
            capacity = float(own[0])
            demand: dict[str, float] = {}
            _add(demand, own[1].allocated)
            _add(demand, own[1].waiting)
        else:
            capacity = float(len(self.engine.cards))
            demand = dict(alloc)
            _add(demand, waiting)
        self.peer_view = self._peer_view()
        for cards, p in self.peer_view.values():
            _add(alloc, p.allocated)
            _add(waiting, p.waiting)
            _add(usage, p.usage)
            _add(demand, p.allocated)
            _add(demand, p.waiting)
            capacity += cards
        self.cluster_alloc, self.cluster_waiting, self.cluster_usage = alloc, waiting, usage
        self.capacity = capacity
        self.shares = fairshare.deserved(self.specs, demand, capacity)
        if self.removed:  # a removed account is forgotten once nothing of it holds or waits
            self.removed = {a for a in self.removed if alloc.get(a, 0.0) + waiting.get(a, 0.0) > EPS}
        warning = quota_warning(self.cfg.named_accounts, capacity)
        if warning != self.warning:  # oversubscribed quotas are a site's choice: said, not refused
            self.warning = warning
            if warning:
                self.engine.event("accounts", warning)

    def accrue(self) -> None:
        """Add what this host's leases used since the last accrual (decayed as they went)."""
        now = self.clock()
        alloc = self.local_allocation()
        for a in {*self.usage, *alloc}:
            u, at = self.usage.get(a, (0.0, now))
            self.usage[a] = (fairshare.accrue(u, alloc.get(a, 0.0), now - at, self.half_life_s), now)

    async def save(self) -> None:
        await self.engine.ledger.write(ledger_accounts.save_usage_op(self.usage))

    # ---- hooks.QueueOrder ---------------------------------------------------------------------------

    def key(self, req: Request, enqueued: float) -> tuple:
        a = account_of(req)
        return fairshare.queue_key(
            self.cluster_alloc.get(a, 0.0), self.shares.get(a, 0.0), req.priority, enqueued
        )

    def refusal(self, req: Request, in_flight: float) -> str:
        spec = self.specs.get(account_of(req))
        if spec is None:
            return ""
        size = request_gpus(self.cfg, req)
        local = self.local_allocation()
        peers = self.peer_view  # decoded once a tick, not once a waiter: gossip is no fresher
        for s in (spec, self.specs.get(spec.parent)):
            if s is None or s.limit is None:
                continue
            names = {s.name} | {c.name for c in self.specs.values() if c.parent == s.name}
            held = sum(local.get(n, 0.0) for n in names)
            held += sum(p.allocated.get(n, 0.0) for _, p in peers.values() for n in names)
            held += in_flight
            if held + size > s.limit + EPS:
                return (
                    f"AccountLimit: {s.name} holds {held:g} of its limit {s.limit:g} GPU-equivalents "
                    f"([accounts.{s.name}] limit)"
                )
        return ""

    def reason(self, req: Request) -> str:
        a = account_of(req)
        if a in self.shares and self.cluster_alloc.get(a, 0.0) >= self.shares[a] - EPS:
            return f"Fairshare: {a} over its share"
        return ""

    # ---- the loop -----------------------------------------------------------------------------------

    async def tick(self) -> None:
        self.accrue()
        self.refresh()
        now = self.clock()
        if now - self._saved >= SAVE_S:
            self._saved = now
            await self.save()
        await self.end_overdue(now)
        if self.cfg.accounts.reclaim != "off":
            self.reclaim(now)
        if self.engine.queue_view():
            self.engine.pump()  # shares, peers' allocations or a limit may let a waiter go now

    async def tick_logged(self) -> None:
        try:
            await self.tick()
        except XpudError as e:
            log.warning("accounts: %s", e)

    async def end_overdue(self, now: float) -> None:
        """End reclaimed leases whose holder did not release them within ``STOP_S``."""
        for lid, deadline in list(self.stopping.items()):
            if lid not in self.engine.leases:
                del self.stopping[lid]
            elif now >= deadline:
                del self.stopping[lid]
                why = f"reclaimed for fair share; its holder did not release it within {STOP_S:g} s"
                await self.engine.reclaim(lid, why)

    def _running(self) -> list[fairshare.Running]:
        """This host's leases for ``plan_reclaim``. Work of an account that this host's summary does not
        carry (more accounts than fit: the least busy are left out) is not taken: the shares count it as
        holding nothing here, so its share is not known."""
        own = self.own()
        carried = None if own is None else own[1].allocated
        return [
            fairshare.Running(
                lease.id,
                account_of(lease),
                lease_gpus(self.cfg, lease),
                lease.restartable
                and self.engine.is_held(lease.id)
                and lease.id not in self.stopping
                and (carried is None or account_of(lease) in carried),
                lease.created,
            )
            for lease in self.engine.leases.values()
        ]

    def _fits(self, req: Request) -> Callable[[Sequence[fairshare.Running]], bool]:
        """Whether ``req`` would fit on this host once the given leases are gone (from the card views:
        whole cards by count, a slice by its card's free memory share)."""
        views = [v for v in self.engine.card_views() if not v.drained]
        leases = self.engine.leases

        def fits(stopped: Sequence[fairshare.Running]) -> bool:
            gone = {r.id for r in stopped} | set(self.stopping)
            if req.mode is Mode.XPU:
                free = 0
                for v in views:
                    holders = {v.whole_lease} if v.whole_lease else {lid for lid, _ in v.slices}
                    free += holders <= gone
                return free >= req.gpus
            spec = self.cfg.slices.get(req.mode.value)
            need = spec.memory_fraction if spec is not None else 1.0
            for v in views:
                if v.whole_lease:
                    if v.whole_lease in gone:
                        return True
                    continue
                room = v.free_memory_fraction
                for lid, _ in v.slices:
                    if lid in gone and lid in leases:
                        room += lease_gpus(self.cfg, leases[lid])
                if room + EPS >= need:
                    return True
            return False

        return fits

    def reclaim(self, now: float) -> list[Lease]:
        """Stop restartable work above its share for the first waiter below its share that it admits."""
        if self.stopping:  # one reclaim at a time: the last one's cards are on their way
            return []
        order = sorted(self.engine.queue_view(), key=lambda q: self.key(q.request, q.enqueued))
        alloc = self.local_allocation()
        for q in order:
            req = q.request
            if q.reason == "BeginTime" or self.refusal(req, 0.0):
                continue
            waiter = fairshare.Waiter(q.ticket, account_of(req), request_gpus(self.cfg, req))
            plan = fairshare.plan_reclaim(
                waiter,
                self._running(),
                specs=self.specs,
                shares=self.shares,
                allocated=self.cluster_alloc or alloc,
                mode=self.cfg.accounts.reclaim,
                now=now,
                protected_until=self.protected_until,
                fits=self._fits(req),
            )
            if not plan:
                continue
            return self._stop(plan, waiter, now)
        return []

    def _stop(self, plan: Iterable[fairshare.Running], waiter: fairshare.Waiter, now: float) -> list[Lease]:
        out = []
        grace = self.cfg.accounts.reclaim_grace_s
        self.protected_until[waiter.account] = now + grace
        for r in plan:
            lease = self.engine.leases.get(r.id)
            if lease is None:
                continue
            share = self.shares.get(r.account, 0.0)
            why = (
                f"lease {lease.id} of account {r.account} (holds {self.cluster_alloc.get(r.account, 0.0):g}, "
                f"deserves {share:g}) reclaimed for account {waiter.account} (request {waiter.id})"
            )
            self.stopping[lease.id] = now + STOP_S
            self.reclaimed_from[r.account] = self.reclaimed_from.get(r.account, 0) + 1
            self.reclaimed_for[waiter.account] = self.reclaimed_for.get(waiter.account, 0) + 1
            self.engine.event("fairshare", why, lease.cards[0] if len(lease.cards) == 1 else -1, lease.id)
            self.engine.notify_holder(lease, "reclaim", why)
            out.append(lease)
        return out

    # ---- seeing it ----------------------------------------------------------------------------------

    def rows(self) -> list[Row]:
        """Every configured account (and any other that holds or waits), in xpud.toml's order."""
        names = [*self.specs]
        for a in sorted({*self.cluster_alloc, *self.cluster_waiting, *self.shares}):
            if a not in self.specs:
                names.append(a)
        if DEFAULT_ACCOUNT not in names:
            names.append(DEFAULT_ACCOUNT)
        out = []
        for n in names:
            s = self.specs.get(n, fairshare.AccountSpec(n))
            out.append(
                Row(
                    n,
                    s.quota,
                    s.limit,
                    s.weight,
                    s.parent,
                    self.shares.get(n, 0.0),
                    self.cluster_alloc.get(n, 0.0),
                    self.cluster_usage.get(n, 0.0) / 3600.0,
                    self.cluster_waiting.get(n, 0.0),
                    self.reclaimed_from.get(n, 0),
                    self.reclaimed_for.get(n, 0),
                    n in self.removed,
                )
            )
        return out
