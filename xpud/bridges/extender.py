"""The Kubernetes scheduler extender: kube-scheduler's ``filter`` and ``prioritize`` verbs over xpud's
view of the cluster, as ``placement.multihost.HostOffer`` snapshots (one per node).

JSON shapes are kube-scheduler's (k8s.io/kube-scheduler/extender/v1, types.go): it POSTs
``ExtenderArgs`` {``pod``, ``nodes`` (a NodeList) or ``nodenames``}; ``filter`` answers
``ExtenderFilterResult`` {``nodes`` or ``nodenames``, ``failedNodes``, ``error``}; ``prioritize``
answers a ``HostPriorityList`` [{``host``, ``score``}] with scores 0..10.

What a pod asks: the sum over its containers of ``<domain>/gpu`` (whole cards) and
``<domain>/<slice size>`` (slices) in limits (else requests); optionally the annotation
``xpu.dev/min-group-gbps``: the modelled all-reduce bus bandwidth its cards need (GB/s).

Filter: a node passes when it has that many free whole cards whose best group reaches the bandwidth
asked, and that many free slices of each size. Prioritize (the policy xpud places with): for whole cards,
the node's best group bandwidth for the count (the ring runs at its slowest link), then the tightest fit
(a pod that fills a node leaves bigger nodes whole); for slices, the node whose slices already break the
fewest whole cards (room on cards that are sliced already), then the tightest fit.

Offers come from a source (any callable returning ``{node: HostOffer}``): the daemons' sockets
(``SocketOffers``) until the federation view serves them.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from xpud.placement.multihost import HostOffer

log = logging.getLogger("xpud.bridges")

MAX_BODY_BYTES = 16 << 20  # a NodeList of a few thousand nodes
MAX_PRIORITY = 10  # kube-scheduler's MaxExtenderPriority
MIN_GBPS_ANNOTATION = "xpu.dev/min-group-gbps"
OfferSource = Callable[[], Mapping[str, HostOffer]]


class BadArgs(ValueError):
    """The request is not an ExtenderArgs this extender can read; one line."""


def _quantity(v) -> int:
    """A Kubernetes quantity for an extended resource (whole numbers only: "4", 4)."""
    text = str(v).strip()
    if not text.isdigit() or len(text) > 6:
        raise BadArgs(f"extended resource quantity {text[:20]!r}: whole numbers only (0..999999)")
    return int(text)


def pod_asks(pod: Mapping, domain: str = "xpu.dev") -> dict[str, int]:
    """``{"gpu": 4}``, ``{"vxpu-half": 1}``: what the pod's containers ask of ``domain``'s resources."""
    if not isinstance(pod, Mapping):
        raise BadArgs("pod: expected an object (a v1.Pod)")
    containers = (pod.get("spec") or {}).get("containers") or []
    asks: dict[str, int] = {}
    for c in containers if isinstance(containers, list) else ():
        res = (c or {}).get("resources") or {}
        wanted = res.get("limits") or res.get("requests") or {}
        for name, v in wanted.items() if isinstance(wanted, Mapping) else ():
            d, _, kind = str(name).partition("/")
            if d == domain and kind:
                asks[kind] = asks.get(kind, 0) + _quantity(v)
    return {k: v for k, v in asks.items() if v}


def min_gbps(pod: Mapping) -> float:
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(MIN_GBPS_ANNOTATION)
    if text is None:
        return 0.0
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or not 0 <= v <= 1e6:
        raise BadArgs(f"annotation {MIN_GBPS_ANNOTATION}={str(text)[:20]!r}: a number of GB/s, 0..1e6")
    return v


def candidates(args: Mapping) -> tuple[list[str], list[dict] | None]:
    """Node names in the request, and the Node objects when it sent a NodeList."""
    if not isinstance(args, Mapping) or not isinstance(args.get("pod"), Mapping):
        raise BadArgs("expected ExtenderArgs {pod, nodes | nodenames}")
    nodes = args.get("nodes")
    if isinstance(nodes, Mapping):
        items = [n for n in nodes.get("items") or [] if isinstance(n, Mapping)]
        return [str((n.get("metadata") or {}).get("name", "")) for n in items], items
    names = args.get("nodenames")
    if isinstance(names, list):
        return [str(n) for n in names], None
    raise BadArgs("ExtenderArgs has neither nodes nor nodenames")


def why_not(offer: HostOffer | None, asks: Mapping[str, int], gbps: float) -> str:
    """Why the node cannot take the pod now ("" when it can)."""
    if offer is None:
        return "no xpud offer for this node"
    if not offer.alive:
        return "xpud on this node is not answering"
    n = asks.get("gpu", 0)
    if n:
        if offer.free_whole < n:
            return f"{n} whole card(s) asked, {offer.free_whole} free"
        if gbps and offer.gbps(n) < gbps:
            return f"best free {n}-card group {offer.gbps(n):.0f} GB/s < {gbps:g} GB/s asked"
    for kind, count in asks.items():
        if kind != "gpu" and offer.free_slices.get(kind, 0) < count:
            return f"{count} {kind} slice(s) asked, {offer.free_slices.get(kind, 0)} free"
    return ""


def filter_nodes(args: Mapping, offers: Mapping[str, HostOffer], domain: str = "xpu.dev") -> dict:
    """kube-scheduler's ``filter``: an ExtenderFilterResult as JSON-ready data."""
    try:
        names, items = candidates(args)
        asks, gbps = pod_asks(args["pod"], domain), min_gbps(args["pod"])
    except BadArgs as e:
        return {"error": str(e)}
    failed = {}
    for name in names:
        why = why_not(offers.get(name), asks, gbps) if asks else ""
        if why:
            failed[name] = why
    result: dict = {"failedNodes": failed}
    if items is not None:
        result["nodes"] = {"items": [n for n, name in zip(items, names, strict=True) if name not in failed]}
    else:
        result["nodenames"] = [n for n in names if n not in failed]
    return result


