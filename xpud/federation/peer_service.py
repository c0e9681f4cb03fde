"""The ``Peer`` gRPC servicer: what other hosts' daemons may ask of this one, over mutual TLS.

The TLS layer has already refused any caller without a certificate from the site CA; each handler learns
who called from the certificate (``peer_of``: its common name, the host name `xpu certs issue` wrote).
Every request is checked by ``xpud.api.validate`` like the local services' requests.

- ``Swim``: a membership message, handed to the ``Federation`` (it must come from the host it says sent it).
- ``Reserve`` / ``Commit`` / ``Abort`` / ``Launch``: forwarded to ``daemon.hostjobs`` when the daemon has
  one, else answered UNIMPLEMENTED. The interface ``hostjobs`` provides (all async, ``peer`` the caller's
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
from typing import Any

import grpc
from grpc import aio

from xpud.api import validate
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import BadRequest, Forbidden, Unauthenticated
from xpud.federation import certs, transport
from xpud.federation.probe import TIME_KEY
from xpud.service.node import streaming, unary

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


def _hostjobs(daemon: Any, what: str):
    jobs = getattr(daemon, "hostjobs", None)
    if jobs is None:
        return None
    return getattr(jobs, what, None)


def _forwarded(what: str) -> Callable:
    """A unary Peer method that hands the request and the caller to ``daemon.hostjobs.<what>``."""

    async def method(self, request, context):
        peer = peer_of(context)
        handler = _hostjobs(self.daemon, what)
        if handler is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, f"this host does not take multi-host jobs ({what})"
            )
        return await handler(request, peer)

    method.__name__ = method.__qualname__ = what.capitalize()  # what the logs name
    return unary(method)


class PeerService(pbg.PeerServicer):
    def __init__(self, federation: Any, daemon: Any = None):
        self.federation = federation
        self.daemon = daemon

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

    @streaming
    async def Launch(self, request_iterator, context):
        peer = peer_of(context)
        handler = _hostjobs(self.daemon, "launch")
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
