"""The scheduler extender: requests as kube-scheduler sends them, over HTTP to `xpud extender`, offers
read from real daemons.

Upstream definitions the fixtures and assertions follow (no kube-scheduler runs here):
- `kubernetes/kube-scheduler: extender/v1/types.go`: ExtenderArgs {Pod, Nodes, NodeNames},
  ExtenderFilterResult {Nodes, NodeNames, FailedNodes, FailedAndUnresolvableNodes, Error}, HostPriority
  {Host, Score}, MaxExtenderPriority 10. No json tags: Go writes the field names as declared, nil pointers
  as null, and reads keys in any case.
- `kubernetes/kubernetes: pkg/scheduler/extender.go` (HTTPExtender.send, Filter, Prioritize): one
  json.Marshal of the args POSTed to urlPrefix/verb with Content-Type application/json; any status but
  200 is an error; a non-empty Error fails the pod; with nodeCacheCapable false it reads the answer's
  Nodes, with true its NodeNames.
- `kubernetes/api: core/v1/types.go` for the Pod and NodeList inside (lower-case json tags, maps with
  sorted keys as Go writes them). tests/data/extender/*.json are those bytes: compact, one line.

The cluster: three 8-card PCIe hosts (2 sockets x 2 switches x 2 cards). node-a has 5 free cards, but
any 4 of them span both sockets; node-b has 4 free on one socket; node-c has 3. A 4-card pod fits by
count on a and b; only b gives it a group on one socket, which is what a topology-aware choice finds."""

from __future__ import annotations

import http.client
import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests import test_federation_daemons as fed
from tests.conftest import BIN, poll
from xpud.bridges import extender as ext
from xpud.placement.multihost import HostOffer

DATA = Path(__file__).parent / "data" / "extender"
site, three = fed.site, fed.three  # fixtures: a CA, three federated daemons on 127.0.0.2-4
HELD = {"node-a": (0, 1, 4), "node-b": (4, 5, 6, 7), "node-c": (0, 1, 2, 3, 4)}


FILTER_RESULT = ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]  # types.go


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def go_post(url: str, body: bytes) -> tuple[int, bytes]:
    """POST as Go's net/http client does for HTTPExtender.send: the body verbatim, its length, Go's
    default headers."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(
            "POST",
            u.path,
            body,
            {
                "User-Agent": "Go-http-client/1.1",
                "Content-Type": "application/json",
                "Accept-Encoding": "gzip",
            },
        )
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


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
    """The bytes kube-scheduler sends (nodeCacheCapable: false, so a NodeList and NodeNames null); the
    answer carries Go's field names, every one, and the Node objects as sent."""
    body = (DATA / "filter-args-nodelist.json").read_bytes()
    assert body.startswith(b'{"Pod":{"metadata":') and b'"NodeNames":null}' in body
    status, raw = go_post(f"{server}/xpud/filter", body)
    assert status == 200, raw
    result = json.loads(raw)
    assert list(result) == FILTER_RESULT
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["node-b"]
    assert result["Nodes"]["items"][0] == json.loads(body)["Nodes"]["items"][1]  # the Node objects, as sent
    assert result["NodeNames"] is None and result["Error"] == ""
    failed = result["FailedNodes"]
    assert failed["node-a"] == "best free 4-card group 10 GB/s < 12 GB/s asked"
    assert failed["node-c"] == "4 whole card(s) asked, 3 free"
    assert result["FailedAndUnresolvableNodes"] == {}

    # without the annotation both fit by count: prioritize ranks b first though a has more free cards
    status, raw = go_post(f"{server}/xpud/prioritize", (DATA / "prioritize-args-nodenames.json").read_bytes())
    assert status == 200, raw
    priorities = json.loads(raw)
    assert all(list(h) == ["Host", "Score"] for h in priorities)  # HostPriority's fields
    scores = {h["Host"]: h["Score"] for h in priorities}
    assert scores["node-b"] == 10 and scores["node-a"] < scores["node-b"] and scores["node-c"] == 0
    most_free = max(["node-a", "node-b"], key=lambda n: 8 - len(HELD[n]))
    assert most_free == "node-a"  # what a count-only (most free) choice would have taken


