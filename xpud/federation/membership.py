"""Cluster membership and failure detection: SWIM with suspicion, incarnations, piggy-backed gossip and
push-pull anti-entropy. Pure: messages in, messages out, the time passed in by the caller.

One ``Swim`` per host: the daemon feeds it what arrives from peers (``handle``) and calls ``tick`` often;
both return the messages to send as ``(address, message)`` pairs. The same code runs over gRPC in the
daemon and in-process in ``xpud.federation.simnet``.

Invariants: a higher incarnation wins, and at the same incarnation dead/left > suspect > alive; a fact
whose incarnation is more than ``AHEAD_MS`` ahead of this host's clock is ignored, so no peer can push a
host's incarnation out of its reach and a host wrongly declared dead, or restarted, always rejoins;
``meta`` is at most ``MAX_META`` bytes, and changing it bumps the owner's incarnation.

The protocol step by step (probes, suspicion, gossip, anti-entropy): see docs/federation.md, Membership.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import IntEnum

from xpud.api.validate import MAX_INCARNATION  # the most an incarnation may be on the wire

MAX_META = 1024  # bytes of a member's meta string
MAX_UPDATES = 24  # facts piggy-backed on one message
MAX_MEMBERS = 10_000  # members (and tombstones) a table holds; facts about more are ignored
AHEAD_MS = 30 * 86_400_000  # how far an incarnation may be ahead of this host's clock: a month of ms


class State(IntEnum):
    """Member states, in precedence order at equal incarnation."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3  # left on purpose (a clean shutdown): never suspected, never refuted

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Update:
    """One fact about one member, as gossiped."""

    name: str
    addr: str
    incarnation: int
    state: State
    meta: str = ""


# ---------------------------------------------------------------------------------------- messages
@dataclass(frozen=True)
class Ping:
    seq: int
    src: str
    src_addr: str
    updates: tuple[Update, ...] = ()
    target: str = ""  # the member the sender means to reach (a stale address is ignored)


@dataclass(frozen=True)
class Ack:
    seq: int
    src: str
    src_addr: str
    updates: tuple[Update, ...] = ()
    about: str = ""  # for an indirect probe: the member that answered


@dataclass(frozen=True)
class PingReq:
    seq: int
    src: str
    src_addr: str
    target: str
    target_addr: str
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True)
class Gossip:
    src: str
    src_addr: str
    updates: tuple[Update, ...]


@dataclass(frozen=True)
class PushPull:
    src: str
    src_addr: str
    members: tuple[Update, ...]
    reply: bool  # the receiver answers with its own table


Message = Ping | Ack | PingReq | Gossip | PushPull
Out = tuple[str, Message]  # (address, message)


@dataclass(frozen=True)
class Change:
    """A member's state as this host now believes it (``state`` None: forgotten)."""

    name: str
    addr: str
    state: State
    incarnation: int
    meta: str
    at: float


PUSH_PULL_SCALE_FROM = 32  # members up to which push-pull keeps its base period


def push_pull_scale(members: int) -> int:
    """How many base periods apart push-pulls are with ``members`` in the table: 1 up to 32, then one
    more per doubling (as HashiCorp memberlist scales it: 2 at 33-64, ..., 6 at 513-1,024). A push-pull
    carries the whole table, so without it each host's share of anti-entropy grows with the cluster;
    news travels by gossip, push-pull only heals what gossip missed (and a wrongly declared death)."""
    if members <= PUSH_PULL_SCALE_FROM:
        return 1
    return math.ceil(math.log2(members) - math.log2(PUSH_PULL_SCALE_FROM)) + 1


@dataclass
class SwimConfig:
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 0.2
    indirect_probes: int = 3
    suspicion_s: float = 7.0  # suspect -> dead; with detection (~1-2 probe periods) inside dead_after_s
    gossip_interval_s: float = 0.2
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    push_pull_interval_s: float = 15.0
    gossip_to_dead_s: float = 15.0  # keep telling a dead member, so a wrongly declared one can refute
    tombstone_s: float = 3600.0  # how long a dead member's incarnation is remembered

    @classmethod
    def for_dead_after(cls, dead_after_s: float, **kw) -> SwimConfig:
        """Settings that declare a crashed host dead within about ``dead_after_s``."""
        cfg = cls(**kw)
        cfg.suspicion_s = max(dead_after_s - 4.0 * cfg.probe_interval_s - 1.0, 2.0 * cfg.probe_interval_s)
        return cfg


@dataclass
class Member:
    name: str
    addr: str
    incarnation: int
    state: State
    meta: str = ""
    since: float = 0.0  # when this state began here
    heard: float = 0.0  # when it or a new fact about it was last heard here (how fresh its meta is)

    def update(self) -> Update:
        return Update(self.name, self.addr, self.incarnation, self.state, self.meta)


