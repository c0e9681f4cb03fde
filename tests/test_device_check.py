"""scripts/device-check.sh over a simulated machine (the mode CI runs, so the GPU-host script cannot rot),
and the fidelity diff it relies on."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xpud.hw.fidelity import compare_models, compare_replay, record_of, replay

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "device-check.sh"


def run_script(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUD_", "CUDA_", "XPU_"))}
    env["XPUD_BIN"] = str(Path(sys.executable).parent)
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_the_device_check_passes_over_a_simulated_machine(tmp_path):
    r = run_script("--simulate", "pcie-4x-a100-bridged", "--poll-seconds", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("device-check (simulated pcie-4x-a100-bridged): 12 passed, 0 failed")
    steps = [line.split()[1] for line in lines[1:]]
    assert steps == [
        "check-hardware",
        "fidelity",
        "daemon",
        "xpu-ls",
        "xpu-health",
        "xpu-topo",
        "whole-card-run",
        "health-poll",
        "daemon-cpu",
        "daemon-stop",
        "daemon-log",
        "settings",
    ]
    assert "exactly one card" in r.stdout and "4 card(s) healthy" in r.stdout
    assert (tmp_path / "check-hardware.json").is_file() and (tmp_path / "health_poll.json").is_file()


def test_the_device_check_fails_when_a_step_fails(tmp_path):
    r = run_script("--simulate", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "out"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL check-hardware" in r.stdout and "FAIL daemon" in r.stdout and "FAIL settings" in r.stdout


def test_bad_arguments_are_refused_in_one_line():
    r = run_script("--poll-seconds", "0", "--simulate", "dgx-h100")
    assert r.returncode == 2 and "--poll-seconds 0" in r.stderr


@pytest.mark.parametrize("machine", ["hgx-h200", "pcie-4x-h100", "workstation-2x"])
def test_a_recording_replays_through_the_fake_without_a_difference(machine):
    real = record_of(machine)
    diff = compare_replay(real, replay(real))
    assert diff.ok, diff.mismatches
    assert compare_models(real).ok


def test_the_diff_names_a_signal_the_fake_would_get_wrong():
    real = record_of("hgx-h200")
    fake = replay(real)
    wrong = copy.deepcopy(real)
    wrong["recording"]["samples"][2]["fan_pct"] = 40  # the driver reports a fan the fake does not have
    wrong["recording"]["samples"][3]["nvlink_links_down"] = None  # or no NVLink state at all
    wrong["recording"]["samples"][1]["temperature_slowdown_c"] = 90  # or another fixed threshold
    wrong["recording"]["samples"][0]["ecc_sbe_volatile"] = 7  # a counter: a note, not a mismatch
    diff = compare_replay(wrong, fake)
    assert sorted(diff.mismatches) == [
        "replay card 1 temperature_slowdown_c: driver 90, fake 87",
        "replay card 2 fan_pct: driver 40, fake absent",
        "replay card 3 nvlink_links_down: driver absent, fake 0",
    ]
    assert diff.notes == [
        "replay card 0 ecc_sbe_volatile: driver 7, fake 0 (a counter the fake starts at zero)"
    ]


def test_a_shipped_model_that_disagrees_with_the_driver_is_a_mismatch():
    real = record_of("hgx-h200")
    real["models"]["nvidia-h200"]["pcie_gen"] = 4
    real["recording"]["samples"][0]["fan_pct"] = 30
    diff = compare_models(real)
    assert "model NVIDIA H200 in hgx-h200 pcie_gen: driver 4, hgx-h200 5" in diff.mismatches
    assert "model NVIDIA H200 in hgx-h200 fan_pct: driver 30, fake absent" in diff.mismatches
