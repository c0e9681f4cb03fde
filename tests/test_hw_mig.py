"""MIG through the adapter and through the fake's pynvml surface: ids, placements, overlap, in use, holes."""

from __future__ import annotations

import ctypes
import re

import pynvml
import pytest

from xpud.hw.fakenvml import FakeNvml
from xpud.hw.machines import machines_dir
from xpud.hw.nvml import (
    Nvml,
    NvmlError,
    NvmlInsufficientResources,
    NvmlInUse,
    NvmlNoPermission,
    NvmlNotFound,
    NvmlNotSupported,
)

MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
GIB = 1 << 30


def mig_card(machine="dgx-h100", index=0, **kw) -> tuple[FakeNvml, Nvml]:
    """A machine whose card ``index`` has MIG switched on (nothing holds it: the driver resets it itself)."""
    fake = FakeNvml(machine, clock=lambda: 1000.0, **kw)
    nvml = Nvml(fake)
    assert nvml.set_mig_mode(index, True) == "done"
    assert nvml.mig_mode(index) == (1, 1)
    return fake, nvml


def test_h100_profiles_record_enum_and_driver_id():
    _, nvml = mig_card()
    by_name = {p.name: p for p in nvml.mig_profiles(0)}
    assert set(by_name) == {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}
    half = by_name["3g.40gb"]
    assert (half.profile, half.id) == (pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9)  # the id is not the enum
    assert (half.slice_count, half.memory_slices, half.max_instances) == (3, 4, 2)
    assert half.placements == ((0, 4), (4, 4))
    assert by_name["2g.20gb"].placements == ((0, 2), (2, 2), (4, 2))
    assert by_name["1g.10gb"].placements == tuple((s, 1) for s in range(7))
    assert by_name["7g.80gb"].memory_bytes == 81152 * (1 << 20)
    assert sum(p.profile != p.id for p in by_name.values()) >= 5


def test_h200_and_a100_geometry():
    _, nvml = mig_card("hgx-h200", index=3)
    names = {p.name: p.id for p in nvml.mig_profiles(3)}
    assert names == {
        "1g.18gb": 19,
        "1g.18gb+me": 20,
        "1g.35gb": 15,
        "2g.35gb": 14,
        "3g.71gb": 9,
        "4g.71gb": 5,
        "7g.141gb": 0,
    }
    a100 = {p.name for p in mig_card("dgx-a100")[1].mig_profiles(0)}
    assert {"1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"} <= a100


def test_cards_without_mig():
    nvml = Nvml(FakeNvml("pcie-8x-l40s"))
    assert nvml.mig_mode(0) is None and nvml.mig_profiles(0) == [] and nvml.mig_instances(0) == []
    with pytest.raises(NvmlNotSupported):
        nvml.create_mig_instance(0, 9, 0)


def test_create_needs_mig_mode_on():
    nvml = Nvml(FakeNvml("dgx-h100"))
    with pytest.raises(NvmlNotSupported, match="card 0: MIG is off"):
        nvml.create_mig_instance(0, 9, 0)


def test_one_half_and_two_quarters_fill_the_card():
    fake, nvml = mig_card()
    half = nvml.create_mig_instance(0, 9, 4)  # 3g.40gb at slot 4
    q1 = nvml.create_mig_instance(0, 14, 0)  # 2g.20gb at 0
    q2 = nvml.create_mig_instance(0, 14, 2)  # 2g.20gb at 2
    assert (half.name, half.start, half.size, half.profile_id) == ("3g.40gb", 4, 4, 9)
    assert [(m["name"], m["start"]) for m in fake.mig_layout(0)] == [
        ("2g.20gb", 0),
        ("2g.20gb", 2),
        ("3g.40gb", 4),
    ]
    listed = nvml.mig_instances(0)
    assert [m.gpu_instance_id for m in listed] == [
        q1.gpu_instance_id,
        q2.gpu_instance_id,
        half.gpu_instance_id,
    ]
    for m in listed:
        assert m.compute_instance_ids == (0,) and MIG_UUID.match(m.uuid)
    assert len({m.uuid for m in listed}) == 3
    for profile, start in ((19, 0), (9, 0), (15, 6)):  # every slot is taken now
        with pytest.raises(NvmlInsufficientResources, match="NVML_ERROR_INSUFFICIENT_RESOURCES"):
            nvml.create_mig_instance(0, profile, start)


def test_overlap_and_instance_limits():
    fake, nvml = mig_card()
    nvml.create_mig_instance(0, 9, 0)
    with pytest.raises(NvmlInsufficientResources):
        nvml.create_mig_instance(0, 14, 2)  # 2g at 2 overlaps the 3g at 0..3
    nvml.create_mig_instance(0, 20, 4)  # 1g.10gb+me: one per card
    with pytest.raises(NvmlInsufficientResources):
        nvml.create_mig_instance(0, 20, 5)
    assert len(fake.mig_layout(0)) == 2


