"""Machine descriptions: the shipped ones load, names resolve through the package, mistakes are one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from xpud.hw.machines import (
    MachineError,
    format_cpulist,
    list_machines,
    load_machine,
    machines_dir,
    parse_cpulist,
)
from xpud.topology import HOSTBRIDGE, INTERNAL, MULTIPLE, NODE, SINGLE, SYSTEM

DATA = Path(__file__).parent / "data"
SHIPPED = [
    "dgx-a100",
    "dgx-h100",
    "hgx-h200",
    "pcie-8x-l40s",
    "pcie-4x-h100",
    "pcie-4x-a100-bridged",
    "workstation-2x",
]


def test_shipped_machines_are_listed_and_found_through_the_package():
    assert set(SHIPPED) <= set(list_machines())
    # importlib.resources.files("xpud.etc") / "machines" -- the package maps xpud.etc to etc/
    assert (machines_dir() / "dgx-h100.toml").is_file()


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_machine_loads(name):
    m = load_machine(name)
    assert m.name == name
    assert m.cards and all(c.uuid.startswith("GPU-") for c in m.cards)
    assert len({c.uuid for c in m.cards}) == len(m.cards)


def test_dgx_h100_shape():
    m = load_machine("dgx-h100")
    assert len(m.cards) == 8 and m.cpu_count == 224
    assert [c.numa for c in m.cards] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {c.nvlink_switch_links for c in m.cards} == {18}
    h100 = m.cards[0].model
    assert (h100.name, h100.memory_mib, h100.architecture) == ("NVIDIA H100 80GB HBM3", 81559, "hopper")
    by_name = {p.name: p for p in h100.mig_profiles}
    assert (
        by_name["3g.40gb"].placements == (0, 4)
        and by_name["3g.40gb"].id == 9
        and by_name["3g.40gb"].profile == 2
    )
    assert by_name["1g.10gb"].instances == 7 and by_name["7g.80gb"].placement_size == 8
    assert m.level(0, 1) == NODE and m.level(0, 4) == SYSTEM


def test_pcie_tree_levels():
    l40s = load_machine("pcie-8x-l40s")
    assert (l40s.level(0, 1), l40s.level(0, 2), l40s.level(0, 4)) == (SINGLE, NODE, SYSTEM)
    a100 = load_machine("dgx-a100")
    assert (a100.level(0, 1), a100.level(0, 2), a100.level(1, 7)) == (MULTIPLE, NODE, SYSTEM)
    assert load_machine("workstation-2x").level(0, 1) == HOSTBRIDGE


def test_same_board_is_internal(tmp_path):
    path = tmp_path / "board.toml"
    path.write_text(
        'name = "board"\nnuma_cpus = ["0-7"]\n[models.k80]\nname = "Tesla K80"\nmemory_mib = 12288\n'
        '[[cards]]\nmodel = "k80"\nbus_id = "00000000:05:00.0"\nboard = "b0"\n'
        '[[cards]]\nmodel = "k80"\nbus_id = "00000000:06:00.0"\nboard = "b0"\n'
    )
    assert load_machine(path).level(0, 1) == INTERNAL


def test_uuids_are_deterministic_per_machine_and_index():
    a, b = load_machine("dgx-h100"), load_machine("dgx-h100")
    assert [c.uuid for c in a.cards] == [c.uuid for c in b.cards]
    assert a.cards[0].uuid != load_machine("hgx-h200").cards[0].uuid


def test_cpulists_round_trip():
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert format_cpulist((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    assert parse_cpulist("") == ()


def test_a_fixture_path_loads():
    m = load_machine(DATA / "nvlink-mesh.toml")
    assert m.cards[0].nvlink_peers == (1, 1, 2, 2, 3, 3)


BASE = 'name = "t"\nnuma_cpus = ["0-7"]\n[models.m]\nname = "X"\nmemory_mib = 1024\n'
CARD = '[[cards]]\nmodel = "m"\nbus_id = "00000000:01:00.0"\n'


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (BASE + CARD + "colour = 1\n", "cards[0].colour: unknown key"),
        (BASE.replace("memory_mib = 1024\n", "") + CARD, "models.m.memory_mib: required"),
        (BASE.replace("1024", '"lots"') + CARD, "models.m.memory_mib: expected int"),
        (BASE + CARD.replace('"m"', '"nope"'), "cards[0].model: no model 'nope'"),
        (BASE + CARD + "numa = 3\n", "cards[0].numa: node 3 has no entry in numa_cpus"),
        (BASE + 'architecture = "hopper9"\n' + CARD, "models.m.architecture"),
        (BASE + CARD + "mig_enabled = true\n", "cards[0].mig_enabled: model 'm' has no mig_profiles"),
        (BASE + "[topology]\nlevels = [[0, 10]]\n" + CARD, "topology.levels: expected a 1x1 matrix"),
        ("numa_cpus = []\n", ": name: required"),
        (
            BASE + 'nvlink_version = "4.0"\nnvlink_links = 40\n' + CARD,
            "models.m.nvlink_links: expected 0 to 36",
        ),
        (BASE + "nvlink_links = 12\n" + CARD, "models.m.nvlink_links: needs nvlink_version"),
        (
            BASE + 'nvlink_version = "4.0"\nnvlink_links = 2\n' + CARD + "nvlink_switch_links = 4\n",
            "cards[0].nvlink_peers: 4 links wired but model 'm' has 2",
        ),
    ],
)
def test_mistakes_name_the_file_and_the_key(tmp_path, text, where):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(MachineError) as err:
        load_machine(path)
    message = str(err.value)
    assert str(path) in message and where in message and "\n" not in message


def test_asymmetric_nvlink_peers_are_refused(tmp_path):
    path = tmp_path / "asym.toml"
    two = CARD + "nvlink_peers = [1]\n" + CARD.replace(":01:", ":02:")
    path.write_text(BASE + 'nvlink_version = "2.0"\n' + two)
    with pytest.raises(
        MachineError, match=r"cards\[0\].nvlink_peers: links to card 1 are not listed the same"
    ):
        load_machine(path)


def test_unknown_name_lists_the_choices():
    with pytest.raises(MachineError, match=r"unknown machine 'dgx-9000': choose one of .*dgx-h100"):
        load_machine("dgx-9000")


def test_bad_toml_is_one_line(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("name = \n")
    with pytest.raises(MachineError, match=r"broken\.toml: not valid TOML"):
        load_machine(path)


RANGE_MISTAKES = [
    (
        BASE.replace("1024", str(2**63)) + CARD,
        "models.m.memory_mib: 9223372036854775808 is outside 1..16777216",
    ),
    (BASE.replace("1024", "0") + CARD, "models.m.memory_mib: 0 is outside 1..16777216"),
    (BASE + "power_limit_w = -300.0\n" + CARD, "models.m.power_limit_w: -300.0 is outside 1.0..10000.0"),
    (BASE + "power_limit_w = nan\n" + CARD, "models.m.power_limit_w: nan is not a finite number"),
    (BASE + "power_idle_w = inf\n" + CARD, "models.m.power_idle_w: inf is not a finite number"),
    (
        BASE + "power_limit_w = 300.0\npower_idle_w = 400.0\n" + CARD,
        "power_idle_w: 400.0 is outside 0.0..300.0",
    ),
    (BASE + "temp_slowdown_c = 100000\n" + CARD, "models.m.temp_slowdown_c: 100000 is outside -50..200"),
    (BASE + "pcie_width = -16\n" + CARD, "models.m.pcie_width"),
    (BASE + CARD + "nvlink_switch_links = 1000000\n", "cards[0].nvlink_switch_links: 1000000 is outside"),
    (BASE + CARD + "numa = -1\n", "cards[0].numa: -1 is outside 0..1023"),
    (BASE + CARD + "nvlink_peers = [-5]\n", "cards[0].nvlink_peers: expected integers in 0..255"),
    (BASE + CARD + f"board = '{'b' * 1000}'\n", "1000 characters; at most 256"),
    (BASE.replace('"0-7"', '"0-99999999999"') + CARD, "numa_cpus: expected cpulist strings"),
    (BASE + "max_mig_devices = 1" + "0" * 30 + "\n" + CARD, "models.m.max_mig_devices"),
    (BASE + CARD * 300, "cards: 300 cards; at most 256"),
    (
        BASE + "[[models.m.mig_profiles]]\nprofile = 0\nid = 19\nname = 'p'\nslices = 1\nmemory_mib = -1\n"
        "instances = 7\nplacements = [0]\nplacement_size = 1\n" + CARD,
        "models.m.mig_profiles[0].memory_mib: -1 is outside",
    ),
    ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
]


@pytest.mark.parametrize(("text", "where"), RANGE_MISTAKES, ids=[w[:48] for _, w in RANGE_MISTAKES])
def test_out_of_range_values_are_one_line_naming_the_key(tmp_path, text, where):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(MachineError) as err:
        load_machine(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and where in message and "\n" not in message and len(message) < 300


def test_a_recording_with_huge_or_deep_json_is_refused(tmp_path):
    path = tmp_path / "rec.json"
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(MachineError, match=r"rec\.json: nested too deeply"):
        load_machine(path)
    path.write_text(
        '{"name": "t", "numa_cpus": ["0-7"], "models": {"m": {"name": "X", "memory_mib": 1e999}},'
        ' "cards": [{"model": "m", "bus_id": "00000000:01:00.0"}]}'
    )
    with pytest.raises(MachineError, match=r"models\.m\.memory_mib: expected int, got inf"):
        load_machine(path)
