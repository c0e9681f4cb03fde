"""Prometheus metrics on a local HTTP port (``[metrics] listen``), with ``prometheus-client``.

A small threaded WSGI server around prometheus_client's app serves ``/metrics`` (404 on any other path) from
a daemon thread. At each scrape its ``LoopCollector`` asks the daemon's asyncio loop to build a snapshot
(``families``: plain metric-family objects, built from the engine's cards, leases and queue, the monitor's
reports and ``xpud.engine.stats``) and waits for it; the HTTP thread only reads what the loop handed over,
never the engine's state. When the loop does not answer within ``SNAPSHOT_WAIT_S`` (stalled), the last
snapshot is served again and ``xpud_metrics_snapshot_age_seconds`` says how old it is.

Names follow Prometheus practice: ``xpud_`` prefix, base units in the name (seconds, bytes, ratio),
``_total`` on counters. Labels are bounded: ``card``/``uuid`` (cards on the host), ``mode`` (xpu and the
configured slice sizes), ``state``, ``signal``, ``size``, ``kind`` (event kinds), ``xid`` (configured XIDs,
the rest as ``other``), ``owner`` (the ``OWNER_LABELS`` uids holding most leases, the rest as ``other``).
No lease ids or pids.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from xpud.config.schema import listen_address
from xpud.engine.stats import Histogram
from xpud.hw.signals import ABSENT, FAIL, INFO, OK, WARN
from xpud.model import CardMode, HealthState, Mode

if TYPE_CHECKING:
    from xpud.controllers.health import HealthMonitor
    from xpud.engine.engine import Engine

log = logging.getLogger("xpud.daemon.metrics")

SNAPSHOT_WAIT_S = 2.0
OWNER_LABELS = 20
SIGNAL_LEVEL = {OK: 0, INFO: 1, WARN: 2, FAIL: 3}
CARD = ("card", "uuid")

# Every metric name this module writes (the Grafana dashboard's test checks its queries against it).
NAMES = (
    "xpud_info",
    "xpud_account_share",
    "xpud_account_allocated",
    "xpud_account_waiting",
    "xpud_account_usage_gpu_hours",
    "xpud_account_reclaims_total",
    "xpud_metrics_snapshot_age_seconds",
    "xpud_cards",
    "xpud_card_health_score",
    "xpud_card_health_state",
    "xpud_card_health_signal_status",
    "xpud_card_drained",
    "xpud_card_mode",
    "xpud_card_leased",
    "xpud_card_slices",
    "xpud_card_standby_slices",
    "xpud_card_free_memory_ratio",
    "xpud_card_free_compute_ratio",
    "xpud_card_memory_total_bytes",
    "xpud_card_memory_used_bytes",
    "xpud_card_utilization_ratio",
    "xpud_card_temperature_celsius",
    "xpud_card_power_watts",
    "xpud_leases",
    "xpud_leases_by_owner",
    "xpud_window_whole_share",
    "xpud_queue_requests",
    "xpud_queue_oldest_age_seconds",
    "xpud_placement_decision_seconds",
    "xpud_lease_grant_seconds",
    "xpud_queue_wait_seconds",
    "xpud_events_total",
    "xpud_mode_switches_total",
    "xpud_moves_total",
    "xpud_conversions_total",
    "xpud_faults_total",
    "xpud_application_xids_total",
)


def families(
    engine: Engine,
    monitor: HealthMonitor | None,
    version: str,
    backend: str,
    accounts: Callable[[], Any] | None = None,
) -> list[Metric]:
    """The daemon's metrics now. Runs on the daemon's loop (reads engine and monitor state)."""
    cfg = engine.cfg
    out: list[Metric] = []
    g = GaugeMetricFamily(
        "xpud_info", "The daemon's version and hardware backend.", labels=["version", "backend"]
    )
    g.add_metric([version, backend], 1)
    out.append(g)
    views = engine.card_views()
    out.append(GaugeMetricFamily("xpud_cards", "Cards on this host.", value=len(views)))
    out += _card_families(engine, monitor, views, list(cfg.slices))
    out += _lease_families(engine, [Mode.XPU, *cfg.slices])
    out += _queue_families(engine)
    w = engine.window
    share = _gauge(
        "xpud_window_whole_share",
        "Share of usable cards the capacity window in force keeps whole (0: none in force).",
        ["window"],
    )
    share.add_metric([w.name if w else ""], w.whole_share if w else 0.0)
    out.append(share)
    out += _stat_families(engine.stats, set(cfg.health.xid_fail) | set(cfg.health.xid_warn))
    out += _account_families(accounts() if accounts is not None else None)
    return out


def _account_families(accounts) -> list[Metric]:
    """Per account (issue #33; none without [accounts.NAME]): the configured accounts and ``default``
    (at most 257), any other name a peer publishes as ``other``. GPU-equivalents across the cluster."""
    names = ("share", "allocated", "waiting", "usage_gpu_hours")
    docs = (
        "Deserved share across the cluster (GPU-equivalents).",
        "GPU-equivalents held across the cluster.",
        "GPU-equivalents its queued requests ask for, across the cluster.",
        "Decayed usage across the cluster (GPU-hours; [accounts] usage_half_life).",
    )
    gauges = [_gauge(f"xpud_account_{n}", d, ["account"]) for n, d in zip(names, docs, strict=True)]
    reclaims = CounterMetricFamily(
        "xpud_account_reclaims",
        "Leases this host stopped for fair share: direction from (its work stopped) or for (stopped for it).",
        labels=["account", "direction"],
    )
    if accounts is None:
        return [*gauges, reclaims]
    accounts.refresh()  # as things stand at the scrape (on the loop: the engine's memory and the view)
    known = set(accounts.specs) | {"default"}
    folded: dict[str, list[float]] = {}
    for r in accounts.rows():
        label = r.name if r.name in known else "other"
        vals = folded.setdefault(label, [0.0] * 6)
        for i, v in enumerate(
            (r.share, r.allocated, r.waiting, r.usage_gpu_h, r.reclaimed_from, r.reclaimed_for)
        ):
            vals[i] += v
    for label, vals in folded.items():
        for g, v in zip(gauges, vals[:4], strict=True):
            g.add_metric([label], v)
        reclaims.add_metric([label, "from"], vals[4])
        reclaims.add_metric([label, "for"], vals[5])
    return [*gauges, reclaims]


def _gauge(name: str, doc: str, labels: Iterable[str] = CARD) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _card_families(engine: Engine, monitor: HealthMonitor | None, views, sizes: list[str]) -> list[Metric]:
    score = _gauge("xpud_card_health_score", "Health score, 0 (failing) to 100 (healthy).")
    state = _gauge(
        "xpud_card_health_state", "1 for the card's health state, 0 for the others.", [*CARD, "state"]
    )
    signal = _gauge(
        "xpud_card_health_signal_status",
        "Each health signal's status: 0 ok, 1 info, 2 warn, 3 fail (absent signals are left out).",
        [*CARD, "signal"],
    )
    drained = _gauge(
        "xpud_card_drained", "1 when the card takes no new leases (operator drain or unhealthy)."
    )
    mode = _gauge(
        "xpud_card_mode", "1 for the card's mode (whole or sliced), 0 for the other.", [*CARD, "mode"]
    )
    leased = _gauge("xpud_card_leased", "1 when a lease holds the card whole or a slice of it.")
    slices = _gauge("xpud_card_slices", "Slices in use on the card, by size.", [*CARD, "size"])
    standby = _gauge(
        "xpud_card_standby_slices",
        "Slices pre-created on the card ahead of a forecast peak, held by no lease yet, by size.",
        [*CARD, "size"],
    )
    ready = Counter((s.card_index, s.size) for s in engine.standby.slices.values())
    free_mem = _gauge("xpud_card_free_memory_ratio", "Share of the card's memory free for slices (0-1).")
    free_sm = _gauge("xpud_card_free_compute_ratio", "Share of the card's compute free for slices (0-1).")
    mem_total = _gauge("xpud_card_memory_total_bytes", "The card's memory.")
    mem_used = _gauge("xpud_card_memory_used_bytes", "Memory in use on the card (last poll).")
    util = _gauge("xpud_card_utilization_ratio", "GPU utilisation over the last sample period (0-1).")
    temp = _gauge("xpud_card_temperature_celsius", "GPU temperature (last poll).")
    power = _gauge("xpud_card_power_watts", "Power draw (last poll).")
    for v in views:
        labels = [str(v.info.index), v.info.uuid]
        score.add_metric(labels, v.health_score)
        for s in HealthState:
            state.add_metric([*labels, s.value], float(v.health_state is s))
        if monitor is not None:
            for sig in monitor.report(v.info.index).signals:
                if sig.status != ABSENT:
                    signal.add_metric([*labels, sig.name], SIGNAL_LEVEL.get(sig.status, 0))
        drained.add_metric(labels, float(v.drained))
        for m in CardMode:
            mode.add_metric([*labels, m.value], float(v.mode is m))
        leased.add_metric(labels, float(not v.idle))
        held = Counter(s.size for _, s in v.slices)
        for size in sizes:
            slices.add_metric([*labels, size], held.get(size, 0))
            standby.add_metric([*labels, size], ready.get((v.info.index, size), 0))
        free_mem.add_metric(labels, v.free_memory_fraction)
        free_sm.add_metric(labels, v.free_compute_pct / 100)
        mem_total.add_metric(labels, v.info.memory_total_bytes)
        s = v.sample
        if s is not None and not s.lost:
            if s.memory_used_bytes is not None:
                mem_used.add_metric(labels, s.memory_used_bytes)
            if s.utilization_gpu_pct is not None:
                util.add_metric(labels, s.utilization_gpu_pct / 100)
            if s.temperature_c is not None:
                temp.add_metric(labels, s.temperature_c)
            if s.power_w is not None:
                power.add_metric(labels, s.power_w)
    return [
        score,
        state,
        signal,
        drained,
        mode,
        leased,
        slices,
        standby,
        free_mem,
        free_sm,
        mem_total,
        mem_used,
        util,
        temp,
        power,
    ]


def _lease_families(engine, modes: list[str]) -> list[Metric]:
    leases = engine.lease_list()
    by_mode = Counter(lease.mode for lease in leases)
    g = _gauge("xpud_leases", "Active leases, by mode.", ["mode"])
    for m in modes:
        g.add_metric([m], by_mode.get(m, 0))
    owners = Counter(lease.owner_uid for lease in leases).most_common()
    o = _gauge(
        "xpud_leases_by_owner",
        f"Active leases, by owner uid (the {OWNER_LABELS} uids with most leases; the rest as 'other').",
        ["owner"],
    )
    for uid, n in owners[:OWNER_LABELS]:
        o.add_metric([str(uid)], n)
    if len(owners) > OWNER_LABELS:
        o.add_metric(["other"], sum(n for _, n in owners[OWNER_LABELS:]))
    return [g, o]


def _queue_families(engine) -> list[Metric]:
    waiting = engine.queue_view()
    now = engine.clock()
    oldest = max((now - q.enqueued for q in waiting), default=0.0)
    return [
        GaugeMetricFamily("xpud_queue_requests", "Requests waiting in the queue.", value=len(waiting)),
        GaugeMetricFamily(
            "xpud_queue_oldest_age_seconds",
            "How long the oldest waiting request has waited (0: none waits).",
            value=max(0.0, oldest),
        ),
    ]


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=h.cumulative(), sum_value=h.total)


def _stat_families(stats, named_xids: set[int]) -> list[Metric]:
    out: list[Metric] = [
        _histogram(
            "xpud_placement_decision_seconds",
            "Time to choose cards for one request (placement).",
            stats.decision,
        ),
        _histogram(
            "xpud_lease_grant_seconds",
            "Time from cards chosen to lease committed (mode switch, slice preparation, ledger commit).",
            stats.grant,
        ),
        _histogram("xpud_queue_wait_seconds", "Time granted requests waited in the queue.", stats.queue_wait),
    ]
    ev = CounterMetricFamily("xpud_events", "Engine events, by kind.", labels=["kind"])
    for kind, n in sorted(stats.events.items()):
        ev.add_metric([kind], n)
    out.append(ev)
    out.append(
        CounterMetricFamily(
            "xpud_mode_switches",
            "Cards switched between whole and sliced.",
            value=stats.events.get("mode", 0),
        )
    )
    mv = CounterMetricFamily(
        "xpud_moves",
        "Lease moves: started (target reserved), done (acknowledged and committed), abandoned.",
        labels=["outcome"],
    )
    for outcome in ("started", "done", "abandoned"):
        mv.add_metric([outcome], stats.moves.get(outcome, 0))
    out.append(mv)
    conv = CounterMetricFamily(
        "xpud_conversions",
        "Idle cards converted by the burst check, by target mode and reason.",
        labels=["mode", "reason"],
    )
    for (to, reason), n in sorted(stats.conversions.items()):
        conv.add_metric([to, reason], n)
    out.append(conv)
    faults = CounterMetricFamily(
        "xpud_faults",
        "Card XID events (application XIDs excluded), by XID; unlisted XIDs as 'other'.",
        labels=["xid"],
    )
    by_xid: Counter = Counter()
    for xid, n in stats.xids.items():
        by_xid[str(xid) if xid in named_xids else "other"] += n
    for xid, n in sorted(by_xid.items()):
        faults.add_metric([xid], n)
    out.append(faults)
    out.append(
        CounterMetricFamily(
            "xpud_application_xids", "Application XIDs, counted against leases.", value=stats.app_xids
        )
    )
    return out


class LoopCollector:
    """A prometheus_client collector whose samples are built on an asyncio loop (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, build: Callable[[], list[Metric]]):
        self.loop, self.build = loop, build
        self._last: tuple[float, list[Metric]] = (time.monotonic(), [])

    def describe(self) -> list[Metric]:
        return []  # registration must not call collect(): the loop may not run yet

    def collect(self) -> Iterable[Metric]:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self.build())
                except BaseException as e:
                    fut.set_exception(e)

        try:
            self.loop.call_soon_threadsafe(run)
            self._last = (time.monotonic(), fut.result(SNAPSHOT_WAIT_S))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            log.warning(
                "metrics: the daemon's loop did not answer in %g s; serving the last snapshot",
                SNAPSHOT_WAIT_S,
            )
        except RuntimeError:  # the loop is closed: the daemon is stopping
            pass
        at, metrics = self._last
        yield from metrics
        yield GaugeMetricFamily(
            "xpud_metrics_snapshot_age_seconds",
            "Age of the snapshot served (0 unless the daemon's loop did not answer this scrape).",
            value=round(time.monotonic() - at, 3),
        )


