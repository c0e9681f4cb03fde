"""The scheduler extender: kube-scheduler-shaped requests (tests/data/extender, written from
k8s.io/kube-scheduler/extender/v1's types) over HTTP to `xpud extender`, offers read from real daemons.

The cluster: three 8-card PCIe hosts (2 sockets x 2 switches x 2 cards). node-a has 5 free cards, but
any 4 of them span both sockets; node-b has 4 free on one socket; node-c has 3. A 4-card pod fits by
count on a and b; only b gives it a group on one socket, which is what a topology-aware choice finds."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import BIN, poll
from xpud.bridges import extender as ext
from xpud.placement.multihost import HostOffer

DATA = Path(__file__).parent / "data" / "extender"
HELD = {"node-a": (0, 1, 4), "node-b": (4, 5, 6, 7), "node-c": (0, 1, 2, 3, 4)}


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture
def cluster(daemon_factory):
    daemons = {}
    for name, held in HELD.items():
        d = daemon_factory(name=name)
        with d.client(admin=True) as c:  # anchored: held without a Hold stream for the test's length
            c.acquire_lease("xpu", gpus=len(held), cards=held, anchor=f"slurm:{len(daemons) + 1}")
        daemons[name] = d
    return daemons


@pytest.fixture
def server(cluster, short_tmp):
    nodes = [f"--node={name}={d.runtime_dir}" for name, d in cluster.items()]
    nodes.append(f"--node=node-x={short_tmp}/nowhere")  # a node whose xpud does not answer
    with open(short_tmp / "extender.log", "wb") as log:
        proc = subprocess.Popen(
            [str(BIN / "xpud"), "extender", "--listen", "127.0.0.1:0", *nodes], stdout=log, stderr=log
        )
    try:
        port = poll(lambda: _port(short_tmp / "extender.log"), 15)
        assert port, (short_tmp / "extender.log").read_text()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _port(log: Path) -> int | None:
    for line in log.read_text().splitlines():
        if "extender serving on" in line:
            return int(line.split("127.0.0.1:")[1].split()[0])
    return None


def post(url: str, body: dict) -> dict | list:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_only_the_topology_aware_choice_fits_a_4_card_pod(server):
    args = load("filter-args-nodelist.json")
    result = post(f"{server}/xpud/filter", args)
    assert [n["metadata"]["name"] for n in result["nodes"]["items"]] == ["node-b"]
    assert result["nodes"]["items"][0] == args["nodes"]["items"][1]  # the Node objects, as sent
    failed = result["failedNodes"]
    assert failed["node-a"] == "best free 4-card group 10 GB/s < 12 GB/s asked"
    assert failed["node-c"] == "4 whole card(s) asked, 3 free"
    assert "error" not in result

    # without the annotation both fit by count: prioritize ranks b first though a has more free cards
    scores = {
        h["host"]: h["score"]
        for h in post(f"{server}/xpud/prioritize", load("prioritize-args-nodenames.json"))
    }
    assert scores["node-b"] == 10 and scores["node-a"] < scores["node-b"] and scores["node-c"] == 0
    most_free = max(["node-a", "node-b"], key=lambda n: 8 - len(HELD[n]))
    assert most_free == "node-a"  # what a count-only (most free) choice would have taken


def test_slices_filter_by_free_room_and_a_dead_node_fails(server):
    result = post(f"{server}/filter", load("filter-args-slice.json"))
    assert result["nodenames"] == ["node-a", "node-b", "node-c"]
    assert result["failedNodes"] == {"node-x": "xpud on this node is not answering"}
    # bad input: kube-scheduler gets the reason in `error`, with HTTP 200
    assert "neither nodes nor nodenames" in post(f"{server}/filter", {"pod": {}})["error"]


def test_pod_asks_and_limits_of_the_json():
    pod = {"spec": {"containers": [
        {"resources": {"limits": {"xpu.dev/gpu": "2"}}},
        {"resources": {"requests": {"xpu.dev/gpu": 1, "xpu.dev/vxpu-quarter": "1", "cpu": "1"}}},
        {"resources": {"limits": {"other.io/gpu": "1"}}},
    ]}}  # fmt: skip
    assert ext.pod_asks(pod) == {"gpu": 3, "vxpu-quarter": 1}
    for bad in ("1.5", "-1", "1e3", "99999999"):
        with pytest.raises(ext.BadArgs):
            ext.pod_asks({"spec": {"containers": [{"resources": {"limits": {"xpu.dev/gpu": bad}}}]}})
    for bad in ("nan", "inf", "-1", "x"):
        with pytest.raises(ext.BadArgs):
            ext.min_gbps({"metadata": {"annotations": {ext.MIN_GBPS_ANNOTATION: bad}}})


def test_slice_pods_go_where_cards_are_sliced_already():
    offers = {
        "whole": HostOffer("whole", free_whole=8, free_slices={"vxpu-half": 16}),
        "packed": HostOffer("packed", free_whole=0, free_slices={"vxpu-half": 1}),
    }
    args = {"pod": {"spec": {"containers": [{"resources": {"limits": {"xpu.dev/vxpu-half": "1"}}}]}},
            "nodenames": ["whole", "packed"]}  # fmt: skip
    scores = {h["host"]: h["score"] for h in ext.prioritize(args, offers)}
    assert scores["packed"] == 10 and scores["whole"] < 10
