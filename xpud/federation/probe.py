"""Probe peers from outside the daemon (``xpud doctor``): can this host reach each peer's ``Peer`` service
with its certificate, and how far apart are the two clocks?

A probe is one empty ``Gossip`` message in this host's name (it changes nothing at the peer and causes no
reply message). The peer's servicer puts its wall clock in the trailing metadata (``TIME_KEY``); the skew
is that time minus the middle of the call here, give or take half the round trip. Blocking: for the
doctor, never for the daemon.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.federation.certs import HostCredentials

TIME_KEY = "x-xpud-time"  # trailing metadata of Peer.Swim: the peer's time.time(), as text


@dataclass(frozen=True)
class Probe:
    addr: str
    ok: bool
    error: str = ""
    skew_s: float = 0.0  # the peer's clock minus this host's
    rtt_s: float = 0.0

    @property
    def uncertainty_s(self) -> float:
        return self.rtt_s / 2


def probe(creds: HostCredentials, name: str, own_addr: str, addr: str, timeout_s: float = 3.0) -> Probe:
    channel_creds = grpc.ssl_channel_credentials(creds.ca, creds.key, creds.cert)
    msg = pb.SwimMessage(kind=pb.SwimMessage.GOSSIP, src=name, src_addr=own_addr)
    with grpc.secure_channel(addr, channel_creds) as ch:
        t0 = time.time()
        try:
            _, call = pbg.PeerStub(ch).Swim.with_call(msg, timeout=timeout_s)
        except grpc.RpcError as e:
            detail = (e.details() or "")[:160] if hasattr(e, "details") else str(e)[:160]
            code = e.code().name if hasattr(e, "code") else "ERROR"
            return Probe(addr, False, f"{code}: {detail}")
        t1 = time.time()
    meta = dict(call.trailing_metadata() or ())
    try:
        theirs = float(meta[TIME_KEY])
    except (KeyError, ValueError):
        return Probe(addr, True, "the peer does not report its clock (an older xpud)", rtt_s=t1 - t0)
    return Probe(addr, True, skew_s=theirs - (t0 + t1) / 2, rtt_s=t1 - t0)


def probe_all(
    creds: HostCredentials, name: str, own_addr: str, addrs: Iterable[str], timeout_s: float = 3.0
) -> list[Probe]:
    seen = dict.fromkeys(a for a in addrs if a != own_addr)
    return [probe(creds, name, own_addr, a, timeout_s) for a in list(seen)[:64]]