def test_slices_filter_by_free_room_and_a_dead_node_is_unresolvable(server):
    status, raw = go_post(f"{server}/filter", (DATA / "filter-args-slice.json").read_bytes())
    assert status == 200, raw
    result = json.loads(raw)
    assert result["NodeNames"] == ["node-a", "node-b", "node-c"] and result["Nodes"] is None
    assert result["FailedNodes"] == {}
    assert result["FailedAndUnresolvableNodes"] == {"node-x": "xpud on this node is not answering"}
    # bad input: kube-scheduler gets the reason in Error, with HTTP 200
    assert "neither Nodes nor NodeNames" in post(f"{server}/filter", {"Pod": {}, "Nodes": None})["Error"]


@pytest.mark.parametrize(
    "keys",
    [
        ("pod", "nodes", "nodenames"),  # what xpud read before: Go accepts it too
        ("POD", "NODES", "NodeNAMES"),
        ("Pod", "Nodes", "NodeNames"),
    ],
)
def test_keys_are_read_in_any_case_as_go_reads_them(keys):
    """Go's encoding/json matches a key to an untagged field case-insensitively."""
    offers = {"node-a": HostOffer("node-a", free_whole=8), "node-b": HostOffer("node-b", free_whole=1)}
    sent = load("prioritize-args-nodenames.json")
    pod_key, nodes_key, names_key = keys
    args = {pod_key: sent["Pod"], nodes_key: None, names_key: ["node-a", "node-b"]}
    result = ext.filter_nodes(args, offers)
    assert result["Error"] == "" and result["NodeNames"] == ["node-a"], result
    assert result["FailedNodes"] == {"node-b": "4 whole card(s) asked, 1 free"}
    assert [h["Host"] for h in ext.prioritize(args, offers)] == ["node-a", "node-b"]
    # the last of several keys that fold to one field wins, as in Go
    assert ext.field({"NodeNames": ["x"], "nodenames": ["y"]}, "NodeNames") == ["y"]


def test_the_answer_to_a_request_it_cannot_read_is_a_filter_result():
    result = ext.filter_nodes({"Pod": None, "NodeNames": ["a"]}, {})
    assert list(result) == FILTER_RESULT and "ExtenderArgs" in result["Error"]
    assert result["Nodes"] is None and result["FailedNodes"] is None


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
    args = {"Pod": {"spec": {"containers": [{"resources": {"limits": {"xpu.dev/vxpu-half": "1"}}}]}},
            "Nodes": None, "NodeNames": ["whole", "packed"]}  # fmt: skip
    scores = {h["Host"]: h["Score"] for h in ext.prioritize(args, offers)}
    assert scores["packed"] == 10 and scores["whole"] < 10


def test_offers_from_the_federated_view_of_one_daemon(three, short_tmp):
    """`--cluster DIR`: one federated daemon's view speaks for every host of the cluster (h2 has four
    cards, h1 and h3 two each), so only h2 can take a 4-card pod."""
    assert poll(lambda: fed.converged(three), 30), [h.cluster() for h in three]
    h1 = three[0]
    with open(short_tmp / "extender.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(BIN / "xpud"),
                "extender",
                "--listen",
                "127.0.0.1:0",
                "--cluster",
                str(h1.daemon.runtime_dir),
            ],
            stdout=log,
            stderr=log,
        )
    try:
        port = poll(lambda: _port(short_tmp / "extender.log"), 15)
        assert port, (short_tmp / "extender.log").read_text()
        args = {**load("prioritize-args-nodenames.json"), "NodeNames": ["h1", "h2", "h3", "h9"]}
        result = post(f"http://127.0.0.1:{port}/filter", args)
        assert result["NodeNames"] == ["h2"], result
        assert set(result["FailedNodes"]) == {"h1", "h3"}
        assert set(result["FailedAndUnresolvableNodes"]) == {"h9"}  # not in the cluster
        assert result["FailedNodes"]["h1"] == "4 whole card(s) asked, 2 free"
        scores = {h["Host"]: h["Score"] for h in post(f"http://127.0.0.1:{port}/prioritize", args)}
        assert scores["h2"] == 10 and scores["h1"] == scores["h3"] == 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_extender_wants_one_source_of_offers(short_tmp):
    r = subprocess.run(
        [str(BIN / "xpud"), "extender", "--listen", "127.0.0.1:0"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "give --cluster RUNTIME_DIR" in r.stderr