@dataclass
class _Probe:
    seq: int
    target: str
    sent: float
    indirect_sent: bool = False
    acked: bool = False


@dataclass
class _Relay:
    requester_addr: str
    seq: int  # the requester's sequence number
    target: str
    expires: float


def overrides(new: Update, old: Member) -> bool:
    """Whether ``new`` replaces what is known of ``old`` (SWIM's precedence rules)."""
    if new.incarnation != old.incarnation:
        return new.incarnation > old.incarnation
    return new.state > old.state


@dataclass
class Swim:
    """One host's view of the membership. Not thread-safe: drive it from one task."""

    name: str
    addr: str
    now: float
    incarnation: int = -1  # -1: milliseconds of ``now`` (a restart starts above every earlier number)
    meta: str = ""
    cfg: SwimConfig = field(default_factory=SwimConfig)
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.incarnation < 0:
            self.incarnation = int(self.now * 1000)
        _check_meta(self.meta)
        # the clock in ms as incarnations count it (``now`` may be monotonic: this is immune to steps)
        self._clock_base_ms = self.incarnation - int(self.now * 1000)
        self.members: dict[str, Member] = {
            self.name: Member(
                self.name, self.addr, self.incarnation, State.ALIVE, self.meta, self.now, self.now
            )
        }
        self._queue: dict[str, tuple[Update, int]] = {}  # name -> (fact, transmissions left)
        self._seq = 0
        self._order: list[str] = []
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._suspected_at: dict[str, float] = {}
        self._next_probe = self.now + self.rng.uniform(0, self.cfg.probe_interval_s)
        self._next_gossip = self.now + self.rng.uniform(0, self.cfg.gossip_interval_s)
        self._next_push_pull = self.now + self.rng.uniform(0, self.cfg.push_pull_interval_s)
        self._changes: list[Change] = []
        self._next_tombstone_sweep = self.now + 60.0
        self._seeds: list[str] = []
        self.left = False
        self._broadcast(self.members[self.name].update())

    # ------------------------------------------------------------------------------ public
    def join(self, seeds: Iterable[str]) -> list[Out]:
        """Ask each seed address for its table (a push-pull); repeated at every push-pull period until
        some member is known."""
        self._seeds = [s for s in seeds if s != self.addr]
        return [(s, self._push_pull(reply=True)) for s in self._seeds]

    def set_meta(self, meta: str) -> None:
        """Change this host's meta (e.g. its location or summary version); spreads as a new incarnation."""
        _check_meta(meta)
        if meta == self.meta:
            return
        self.meta = meta
        self._refresh_self()

    def gossip_now(self) -> list[Out]:
        """A gossip round now rather than at the next period (e.g. right after ``set_meta``: news of freed
        capacity reaches ``gossip_fanout`` members at once); the next round is a full period away."""
        if self.left:
            return []
        self._next_gossip = self.now + self.cfg.gossip_interval_s
        return self._gossip_round()

    def leave(self) -> list[Out]:
        """A clean shutdown: tell ``gossip_fanout`` members right away (gossip carries it further)."""
        self.left = True
        me = self.members[self.name]
        me.state, me.since = State.LEFT, self.now
        self._broadcast(me.update())
        return [(m.addr, Gossip(self.name, self.addr, (me.update(),))) for m in self._gossip_targets()]

    def alive(self) -> list[Member]:
        """Members believed alive (suspect ones included: they may refute), this host first."""
        return [m for m in self.members.values() if m.state in (State.ALIVE, State.SUSPECT)]

    def pop_changes(self) -> list[Change]:
        out, self._changes = self._changes, []
        return out

    def tick(self, now: float) -> list[Out]:
        """Advance the clock: probes and their time-outs, suspicions that expire, gossip, push-pull."""
        self.now = max(self.now, now)
        if self.left:
            return []
        self.members[self.name].heard = self.now
        out: list[Out] = []
        self._expire_suspicions()
        self._expire_relays()
        p = self._probe
        if p and not p.acked and not p.indirect_sent and self.now >= p.sent + self.cfg.probe_timeout_s:
            out += self._indirect(p)
        if self.now >= self._next_probe:
            if p and not p.acked:
                self._suspect_member(p.target)
            self._probe = None
            self._next_probe = self.now + self.cfg.probe_interval_s
            out += self._start_probe()
        if self.now >= self._next_gossip:
            self._next_gossip = self.now + self.cfg.gossip_interval_s
            out += self._gossip_round()
        if self.now >= self._next_push_pull:
            self._next_push_pull = self.now + self.push_pull_interval_s()
            out += self._anti_entropy()
        return out

    def handle(self, msg: Message, now: float) -> list[Out]:
        """A message from a peer; returns the replies and relays it causes."""
        self.now = max(self.now, now)
        if self.left:
            return []
        sender = self.members.get(msg.src)
        if sender is not None and sender.addr == msg.src_addr and sender.state is State.ALIVE:
            sender.heard = self.now  # its facts as known here are this fresh
        match msg:
            case Ping():
                self._merge(msg.updates)
                if msg.target and msg.target != self.name:
                    return []  # meant for whoever had this address before
                return [(msg.src_addr, Ack(msg.seq, self.name, self.addr, self._piggyback()))]
            case Ack():
                self._merge(msg.updates)
                relay = self._relays.pop(msg.seq, None)
                if relay is not None:
                    ack = Ack(relay.seq, self.name, self.addr, self._piggyback(), about=relay.target)
                    return [(relay.requester_addr, ack)]
                p = self._probe
                if p and p.seq == msg.seq and (msg.about or msg.src) == p.target:
                    p.acked = True
                return []
            case PingReq():
                self._merge(msg.updates)
                seq = self._next_seq()
                self._relays[seq] = _Relay(
                    msg.src_addr, msg.seq, msg.target, self.now + self.cfg.probe_interval_s
                )
                ping = Ping(seq, self.name, self.addr, self._piggyback(), target=msg.target)
                return [(msg.target_addr, ping)]
            case Gossip():
                self._merge(msg.updates)
                return []
            case PushPull():
                self._merge(msg.members, full_sync=True)
                if msg.reply:
                    return [(msg.src_addr, self._push_pull(reply=False))]
                return []
        return []

    # ------------------------------------------------------------------------------ probing
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _start_probe(self) -> list[Out]:
        target = self._next_target()
        if target is None:
            return []
        m = self.members[target]
        self._probe = _Probe(self._next_seq(), target, self.now)
        return [(m.addr, Ping(self._probe.seq, self.name, self.addr, self._piggyback(), target=target))]

    def _next_target(self) -> str | None:
        for _ in range(2):
            while self._order:
                name = self._order.pop()
                m = self.members.get(name)
                if m and m.state in (State.ALIVE, State.SUSPECT):
                    return name
            self._order = [m.name for m in self.alive() if m.name != self.name]
            self.rng.shuffle(self._order)
        return None

    def _indirect(self, p: _Probe) -> list[Out]:
        p.indirect_sent = True
        target = self.members.get(p.target)
        if target is None:
            return []
        helpers = [m for m in self.alive() if m.name not in (self.name, p.target) and m.state is State.ALIVE]
        chosen = self.rng.sample(helpers, min(self.cfg.indirect_probes, len(helpers)))
        req = PingReq(p.seq, self.name, self.addr, target.name, target.addr, self._piggyback())
        return [(m.addr, req) for m in chosen]

    def _expire_relays(self) -> None:
        for seq in [s for s, r in self._relays.items() if r.expires <= self.now]:
            del self._relays[seq]

    def _suspect_member(self, name: str) -> None:
        m = self.members.get(name)
        if m is None or m.state is not State.ALIVE:
            return
        self._apply(Update(m.name, m.addr, m.incarnation, State.SUSPECT, m.meta))

    def _expire_suspicions(self) -> None:
        for name, since in list(self._suspected_at.items()):
            m = self.members.get(name)
            if m is None or m.state is not State.SUSPECT:
                self._suspected_at.pop(name, None)
            elif self.now - since >= self.cfg.suspicion_s:
                self._apply(Update(m.name, m.addr, m.incarnation, State.DEAD, m.meta))
        if self.now >= self._next_tombstone_sweep:  # O(members): once a minute is plenty
            self._next_tombstone_sweep = self.now + 60.0
            horizon = self.now - self.cfg.tombstone_s
            for name in [n for n, m in self.members.items() if m.state >= State.DEAD and m.since < horizon]:
                if name != self.name:
                    del self.members[name]

    # ------------------------------------------------------------------------------ gossip
    def _retransmits(self) -> int:
        return self.cfg.retransmit_mult * max(1, math.ceil(math.log10(len(self.members) + 1)))

    def _broadcast(self, u: Update) -> None:
        self._queue[u.name] = (u, self._retransmits())

    def _piggyback(self) -> tuple[Update, ...]:
        """Up to MAX_UPDATES queued facts, least-sent first; each use counts as a transmission."""
        if not self._queue:
            return ()
        picked = heapq.nlargest(MAX_UPDATES, self._queue.items(), key=lambda kv: kv[1][1])
        for name, (u, left) in picked:
            if left <= 1:
                del self._queue[name]
            else:
                self._queue[name] = (u, left - 1)
        return tuple(u for _, (u, _) in picked)

    def _gossip_targets(self) -> list[Member]:
        recent_dead = self.now - self.cfg.gossip_to_dead_s
        pool = [
            m
            for m in self.members.values()
            if m.name != self.name
            and (
                m.state in (State.ALIVE, State.SUSPECT) or (m.state is State.DEAD and m.since >= recent_dead)
            )
        ]
        return self.rng.sample(pool, min(self.cfg.gossip_fanout, len(pool)))

    def _gossip_round(self) -> list[Out]:
        if not self._queue:
            return []
        out = []
        for m in self._gossip_targets():
            updates = self._piggyback()
            if not updates:
                break
            out.append((m.addr, Gossip(self.name, self.addr, updates)))
        return out

    def push_pull_interval_s(self) -> float:
        """``push_pull_interval_s``, longer in a large cluster (``push_pull_scale`` of the live members)."""
        return self.cfg.push_pull_interval_s * push_pull_scale(len(self.alive()))

    def _push_pull(self, reply: bool) -> PushPull:
        """The whole table, deaths included: a member declared dead learns it here and refutes."""
        return PushPull(self.name, self.addr, tuple(m.update() for m in self.members.values()), reply)

    def _anti_entropy(self) -> list[Out]:
        """Swap tables with one live member; also with one dead member (as Serf's reconnect: a host
        wrongly declared dead, e.g. across a healed partition, learns it and refutes); alone, the seeds."""
        out: list[Out] = []
        others = [m for m in self.alive() if m.name != self.name]
        dead = [m for m in self.members.values() if m.state is State.DEAD]
        if others:
            out.append((self.rng.choice(others).addr, self._push_pull(reply=True)))
        else:
            out += [(s, self._push_pull(reply=True)) for s in self._seeds]
        if dead:
            out.append((self.rng.choice(dead).addr, self._push_pull(reply=True)))
        return out

    # ------------------------------------------------------------------------------ merging
    def _merge(self, updates: Iterable[Update], full_sync: bool = False) -> None:
        for u in updates:
            if full_sync and u.state is State.DEAD and u.name != self.name:
                # another host's table is old news: a death in it only starts a suspicion here
                u = replace(u, state=State.SUSPECT)
            self._apply(u)

    def ceiling(self) -> int:
        """The highest incarnation a fact may carry here now (``AHEAD_MS`` beyond this host's clock)."""
        return min(int(self.now * 1000) + self._clock_base_ms + AHEAD_MS, MAX_INCARNATION - 1)

    def _apply(self, u: Update) -> None:
        if not _valid(u) or u.incarnation > self.ceiling():
            return
        if u.name == self.name:
            self._about_me(u)
            return
        old = self.members.get(u.name)
        if old is None:
            if len(self.members) >= MAX_MEMBERS or u.state >= State.DEAD:
                return  # a death of someone never known needs no tombstone
            old = self.members[u.name] = Member(u.name, u.addr, -1, State.ALIVE, since=self.now)
            fresh = True
        else:
            fresh = False
            if not overrides(u, old):
                return
        changed_state = fresh or old.state is not u.state
        old.addr, old.incarnation, old.meta, old.heard = u.addr, u.incarnation, u.meta, self.now
        if changed_state:
            old.state, old.since = u.state, self.now
        if u.state is State.SUSPECT and changed_state:
            self._suspected_at[u.name] = self.now
        elif u.state is not State.SUSPECT:
            self._suspected_at.pop(u.name, None)
        self._broadcast(u)
        self._changes.append(Change(u.name, u.addr, u.state, u.incarnation, u.meta, self.now))

    def _about_me(self, u: Update) -> None:
        """Someone says something of this host: refute a suspicion or a death with a higher incarnation."""
        if self.left:
            return
        stale_life = u.incarnation > self.incarnation  # e.g. facts from before a clock step back
        if (u.state in (State.SUSPECT, State.DEAD) and u.incarnation >= self.incarnation) or stale_life:
            self.incarnation = max(self.incarnation, u.incarnation)
            self._refresh_self()

    def _refresh_self(self) -> None:
        self.incarnation += 1
        me = self.members[self.name]
        me.incarnation, me.meta, me.state, me.heard = self.incarnation, self.meta, State.ALIVE, self.now
        self._broadcast(me.update())


def _check_meta(meta: str) -> None:
    if len(meta.encode()) > MAX_META:
        raise ValueError(f"member meta is {len(meta.encode())} bytes; at most {MAX_META}")


def _valid(u: Update) -> bool:
    """Facts from the wire are bounded: a name, an address, a sane incarnation, a short meta."""
    return (
        0 < len(u.name) <= 253
        and 0 < len(u.addr) <= 300
        and 0 <= u.incarnation <= MAX_INCARNATION
        and isinstance(u.state, State)
        and len(u.meta) <= MAX_META
    )
