"""``Federation``: this daemon as a member of its cluster.

Created by the daemon when ``[cluster] listen`` is set (``daemon.federation``; None otherwise). It runs the
``Peer`` gRPC server with mutual TLS (``require_client_auth``: no certificate from the site CA, no
service), drives ``membership.Swim`` from one task (a tick every ``TICK_S``; messages in through the
servicer, out through ``transport.Sender``), and keeps this host's ``view.HostSummary`` in its membership
meta: refreshed soon after the engine reports a change (at most once per ``PUBLISH_GAP_S``) and at least
once per ``SUMMARY_EVERY_S``, and spread only when it changed, by a gossip round at once.

``room`` (``room.Room``) is notified when the view shows more free capacity than before (a host's summary
offers more whole cards or slices, a host comes alive with some, this host's own summary grows): the
coordinator's queued multi-host jobs plan again then instead of polling.

What other parts use: ``name``, ``addr``, ``members()`` (``view.HostEntry``: name, addr, state,
incarnation, age, summary), ``offers()`` (``placement.multihost.HostOffer`` for multi-host placement) and
``channel(addr)`` (a cached mutual-TLS ``grpc.aio`` channel to a peer, this host's certificate as client).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from xpud import config
from xpud.api.server import add_to_server
from xpud.federation import certs, summary, transport, view
from xpud.federation.membership import State, Swim, SwimConfig
from xpud.federation.peer_service import PeerService
from xpud.federation.room import Room
from xpud.placement.multihost import HostOffer
from xpud.planning.fairshare import HostAccounts

if TYPE_CHECKING:
    from xpud.federation.hostjobs import HostJobs

log = logging.getLogger("xpud.federation")

TICK_S = 0.05  # how often Swim.tick runs (its timers are 0.2 s and up)
SUMMARY_EVERY_S = 1.0  # the summary is refreshed at least this often (health, samples: a fallback)
PUBLISH_GAP_S = 0.1  # at most one refresh (and one new incarnation for it) per this long on engine news
JOIN_RETRY_S = 1.0  # first wait before asking the seeds again, doubling up to the push-pull period
SEND_TIMEOUT_S = 1.0  # deadline of one membership message


class Federation:
    def __init__(
        self,
        cfg: config.ClusterSection,
        engine: Any,
        hostjobs: HostJobs | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Reads and checks the certificate files (raises ``certs.CertError`` with one line); starts
        nothing: ``start`` does."""
        self.cfg = cfg
        self.name = cfg.name or socket.gethostname()
        self.addr = cfg.listen
        host, _ = config.split_host_port(cfg.listen)
        self.creds = certs.load_host(cfg.ca, cfg.cert, cfg.key, self.name, host)
        self.engine = engine
        self.peer_jobs = None  # xpud.service.jobs.PeerJobs: the daemon sets it once its jobs run
        self.hostjobs = hostjobs  # Peer's Reserve/Commit/Abort/Launch go there (None: refused)
        self.clock = clock  # the protocol's timers (monotonic: a clock step must not expire suspicions)
        self.swim: Swim | None = None
        self.channels = transport.Channels(self.creds.ca, self.creds.cert, self.creds.key)
        self.sender = transport.Sender(self.channels, timeout_s=SEND_TIMEOUT_S)
        self.server: aio.Server | None = None
        self.started = 0.0
        self._task: asyncio.Task | None = None
        self._refresh: asyncio.Task | None = None
        self._next_summary = 0.0
        self._last_refresh = -math.inf
        self._engine_news: asyncio.Queue | None = None  # engine.watch(): something changed there
        self._own: view.HostSummary | None = None  # this host's summary as last published
        self._offered: dict[str, view.HostSummary | None] = {}  # alive peers' summaries, as last heard
        self.room = Room()
        self._groups = summary.GroupCache()
        self._states: dict[str, State] = {}
        self._join_backoff = JOIN_RETRY_S
        self._next_join = 0.0
        # this host's accounts for its summary (xpud.controllers.accounts, plugged in by the daemon)
        self.accounts_source: Callable[[], HostAccounts] | None = None
        self._own_accounts: tuple[int, HostAccounts] | None = None  # as the peers read it (own_accounts)

    # ------------------------------------------------------------------------------ life
    async def start(self) -> None:
        """Serve ``Peer`` on ``listen`` and join through the seeds. Raises OSError if it cannot listen."""
        self._own = await self._summary()
        meta = view.encode(self._own)
        self._published(meta)
        self.swim = Swim(
            self.name,
            self.addr,
            self.clock(),
            incarnation=int(time.time() * 1000),  # wall clock in ms: a restart starts above its old numbers
            meta=meta,
            cfg=SwimConfig.for_dead_after(self.cfg.dead_after_s),
        )
        server = aio.server(options=transport.SERVER_OPTIONS)
        add_to_server(PeerService(self, self.hostjobs), server)
        creds = grpc.ssl_server_credentials(
            [(self.creds.key, self.creds.cert)], root_certificates=self.creds.ca, require_client_auth=True
        )
        try:
            port = server.add_secure_port(self.addr, creds)
        except RuntimeError:  # grpc.aio raises where grpc returns 0
            port = 0
        if not port:
            await server.stop(None)
            raise OSError(
                f"[cluster] listen = {self.addr!r}: cannot listen there: the port is in use, or the address "
                "is not one of this host's"
            )
        await server.start()
        self.server = server
        self.started = self.clock()
        self._next_summary = self.clock() + SUMMARY_EVERY_S
        self._engine_news = self.engine.watch()
        self.sender.send(self.swim.join(self.cfg.seeds))
        self._next_join = self.clock() + JOIN_RETRY_S
        self._task = asyncio.create_task(self._run(), name="federation")
        log.info(
            "cluster member %s on %s (incarnation %d), seeds: %s",
            self.name,
            self.addr,
            self.swim.incarnation,
            ", ".join(self.cfg.seeds) or "none",
        )

    async def stop(self) -> None:
        """Leave cleanly (peers mark this host ``left``, not dead), then stop serving."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._refresh:
            self._refresh.cancel()
        if self._engine_news is not None:
            self.engine.unwatch(self._engine_news)
            self._engine_news = None
        if self.swim is not None and not self.swim.left:
            self.sender.send(self.swim.leave())
            await self.sender.flush(0.5)
        if self.server is not None:
            await self.server.stop(grace=0.3)
        await self.sender.close()
        await self.channels.close()

    # ------------------------------------------------------------------------------ protocol
    def receive(self, msg) -> None:
        """A membership message from a peer (the servicer checked who sent it)."""
        if self.swim is None or self.swim.left:
            return
        self.channels.revive(msg.src_addr)  # e.g. a restarted peer: answer it now, not after a backoff
        self.sender.send(self.swim.handle(msg, self.clock()))
        self._take_changes()  # news of freed capacity wakes queued jobs now, not at the next tick

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                now = self.clock()
                self.sender.send(self.swim.tick(now))
                self._rejoin(now)
                self._take_changes()
                self._maybe_refresh(now)
            except asyncio.CancelledError:
                raise
            except Exception:  # the membership must go on: log and tick again
                log.exception("federation tick")

    def _rejoin(self, now: float) -> None:
        """Alone (the seeds' answers lost, or none up yet): ask the seeds again after 1 s, 2 s, 4 s ... up to
        the push-pull period (Swim itself retries only at each push-pull, 15 s apart)."""
        if len(self.swim.members) > 1 or not self.cfg.seeds:
            self._join_backoff = JOIN_RETRY_S
            return
        if now >= self._next_join:
            self.sender.send(self.swim.join(self.cfg.seeds))
            self._next_join = now + self._join_backoff
            self._join_backoff = min(self._join_backoff * 2, self.swim.cfg.push_pull_interval_s)

    def _maybe_refresh(self, now: float) -> None:
        if (self._refresh is None or self._refresh.done()) and self._refresh_due(now):
            self._next_summary = now + SUMMARY_EVERY_S
            self._last_refresh = now
            self._refresh = asyncio.create_task(self._publish())

    def _refresh_due(self, now: float) -> bool:
        """The periodic refresh, or soon after the engine changed (a lease granted or ended, a card's
        health, a drain), one ``PUBLISH_GAP_S`` after the last at the earliest. Takes the engine's news:
        ask only when no refresh runs (one running may have read the engine before that news)."""
        q = self._engine_news
        if q is not None and not q.empty() and now >= self._last_refresh + PUBLISH_GAP_S:
            while not q.empty():
                q.get_nowait()
            return True
        return now >= self._next_summary

    def _take_changes(self) -> None:
        """The membership's news: one log line per change of a peer's state (a new incarnation alone is
        not news), and ``room`` notified when an alive peer now offers more than it did."""
        more = False
        for ch in self.swim.pop_changes():
            if self._states.get(ch.name) is not ch.state:
                log.info("peer %s (%s) is %s, incarnation %d", ch.name, ch.addr, ch.state, ch.incarnation)
            if len(self._states) < 100_000:
                self._states[ch.name] = ch.state
            if ch.state is not State.ALIVE:
                self._offered.pop(ch.name, None)  # suspect, dead or gone: placement leaves it out
                continue
            try:
                now = view.decode(ch.meta) if ch.meta else None
            except view.BadSummary:
                now = None
            more = more or view.more_room(self._offered.get(ch.name), now)
            if ch.name in self._offered or len(self._offered) < 100_000:
                self._offered[ch.name] = now
        if more:
            self.room.notify()

    async def _summary(self) -> view.HostSummary:
        e = self.engine
        snap = summary.snapshot(e.card_views(), e.busy_cards(), len(e.queue_view()), e.cfg.slices)
        c = self.cfg
        s = await asyncio.to_thread(
            summary.summarize, snap, e.topology, self._groups, c.zone, c.block, c.domain
        )
        source = self.accounts_source
        return s if source is None else dataclasses.replace(s, accounts=source())

    def peer_accounts(self) -> dict[str, tuple[int, HostAccounts]]:
        """(cards, accounts) that each alive peer publishes (this host left out: its own are read live)."""
        return {
            m.name: (m.summary.cards, m.summary.accounts)
            for m in self.members()
            if m.state is State.ALIVE
            and m.name != self.name
            and m.summary is not None
            and m.summary.accounts is not None
        }

    def own_accounts(self) -> tuple[int, HostAccounts] | None:
        """(cards, accounts) of this host as it last published them, read back from the wire as every peer
        reads them (rounded, and only the accounts that fit): fair share counts this host's part from
        these, so that every host computes its shares from the same numbers. None before the first."""
        return self._own_accounts

    def _published(self, meta: str) -> None:
        try:
            s = view.decode(meta)
        except view.BadSummary:  # not expected: encode checked it
            self._own_accounts = None
            return
        self._own_accounts = None if s.accounts is None else (s.cards, s.accounts)

    async def _publish(self) -> None:
        """Refresh this host's summary; when it changed, gossip it at once (and tell ``room`` if it offers
        more: the planner reads this host from its own meta too)."""
        try:
            new = await self._summary()
            meta = view.encode(new)
        except view.BadSummary as e:
            log.warning("this host's summary cannot be published: %s", e)
            return
        if self.swim is None or self.swim.left or meta == self.swim.meta:
            return
        self.swim.set_meta(meta)
        self._published(meta)
        self.sender.send(self.swim.gossip_now())
        old, self._own = self._own, new
        if view.more_room(old, new):
            self.room.notify()

    # ------------------------------------------------------------------------------ for the others
    def members(self) -> list[view.HostEntry]:
        """Every member known here (this host included), by name."""
        if self.swim is None:
            return []
        return view.entries(self.swim.members.values(), self.clock())

    def offers(self) -> list[HostOffer]:
        """What alive hosts offer now (for ``placement.multihost``)."""
        return view.offers(self.members())

    def channel(self, addr: str) -> aio.Channel:
        """A cached mutual-TLS channel to the peer at ``addr`` (HOST:PORT)."""
        return self.channels.get(addr)
