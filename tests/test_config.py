"""Config: every key documented in etc/xpud.toml, bad files refused with file, line, key and reason."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from xpud import config
from xpud.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "etc" / "xpud.toml"


def test_documented_file_lists_every_key_with_its_default():
    data = tomllib.loads(DOC.read_text())
    keys = config.documented_keys()
    assert set(data) == set(keys) | {"slices"}
    for section, fields in keys.items():
        assert set(data[section]) == set(fields), section
        for key, (default, doc) in fields.items():
            assert data[section][key] == default, f"[{section}] {key}"
            assert doc
    assert config.parse(DOC.read_text(), str(DOC)) == config.Config(path=str(DOC))
    text = DOC.read_text()
    for section, fields in keys.items():  # every key has a comment line right above it
        for key in fields:
            line = config._line_of(text, section, key)
            assert text.splitlines()[line - 2].lstrip().startswith("#"), f"[{section}] {key} undocumented"


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ('[leases]\ngrace_s = "ten"\n', 2, ["[leases] grace_s", "expected a number"]),
        ("[daemon]\n\nruntime_dri = '/x'\n", 3, ["unknown key", "did you mean 'runtime_dir'"]),
        ("[devices]\nbackend = 'cuda'\n", 2, ["[devices] backend", "not one of nvml, simulated"]),
        ("[leases]\ngrace_s = -1\n", 2, ["below the minimum"]),
        ("[lease]\ngrace_s = 1\n", 1, ["unknown table", "did you mean 'leases'"]),
        ("[slices.vxpu-half]\nmemory_fraction = 1.5\n", 2, ["memory_fraction", "(0, 1]"]),
        ("[slices.vxpu-eighth]\nmemory_fraction = 0.125\n", 1, ["needs both"]),
        ("[slices.big]\nmemory_fraction = 0.5\ncompute_pct = 10\n", 1, ["vxpu-<word>"]),
        ("[cards]\nreserved_memory_mib = true\n", 2, ["expected an integer"]),
    ],
)
def test_bad_values_name_file_line_and_key(text, line, words):
    with pytest.raises(ConfigError) as e:
        config.parse(text, "/etc/xpud/xpud.toml")
    msg = str(e.value)
    assert msg.startswith(f"/etc/xpud/xpud.toml:{line}: "), msg
    for w in words:
        assert w in msg
    assert "\n" not in msg


def test_invalid_toml_is_refused():
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.parse("[daemon\n", "x.toml")


def test_slices_are_configurable_and_new_sizes_can_be_added():
    cfg = config.parse(
        "[slices.vxpu-half]\ncompute_pct = 40\n[slices.vxpu-eighth]\n"
        "memory_fraction = 0.125\ncompute_pct = 8\n"
    )
    assert cfg.slices["vxpu-half"].compute_pct == 40
    assert cfg.slices["vxpu-half"].memory_fraction == 0.5
    assert cfg.slices["vxpu-eighth"].memory_fraction == 0.125
    assert cfg.slices["vxpu-quarter"].compute_pct == 15


def test_precedence_environment_over_file(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text("[daemon]\nruntime_dir = '/from/file'\nstate_dir = '/state'\n")
    cfg = config.load(f, environ={"XPUD_RUNTIME_DIR": "/from/env"})
    assert cfg.daemon.runtime_dir == "/from/env"
    assert cfg.daemon.state_dir == "/state"
    sim = config.load(f, environ={"XPUD_SIMULATE": "pcie-8x-l40s"})
    assert (sim.devices.backend, sim.devices.machine) == ("simulated", "pcie-8x-l40s")


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "nope.toml", environ={})


def test_round_trip_through_tomli_w():
    cfg = config.parse(
        "[leases]\ngrace_s = 3.5\n[slices.vxpu-eighth]\nmemory_fraction = 0.125\ncompute_pct = 8\n"
    )
    again = config.parse(config.dumps(cfg))
    assert again.leases == cfg.leases and again.slices == cfg.slices