def prioritize(args: Mapping, offers: Mapping[str, HostOffer], domain: str = "xpu.dev") -> list[dict]:
    """kube-scheduler's ``prioritize``: a HostPriorityList (scores 0..10) as JSON-ready data."""
    names, _ = candidates(args)
    asks = pod_asks(args["pod"], domain)
    raw = {name: _merit(offers.get(name), asks) for name in names}
    top = max((v for v in raw.values() if v is not None), default=None)
    out = []
    for name in names:
        v = raw[name]
        score = 0 if v is None or not top else round(MAX_PRIORITY * v / top)
        out.append({"host": name, "score": max(0, min(MAX_PRIORITY, score))})
    return out


def _merit(offer: HostOffer | None, asks: Mapping[str, int]) -> float | None:
    """How good the node is for the pod (higher is better; None: it cannot take it)."""
    if offer is None or not asks or why_not(offer, asks, 0.0):
        return None
    n = asks.get("gpu", 0)
    merit = 1.0
    if n:
        g = offer.gbps(n)
        bw = 1.0 if math.isinf(g) else g
        fit = 1.0 / (1 + offer.free_whole - n)  # a node the pod fills scores highest
        merit = bw * (1 + 0.1 * fit)
    for kind, count in asks.items():
        if kind == "gpu":
            continue
        # slices beyond what the idle whole cards would give sit on cards sliced already: pack there
        spare = offer.free_slices.get(kind, 0) - count
        merit *= 1 + 1.0 / (1 + offer.free_whole) + 0.1 / (1 + spare)
    return merit


# ------------------------------------------------------------------------------------------- offers
class SocketOffers:
    """Offers read from local daemons' sockets, ``{node name: runtime dir}`` (until the federation view
    provides ``daemon.federation.offers()``)."""

    def __init__(self, nodes: Mapping[str, str | Path]):
        self.nodes = dict(nodes)

    def __call__(self) -> dict[str, HostOffer]:
        out = {}
        for name, runtime in self.nodes.items():
            try:
                out[name] = offer_from_daemon(name, runtime)
            except Exception as e:  # a node whose daemon does not answer offers nothing
                log.warning("no offer from %s (%s): %s", name, runtime, e)
                out[name] = HostOffer(name=name, free_whole=0, alive=False)
        return out


def offer_from_daemon(name: str, runtime: str | Path) -> HostOffer:
    from xpud.api.client import Client
    from xpud.hw.topology import Topology
    from xpud.placement.host import best_group

    with Client(runtime, timeout=5) as c:
        cards = c.cards().cards
        t = c.topology()
        info = c.info()
    n = t.size
    topo = Topology(
        levels=tuple(tuple(t.levels[i * n : (i + 1) * n]) for i in range(n)),
        nvlinks=tuple(tuple(t.nvlinks[i * n : (i + 1) * n]) for i in range(n)) if t.nvlinks else (),
    )
    free = [
        x.index
        for x in cards
        if not x.drained and x.health_state != "unhealthy" and not x.whole_lease and not x.slices
    ]
    gbps = []
    for k in range(1, len(free) + 1):
        g = best_group(topo, free, k)
        gbps.append(topo.busbw_gbps(g) if g else 0.0)
    slices = {}
    for s in info.slice_sizes:  # by shares: what each usable card still takes
        per = [
            int((x.free_memory_fraction + 1e-9) // s.memory_fraction)
            for x in cards
            if not x.drained and x.health_state != "unhealthy" and not x.whole_lease
        ]
        slices[s.name] = sum(per)
    health = min((x.health_score for x in cards if x.index in free), default=100)
    return HostOffer(
        name=name, free_whole=len(free), group_gbps=tuple(gbps), health=health, free_slices=slices
    )


# ------------------------------------------------------------------------------------------- HTTP
class Extender:
    """The HTTP server: POST /filter and /prioritize (and under a prefix, e.g. /xpud/filter)."""

    def __init__(self, source: OfferSource, host: str = "127.0.0.1", port: int = 0, domain: str = "xpu.dev"):
        self.source = source
        self.domain = domain
        ext = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                verb = self.path.rstrip("/").rsplit("/", 1)[-1]
                if verb not in ("filter", "prioritize"):
                    return self._send(404, {"error": f"no verb {verb[:40]!r}: use filter or prioritize"})
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY_BYTES:
                    return self._send(413 if length else 400, {"error": f"body of {length} bytes"})
                try:
                    args = json.loads(self.rfile.read(length))
                except ValueError as e:
                    return self._send(400, {"error": f"not JSON: {str(e)[:80]}"})
                offers = ext.source()
                if verb == "filter":
                    return self._send(200, filter_nodes(args, offers, ext.domain))
                try:
                    return self._send(200, prioritize(args, offers, ext.domain))
                except BadArgs as e:
                    return self._send(400, {"error": str(e)})

            def _send(self, code: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt, *a):
                log.debug("extender: " + fmt, *a)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.server.server_address[:2]

    def start(self) -> Extender:
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="extender")
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
