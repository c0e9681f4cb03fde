"""NVSwitch fabric state and the driver's recovery action, through the adapter over the fake.

The fake copies nvml.h / nvidia-ml-py 13.x: ``nvmlDeviceGetGpuFabricInfoV(device, byref(info))`` fills a
``c_nvmlGpuFabricInfoV_t`` (v2) or ``c_nvmlGpuFabricInfo_v3_t`` whose ``version`` NVML checks; the state is
``NVML_GPU_FABRIC_STATE_*`` and ``status`` an NVML return code. DCGM reads it the same way
(NVIDIA/DCGM: DcgmCacheManager::GetFMStatusFromStruct and its test table: NOT_SUPPORTED + SUCCESS = no
fabric; NOT_STARTED / IN_PROGRESS = not trained yet; COMPLETED + SUCCESS = trained; COMPLETED + an error =
training failed). ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` is a field value (``NVML_GPU_RECOVERY_ACTION_*``).
"""

from __future__ import annotations

import ctypes

import pynvml as N
import pytest

from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml

TRAINED = (N.NVML_GPU_FABRIC_STATE_COMPLETED, N.NVML_SUCCESS)


def test_an_nvswitch_card_reports_its_fabric_trained_and_the_fake_follows_the_fault():
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    assert nvml.fabric(0) == TRAINED
    assert (nvml.sample(0).fabric_state, nvml.sample(0).fabric_status) == TRAINED
    fake.set_fabric(0, N.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
    assert nvml.sample(0).fabric_state == N.NVML_GPU_FABRIC_STATE_IN_PROGRESS
    assert nvml.fabric(1) == TRAINED  # one card's state
    fake.set_fabric(0, N.NVML_GPU_FABRIC_STATE_COMPLETED, N.NVML_ERROR_TIMEOUT)
    assert nvml.fabric(0) == (N.NVML_GPU_FABRIC_STATE_COMPLETED, N.NVML_ERROR_TIMEOUT)
    assert not nvml.errors


@pytest.mark.parametrize(
    ("machine", "why"),
    [
        ("pcie-4x-h100", "Hopper without NVSwitch: SUCCESS with state NOT_SUPPORTED"),
        ("pcie-8x-l40s", "Ada: NOT_SUPPORTED"),
        ("dgx-a100", "driver 535: no nvmlDeviceGetGpuFabricInfoV in the library"),
    ],
)
def test_cards_without_a_fabric_to_train_read_none_quietly(machine, why):
    nvml = Nvml(FakeNvml(machine))
    assert nvml.fabric(0) is None, why
    assert nvml.sample(0).fabric_state is None and not nvml.errors


def test_the_fake_checks_the_struct_version_as_nvml_does():
    fake = FakeNvml("hgx-h200")
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    v3 = N.c_nvmlGpuFabricInfo_v3_t()
    assert fake.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(v3)) == N.NVML_SUCCESS
    assert (v3.state, v3.status, v3.healthSummary) == (*TRAINED, N.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY)
    unversioned = N.c_nvmlGpuFabricInfoV_t()
    unversioned.version = 0
    with pytest.raises(N.NVMLError_ArgumentVersionMismatch):
        fake.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(unversioned))
    fake.nvmlShutdown()


def test_a_fail_class_xid_sets_the_recovery_action_until_a_reset():
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    assert nvml.sample(0).recovery_action == N.NVML_GPU_RECOVERY_ACTION_NONE
    fake.inject_xid(0, 119)  # GSP RPC timeout
    assert nvml.sample(0).recovery_action == N.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert nvml.sample(1).recovery_action == N.NVML_GPU_RECOVERY_ACTION_NONE
    fake.inject_xid(0, 13)  # an application XID asks for nothing; the reset is still needed
    assert nvml.sample(0).recovery_action == N.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    fake.reset(0)
    assert nvml.sample(0).recovery_action == N.NVML_GPU_RECOVERY_ACTION_NONE
    # A driver before R550 has no such field: absent, not an error.
    old = Nvml(FakeNvml("dgx-a100"))
    assert old.sample(0).recovery_action is None and not old.errors
