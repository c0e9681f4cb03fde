"""The ``Peer`` gRPC servicer: what other hosts' daemons may ask of this one, over mutual TLS.

The TLS layer has already refused any caller without a certificate from the site CA; each handler learns
who called from the certificate (``peer_of``: its common name, the host name `xpu certs issue` wrote).
Every request is checked by ``xpud.api.validate`` like the local services' requests.

- ``Swim``: a membership message, handed to the ``Federation`` (it must come from the host it says sent it).
- ``Reserve`` / ``Commit`` / ``Abort`` / ``Launch``: forwarded to the ``hostjobs`` the service was given,
  else answered UNIMPLEMENTED. The interface ``hostjobs`` provides (all async, ``peer`` the caller's
  host name):

      await hostjobs.reserve(request: pb.ReserveRequest, peer: str) -> pb.ReserveReply
      await hostjobs.commit(request: pb.CommitRequest, peer: str) -> pb.CommitReply
      await hostjobs.abort(request: pb.AbortRequest, peer: str) -> pb.AbortReply
      hostjobs.launch(requests: AsyncIterator[pb.LaunchInput], peer: str, context)
          -> AsyncIterator[pb.LaunchEvent]

  ``launch`` receives the inputs already validated one by one. Errors are ``xpud.errors`` classes, which
  become status codes as in the local services. What a certificate buys there (no root unless allowed,
  a job only for the host that reserved it) is ``trust``'s, checked by ``hostjobs`` with ``peer``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc import aio

from xpud.api import validate
from xpud.api.server import streaming, unary
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import BadRequest, Forbidden, Unauthenticated, Unavailable
from xpud.federation import certs, transport, trust
from xpud.federation.probe import TIME_KEY

if TYPE_CHECKING:
    from xpud.config import ClusterSection
    from xpud.federation.hostjobs import HostJobs

log = logging.getLogger("xpud.federation")


def peer_of(context: aio.ServicerContext) -> str:
    """The calling host's name, from its client certificate (verified by the TLS handshake)."""
    auth = context.auth_context() or {}
    cn = auth.get("x509_common_name")
    if cn:
        return cn[0].decode(errors="replace")
    pem = auth.get("x509_pem_cert")
    if pem:
        return certs.peer_name(pem[0])
    raise Unauthenticated("no client certificate: peers must show one from the site CA (xpu certs issue)")


def _hostjobs(jobs: HostJobs | None, what: str):
    if jobs is None:
        return None
    return getattr(jobs, what, None)


def _forwarded(what: str) -> Callable:
    """A unary Peer method that hands the request and the caller to ``hostjobs.<what>``."""

    async def method(self, request, context):
        peer = peer_of(context)
        handler = _hostjobs(self.hostjobs, what)
        if handler is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, f"this host does not take multi-host jobs ({what})"
            )
        return await handler(request, peer)

    method.__name__ = method.__qualname__ = what.capitalize()  # what the logs name
    return unary(method)


class Receiver(Protocol):
    """What the servicer serves for (``xpud.federation.node.Federation``): it takes membership messages,
    names this host, holds ``[cluster]``, and the jobs' peer half once the daemon has started its jobs
    (``xpud.service.jobs.PeerJobs``, or None)."""

    name: str
    cfg: ClusterSection
    peer_jobs: Any

    def receive(self, msg: transport.Message) -> None: ...


class PeerService(pbg.PeerServicer):
    def __init__(self, federation: Receiver, hostjobs: HostJobs | None = None):
        self.federation = federation
        self.hostjobs = hostjobs

    @unary
    async def Swim(self, request, context):
        peer = peer_of(context)
        try:
            msg = transport.from_pb(request)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        if msg.src != peer:
            raise Forbidden(
                f"membership message from {validate.clip(msg.src)!r} over a connection of host {peer!r}: "
                "a host speaks only for itself"
            )
        self.federation.receive(msg)
        context.set_trailing_metadata(((TIME_KEY, repr(time.time())),))  # for `xpud doctor`'s skew check
        return pb.SwimReply()

    Reserve = _forwarded("reserve")
    Commit = _forwarded("commit")
    Abort = _forwarded("abort")

    # jobs from any host (xpud/service/jobs.py's PeerJobs, as the daemon built it)
    def _jobs(self, context, uid: int | None = None):
        """The jobs' peer half; ``uid``: the caller acts on jobs (root's only where allow_root_jobs)."""
        peer = peer_of(context)
        if uid is not None:
            trust.check_uid(uid, peer, self.federation.name, self.federation.cfg)
        jobs = self.federation.peer_jobs
        if jobs is None:
            raise Unavailable("this host serves no jobs yet: retry in a moment")
        return jobs

    @unary
    async def PeerListJobs(self, request, context):
        return await self._jobs(context).list(request)

    @unary
    async def PeerCancelJobs(self, request, context):
        return await self._jobs(context, request.uid).cancel(request)

    @streaming
    async def PeerJobLogs(self, request, context):
        async for chunk in self._jobs(context, request.uid).logs(request):
            yield chunk

    @unary
    async def StartRank(self, request, context):
        peer = peer_of(context)
        return await self._jobs(context, request.uid).start_rank(request, peer)

    @unary
    async def PeerRanks(self, request, context):
        return await self._jobs(context, request.uid).ranks(request)

    @streaming
    async def Launch(self, request_iterator, context):
        peer = peer_of(context)
        handler = _hostjobs(self.hostjobs, "launch")
        if handler is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this host does not take multi-host jobs")
        async for event in handler(request_iterator, peer, context):
            yield event


async def _usage_records(self, request, context):
    """This host's leases and reclaims in a window, for a peer's `xpu report` (any peer of the site:
    usage is what `xpu report` shows every user of the cluster too)."""
    peer_of(context)
    return records_pb(self.federation.engine, self.federation.name, request.since, request.until)


PeerService.UsageRecords = unary(_usage_records)


def records_pb(engine: Any, host: str, since: float, until: float) -> pb.UsageRecordsReply:
    """This host's ``engine.accounting.usage_records`` as a message."""
    from xpud.api.convert import usage_records_pb
    from xpud.engine.accounting import usage_records

    return usage_records_pb(host, *usage_records(engine, host, since, until))
