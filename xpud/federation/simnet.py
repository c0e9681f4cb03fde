"""An in-process network for ``membership.Swim``: many hosts, a simulated clock, message delay and loss,
crashes and partitions. Used by the tests and by ``bench/federation.py`` (1,000 hosts in one process).

Deterministic for a seed: one ``random.Random`` drives delays, losses and every host's choices.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from xpud.federation.membership import Member, Message, State, Swim, SwimConfig


def message_bytes(msg: Message) -> int:
    """A size estimate of ``msg`` on the wire (field bytes plus a few bytes of framing per field)."""
    size = 16
    for value in vars(msg).values():
        if isinstance(value, tuple):
            size += sum(8 + len(u.name) + len(u.addr) + len(u.meta) + 10 for u in value)
        else:
            size += 4 + len(str(value))
    return size


@dataclass
class Stats:
    messages: int = 0
    bytes: int = 0
    dropped: int = 0


@dataclass
class SimNet:
    """``n`` hosts named ``h0``..; ``loss``: the chance a message is lost; delays uniform in ``delay_s``;
    ``meta(name)``: each host's meta from its start (e.g. its capacity summary); ``joined``: every host
    starts knowing every other alive, as in a cluster long after its joins (nothing sent for it)."""

    n: int
    seed: int = 0
    loss: float = 0.0
    delay_s: tuple[float, float] = (0.0005, 0.003)
    cfg: SwimConfig = field(default_factory=SwimConfig)
    tick_s: float = 0.05
    meta: Callable[[str], str] | None = None
    joined: bool = False

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.now = 0.0
        self.hosts: dict[str, Swim] = {}
        self.by_addr: dict[str, str] = {}
        self.down: set[str] = set()
        self.cut: set[frozenset[str]] = set()  # pairs of hosts that cannot reach each other
        self.stats = Stats()
        self._events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        for i in range(self.n):
            self.add(f"h{i}", seeds=[self.hosts["h0"].addr] if i and not self.joined else [])
        if self.joined:
            for host in self.hosts.values():
                host.pop_changes()
                host._queue.clear()  # its own "alive" went out long ago
                for other in self.hosts.values():
                    if other is not host:
                        me = other.members[other.name]
                        host.members[other.name] = Member(
                            me.name, me.addr, me.incarnation, State.ALIVE, me.meta, self.now, self.now
                        )
                # long after its joins, push-pulls are spread over a whole period (longer in a large cluster)
                host._next_push_pull = self.now + host.rng.uniform(0, host.push_pull_interval_s())

    # ------------------------------------------------------------------ hosts
    def add(self, name: str, seeds: list[str], incarnation: int = -1) -> Swim:
        addr = f"{name}:7443"
        meta = self.meta(name) if self.meta else ""
        host = Swim(name, addr, self.now, incarnation, meta, self.cfg, random.Random(self.rng.random()))
        self.hosts[name], self.by_addr[addr] = host, name
        self.down.discard(name)
        self._send(name, host.join(seeds))
        self._at(self.now + self.rng.uniform(0, self.tick_s), "tick", name)
        return host

    def crash(self, name: str) -> None:
        self.down.add(name)

    def leave(self, name: str) -> None:
        """A clean shutdown (the daemon's SIGTERM): "left" goes out, then the host stops."""
        self._send(name, self.hosts[name].leave())

    def set_meta(self, name: str, meta: str) -> int:
        """The host's meta changes (as the daemon's on engine news: a gossip round at once); returns the
        incarnation that carries it."""
        host = self.hosts[name]
        host.set_meta(meta)
        self._send(name, host.gossip_now())
        return host.incarnation

    def restart(self, name: str) -> Swim:
        """The host comes back with a fresh table (incarnation from the clock: above its old ones)."""
        return self.add(name, seeds=[self.hosts[n].addr for n in self.hosts if n != name][:1])

    def partition(self, a: set[str], b: set[str]) -> None:
        self.cut |= {frozenset((x, y)) for x in a for y in b}

    def heal(self) -> None:
        self.cut.clear()

    # ------------------------------------------------------------------ running
    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self._events and self._events[0][0] <= end:
            at, _, kind, payload = heapq.heappop(self._events)
            self.now = at
            if kind == "tick":
                name = payload
                if name in self.down or self.hosts[name].left:
                    continue
                self._send(name, self.hosts[name].tick(at))
                self._at(at + self.tick_s, "tick", name)
            else:
                _src, dst, msg = payload
                if dst in self.down:
                    continue
                self._send(dst, self.hosts[dst].handle(msg, at))
        self.now = end

    def _send(self, src: str, out) -> None:
        for addr, msg in out:
            self.stats.messages += 1
            self.stats.bytes += message_bytes(msg)
            dst = self.by_addr.get(addr)
            if dst is None or frozenset((src, dst)) in self.cut or self.rng.random() < self.loss:
                self.stats.dropped += 1
                continue
            self._at(self.now + self.rng.uniform(*self.delay_s), "msg", (src, dst, msg))

    def _at(self, when: float, kind: str, payload) -> None:
        heapq.heappush(self._events, (when, next(self._order), kind, payload))

    # ------------------------------------------------------------------ questions
    def live(self) -> list[str]:
        return [n for n in self.hosts if n not in self.down and not self.hosts[n].left]

    def state_of(self, observer: str, name: str) -> State | None:
        m = self.hosts[observer].members.get(name)
        return None if m is None else m.state

    def converged(self) -> bool:
        """Every live host knows every live host as alive."""
        live = set(self.live())
        for o in live:
            table = self.hosts[o].members.values()
            known = sum(1 for m in table if m.state is State.ALIVE and m.name in live)
            if known != len(live):
                return False
        return True

    def share(self, name: str, states: tuple[State, ...]) -> float:
        """The share of live hosts (other than ``name``) that see ``name`` in one of ``states``."""
        others = [o for o in self.live() if o != name]
        return sum(self.state_of(o, name) in states for o in others) / max(len(others), 1)
