"""scripts/device-check.sh over a simulated machine (the mode CI runs, so the GPU-host script cannot rot),
and the fidelity diff it relies on."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml
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


# ----------------------------------------------- the driver facts recorded on a lent GPU (#29 item 20)

PROBE = ROOT / "scripts" / "device_probe.py"


def probe(machine: str, what: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUD_", "CUDA_", "XPU_"))}
    return subprocess.run(
        [sys.executable, str(PROBE), "--simulate", machine, what, str(out), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


def test_the_script_parses_and_records_the_driver_facts_on_real_cards_only():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text()
    for step in ("minors", "mig-profiles", "fabric", "fields", "recovery", "nvlink", "cvd-uuid", "cuda-load"):
        assert step in text, step
    assert "nvidia-smi --query-gpu=index,minor_number" in text and "/proc/devices" in text
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in text and "mps-limit" in text
    # it changes nothing: nvidia-smi only queries, and no NVML setter is called
    import re

    uses = {m.group(1) for m in re.finditer(r"nvidia-smi (\S+)", text)}
    assert all(u.startswith("--query-gpu=") or u in ("-L", "not", ">/dev/null;") for u in uses), uses
    assert "nvmlDeviceSet" not in text and "nvmlDeviceSet" not in PROBE.read_text()


def test_the_probes_record_what_the_driver_answers(tmp_path):
    for what in ("mig-profiles", "fabric", "fields", "recovery", "nvlink"):
        r = probe("dgx-h100", what, tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
    profiles = json.loads((tmp_path / "mig-profiles.json").read_text())
    assert len(profiles) == 8 and all(
        len(c["profiles"]) == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT for c in profiles
    )
    # MIG off: every enum answers (NOT_SUPPORTED, or INVALID_ARGUMENT: an enum this driver lacks)
    assert {p["rc"] for p in profiles[0]["profiles"].values()} == {"NOT_SUPPORTED", "INVALID_ARGUMENT"}
    fabric = json.loads((tmp_path / "fabric.json").read_text())
    assert {(c["state"], c["status"]) for c in fabric} == {(pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, 0)}
    fields = json.loads((tmp_path / "fields.json").read_text())
    assert fields[0]["fan"] == "NOT_SUPPORTED" and fields[0]["remapped_rows"] == "SUCCESS"
    assert fields[0]["field recovery_action"] == "SUCCESS"
    recovery = json.loads((tmp_path / "recovery.json").read_text())
    assert {(c["rc"], c["action"]) for c in recovery} == {("SUCCESS", 0)}
    nvlink = json.loads((tmp_path / "nvlink.json").read_text())
    assert nvlink[0]["link_count"] == 18 and nvlink[0]["links"][0]["errors"]["replay"] == ["SUCCESS", 0]


def test_the_probes_on_an_older_driver_and_without_pytorch(tmp_path):
    r = probe("dgx-a100", "recovery", tmp_path)  # driver 535: no recovery-action field
    assert r.returncode == 0 and "NOT_SUPPORTED" in r.stdout
    r = probe("dgx-a100", "fabric", tmp_path)  # no nvmlDeviceGetGpuFabricInfoV in that driver
    assert r.returncode == 0 and "FUNCTION_NOT_FOUND" in r.stdout
    try:
        import torch  # noqa: F401
    except ImportError:
        r = probe("dgx-h100", "load", tmp_path, "1")
        assert r.returncode == 3 and r.stdout.startswith("load: SKIP")
