"""One failure switch per NVML call: the adapter degrades to None (or a documented fallback), never crashes.

Each row makes one pynvml function fail on the fake, first as NotSupported (read as absent, silently),
then as an unexpected error (read as absent, and recorded in ``Nvml.errors``). Everything the row does
not name must read exactly as on an unbroken twin machine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pynvml
import pytest

from xpud.hw.fakenvml import FakeNvml
from xpud.hw.machines import load_machine
from xpud.hw.nvml import Nvml, NvmlError
from xpud.topology import SYSTEM

MESH = load_machine(Path(__file__).parent / "data" / "nvlink-mesh.toml")
CODES = [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_UNKNOWN]
ECC = ["ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate"]
ROWS = [
    "remapped_rows_corrected",
    "remapped_rows_uncorrected",
    "remapped_rows_pending",
    "remapped_rows_failure",
]
NVLINK = [
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
    "nvlink_crc_flit_errors",
    "nvlink_crc_data_errors",
]


def pair(machine, **kw):
    """A broken-to-be machine and its unbroken twin, same seed and clock."""
    return [Nvml(FakeNvml(machine, clock=lambda: 2000.0, **kw)) for _ in range(2)]


def fields(sample) -> dict:
    d = dataclasses.asdict(sample)
    d.pop("timestamp")
    return d


# ------------------------------------------------------------------------------------------ samples

SAMPLE_TABLE = [
    # (machine, failing calls, CardSample fields that must read None)
    ("dgx-h100", ["nvmlDeviceGetUtilizationRates"], ["utilization_gpu_pct", "utilization_memory_pct"]),
    ("dgx-h100", ["nvmlDeviceGetMemoryInfo"], ["memory_used_bytes", "memory_total_bytes"]),
    ("dgx-h100", ["nvmlDeviceGetTemperature"], ["temperature_c"]),
    ("dgx-h100", ["nvmlDeviceGetTemperatureThreshold"], ["temperature_slowdown_c", "temperature_shutdown_c"]),
    ("dgx-h100", ["nvmlDeviceGetPowerUsage"], ["power_w"]),
    ("dgx-h100", ["nvmlDeviceGetEnforcedPowerLimit"], ["power_limit_w"]),
    ("dgx-h100", ["nvmlDeviceGetPerformanceState"], ["performance_state"]),
    ("workstation-2x", ["nvmlDeviceGetFanSpeed"], ["fan_pct"]),
    ("dgx-h100", ["nvmlDeviceGetTotalEccErrors"], ECC),
    (MESH, ["nvmlDeviceGetRetiredPages"], ["retired_pages_sbe", "retired_pages_dbe"]),
    (MESH, ["nvmlDeviceGetRetiredPagesPendingStatus"], ["retired_pages_pending"]),
    ("dgx-h100", ["nvmlDeviceGetRemappedRows"], ROWS),
    ("dgx-h100", ["nvmlDeviceGetCurrentClocksEventReasons"], ["clock_event_reasons"]),
    ("dgx-h100", ["nvmlDeviceGetPcieReplayCounter"], ["pcie_replay_counter"]),
    ("dgx-h100", ["nvmlDeviceValidateInforom"], ["inforom_valid"]),
    # NVLink: one field-values call; per-link calls are the fallback, so it takes both to lose a signal.
    # The recovery action is a field value only.
    ("dgx-h100", ["nvmlDeviceGetFieldValues"], ["recovery_action"]),
    ("dgx-h100", ["nvmlDeviceGetNvLinkErrorCounter"], []),
    ("dgx-h100", ["nvmlDeviceGetNvLinkState"], []),
    (
        "dgx-h100",
        ["nvmlDeviceGetFieldValues", "nvmlDeviceGetNvLinkErrorCounter"],
        [*NVLINK, "recovery_action"],
    ),
    # Neither can count the links: the card reads as one without NVLink.
    (
        "dgx-h100",
        ["nvmlDeviceGetFieldValues", "nvmlDeviceGetNvLinkState"],
        [*NVLINK, "nvlink_links_down", "recovery_action"],
    ),
    ("dgx-h100", ["nvmlDeviceGetGpuFabricInfoV"], ["fabric_state", "fabric_status"]),
]


@pytest.mark.parametrize("code", CODES, ids=["not-supported", "unknown-error"])
@pytest.mark.parametrize(
    ("machine", "calls", "absent"), SAMPLE_TABLE, ids=lambda v: "+".join(v) if isinstance(v, list) else None
)
def test_sample_degrades_per_call(machine, calls, absent, code):
    broken, twin = pair(machine)
    for name in calls:
        broken._lib.fail(name, code)
    got, want = fields(broken.sample(0)), fields(twin.sample(0))
    for key in absent:
        assert want[key] is not None, f"{key} should be readable on the twin"
        assert got[key] is None, key
    assert {k: v for k, v in got.items() if k not in absent} == {
        k: v for k, v in want.items() if k not in absent
    }
    if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
        assert not broken.errors  # "not supported" is a value, not a problem
    elif absent:
        assert any(calls[-1] in e or calls[0] in e for e in broken.errors)


def test_unsupported_link_counters_are_not_asked_for_again():
    broken, _ = pair("dgx-h100")
    broken._lib.fail("nvmlDeviceGetFieldValues")
    broken._lib.fail("nvmlDeviceGetNvLinkErrorCounter")
    broken.sample(0)
    broken._lib.calls.clear()
    assert broken.sample(0).nvlink_replay_errors is None
    assert broken._lib.calls["nvmlDeviceGetNvLinkErrorCounter"] == 0


def test_failing_link_counters_are_retried():
    broken, twin = pair("dgx-h100")
    broken._lib.fail("nvmlDeviceGetFieldValues")
    broken._lib.fail("nvmlDeviceGetNvLinkErrorCounter", pynvml.NVML_ERROR_UNKNOWN)
    assert broken.sample(0).nvlink_replay_errors is None
    broken._lib.unfail("nvmlDeviceGetNvLinkErrorCounter")
    assert broken.sample(0).nvlink_replay_errors == twin.sample(0).nvlink_replay_errors == 0


def test_a_failure_on_one_card_leaves_the_others_alone():
    broken, twin = pair("dgx-h100")
    broken._lib.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, index=3)
    assert broken.sample(3).power_w is None
    assert broken.sample(2).power_w == twin.sample(2).power_w


# -------------------------------------------------------------------------------- inventory, topology


def _topo(nvml):
    return nvml.topology()


SAME = None  # the call has a fallback: the broken machine reads exactly like its twin

INVENTORY_TABLE = [
    # (machine, failing call, check on (cards, topology) of the broken machine, or SAME)
    ("dgx-h100", "nvmlDeviceGetSerial", lambda c, t: {x.serial for x in c} == {None}),
    ("dgx-h100", "nvmlDeviceGetMinorNumber", lambda c, t: {x.minor_number for x in c} == {None}),
    ("dgx-h100", "nvmlDeviceGetArchitecture", lambda c, t: {x.architecture for x in c} == {None}),
    ("dgx-h100", "nvmlDeviceGetMigMode", lambda c, t: {x.mig_capable for x in c} == {False}),
    ("dgx-h100", "nvmlDeviceGetCpuAffinity", lambda c, t: c[0].cpu_affinity == () and c[0].numa_node == 0),
    ("dgx-h100", "nvmlDeviceGetMemoryAffinity", lambda c, t: t.numa == (None,) * 8 and c[0].cpu_affinity),
    ("dgx-h100", "nvmlDeviceGetFieldValues", SAME),  # links are counted by probing instead
    ("dgx-h100", "nvmlDeviceGetNvLinkState", lambda c, t: c[0].nvlink_active_links == 0 and t.nvlinks == ()),
    ("dgx-h100", "nvmlDeviceGetNvLinkRemoteDeviceType", lambda c, t: t.nvlinks == ()),
    (MESH, "nvmlDeviceGetNvLinkRemoteDeviceType", SAME),  # a GPU at the far end is told by its bus id
    ("dgx-h100", "nvmlDeviceGetNvLinkRemotePciInfo", SAME),  # switch links need no bus id
    (MESH, "nvmlDeviceGetNvLinkRemotePciInfo", lambda c, t: t.nvlinks == ()),
    ("dgx-h100", "nvmlDeviceGetNvLinkVersion", SAME),  # unknown versions are modelled at 25 GB/s, as NVLink 4
    ("dgx-h100", "nvmlDeviceGetMaxPcieLinkGeneration", lambda c, t: t.pcie_gbps == 25.0),
    ("dgx-h100", "nvmlDeviceGetMaxPcieLinkWidth", lambda c, t: t.pcie_gbps == 25.0),
    (
        "dgx-h100",
        "nvmlDeviceGetTopologyCommonAncestor",
        lambda c, t: (
            {t.levels[i][j] for i in range(8) for j in range(8) if i != j} == {SYSTEM} and t.links(0, 1) == 18
        ),
    ),
]


@pytest.mark.parametrize("code", CODES, ids=["not-supported", "unknown-error"])
@pytest.mark.parametrize(
    ("machine", "call", "check"), INVENTORY_TABLE, ids=lambda v: v if isinstance(v, str) else None
)
def test_inventory_and_topology_degrade_per_call(machine, call, check, code):
    broken, twin = pair(machine)
    broken._lib.fail(call, code)
    cards, topo = broken.cards(), broken.topology()
    if check is SAME:
        assert (cards, topo) == (twin.cards(), twin.topology())
    else:
        assert check(cards, topo) and not check(twin.cards(), twin.topology())
        assert [c.uuid for c in cards] == [c.uuid for c in twin.cards()]


def test_versions_degrade():
    broken, _ = pair("dgx-h100")
    broken._lib.fail("nvmlSystemGetDriverVersion", pynvml.NVML_ERROR_UNKNOWN)
    broken._lib.fail("nvmlSystemGetCudaDriverVersion_v2")
    assert (broken.driver_version(), broken.cuda_version()) == (None, None)


@pytest.mark.parametrize(
    "call",
    [
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetCount",
    ],
)
def test_identity_calls_fail_loudly_in_one_line(call):
    broken, _ = pair("dgx-h100")
    broken._lib.fail(call, pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlError) as err:
        broken.cards()
    assert str(err.value).startswith(call) and "\n" not in str(err.value)


# -------------------------------------------------------------------------------------------- MIG


def mig_pair():
    """Two H100 machines whose card 0 has MIG on and one 3g.40gb instance at slot 4."""
    out = []
    for _ in range(2):
        fake = FakeNvml("dgx-h100", clock=lambda: 2000.0)
        setup = Nvml(fake)
        setup.set_mig_mode(0, True)
        fake.reset(0)
        setup.create_mig_instance(0, 9, 4)
        out.append(Nvml(fake))  # a fresh adapter: nothing cached
    return out


MIG_TABLE = [
    # (failing call, check on (profiles, instances) of card 0)
    ("nvmlDeviceGetGpuInstanceProfileInfo", lambda p, i: p == [] and i == []),
    ("nvmlDeviceGetGpuInstancePossiblePlacements", lambda p, i: {x.placements for x in p} == {()}),
    ("nvmlDeviceGetGpuInstances", lambda p, i: len(p) == 7 and i == []),
    ("nvmlGpuInstanceGetInfo", lambda p, i: len(p) == 7 and i == []),
    ("nvmlDeviceGetMaxMigDeviceCount", lambda p, i: [(x.start, x.device_uuids) for x in i] == [(4, ())]),
    ("nvmlDeviceGetMigDeviceHandleByIndex", lambda p, i: [x.device_uuids for x in i] == [()]),
    ("nvmlDeviceGetGpuInstanceId", lambda p, i: [x.device_uuids for x in i] == [()]),
    ("nvmlDeviceGetComputeInstanceId", lambda p, i: [x.device_uuids for x in i] == [()]),
]


@pytest.mark.parametrize("code", CODES, ids=["not-supported", "unknown-error"])
@pytest.mark.parametrize(("call", "check"), MIG_TABLE, ids=lambda v: v if isinstance(v, str) else None)
def test_mig_reading_degrades_per_call(call, check, code):
    broken, twin = mig_pair()
    broken._lib.fail(call, code)
    assert check(broken.mig_profiles(0), broken.mig_instances(0))
    assert not check(twin.mig_profiles(0), twin.mig_instances(0))


# ------------------------------------------------------------------------------- events, processes


def test_event_registration_degrades_per_card():
    for call in ("nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents"):
        broken, _ = pair("dgx-h100")
        broken._lib.fail(call, pynvml.NVML_ERROR_NOT_SUPPORTED, index=2)
        w = broken.event_waiter()
        assert set(w.registered) == {0, 1, 3, 4, 5, 6, 7} and 2 in w.unregistered
        w.close()
    broken, _ = pair("dgx-h100")
    broken._lib.fail("nvmlEventSetCreate", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlError, match="nvmlEventSetCreate"):
        broken.event_waiter()


def test_processes_and_compute_mode_degrade():
    broken, _ = pair("dgx-h100")
    broken._lib.fail("nvmlDeviceGetComputeRunningProcesses")
    broken._lib.fail("nvmlDeviceGetComputeMode")
    assert broken.processes(0) == [] and broken.compute_mode(0) is None


# ------------------------------------------------------------------------------------- coverage

COVERED = (
    {c for _, calls, _ in SAMPLE_TABLE for c in calls}
    | {c for _, c, _ in INVENTORY_TABLE}
    | {c for c, _ in MIG_TABLE}
    | {
        "nvmlSystemGetDriverVersion",
        "nvmlSystemGetCudaDriverVersion_v2",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetCreate",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetComputeMode",
    }
)
# Calls that change state or start/stop NVML: failing them must raise (test_hw_mig, test_hw_nvml).
DRIVING = {
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceSetMigMode",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlDeviceGetGpuInstanceById",
    "nvmlGpuInstanceGetComputeInstances",
    "nvmlComputeInstanceDestroy",
    "nvmlGpuInstanceDestroy",
    "nvmlDeviceSetComputeMode",
    "nvmlEventSetWait",
    "nvmlEventSetFree",
}


def test_the_tables_cover_every_call_the_adapter_makes():
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    nvml.driver_version(), nvml.cuda_version(), nvml.cards(), nvml.topology(), nvml.sample(0)
    nvml.set_mig_mode(0, True)
    fake.reset(0)
    nvml.mig_instances(0)
    nvml.destroy_mig_instance(0, nvml.create_mig_instance(0, 9, 0).gpu_instance_id)
    nvml.processes(1), nvml.set_compute_mode(1, "DEFAULT"), nvml.compute_mode(1)
    w = nvml.event_waiter()
    w.wait(0)
    w.close()
    nvml.close()
    calls = set(fake.calls)
    for machine in (MESH, "workstation-2x"):
        other = FakeNvml(machine)
        Nvml(other).sample(0)
        calls |= set(other.calls)
    assert calls - COVERED - DRIVING == set()
