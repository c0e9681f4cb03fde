"""Where the dashboard's data comes from: a host source (one daemon) and a cluster feed (many hosts).

The app depends only on these small interfaces, so tests and screenshots can feed recorded data through
the same path as a live daemon. The blocking loops here run in the app's worker threads; they call back
with plain messages and never touch Textual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from xpu_tui.hostrow import HostRow, from_cluster_host, from_watch

from xpud.api.client import Client
from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import Forbidden, NotFound, Unavailable, XpudError

RETRY_S = 2.0  # wait between reconnect attempts


class HostSource(Protocol):
    """One daemon: its facts, its Watch stream and (on the admin socket) the operator verbs."""

    admin: bool  # connected through the admin socket

    def info(self) -> pb.InfoReply: ...
    def topology(self) -> pb.TopologyReply: ...
    def updates(self, interval_s: float) -> Iterator[pb.WatchUpdate]: ...
    def close(self) -> None: ...
    def drain(self, card: str, reason: str) -> pb.Card: ...
    def undrain(self, card: str) -> pb.Card: ...
    def set_mode(self, card: str, mode: str) -> pb.Card: ...
    def evict(self, lease_id: str, reason: str) -> pb.Lease: ...
    def health(self, card: str) -> pb.CardHealth: ...
    def accounts(self) -> pb.AccountsReply: ...


class ClientSource:
    """A live daemon behind an ``xpud.api.client.Client``."""

    label = "live"  # what the status line calls the connection once it works

    def __init__(self, client: Client):
        self.client = client
        self.admin = client.admin is not None
        self._calls: set = set()
        self._lock = threading.Lock()

    def info(self) -> pb.InfoReply:
        return self.client.info()

    def topology(self) -> pb.TopologyReply:
        return self.client.topology()

    def updates(self, interval_s: float) -> Iterator[pb.WatchUpdate]:
        call = self.client.watch(interval_s)
        with self._lock:
            self._calls.add(call)
        try:
            yield from self.client.iterate(call)
        finally:
            with self._lock:
                self._calls.discard(call)

    def close(self) -> None:
        # Cancelling the stream is what unblocks the worker thread that iterates it.
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def drain(self, card: str, reason: str) -> pb.Card:
        return self.client.drain(card, reason)

    def undrain(self, card: str) -> pb.Card:
        return self.client.undrain(card)

    def set_mode(self, card: str, mode: str) -> pb.Card:
        return self.client.set_mode(card, mode)

    def evict(self, lease_id: str, reason: str) -> pb.Lease:
        return self.client.evict(lease_id, reason)

    def health(self, card: str) -> pb.CardHealth:
        return self.client.health(card, history=5).cards[0]

    def accounts(self) -> pb.AccountsReply:
        return self.client.accounts()


class RecordedSource:
    """Recorded or constructed data played through the live path: for tests, screenshots and ``--demo``.

    ``updates`` yields the recorded updates and then stays quiet (like a daemon with nothing new)
    until closed. Operator verbs are refused unless ``admin``; when allowed they are only recorded. A card's
    health is ``health_of(card)`` for the card as last recorded; the accounts are ``accounts`` (none given:
    no accounts configured).
    """

    label = "demo"  # constructed or recorded data: never called live

    def __init__(
        self,
        info: pb.InfoReply,
        topology: pb.TopologyReply,
        updates: Sequence[pb.WatchUpdate],
        admin: bool = False,
        health_of: Callable[[pb.Card], pb.CardHealth] | None = None,
        accounts: pb.AccountsReply | None = None,
    ):
        self._info, self._topology, self._updates = info, topology, list(updates)
        self._accounts = accounts or pb.AccountsReply(enabled=False)
        self.admin = admin
        self._health_of = health_of
        self.actions: list[tuple[str, ...]] = []
        self._closed = threading.Event()

    def info(self) -> pb.InfoReply:
        return self._info

    def topology(self) -> pb.TopologyReply:
        return self._topology

    def updates(self, interval_s: float) -> Iterator[pb.WatchUpdate]:
        yield from self._updates
        self._closed.wait()

    def close(self) -> None:
        self._closed.set()

    def accounts(self) -> pb.AccountsReply:
        return self._accounts

    def _act(self, *action: str) -> None:
        if not self.admin:
            raise Forbidden("this action needs the admin socket")
        self.actions.append(action)

    def drain(self, card: str, reason: str) -> pb.Card:
        self._act("drain", card, reason)
        return pb.Card()

    def undrain(self, card: str) -> pb.Card:
        self._act("undrain", card)
        return pb.Card()

    def set_mode(self, card: str, mode: str) -> pb.Card:
        self._act("set_mode", card, mode)
        return pb.Card()

    def evict(self, lease_id: str, reason: str) -> pb.Lease:
        self._act("evict", lease_id, reason)
        return pb.Lease()

    def health(self, card: str) -> pb.CardHealth:
        last = {str(c.index): c for c in self._updates[-1].cards.cards} if self._updates else {}
        if card not in last:
            raise NotFound(f"card {card}: no such card")
        c = last[card]
        if self._health_of is not None:
            return self._health_of(c)
        return pb.CardHealth(index=c.index, uuid=c.uuid, state=c.health_state, score=c.health_score)


def follow(
    source: HostSource,
    interval_s: float,
    stop: threading.Event,
    on_connect: Callable[[pb.InfoReply, pb.TopologyReply | None], None],
    on_update: Callable[[pb.WatchUpdate], None],
    on_error: Callable[[str], None],
    retry_s: float = RETRY_S,
) -> None:
    """Stream a source's updates until ``stop`` is set, reconnecting after errors (blocking)."""
    while not stop.is_set():
        try:
            info = source.info()
            try:
                topology = source.topology()
            except XpudError:
                topology = None  # tiles are still useful ungrouped
            on_connect(info, topology)
            for update in source.updates(interval_s):
                on_update(update)
                if stop.is_set():
                    return
            if stop.is_set():
                return
            raise Unavailable("the daemon closed the Watch stream")
        except XpudError as e:
            on_error(str(e))
        stop.wait(retry_s)


