"""check-hardware: the report, its exit code, and a JSON recording that replays as a simulated machine."""

from __future__ import annotations

import io
import json

import pynvml
import pytest

from xpud.hw.check import check_hardware
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.machines import load_machine, machines_dir
from xpud.hw.nvml import Nvml

MACHINES = ["dgx-h100", "dgx-a100", "hgx-h200", "pcie-8x-l40s", "workstation-2x"]
MUTATING = ("Set", "Create", "Destroy")


def run(fake: FakeNvml, as_json: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    code = check_hardware(fake, out=out, as_json=as_json)
    return code, out.getvalue()


def test_text_report_of_a_dgx_h100():
    fake = FakeNvml("dgx-h100", clock=lambda: 100.0)
    code, text = run(fake)
    assert code == 0
    assert text.startswith("NVIDIA driver 550.90.07, CUDA 12.4, 8 card(s)\n")
    assert "GPU0  NVIDIA H100 80GB HBM3  79.6 GiB  00000000:1B:00.0  GPU-" in text
    matrix_row = next(line for line in text.splitlines() if line.startswith("  GPU4 ") and " X " in line)
    assert matrix_row.split() == ["GPU4", *["NV18"] * 4, "X", *["NV18"] * 3, "56-111,168-223", "1"]
    # MIG is off: the card lists no profiles (NOT_SUPPORTED, as the driver); the report still says what
    # xpud would use, from the profile map over the model's known geometry.
    assert "no profiles listed while MIG is off" in text and "profile 3g.40gb" not in text
    assert "xpud uses vxpu-half     -> 3g.40gb  (map; profiles from etc/machines/dgx-h100.toml)" in text
    assert "profiles as GPU0" in text
    assert "GPU7  registered: xid, ecc-sbe, ecc-dbe" in text
    assert text.rstrip().endswith("No problems.")


def test_pcie_matrix_and_no_mig():
    code, text = run(FakeNvml("pcie-8x-l40s"))
    rows = {
        line.split()[0]: line.split()[1:9]
        for line in text.splitlines()
        if line.startswith("  GPU") and "X" in line
    }
    assert rows["GPU0"] == ["X", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    assert "GPU3  not supported" in text and code == 0


@pytest.mark.parametrize("machine", MACHINES)
def test_check_changes_nothing(machine):
    fake = FakeNvml(machine)
    run(fake)
    run(fake, as_json=True)
    assert [name for name in fake.calls if name.startswith(tuple(f"nvmlDevice{m}" for m in MUTATING))] == []
    assert not any(m in name for name in fake.calls for m in ("GpuInstanceCreate", "Destroy"))


def test_adapter_errors_give_exit_code_1_and_are_listed():
    fake = FakeNvml("dgx-h100")
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, index=5)
    fake.fail("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_NO_PERMISSION, index=1)
    code, text = run(fake)
    assert code == 1
    assert "2 problem(s):" in text
    assert "  nvmlDeviceGetPowerUsage on card 5: unknown (NVML_ERROR_UNKNOWN)" in text
    assert "events on card 1: nvmlDeviceRegisterEvents on card 1: no permission: run as root" in text


def test_not_supported_is_not_a_problem_but_a_lost_card_is():
    fake = FakeNvml("dgx-h100")
    fake.fail("nvmlDeviceGetPcieReplayCounter")  # NotSupported
    assert run(fake)[0] == 0
    fake.lose(3)
    code, text = run(fake)
    assert code == 1 and "card 3: lost (fallen off the bus)" in text and "GPU3  LOST" in text


class _NoLibrary:
    def nvmlInit(self):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


def test_no_nvml_exits_2_with_the_reason_on_stderr(capsys):
    out = io.StringIO()
    assert check_hardware(_NoLibrary(), out=out) == 2
    assert out.getvalue() == ""
    assert "NVML not found (libnvidia-ml.so.1)" in capsys.readouterr().err


@pytest.mark.parametrize("machine", MACHINES)
def test_json_recording_replays_as_the_same_machine(machine, tmp_path):
    original = FakeNvml(machine)
    code, text = run(original, as_json=True)
    assert code == 0
    record = json.loads(text)
    assert record["recording"]["problems"] == [] and len(record["recording"]["samples"]) == len(
        record["cards"]
    )
    path = tmp_path / "recording.json"
    path.write_text(text)
    replay = load_machine(str(path))
    a, b = Nvml(FakeNvml(machine)), Nvml(FakeNvml(replay))
    assert b.cards() == a.cards()
    assert b.topology() == a.topology()
    assert (b.driver_version(), b.cuda_version()) == (a.driver_version(), a.cuda_version())
    for i in range(len(a.cards())):
        assert b.mig_profiles(i) == a.mig_profiles(i)
        assert b.nvlinks(i) == a.nvlinks(i)
        if a.mig_mode(i) is not None:  # MIG-capable: the replay has the same profiles once MIG is on
            assert a.set_mig_mode(i, True) == b.set_mig_mode(i, True) == "done"
            assert b.mig_profiles(i) == a.mig_profiles(i) != []
    s_a, s_b = a.sample(0), b.sample(0)
    for key in (
        "memory_total_bytes",
        "temperature_slowdown_c",
        "temperature_shutdown_c",
        "power_limit_w",
        "fan_pct",
    ):
        assert getattr(s_b, key) == getattr(s_a, key), key


def test_recording_keeps_mig_mode_and_lists_instances(tmp_path):
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    nvml.set_mig_mode(2, True)
    fake.reset(2)
    nvml.create_mig_instance(2, 9, 0)
    code, text = run(fake, as_json=True)
    record = json.loads(text)
    assert code == 0 and record["cards"][2]["mig_enabled"] is True
    assert [m["name"] for m in record["recording"]["mig_instances"][2]] == ["3g.40gb"]
    path = tmp_path / "rec.json"
    path.write_text(text)
    assert [c.mig_enabled for c in Nvml(FakeNvml(load_machine(path))).cards()] == [
        False,
        False,
        True,
        *[False] * 5,
    ]


def test_a_card_with_mig_off_gets_its_profiles_from_a_card_of_its_model_with_mig_on(tmp_path):
    fake = FakeNvml("dgx-h100")
    Nvml(fake).set_mig_mode(3, True)
    code, text = run(fake, as_json=True)
    record = json.loads(text)
    assert code == 0 and record["recording"]["mig_profiles_from"] == {}
    assert {p["name"] for p in record["models"]["nvidia-h100-80gb-hbm3"]["mig_profiles"]} >= {"3g.40gb"}


def test_mig_off_on_a_model_no_description_knows_is_explained_not_a_problem(tmp_path):
    text = (machines_dir() / "dgx-h100.toml").read_text().replace("NVIDIA H100 80GB HBM3", "NVIDIA H999")
    path = tmp_path / "h999.toml"
    path.write_text(text)
    code, report = run(FakeNvml(load_machine(path)))
    assert code == 0
    assert "Note: GPU0 (NVIDIA H999): MIG is off and no machine description knows" in report
    assert "xpud uses vxpu-half     -> none  (derived once MIG is on)" in report


def test_an_older_driver_gives_no_problems(caplog):
    # Regression (issue 11, item 5): driver 535 answers INVALID_ARGUMENT for the binding's later profile
    # enums; enumerating them all logged errors and made check-hardware exit 1.
    fake = FakeNvml("dgx-a100")
    Nvml(fake).set_mig_mode(0, True)
    code, text = run(fake)
    assert code == 0 and text.rstrip().endswith("No problems.") and "INVALID_ARGUMENT" not in caplog.text
    assert "profile 3g.40gb      id 9   enum 2   x2  at 0,4" in text
