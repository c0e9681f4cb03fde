"""The Kubernetes scheduler extender: kube-scheduler's ``filter`` and ``prioritize`` verbs over xpud's
view of the cluster, as ``placement.multihost.HostOffer`` snapshots (one per node).

JSON shapes are kube-scheduler's (``kubernetes/kube-scheduler: extender/v1/types.go``). Those types have
no json tags, so Go writes the field names as declared and reads keys case-insensitively: it POSTs
``ExtenderArgs`` {``Pod``, ``Nodes`` (a NodeList, or null) , ``NodeNames`` (or null)}; ``filter``
answers ``ExtenderFilterResult`` {``Nodes``, ``NodeNames``, ``FailedNodes``,
``FailedAndUnresolvableNodes``, ``Error``}; ``prioritize`` answers a ``HostPriorityList``
[{``Host``, ``Score``}] with scores 0..10. The Pod and NodeList inside are API objects with their
usual lower-case keys. Keys are read as Go's decoder reads them (any case); answers use Go's names.

What a pod asks: the sum over its containers of ``<domain>/gpu`` (whole cards) and
``<domain>/<slice size>`` (slices) in limits (else requests); optionally the annotation
``xpu.dev/min-group-gbps``: the modelled all-reduce bus bandwidth its cards need (GB/s).

Filter: a node passes when it has that many free whole cards whose best group reaches the bandwidth
asked, and that many free slices of each size; a node without an answering xpud is failed as
unresolvable (preempting pods there changes nothing). Prioritize (the policy xpud places with): for
whole cards, the node's best group bandwidth for the count (the ring runs at its slowest link), then the
tightest fit (a pod that fills a node leaves bigger nodes whole); for slices, the node whose slices
already break the fewest whole cards (room on cards that are sliced already), then the tightest fit.

Offers come from a source (any callable returning ``{node: HostOffer}``): the daemons' sockets
(``SocketOffers``) or one federated daemon's cluster view (``ClusterOffers``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from xpud.errors import XpudError
from xpud.placement.multihost import HostOffer

log = logging.getLogger("xpud.bridges")

MAX_BODY_BYTES = 16 << 20  # a NodeList of a few thousand nodes
MAX_PRIORITY = 10  # kube-scheduler's MaxExtenderPriority
MIN_GBPS_ANNOTATION = "xpu.dev/min-group-gbps"
OfferSource = Callable[[], Mapping[str, HostOffer]]


class BadArgs(XpudError, ValueError):
    """The request is not an ExtenderArgs this extender can read; one line."""


def field(obj, name: str):
    """Struct field ``name`` of a JSON object as Go's encoding/json fills it: the key matches in any case
    (``Pod``, ``pod``, ``POD``); of several keys that match, the last one wins. None when absent."""
    if not isinstance(obj, Mapping):
        return None
    want, found = name.casefold(), None
    for key, value in obj.items():
        if isinstance(key, str) and key.casefold() == want:
            found = value
    return found


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
    containers = field(field(pod, "spec"), "containers") or []
    asks: dict[str, int] = {}
    for c in containers if isinstance(containers, list) else ():
        res = field(c, "resources")
        wanted = field(res, "limits") or field(res, "requests") or {}
        for name, v in wanted.items() if isinstance(wanted, Mapping) else ():  # a map: keys as they are
            d, _, kind = str(name).partition("/")
            if d == domain and kind:
                asks[kind] = asks.get(kind, 0) + _quantity(v)
    return {k: v for k, v in asks.items() if v}


def min_gbps(pod: Mapping) -> float:
    annotations = field(field(pod, "metadata"), "annotations")
    text = annotations.get(MIN_GBPS_ANNOTATION) if isinstance(annotations, Mapping) else None
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
    if not isinstance(field(args, "Pod"), Mapping):
        raise BadArgs("expected ExtenderArgs {Pod, Nodes | NodeNames} (kube-scheduler extender/v1)")
    nodes = field(args, "Nodes")
    if isinstance(nodes, Mapping):
        items = field(nodes, "items")
        items = [n for n in items if isinstance(n, Mapping)] if isinstance(items, list) else []
        return [str(field(field(n, "metadata"), "name") or "") for n in items], items
    names = field(args, "NodeNames")
    if isinstance(names, list):
        return [str(n) for n in names], None
    raise BadArgs("ExtenderArgs has neither Nodes nor NodeNames")


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


def unresolvable(offer: HostOffer | None) -> bool:
    """No answering xpud on the node: preempting its pods would change nothing."""
    return offer is None or not offer.alive


def filter_result(error: str = "") -> dict:
    """An ExtenderFilterResult as Go marshals it: every field, nil ones as null."""
    return {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": None,
        "FailedAndUnresolvableNodes": None,
        "Error": error,
    }


def filter_nodes(args: Mapping, offers: Mapping[str, HostOffer], domain: str = "xpu.dev") -> dict:
    """kube-scheduler's ``filter``: an ExtenderFilterResult as JSON-ready data. It answers in the form it
    was asked: Nodes for a NodeList (nodeCacheCapable: false), NodeNames for names."""
    try:
        names, items = candidates(args)
        pod = field(args, "Pod")
        asks, gbps = pod_asks(pod, domain), min_gbps(pod)
    except BadArgs as e:
        return filter_result(str(e))
    failed, hopeless = {}, {}
    for name in names:
        offer = offers.get(name)
        why = why_not(offer, asks, gbps) if asks else ""
        if why:
            (hopeless if unresolvable(offer) else failed)[name] = why
    result = filter_result()
    result["FailedNodes"], result["FailedAndUnresolvableNodes"] = failed, hopeless
    passed = [n for n in names if n not in failed and n not in hopeless]
    if items is not None:
        keep = set(passed)
        result["Nodes"] = {
            "metadata": {},
            "items": [n for n, name in zip(items, names, strict=True) if name in keep],
        }
    else:
        result["NodeNames"] = passed
    return result


def prioritize(args: Mapping, offers: Mapping[str, HostOffer], domain: str = "xpu.dev") -> list[dict]:
    """kube-scheduler's ``prioritize``: a HostPriorityList (scores 0..10) as JSON-ready data."""
    names, _ = candidates(args)
    asks = pod_asks(field(args, "Pod"), domain)
    raw = {name: _merit(offers.get(name), asks) for name in names}
    top = max((v for v in raw.values() if v is not None), default=None)
    out = []
    for name in names:
        v = raw[name]
        score = 0 if v is None or not top else round(MAX_PRIORITY * v / top)
        out.append({"Host": name, "Score": max(0, min(MAX_PRIORITY, score))})
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
    """Offers read from local daemons' sockets, ``{node name: runtime dir}`` (for hosts without
    ``[cluster]``; ``ClusterOffers`` reads the federated view instead)."""

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