def poll_accounts(
    source: HostSource,
    every_s: float,
    stop: threading.Event,
    on_reply: Callable[[pb.AccountsReply], None],
) -> None:
    """Ask ``source`` for its accounts every ``every_s`` until ``stop`` is set (blocking). A daemon without
    accounts answers ``enabled`` false, and is asked again (a reload may add them); an error is skipped
    (the Watch stream reports the connection)."""
    while not stop.is_set():
        with contextlib.suppress(XpudError):
            on_reply(source.accounts())
        stop.wait(every_s)


# ------------------------------------------------------------------------------------------ cluster
@dataclass(frozen=True)
class HostSpec:
    """A host of the cluster view given on the command line: ``[DOMAIN/][NAME=]RUNTIME_DIR``."""

    runtime_dir: Path
    name: str = ""  # "" = the runtime dir
    domain: str = ""

    @classmethod
    def parse(cls, text: str) -> HostSpec:
        label, sep, path = text.partition("=")
        if not sep:
            return cls(Path(text))
        domain, _, name = label.rpartition("/")
        return cls(Path(path), name, domain)


class ClusterFeed(Protocol):
    """Publishes host summaries (in batches) until ``stop`` is set. Blocking; run in a worker thread."""

    def run(self, publish: Callable[[list[HostRow]], None], stop: threading.Event) -> None: ...


class StaticCluster:
    """A fixed set of summaries (generated or recorded), published once."""

    def __init__(self, hosts: Iterable[HostRow]):
        self.hosts = list(hosts)

    def run(self, publish: Callable[[list[HostRow]], None], stop: threading.Event) -> None:
        publish(self.hosts)
        stop.wait()


class LocalHosts:
    """Several local daemons (one runtime dir each), each followed on its own Watch stream."""

    def __init__(
        self,
        hosts: Sequence[HostSpec],
        interval_s: float = 1.0,
        connect: Callable[[Path], HostSource] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.hosts = list(hosts)
        self.interval_s = interval_s
        self.connect = connect or (lambda d: ClientSource(Client(d)))
        self.clock = clock

    def run(self, publish: Callable[[list[HostRow]], None], stop: threading.Event) -> None:
        threads = [
            threading.Thread(target=self._follow, args=(h, publish, stop), daemon=True, name=f"host {h}")
            for h in self.hosts
        ]
        for t in threads:
            t.start()
        stop.wait()

    def _follow(self, host: HostSpec, publish, stop: threading.Event) -> None:
        source = self.connect(host.runtime_dir)
        # Several local daemons share one hostname: the runtime dir is what tells them apart.
        name = host.name or str(host.runtime_dir)
        last = HostRow(name=name, domain=host.domain)

        def on_update(update: pb.WatchUpdate) -> None:
            nonlocal last
            last = from_watch(name, update, self.clock(), host.domain)
            publish([last])

        def on_error(message: str) -> None:
            nonlocal last
            last = dataclasses.replace(last, error=message)  # keep the last numbers, marked stale
            publish([last])

        threading.Thread(target=lambda: (stop.wait(), source.close()), daemon=True).start()
        follow(source, self.interval_s, stop, lambda _info, _topology: None, on_update, on_error)


class FederationHosts:
    """The cluster as the local daemon sees it through federation (``Node.GetCluster``), asked every
    ``interval_s``. On an error the hosts last seen are published again, marked with it."""

    def __init__(self, client: Client, interval_s: float = 1.0, clock: Callable[[], float] = time.time):
        self.client = client
        self.interval_s = interval_s
        self.clock = clock

    def run(self, publish: Callable[[list[HostRow]], None], stop: threading.Event) -> None:
        last: list[HostRow] = []
        while not stop.is_set():
            try:
                reply = self.client.cluster()
                now = self.clock()
                last = [from_cluster_host(h, now) for h in reply.hosts]
                publish(last)
            except XpudError as e:
                publish([dataclasses.replace(h, error=str(e)) for h in last])
            stop.wait(self.interval_s)
