"""The adapter over the fake, machine by machine: inventory, topology, samples, degradation, cost."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pynvml
import pytest

from xpud.hw.fakenvml import FakeNvml
from xpud.hw.machines import load_machine
from xpud.hw.nvml import Nvml, NvmlError, NvmlGpuLost, NvmlNoPermission, NvmlUnavailable, norm_bus_id
from xpud.topology import HOSTBRIDGE, MULTIPLE, NODE, SINGLE, SYSTEM

DATA = Path(__file__).parent / "data"
GIB = 1 << 30


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def adapter(machine="dgx-h100", seed=0, clock=None, **kw) -> tuple[FakeNvml, Nvml]:
    fake = FakeNvml(machine, seed=seed, clock=clock or Clock(), **kw)
    return fake, Nvml(fake)


def values(sample) -> dict:
    d = dataclasses.asdict(sample)
    d.pop("timestamp")
    return d


# ---------------------------------------------------------------------------------------- inventory


def test_versions():
    _, nvml = adapter("dgx-a100")
    assert (nvml.driver_version(), nvml.cuda_version()) == ("535.183.06", "12.2")


def test_dgx_h100_inventory():
    _, nvml = adapter("dgx-h100")
    cards = nvml.cards()
    assert len(cards) == 8
    c0, c5 = cards[0], cards[5]
    assert (c0.index, c0.name, c0.memory_total_bytes) == (0, "NVIDIA H100 80GB HBM3", 81559 * (1 << 20))
    assert c0.pci_bus_id == "00000000:1B:00.0" and c5.pci_bus_id == "00000000:C3:00.0"
    assert c0.uuid == load_machine("dgx-h100").cards[0].uuid
    assert (c0.numa_node, c5.numa_node) == (0, 1)
    assert c0.cpu_affinity == (*range(0, 56), *range(112, 168))
    assert c5.cpu_affinity == (*range(56, 112), *range(168, 224))
    assert (c0.mig_capable, c0.mig_enabled, c0.nvlink_active_links) == (True, False, 18)
    assert c0.architecture == "hopper" and c0.serial and c0.serial.isdigit()


def test_minor_numbers_are_the_drivers_not_the_index():
    # REFERENCE.md "Real-driver behaviour": /dev/nvidia<minor> need not follow the NVML index. dgx-a100 ships
    # an order other than NVML's, so anything that takes the index for the minor shows up there.
    _, nvml = adapter("dgx-a100")
    assert [c.minor_number for c in nvml.cards()] == [2, 3, 0, 1, 6, 7, 4, 5]
    _, nvml = adapter("dgx-h100")
    assert [c.minor_number for c in nvml.cards()] == list(range(8))


def test_a_mig_device_has_no_minor_of_its_own():
    fake, _ = adapter("dgx-a100")
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetMinorNumber(h) == 2
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetMinorNumber(object())


@pytest.mark.parametrize(
    ("machine", "name", "gib", "mig", "links", "numa"),
    [
        ("dgx-a100", "NVIDIA A100-SXM4-80GB", 80, True, 12, [0, 0, 0, 0, 1, 1, 1, 1]),
        ("hgx-h200", "NVIDIA H200", 140, True, 18, [0, 0, 0, 0, 1, 1, 1, 1]),
        ("pcie-8x-l40s", "NVIDIA L40S", 44, False, 0, [0, 0, 0, 0, 1, 1, 1, 1]),
        ("workstation-2x", "NVIDIA RTX 6000 Ada Generation", 47, False, 0, [0, 0]),
    ],
)
def test_inventory_of_each_machine(machine, name, gib, mig, links, numa):
    _, nvml = adapter(machine)
    cards = nvml.cards()
    assert {c.name for c in cards} == {name}
    assert {c.memory_total_bytes // GIB for c in cards} == {gib}
    assert {c.mig_capable for c in cards} == {mig}
    assert {c.nvlink_active_links for c in cards} == {links}
    assert [c.numa_node for c in cards] == numa
    assert len({c.uuid for c in cards}) == len(cards)


def test_bus_ids_are_normalised():
    assert norm_bus_id("0000:1b:00.0") == "00000000:1B:00.0"
    assert norm_bus_id("00000000:1B:00.0") == "00000000:1B:00.0"


# ----------------------------------------------------------------------------------------- topology


def labels(topo) -> list[list[str]]:
    return [[topo.label(i, j) for j in range(topo.size)] for i in range(topo.size)]


@pytest.mark.parametrize(
    ("machine", "nv", "gbps"),
    [("dgx-h100", "NV18", 50.4), ("hgx-h200", "NV18", 50.4), ("dgx-a100", "NV12", 25.2)],
)
def test_nvswitch_machines_connect_every_pair(machine, nv, gbps):
    _, nvml = adapter(machine)
    topo = nvml.topology()
    assert all(labels(topo)[i][j] == (nv if i != j else "X") for i in range(8) for j in range(8))
    assert topo.numa == (0, 0, 0, 0, 1, 1, 1, 1)
    assert topo.levels[0][1] == (MULTIPLE if machine == "dgx-a100" else NODE)
    assert topo.levels[0][4] == SYSTEM
    assert topo.nvlink_gbps_per_link == 25.0 and topo.pcie_gbps == gbps
    assert topo.bandwidth_gbps(0, 7) == int(nv[2:]) * 25.0


def test_pcie_box_levels_without_nvlink():
    _, nvml = adapter("pcie-8x-l40s")
    topo = nvml.topology()
    assert topo.nvlinks == ()
    assert labels(topo)[0] == ["X", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    assert labels(topo)[6] == ["SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "X", "PIX"]
    assert topo.levels[2][3] == SINGLE


def test_workstation_shares_a_host_bridge():
    _, nvml = adapter("workstation-2x")
    topo = nvml.topology()
    assert topo.levels[0][1] == HOSTBRIDGE and labels(topo) == [["X", "PHB"], ["PHB", "X"]]


def test_direct_nvlinks_are_counted_per_pair():
    _, nvml = adapter(load_machine(DATA / "nvlink-mesh.toml"))
    topo = nvml.topology()
    assert labels(topo)[0] == ["X", "NV2", "NV2", "NV2"]
    assert topo.levels[0][1] == SINGLE and topo.levels[0][2] == NODE
    links = nvml.nvlinks(0)
    assert [(lk.remote, lk.remote_index) for lk in links[:2]] == [("gpu", 1), ("gpu", 1)]
    assert links[0].remote_bus_id == "00000000:16:00.0"


# ------------------------------------------------------------------------------------------ samples


def test_idle_h100_sample():
    _, nvml = adapter("dgx-h100")
    s = nvml.sample(0)
    assert not s.lost
    assert 0 <= s.utilization_gpu_pct <= 2
    assert s.memory_used_bytes == 512 * (1 << 20) and s.memory_total_bytes == 81559 * (1 << 20)
    assert 28 <= s.temperature_c <= 35 and (s.temperature_slowdown_c, s.temperature_shutdown_c) == (87, 92)
    assert 50 <= s.power_w <= 100 and s.power_limit_w == 700.0
    assert s.fan_pct is None  # SXM boards have no fan of their own: NotSupported -> None
    assert (s.ecc_sbe_volatile, s.ecc_dbe_volatile, s.ecc_sbe_aggregate, s.ecc_dbe_aggregate) == (0, 0, 0, 0)
    assert (s.retired_pages_sbe, s.retired_pages_dbe, s.retired_pages_pending) == (None, None, None)
    assert (s.remapped_rows_corrected, s.remapped_rows_uncorrected) == (0, 0)
    assert (s.remapped_rows_pending, s.remapped_rows_failure) == (False, False)
    assert s.clock_event_reasons == pynvml.nvmlClocksEventReasonGpuIdle
    assert (s.pcie_replay_counter, s.inforom_valid, s.performance_state) == (0, True, 8)
    assert (s.nvlink_replay_errors, s.nvlink_recovery_errors, s.nvlink_links_down) == (0, 0, 0)
    assert (s.nvlink_crc_flit_errors, s.nvlink_crc_data_errors) == (0, 0)


@pytest.mark.parametrize("machine", ["dgx-h100", "dgx-a100", "hgx-h200", "pcie-8x-l40s", "workstation-2x"])
def test_every_card_of_every_machine_samples_cleanly(machine):
    fake, nvml = adapter(machine)
    fake.add_process(0, 10, 4 * GIB)
    for info in nvml.cards():
        s = nvml.sample(info.index)
        assert not s.lost and s.memory_total_bytes == info.memory_total_bytes
        assert 20 <= s.temperature_c < s.temperature_slowdown_c < s.temperature_shutdown_c
        assert 0 < s.power_w <= s.power_limit_w
        assert 0 <= s.utilization_gpu_pct <= 100 and s.performance_state in (0, 8)
        assert (s.ecc_dbe_volatile, s.remapped_rows_uncorrected, s.inforom_valid) == (0, 0, True)
        assert (s.nvlink_links_down == 0) if info.nvlink_active_links else (s.nvlink_links_down is None)
    assert not nvml.errors


def test_pcie_cards_have_no_nvlink_signals_and_the_workstation_a_fan():
    _, nvml = adapter("pcie-8x-l40s")
    s = nvml.sample(3)
    assert (s.nvlink_links_down, s.nvlink_replay_errors) == (None, None)
    _, ws = adapter("workstation-2x")
    assert 30 <= ws.sample(1).fan_pct <= 31


def test_page_retirement_cards_report_pages_not_rows():
    _, nvml = adapter(load_machine(DATA / "nvlink-mesh.toml"))
    s = nvml.sample(0)
    assert (s.retired_pages_sbe, s.retired_pages_dbe, s.retired_pages_pending) == (0, 0, False)
    assert s.remapped_rows_corrected is None


def test_values_track_processes():
    clock = Clock()
    fake, nvml = adapter("dgx-h100", clock=clock)
    fake.add_process(2, pid=4242, used_bytes=10 * GIB)
    busy, idle = nvml.sample(2), nvml.sample(3)
    assert busy.utilization_gpu_pct >= 40 and idle.utilization_gpu_pct <= 2
    assert busy.memory_used_bytes == 10 * GIB + 512 * (1 << 20)
    assert busy.power_w > idle.power_w + 150
    assert busy.temperature_c > idle.temperature_c + 10
    assert busy.performance_state == 0 and busy.clock_event_reasons & pynvml.nvmlClocksEventReasonGpuIdle == 0
    assert nvml.processes(2) == [(4242, 10 * GIB)] and nvml.processes(3) == []
    fake.remove_process(2, 4242)
    assert nvml.sample(2).utilization_gpu_pct <= 2


def test_values_vary_over_time_but_are_deterministic_per_seed_and_clock():
    c1, c2 = Clock(), Clock()
    f1, n1 = adapter("dgx-h100", seed=7, clock=c1)
    f2, n2 = adapter("dgx-h100", seed=7, clock=c2)
    for f in (f1, f2):
        f.add_process(0, 1, GIB)
    series1, series2 = [], []
    for t in range(0, 120, 3):
        c1.t = c2.t = 1000.0 + t
        series1.append(values(n1.sample(0)))
        series2.append(values(n2.sample(0)))
    assert series1 == series2
    assert len({s["utilization_gpu_pct"] for s in series1}) > 5  # it moves
    assert len({s["power_w"] for s in series1}) > 5
    f3, n3 = adapter("dgx-h100", seed=8, clock=c1)
    f3.add_process(0, 1, GIB)
    assert values(n3.sample(0)) != series1[-1]


def test_sampling_eight_cards_is_cheap():
    fake, nvml = adapter("dgx-h100")
    nvml.cards()
    for i in range(8):
        nvml.sample(i)  # thresholds are read once
    fake.calls.clear()
    start = time.perf_counter()
    for i in range(8):
        nvml.sample(i)
    elapsed = time.perf_counter() - start
    per_card = sum(fake.calls.values()) / 8
    # One field-values call covers the 18 links' states and error totals: no per-link loop.
    assert per_card <= 24, fake.calls
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 0 and fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 0
    assert elapsed < 0.05  # adapter + fake; 2 % of a core at 1 Hz would be 20 ms


# ----------------------------------------------------------------------------- degradation, errors


def test_lost_card_gives_a_lost_sample_not_an_exception():
    fake, nvml = adapter("dgx-h100")
    before = nvml.cards()
    fake.lose(4)
    s = nvml.sample(4)
    assert s.lost and s.temperature_c is None
    assert nvml.cards()[4] == before[4]  # inventory read before the loss is kept
    assert not nvml.sample(3).lost
    topo = nvml.topology()
    assert topo.levels[4][0] == SYSTEM and topo.links(4, 0) == 0 and topo.links(0, 1) == 18
    with pytest.raises(NvmlGpuLost, match="card 4"):
        nvml.processes(4)


def test_card_lost_before_it_was_ever_read():
    fake, nvml = adapter("dgx-h100")
    fake.lose(1)
    assert nvml.card_info(1).name == "(lost)"
    assert nvml.sample(1).lost


def test_missing_function_in_an_old_binding_falls_back_or_reads_none():
    fake, nvml = adapter("dgx-h100")
    fake.hide("nvmlDeviceGetCurrentClocksEventReasons")  # older bindings only have ...ThrottleReasons
    assert nvml.sample(0).clock_event_reasons == pynvml.nvmlClocksEventReasonGpuIdle
    fake.hide("nvmlDeviceGetPcieReplayCounter")
    assert nvml.sample(0).pcie_replay_counter is None
    assert not nvml.errors


def test_unexpected_errors_are_recorded_once_per_call_and_read_as_none():
    fake, nvml = adapter("dgx-h100")
    fake.fail("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_UNKNOWN, index=2)
    assert nvml.sample(2).temperature_c is None and nvml.sample(1).temperature_c is not None
    assert list(nvml.errors) == ["nvmlDeviceGetTemperature on card 2: unknown (NVML_ERROR_UNKNOWN)"]


def test_identity_calls_are_required():
    fake, nvml = adapter("dgx-h100")
    fake.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlError, match=r"^nvmlDeviceGetUUID on card 0: unknown \(NVML_ERROR_UNKNOWN\)$"):
        nvml.cards()


class _NoLibrary:
    def nvmlInit(self):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


class _NoDriver:
    def nvmlInit(self):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


def test_missing_library_or_driver_says_what_to_do():
    with pytest.raises(NvmlUnavailable) as err:
        Nvml(_NoLibrary()).open()
    assert str(err.value) == (
        "NVML not found (libnvidia-ml.so.1): install the NVIDIA driver, or run `xpud --simulate dgx-h100`"
    )
    with pytest.raises(NvmlUnavailable, match=r"driver not loaded.*modprobe nvidia.*--simulate"):
        Nvml(_NoDriver()).cards()


def test_real_pynvml_without_a_gpu_is_unavailable_not_a_crash():
    nvml = Nvml()
    try:
        nvml.open()
    except NvmlUnavailable as e:
        assert "--simulate" in str(e)
    else:  # a host with a GPU
        nvml.close()
        pytest.skip("NVML is available here")


def test_a_failed_open_leaves_nvml_closed():
    fake, nvml = adapter("dgx-h100")
    fake.fail("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlError, match="nvmlDeviceGetCount"):
        nvml.open()
    fake.unfail()
    assert nvml.card_count() == 8
    assert fake.calls["nvmlInit"] - fake.calls["nvmlShutdown"] == 1


def test_calls_need_init_and_the_adapter_opens_lazily():
    fake, nvml = adapter("dgx-h100")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    assert nvml.card_count() == 8
    nvml.close()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


# ------------------------------------------------------------------------------------- compute mode


def test_compute_mode_by_name_or_value():
    _, nvml = adapter("pcie-8x-l40s")
    assert nvml.compute_mode(0) == "DEFAULT"
    nvml.set_compute_mode(0, "EXCLUSIVE_PROCESS")
    assert nvml.compute_mode(0) == "EXCLUSIVE_PROCESS" and nvml.compute_mode(1) == "DEFAULT"
    nvml.set_compute_mode(0, pynvml.NVML_COMPUTEMODE_DEFAULT)
    assert nvml.compute_mode(0) == "DEFAULT"


def test_compute_mode_needs_root():
    _, nvml = adapter("pcie-8x-l40s", root=False)
    with pytest.raises(NvmlNoPermission, match="run as root"):
        nvml.set_compute_mode(0, "EXCLUSIVE_PROCESS")
