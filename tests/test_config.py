"""Config: every key documented in etc/xpud.toml, bad files refused with file, line, key and reason."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

import pytest

from xpud import config
from xpud.config.read import _line_of
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
            line = _line_of(text, section, key)
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
        ("[slices.vxpu-half]\nmemory_fraction = nan\n", 2, ["memory_fraction", "(0, 1]"]),
        ("[slices.vxpu-" + "x" * 41 + "]\nmemory_fraction = 0.5\ncompute_pct = 10\n", 1, ["45 characters"]),
        ("[slices.vxpu-eighth]\nmemory_fraction = 0.125\n", 1, ["needs both"]),
        ("[slices.big]\nmemory_fraction = 0.5\ncompute_pct = 10\n", 1, ["vxpu-<word>"]),
        ("[cards]\nreserved_memory_mib = true\n", 2, ["expected an integer"]),
        ("[leases]\ndefault_wait_s = -5\n", 2, ["[leases] default_wait_s", "below the minimum"]),
        ("[leases]\ndefault_wait_s = inf\n", 2, ["[leases] default_wait_s", "not a finite number"]),
        ("[leases]\nmax_wait_s = 60\ndefault_wait_s = 600\n", 3, ["default_wait_s", "above max_wait_s (60)"]),
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
    with pytest.raises(ConfigError, match=r"^x\.toml: nested too deeply"):
        config.parse("[health]\nxid_fail = " + "[" * 5000 + "]" * 5000 + "\n", "x.toml")


def test_a_file_that_is_not_utf8_is_one_line_with_its_line(tmp_path):
    """It was a UnicodeDecodeError traceback from the daemon's start (a crash loop under systemd), from a
    reload and from `xpu config set`."""
    from xpud.hw import mig_map

    path = tmp_path / "xpud.toml"
    path.write_bytes(b"[leases]\ngrace_s = 5  # caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: the config file is not UTF-8 \(byte 27\)"):
        config.load(path)
    with pytest.raises(ConfigError, match=rf"^{path}:2: the MIG profile map is not UTF-8"):
        mig_map.load(path)


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


def _numeric_keys() -> list[tuple[str, str, type, dict]]:
    out = []
    for section, cls in config.SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float, tuple[int, ...]):
                out.append((section, f.name, hints[f.name], dict(f.metadata)))
    return out


def test_every_numeric_key_has_a_range():
    missing = [f"[{s}] {k}" for s, k, _, rules in _numeric_keys() if "min" not in rules or "max" not in rules]
    assert missing == []


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+nan"])
@pytest.mark.parametrize(("section", "key"), [(s, k) for s, k, kind, _ in _numeric_keys() if kind is float])
def test_non_finite_numbers_are_refused_for_every_float_key(section, key, value):
    text = f"[{section}]\n\n{key} = {value}\n"
    with pytest.raises(ConfigError) as e:
        config.parse(text, "/etc/xpud/xpud.toml")
    assert str(e.value).startswith(f"/etc/xpud/xpud.toml:3: [{section}] {key}: ")
    assert "not a finite number" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("section", "key", "kind", "rules"), _numeric_keys())
def test_values_beyond_the_range_are_refused_for_every_numeric_key(section, key, kind, rules):
    for bad in (rules["max"] + 1, rules["min"] - 1):
        value = f"[{bad!r}]" if typing.get_origin(kind) is tuple else repr(kind(bad))
        with pytest.raises(
            ConfigError, match=rf"xpud.toml:2: \[{section}\] {key}: .*(outside|minimum|maximum)"
        ):
            config.parse(f"[{section}]\n{key} = {value}\n", "xpud.toml")


def test_huge_lists_and_strings_are_refused():
    with pytest.raises(ConfigError, match="300 items; at most 256"):
        config.parse(f"[health]\nxid_fail = {list(range(300))}\n")
    with pytest.raises(ConfigError, match=r"\[daemon\] state_dir: 5000 characters"):
        config.parse(f"[daemon]\nstate_dir = '{'x' * 5000}'\n")


def test_environment_overrides_are_checked_like_the_file():
    with pytest.raises(ConfigError) as e:
        config.load(None, environ={"XPUD_LOG_LEVEL": "loud"})
    assert str(e.value) == (
        "environment variable XPUD_LOG_LEVEL: [daemon] log_level: 'loud' is not one of "
        "debug, info, warning, error"
    )
    cfg = config.checked(config.Config(), "leases", "grace_s", "2.5", "--grace")
    assert cfg.leases.grace_s == 2.5
    with pytest.raises(ConfigError, match=r"--grace: \[leases\] grace_s: nan is not a finite number"):
        config.checked(config.Config(), "leases", "grace_s", "nan", "--grace")
    with pytest.raises(ConfigError, match=r"--seed: \[devices\] seed: -1 is below the minimum 0"):
        config.checked(config.Config(), "devices", "seed", -1, "--seed")


def test_mps_idle_keep_s_is_checked_and_reaches_the_mps_backend(tmp_path):
    for bad, why in (("3601.0", "maximum 3600"), ("-0.5", "minimum 0"), ("nan", "not a finite number")):
        with pytest.raises(ConfigError, match=rf"^xpud.toml:2: \[cards\] mps_idle_keep_s: .*{why}"):
            config.parse(f"[cards]\nmps_idle_keep_s = {bad}\n", "xpud.toml")
    from xpud.hw.fakenvml import FakeNvml
    from xpud.hw.nvml import Nvml
    from xpud.isolation import backend_for
    from xpud.isolation.faketools import FakeNvidiaTools

    nvml = Nvml(FakeNvml("pcie-8x-l40s"))
    nvml.open()
    for text, keep in (("0", 0.0), ("3600", 3600.0), ("", 30.0)):
        cfg = config.parse(f"[cards]\n{'mps_idle_keep_s = ' + text if text else ''}\n", "xpud.toml")
        assert backend_for(cfg, nvml, FakeNvidiaTools())(nvml.card_info(0)).idle_keep_s == keep
