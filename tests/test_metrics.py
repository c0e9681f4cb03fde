"""Prometheus metrics: a real simulated daemon with leases, a drained card and a queued request, scraped over
HTTP, parsed with prometheus_client's parser, checked against `xpu ls --json`, and linted by promtool."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_until
from xpud import config
from xpud.daemon.metrics import NAMES
from xpud.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(found: dict, name: str, **labels) -> float:
    hits = [s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


@pytest.fixture
def busy_site(daemon_factory):
    """A daemon on pcie-8x-l40s with a whole-card lease, two slices, card 7 drained and a request for all
    eight cards waiting; returns (daemon, port, [clients holding leases], waiting process)."""
    port = free_port()
    d = daemon_factory(config=f'[leases]\ngrace_s = 30.0\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    c = d.client()
    whole = c.acquire_lease("xpu", gpus=1)
    halves = [c.acquire_lease("vxpu-half") for _ in range(2)]
    assert d.xpu("drain", "7", "--reason", "metrics test").returncode == 0
    waiter = d.xpu_popen("run", "--gpus", "8", "--wait", "60", "--", "true", stderr=subprocess.DEVNULL)
    wait_until(lambda: list(c.leases().queue))
    yield d, port, [whole, *halves]
    waiter.kill()
    waiter.wait(10)
    c.close()


def test_scrape_matches_xpu_ls(busy_site):
    d, port, granted = busy_site
    text = scrape(port)
    found = samples(text)
    cards = json.loads(d.xpu("ls", "--json").stdout)
    assert value(found, "xpud_cards") == len(cards) == 8
    for card in cards:
        lab = {"card": str(card["index"]), "uuid": card["uuid"]}
        assert value(found, "xpud_card_health_score", **lab) == card["health_score"]
        assert value(found, "xpud_card_drained", **lab) == float(card["drained"])
        assert value(found, "xpud_card_mode", **lab, mode=card["mode"]) == 1.0
        assert value(found, "xpud_card_health_state", **lab, state=card["health_state"]) == 1.0
        assert value(found, "xpud_card_memory_total_bytes", **lab) == card["memory_total_bytes"]
        assert value(found, "xpud_card_free_memory_ratio", **lab) == pytest.approx(
            card["free_memory_pct"] / 100
        )
        halves = sum(1 for s in card["slices"] if s["size"] == "vxpu-half")
        assert value(found, "xpud_card_slices", **lab, size="vxpu-half") == halves
        assert value(found, "xpud_card_standby_slices", **lab, size="vxpu-half") == 0  # MPS: none made
        leased = bool(card["whole_lease"] or card["slices"])
        assert value(found, "xpud_card_leased", **lab) == float(leased)
        assert {
            s.labels["signal"]
            for s in found["xpud_card_health_signal_status"]
            if s.labels["card"] == lab["card"]
        }
    assert value(found, "xpud_card_drained", card="7", uuid=cards[7]["uuid"]) == 1.0
    assert value(found, "xpud_leases", mode="xpu") == 1
    assert value(found, "xpud_leases", mode="vxpu-half") == 2
    assert value(found, "xpud_leases", mode="vxpu-quarter") == 0
    assert value(found, "xpud_leases_by_owner", owner=str(os.getuid())) == 3
    assert value(found, "xpud_queue_requests") == 1
    assert 0 < value(found, "xpud_queue_oldest_age_seconds") < 60
    # three grants, each one placement decision at least; the histograms count them
    assert value(found, "xpud_lease_grant_seconds_count") == 3
    assert value(found, "xpud_placement_decision_seconds_count") >= 4  # + the queued request's
    assert value(found, "xpud_events_total", kind="grant") == 3
    assert value(found, "xpud_events_total", kind="drain") == 1
    assert value(found, "xpud_mode_switches_total") >= 1  # a whole card became sliced for the halves
    # no lease ids or pids anywhere in the labels
    lease_ids = {g.lease.id for g in granted}
    assert not any(lid in text for lid in lease_ids)


def test_every_declared_name_is_served(busy_site):
    _, port, _ = busy_site
    fams = {f.name for f in text_string_to_metric_families(scrape(port))}
    # the parser names counters without _total
    served = fams | {f + "_total" for f in fams}
    assert set(NAMES) <= served, set(NAMES) - served


@pytest.fixture(scope="session")
def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(
            "promtool missing and cannot be installed here (needs root and apt-get: Debian's prometheus)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"],
            env=env,
            capture_output=True,
            timeout=600,
            check=True,
        )
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"promtool missing and `apt-get install prometheus` failed: {e}")
    return shutil.which("promtool") or pytest.skip("Debian's prometheus installed no promtool")


@pytest.mark.timeout(700)
def test_promtool_accepts_the_exposition(busy_site, promtool):
    _, port, _ = busy_site
    text = scrape(port)
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "listen, ok",
    [
        ("", True),
        ("127.0.0.1:9403", True),
        ("[::1]:9403", True),
        ("localhost:0", True),
        ("127.0.0.1", False),
        ("127.0.0.1:99999", False),
        ("[zz::1]:80", False),
        ("http://x:1", False),
    ],
)
def test_listen_is_checked(listen, ok):
    text = f'[metrics]\nlisten = "{listen}"\n'
    if ok:
        assert config.parse(text).metrics.listen == listen
    else:
        with pytest.raises(ConfigError, match=r"<string>:2: \[metrics\] listen: "):
            config.parse(text)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_only_the_metrics_path_answers_every_other_path_is_404(daemon_factory):
    port = free_port()
    d = daemon_factory(config=f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    d.client().acquire_lease("xpu", gpus=1)
    base = f"http://127.0.0.1:{port}"
    status, text = get(f"{base}/metrics")
    assert status == 200 and "xpud_leases_by_owner" in text
    for path in ("/", "/debug", "/metrics/", "/metricsx", "/favicon.ico", "/x/metrics", "/../metrics"):
        status, text = get(base + path)
        assert (status, text) == (404, "not found: xpud serves /metrics only\n"), path
    assert get(f"{base}/metrics?name[]=xpud_leases_by_owner")[0] == 200  # prometheus' own query still works


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 here")
def test_an_ipv6_listen_address_is_served(daemon_factory):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    daemon_factory(config=f'[metrics]\nlisten = "[::1]:{port}"\n')
    assert get(f"http://[::1]:{port}/metrics")[0] == 200
    assert get(f"http://[::1]:{port}/")[0] == 404


def test_a_taken_port_stops_the_start_with_one_line(daemon_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = daemon_factory(config=f'[metrics]\nlisten = "127.0.0.1:{port}"\n', start=False)
        d.start(wait=False)
        assert d.proc.wait(30) == 1
        assert re.search(r"\[metrics\] listen = .*cannot listen", d.log.read_text())


def test_grafana_dashboard_uses_only_served_metrics():
    dash = json.loads((ROOT / "etc/grafana/xpud.json").read_text())
    exprs = [
        t["expr"]
        for row in dash["panels"]
        for p in [row, *row.get("panels", [])]
        for t in p.get("targets", [])
    ]
    assert len(exprs) >= 12
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    names = set()
    for e in exprs:
        names |= {n for n in re.findall(r"\b(xpud_[a-z_]+)", e)}
    base = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in names}
    assert base <= set(NAMES), base - set(NAMES)
    titles = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert titles[:3] == ["Cluster", "Host", "Cards"]