class ClusterOffers:
    """Offers from the federated cluster view, as one daemon with ``[cluster]`` sees it (``GetCluster``
    on its socket): every host of the cluster, by its name in the cluster (which must be the Kubernetes
    node's name). Hosts that are not alive, or whose summary failed its checks, offer nothing."""

    def __init__(self, runtime: str | Path):
        self.runtime = runtime

    def __call__(self) -> dict[str, HostOffer]:
        from xpud.api.client import Client

        with Client(self.runtime, timeout=5) as c:
            reply = c.cluster()
        if not reply.enabled:
            raise BadArgs(f"the daemon of {self.runtime} has no [cluster]: use --node NAME=RUNTIME_DIR")
        return {h.name: offer_from_cluster_host(h) for h in reply.hosts}


def offer_from_cluster_host(h) -> HostOffer:
    """A ``ClusterHost`` (``GetCluster``) as placement's ``HostOffer``."""
    if h.state != "alive" or not h.summary_valid:
        return HostOffer(name=h.name, free_whole=0, alive=False)
    gbps = [float("inf") if k == 0 else x for k, x in enumerate(h.group_gbps)]
    return HostOffer(
        name=h.name,
        free_whole=h.free_whole,
        group_gbps=tuple(gbps),
        health=h.health,
        domain=h.domain,
        block=h.block,
        zone=h.zone,
        free_slices=dict(h.free_slices),
        queue=h.queue,
    )


def offer_from_daemon(name: str, runtime: str | Path) -> HostOffer:
    from xpud.api.client import Client
    from xpud.placement.host import best_group
    from xpud.topology import Topology

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
                    return self._send(404, {"Error": f"no verb {verb[:40]!r}: use filter or prioritize"})
                text = self.headers.get("Content-Length") or "0"
                length = int(text) if text.isdigit() and len(text) < 12 else -1
                if not 0 < length <= MAX_BODY_BYTES:
                    code = 413 if length > MAX_BODY_BYTES else 400
                    return self._send(
                        code, {"Error": f"Content-Length {text[:20]!r}: 1..{MAX_BODY_BYTES} bytes"}
                    )
                try:
                    args = json.loads(self.rfile.read(length))
                except ValueError as e:
                    return self._send(400, {"Error": f"not JSON: {str(e)[:80]}"})
                try:
                    offers = ext.source()
                except Exception as e:  # no offers: kube-scheduler hears why, the extender lives on
                    log.warning("extender: no offers: %s", e)
                    why = f"xpud offers unavailable: {str(e)[:200]}"
                    return (
                        self._send(200, filter_result(why))
                        if verb == "filter"
                        else self._send(503, {"Error": why})
                    )
                if verb == "filter":
                    return self._send(200, filter_nodes(args, offers, ext.domain))
                try:
                    return self._send(200, prioritize(args, offers, ext.domain))
                except BadArgs as e:  # kube-scheduler reads any status but 200 as the extender's error
                    return self._send(400, {"Error": str(e)})

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
