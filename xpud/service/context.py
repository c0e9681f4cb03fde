"""What the servicers share (``Context``): the engine, the credential issuer, this daemon's facts and the
parts a request may reach (health monitor, defragmenter, federation, multi-host jobs, carbon signal), each
typed and None where this daemon runs without it. Built by ``xpud.daemon.app``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grpc import aio

from xpud.api import convert
from xpud.api.auth import METADATA_KEY, CredentialIssuer
from xpud.api.v1 import xpu_pb2 as pb
from xpud.engine.engine import Engine
from xpud.model import Caller, Lease
from xpud.planning.green import Signal

if TYPE_CHECKING:
    from xpud.controllers.accounts import Accounts
    from xpud.controllers.defragmenter import Defragmenter
    from xpud.controllers.health import HealthMonitor
    from xpud.federation.hostjobs import HostJobs
    from xpud.federation.node import Federation
    from xpud.hw.fakenvml import FakeNvml
    from xpud.isolation.scope import Scopes
    from xpud.jobs.book import JobBook
    from xpud.service.gangjobs import Gang

REPLY_BUDGET = 3 * 1024 * 1024  # bytes per reply: gRPC refuses messages over 4 MiB unless told otherwise


@dataclass(frozen=True)
class DaemonInfo:
    """Facts about this daemon for ``Node.Info`` (the InfoReply fields of the same names)."""

    version: str = ""
    hostname: str = ""
    backend: str = ""  # "nvml" or "simulated:<machine>"
    driver_version: str = ""
    started: float = 0.0  # wall time, s
    user_socket: str = ""
    admin_socket: str = ""
    config_path: str = ""  # "" when it runs on defaults
    device_isolation: str = ""  # "enforced" or "advisory (why)" (xpud.isolation.scope)


@dataclass
class Context:
    """What the servicers share: the engine, the credential issuer and facts about this daemon."""

    engine: Engine
    issuer: CredentialIssuer
    info: DaemonInfo = field(default_factory=DaemonInfo)
    fake: FakeNvml | None = None  # the simulated NVML (fault injection is refused without it)
    health: HealthMonitor | None = None  # the health monitor, when running
    defrag: Defragmenter | None = None  # the defragmenter (Admin.Defrag), when running
    federation: Federation | None = None  # this host in its cluster, when [cluster] is configured
    hostjobs: HostJobs | None = None  # multi-host jobs (Node.RunJob coordinates them through it)
    carbon: Signal | None = None  # the carbon signal (Acquire plans --when-green starts from it)
    scopes: Scopes | None = None  # each lease's device scope (xpud.isolation.scope)
    accounts: Accounts | None = None  # fair share between accounts (xpud.controllers.accounts), when set up
    jobs: JobBook | None = None  # detached jobs (xpud.jobs.book), once the daemon has started them
    gang: Gang | None = None  # submitted multi-host jobs this daemon placed (xpud.service.gangjobs.Gang)
    # multi-host jobs this daemon coordinates: job id -> [JobRun, its task, its JobRecord] (xpu cancel)
    multi_host: dict[str, list] = field(default_factory=dict)
    # lease id -> (the active Lease, its message as Acquire answered it): its Release answers a copy
    granted: dict[str, tuple[Lease, pb.Lease]] = field(default_factory=dict)

    def remember_grant(self, lease: Lease, msg: pb.Lease) -> None:
        """Keep the message of a lease just granted (``lease_pb(lease, True)``): its release answers a copy
        of it with the end's fields, one Lease message built per grant+release instead of two. Leases
        ended otherwise (reclaimed, evicted) are dropped whenever the table has doubled."""
        kept = self.granted
        if len(kept) >= 2 * len(self.engine.leases) + 64:
            leases = self.engine.leases
            self.granted = kept = {k: v for k, v in kept.items() if leases.get(k) is v[0]}
        kept[lease.id] = (lease, msg)

    def ended_msg(self, msg: pb.Lease, active: Lease | None, ended: Lease) -> None:
        """Fill ``msg`` (empty) with ``lease_pb(ended, True)``; ``active``: the lease object that was
        ended (``ended`` is its copy with the end's fields). From the grant's message when it was made
        from that very object (a Lease is frozen: a move or a restart count makes a new one)."""
        kept = self.granted.pop(ended.id, None)
        if kept is None or active is None or kept[0] is not active:
            msg.CopyFrom(convert.lease_pb(ended, True))
            return
        msg.CopyFrom(kept[1])
        convert.end_lease_pb(msg, ended)

    def cards_reply(self) -> pb.ListCardsReply:
        return convert.cards_reply(self.card_msgs(), self.info.hostname, self.engine.cfg.slices)

    def caller(self, context: aio.ServicerContext) -> Caller:
        md = dict(context.invocation_metadata() or ())
        return self.issuer.check(md.get(METADATA_KEY))

    def card_msgs(self) -> list[pb.Card]:
        e = self.engine
        return [convert.card_pb(v, e.isolation_name(v.info.index)) for v in e.card_views()]

    def leases_reply(self, caller: Caller, budget: int, leases: list | None = None) -> pb.ListLeasesReply:
        """Leases (active ones unless given) then the queue, as many as fit in ``budget`` bytes; the reply
        counts what it left out, so no listing can outgrow gRPC's message limit."""
        e = self.engine
        leases = e.lease_list() if leases is None else leases
        lease_msgs = (
            convert.lease_pb(le, caller.admin or caller.uid == le.owner_uid, e.is_held(le.id))
            for le in leases
        )
        kept, budget = fit(lease_msgs, budget)
        queue = e.queue_view()
        queued, _ = fit((convert.queue_pb(q) for q in queue), budget)
        return pb.ListLeasesReply(
            leases=kept,
            queue=queued,
            leases_omitted=len(leases) - len(kept),
            queue_omitted=len(queue) - len(queued),
        )


def fit(msgs, budget: int) -> tuple[list, int]:
    """The leading messages of ``msgs`` whose encoded sizes fit in ``budget`` bytes; and what is left."""
    kept = []
    for m in msgs:
        size = m.ByteSize() + 8  # + the field's tag and length
        if size > budget:
            break
        kept.append(m)
        budget -= size
    return kept, budget