def test_a_placement_the_profile_does_not_have_is_refused_before_nvml():
    _, nvml = mig_card()
    with pytest.raises(NvmlError, match=r"3g.40gb cannot start at slot 2 \(possible: 0, 4\)"):
        nvml.create_mig_instance(0, 9, 2)
    with pytest.raises(NvmlNotSupported, match="no MIG profile id 2"):
        nvml.create_mig_instance(0, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 0)  # the enum, not the id


def test_destroy_in_use_then_free():
    fake, nvml = mig_card()
    half = nvml.create_mig_instance(0, 9, 0)
    fake.add_process(0, 777, 2 * GIB, gpu_instance_id=half.gpu_instance_id)
    assert nvml.processes(0) == [(777, 2 * GIB)]
    with pytest.raises(NvmlInUse, match="NVML_ERROR_IN_USE"):
        nvml.destroy_mig_instance(0, half.gpu_instance_id)
    assert len(fake.mig_layout(0)) == 1
    fake.remove_process(0, 777)
    nvml.destroy_mig_instance(0, half.gpu_instance_id)
    assert fake.mig_layout(0) == [] and nvml.mig_instances(0) == []
    with pytest.raises(NvmlNotFound):
        nvml.destroy_mig_instance(0, half.gpu_instance_id)


def test_gpu_instance_with_compute_instances_is_in_use_at_the_nvml_level():
    fake, nvml = mig_card()
    half = nvml.create_mig_instance(0, 9, 0)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    gi = fake.nvmlDeviceGetGpuInstanceById(h, half.gpu_instance_id)
    with pytest.raises(pynvml.NVMLError_InUse):
        fake.nvmlGpuInstanceDestroy(gi)  # compute instances first


def test_holes_in_mig_device_indices():
    fake, nvml = mig_card()
    a = nvml.create_mig_instance(0, 14, 0)
    b = nvml.create_mig_instance(0, 14, 2)
    c = nvml.create_mig_instance(0, 14, 4)
    nvml.destroy_mig_instance(0, b.gpu_instance_id)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)) == a.uuid
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    assert fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)) == c.uuid
    assert [m.uuid for m in nvml.mig_instances(0)] == [a.uuid, c.uuid]  # the hole is skipped, not the end
    d = nvml.create_mig_instance(0, 14, 2)
    assert d.uuid not in (a.uuid, b.uuid, c.uuid)  # a new instance, a new UUID


def test_profile_info_through_the_pynvml_surface():
    fake, _ = mig_card()
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    info = fake.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    assert (info.id, info.sliceCount, info.instanceCount, info.memorySizeMB) == (9, 3, 2, 40448)
    assert info.name == "MIG 3g.40gb"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE)
    count = ctypes.c_uint(0)
    fake.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, None, ctypes.byref(count))
    assert count.value == 2
    small = (pynvml.c_nvmlGpuInstancePlacement_t * 1)()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, small, ctypes.byref(count))


def test_a_mig_mode_change_on_a_held_card_stays_pending_until_cancelled():
    # nvml.h: the driver sets the pending mode, then fails to activate it (IN_USE) while the card is held;
    # the pending mode stays, so any later reset would apply it, unless the current mode is asked again.
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    for hold, let_go in (
        (lambda: fake.add_process(1, 5, GIB), lambda: fake.remove_process(1, 5)),
        (lambda: fake.add_client(1, "dcgm"), lambda: fake.remove_client(1, "dcgm")),
    ):
        hold()
        assert nvml.set_mig_mode(1, True) == "in-use" and nvml.mig_mode(1) == (0, 1)
        with pytest.raises(pynvml.NVMLError_InUse):
            fake.reset(1)  # nvidia-smi -r is refused for the same reason
        assert nvml.cancel_pending_mig_mode(1) and nvml.mig_mode(1) == (0, 0)
        assert not nvml.cancel_pending_mig_mode(1)
        let_go()
    assert nvml.set_mig_mode(1, True) == "done" and nvml.card_info(1).mig_enabled


def test_our_own_event_registration_holds_the_card_until_released():
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    w = nvml.event_waiter()
    assert nvml.set_mig_mode(2, True) == "in-use"
    nvml.cancel_pending_mig_mode(2)
    with nvml.card_released(2):
        assert 2 not in w.registered and 3 in w.registered
        assert nvml.set_mig_mode(2, True) == "done"
    assert 2 in w.registered and nvml.mig_mode(2) == (1, 1)
    fake.inject_xid(2, 31)
    assert [(e.card_index, e.xid) for e in w.wait(1000)] == [(2, 31)]
    w.close()


