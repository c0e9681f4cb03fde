"""Every command's --json against docs/json.md: every documented key present, none undocumented, each value
of its documented type (null only where the document allows it), and the document's examples too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from xpu_cli import jsonshape

from xpud.api.v1 import xpu_pb2 as pb

DOC = Path(__file__).resolve().parents[1] / "docs" / "json.md"
SCALARS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
}


def schemas() -> dict[str, dict[str, str]]:
    """Object name -> {key: type}, from the document's "## Name" sections and their key/type tables."""
    out: dict[str, dict[str, str]] = {}
    name = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
        elif name and line.startswith("| `") and line.count("|") >= 4:
            keys, typ = (cell.strip() for cell in line.split("|")[1:3])
            for key in re.findall(r"`([^`]+)`", keys):
                out.setdefault(name, {})[key] = typ
    return out


SCHEMAS = schemas()


def check(value, typ: str, where: str = "$") -> None:
    """Raise AssertionError unless ``value`` has type ``typ`` (the document's notation)."""
    if typ.endswith(" or null"):
        if value is None:
            return
        typ = typ.removesuffix(" or null")
    assert value is not None, f"{where}: null, but the document says {typ}"
    if typ in SCALARS:
        assert SCALARS[typ](value), f"{where}: {value!r} is not {typ}"
    elif typ.startswith("[") and typ.endswith("]"):
        assert isinstance(value, list), f"{where}: not a list"
        for i, v in enumerate(value):
            check(v, typ[1:-1], f"{where}[{i}]")
    elif typ.startswith("{string: "):
        assert isinstance(value, dict), f"{where}: not an object"
        for k, v in value.items():
            check(v, typ.removeprefix("{string: ").removesuffix("}"), f"{where}.{k}")
    else:
        assert typ in SCHEMAS, f"{where}: {typ} is not documented"
        assert isinstance(value, dict), f"{where}: not an object"
        want = SCHEMAS[typ]
        assert list(value) == [k for k in value if k in want] and set(value) == set(want), (
            f"{where} ({typ}): undocumented {sorted(set(value) - set(want))}, "
            f"missing {sorted(set(want) - set(value))}"
        )
        for k, v in value.items():
            check(v, want[k], f"{where}.{k}")


def test_the_document_is_read_whole():
    objects = {"Card", "Sample", "Lease", "QueueEntry", "CardHealth", "Signal", "Info", "DefragPlan", "Event"}
    objects |= {"LeaseShow", "CardShow"}
    assert objects <= set(SCHEMAS)
    assert len(SCHEMAS["Sample"]) == len(pb.Sample.DESCRIPTOR.fields)
    assert SCHEMAS["Card"]["health_state"] == SCHEMAS["CardHealth"]["health_state"] == "string"


@pytest.mark.parametrize(("typ", "text"), re.findall(r"```json (\S+)\n(.*?)```", DOC.read_text(), re.S))
def test_the_documents_examples_follow_it(typ, text):
    check(json.loads(text), typ)


def test_the_rules_on_a_bare_message():
    """What the daemon did not give is null: unset optional fields, messages, empty strings, sentinels."""
    card = jsonshape.to_dict(pb.Card(index=2, free_memory_fraction=0.25))
    assert set(card) == set(SCHEMAS["Card"])
    assert card["numa_node"] is None and card["sample"] is None and card["whole_lease"] is None
    assert card["free_memory_pct"] == 25.0 and "free_memory_fraction" not in card
    lease = jsonshape.to_dict(pb.Lease(id="a", owner_uid=0, holder_pid=0))
    assert lease["holder_pid"] is None and lease["user"] and list(lease)[2:4] == ["owner_uid", "user"]
    ratio = jsonshape.to_dict(pb.Signal(name="r", value=0.5, threshold=0.9, unit="ratio"))
    assert (ratio["value"], ratio["threshold"], ratio["unit"]) == (50.0, 90.0, "%")


@pytest.mark.slow
def test_every_command_prints_its_documented_shape(daemon_factory):
    d = daemon_factory("dgx-h100")
    assert d.xpu("mode", "3", "sliced").returncode == 0
    assert d.xpu("drain", "5", "--reason", "fan").returncode == 0
    assert d.xpu("fault", "inject", "6", "ecc-dbe").returncode == 0
    with d.client() as c:
        c.acquire_lease("vxpu-half", command="python notebook.py")
        c.acquire_lease("xpu", gpus=2, restartable=True)
        assert d.xpu("run", "-J", "ended", "--", "sh", "-c", "exit 3").returncode == 3
        ended = next(x for x in c.leases(all=True).leases if x.name == "ended")
        queued = d.xpu_popen("run", "-g", "8", "--wait", "30", "--", "true")
        try:
            from tests.conftest import wait_until

            wait_until(lambda: len(c.leases().queue) == 1, timeout=20)
            outputs = {
                ("ls",): "[Card]",
                ("leases",): "LeaseList",
                ("leases", "--all"): "LeaseList",
                ("leases", "--usage"): "LeaseUsage",
                ("health",): "[CardHealth]",
                ("health", "6"): "[CardHealth]",
                ("info",): "Info",
                ("topo",): "Topology",
                ("defrag", "--plan"): "DefragPlan",
                ("show", ended.id): "LeaseShow",
                ("show", "3"): "CardShow",
                ("events",): "[Event]",
                ("events", "--lease", ended.id): "[Event]",
                ("health", "--details"): "[CardHealth]",
                ("accounts",): "Accounts",
                ("report",): "Report",
                ("report", "--by", "card-model"): "Report",
            }
            seen = {}
            for args, typ in outputs.items():
                r = d.xpu(*args, "--json")
                assert r.returncode == 0, (args, r.stderr)
                seen[args] = json.loads(r.stdout)
                check(seen[args], typ, "xpu " + " ".join(args))
            r = d.xpu("wait", ended.id, "--json")
            assert r.returncode == 3
            check(json.loads(r.stdout), "Lease", "xpu wait")
        finally:
            queued.terminate()
            queued.wait(20)
    cards = seen["ls",]
    assert cards[5]["drain_reason"] == "fan" and cards[0]["drain_reason"] is None
    assert {s["size"] for s in cards[3]["slices"]} == {"vxpu-half"}
    assert 40 < cards[3]["free_memory_pct"] < 60  # a percentage, not a fraction
    health = {h["index"]: h for h in seen["health",]}
    assert health[6]["health_state"] == cards[6]["health_state"] == "unhealthy"
    assert health[6]["health_score"] == cards[6]["health_score"]
    usage = {u["lease_id"]: u for u in seen["leases", "--usage"]["rows"]}
    assert {u["mode"] for u in usage.values()} == {"vxpu-half", "xpu"}
    assert {u["cap_pct"] for u in usage.values()} == {30, 100}
    leases = seen["leases",]
    assert all(le["holder_pid"] > 0 for le in leases["leases"])  # the test process asked for them
    assert leases["queue"][0]["gpus"] == 8 and leases["queue"][0]["user"]
    assert leases["queue"][0]["reason"] == "Resources"
    (gone,) = [x for x in seen["leases", "--all"]["leases"] if x["name"] == "ended"]
    assert (gone["exit_code"], gone["status"], gone["mark"]) == (3, "exit 3", None)