NOT_FOUND = b"not found: xpud serves /metrics only\n"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the daemon's stop


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:
        pass  # one line per scrape in the daemon's journal is noise


def metrics_only(app):
    """``app`` on ``/metrics`` (any query: prometheus' ``name[]=`` filter works); 404 on every other path.
    prometheus_client's own server answered every path (``/``, ``/debug``, ...) with the metrics."""

    def serve(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [NOT_FOUND]
        return app(environ, start_response)

    return serve


class MetricsServer:
    """``/metrics`` on ``listen`` (host:port) for the daemon; ``start`` on its loop, ``stop`` at the end.
    ``snapshot`` builds the metric families (``families``), on the loop."""

    def __init__(self, listen: str, snapshot: Callable[[], list[Metric]]):
        self.listen, self.snapshot = listen, snapshot
        self.httpd = None
        self.thread = None

    @property
    def address(self) -> tuple[str, int] | None:
        return None if self.httpd is None else self.httpd.server_address[:2]

    def start(self) -> None:
        host, port = listen_address(self.listen)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(LoopCollector(asyncio.get_running_loop(), self.snapshot))
        try:
            self.httpd = make_server(
                host,
                port,
                metrics_only(make_wsgi_app(registry)),
                server_class=_Server6 if ":" in host else _Server,
                handler_class=_Quiet,
            )
        except OSError as e:
            raise OSError(
                e.errno, f"[metrics] listen = {self.listen!r}: cannot listen: {e.strerror}"
            ) from None
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self.thread.start()
        log.info("metrics on http://%s:%d/metrics", *self.address)

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join(5)
            self.httpd = None