def test_instances_must_go_before_mig_goes_off():
    _, nvml = mig_card()
    nvml.create_mig_instance(0, 9, 0)
    with pytest.raises(NvmlInUse):
        nvml.set_mig_mode(0, False)


def test_in_a_vm_the_mode_waits_for_a_reset():
    fake = FakeNvml("dgx-h100", passthrough=True)
    nvml = Nvml(fake)
    assert nvml.set_mig_mode(0, True) == "reset" and nvml.mig_mode(0) == (0, 1)
    fake.reset(0)
    assert nvml.mig_mode(0) == (1, 1)


def test_profiles_are_not_listed_while_mig_is_off():
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # as the driver: profile calls need MIG on
        fake.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, None, ctypes.byref(ctypes.c_uint(0)))
    assert nvml.mig_profiles(0) == [] and not nvml.errors
    nvml.set_mig_mode(0, True)
    assert len(nvml.mig_profiles(0)) == 7  # read afresh once MIG is on


def test_an_older_driver_knows_fewer_profiles_and_enumeration_skips_them_quietly(caplog):
    # dgx-a100 runs driver 535: it answers INVALID_ARGUMENT for the binding's later profile enums.
    fake, nvml = mig_card("dgx-a100")
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX)
    names = {p.name for p in nvml.mig_profiles(0)}
    assert {"1g.10gb", "3g.40gb", "7g.80gb"} <= names
    half = nvml.create_mig_instance(0, 9, 0)  # the compute-instance enumeration stops quietly too
    nvml.destroy_mig_instance(0, half.gpu_instance_id)
    assert not nvml.errors and "INVALID_ARGUMENT" not in caplog.text
    calls = fake.calls["nvmlDeviceGetGpuInstanceProfileInfo"]
    # ours above, then every enum the binding knows: an unknown one is skipped, bounded by the COUNT
    assert calls == 1 + pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT


def test_an_invalid_argument_for_one_profile_skips_that_profile_and_enumeration_goes_on(caplog):
    """NVIDIA's go-nvlib (pkg/nvlib/device/mig_profile.go, GetMigProfiles) and mig-parted enumerate the
    GPU-instance profile enums up to the binding's COUNT and ``continue`` on ERROR_NOT_SUPPORTED and
    ERROR_INVALID_ARGUMENT: one profile the driver refuses does not hide the ones after it."""
    fake, nvml = mig_card("dgx-h100")
    fake.invalid_profiles = {pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1}  # the 1g.10gb+me enum (7)
    names = {p.name for p in nvml.mig_profiles(0)}
    # 1g.20gb is enum 9 (1_SLICE_REV2), after the refused one
    assert names == {"1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}
    assert not nvml.errors and "INVALID_ARGUMENT" not in caplog.text
    assert fake.calls["nvmlDeviceGetGpuInstanceProfileInfo"] == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT


def test_mig_on_hides_utilisation_and_remapped_rows():
    _, nvml = mig_card()
    on, off = nvml.sample(0), nvml.sample(1)
    assert on.utilization_gpu_pct is None and on.remapped_rows_corrected is None
    assert off.utilization_gpu_pct is not None and off.remapped_rows_corrected == 0
    assert on.temperature_c is not None and not nvml.errors


def test_mig_device_handles_answer_for_their_instance():
    fake, nvml = mig_card()
    half = nvml.create_mig_instance(0, 9, 4)
    fake.add_process(0, 99, 3 * GIB, gpu_instance_id=half.gpu_instance_id)
    fake.nvmlInit()
    mh = fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(0), 0)
    assert fake.nvmlDeviceGetMemoryInfo(mh).total == 40448 * (1 << 20)
    assert [p.pid for p in fake.nvmlDeviceGetComputeRunningProcesses(mh)] == [99]
    assert fake.nvmlDeviceGetName(mh) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetUtilizationRates(mh)


def test_driving_mig_needs_root():
    fake = FakeNvml("dgx-a100", root=False)
    fake.card_state(0).mig = fake.card_state(0).mig_pending = 1
    with pytest.raises(NvmlNoPermission, match="run as root"):
        Nvml(fake).create_mig_instance(0, 9, 0)


def test_a_machine_can_start_with_mig_on(tmp_path):
    text = (machines_dir() / "dgx-h100.toml").read_text()
    path = tmp_path / "mig-on.toml"
    path.write_text(
        text.replace("nvlink_switch_links = 18\n", "nvlink_switch_links = 18\nmig_enabled = true\n", 1)
    )
    nvml = Nvml(FakeNvml(str(path)))
    assert [c.mig_enabled for c in nvml.cards()] == [True] + [False] * 7
