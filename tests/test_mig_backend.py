"""The MIG backend over the fake NVML and the simulated tools: modes, instances, reuse, cleanup, start-up."""

from __future__ import annotations

import threading

import pytest

from xpud.config.schema import DEFAULT_SLICES
from xpud.errors import ConfigError, Conflict, NoCapacity
from xpud.hw import mig_map
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml, NvmlError
from xpud.isolation.base import Held
from xpud.isolation.faketools import FakeNvidiaTools
from xpud.isolation.mig import MigIsolation
from xpud.model import CardMode, Slice, SliceSpec

HALF, QUARTER = DEFAULT_SLICES["vxpu-half"], DEFAULT_SLICES["vxpu-quarter"]


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def backend(machine="dgx-h100", index=0, keep=0.0, switch="idle", slices=None, table=None):
    fake = FakeNvml(machine)
    nvml = Nvml(fake)
    nvml.open()
    tools = FakeNvidiaTools(fake)
    clock = Clock()
    card = nvml.card_info(index)
    b = MigIsolation(
        card,
        nvml,
        tools,
        mig_map.load() if table is None else table,
        slices or DEFAULT_SLICES,
        switch=switch,
        idle_keep_s=keep,
        clock=clock,
    )
    return b, card, fake, nvml, tools, clock


def layout(fake, index=0):
    return [(g["name"], g["start"]) for g in fake.mig_layout(index)]


def backend_on(fake, nvml, tools, index=0, switch="idle"):
    return MigIsolation(
        nvml.card_info(index), nvml, tools, mig_map.load(), DEFAULT_SLICES, switch=switch, clock=Clock()
    )


def test_entering_sliced_mode_switches_mig_on_where_the_driver_resets_the_card_itself():
    b, card, _fake, nvml, tools, _ = backend()
    assert nvml.mig_mode(0) == (0, 0)
    assert b.fits(card, [], HALF)  # an idle card may be switched
    b.enter_sliced(card)
    assert nvml.mig_mode(0) == (1, 1)
    assert [argv for argv, _, _ in tools.calls if argv[0] == "nvidia-smi"] == []
    b.leave_sliced(card)
    assert nvml.mig_mode(0) == (0, 0)


def test_a_mig_switch_reads_the_cards_minor_again_where_the_driver_renumbered_it():
    b, card, fake, _nvml, _tools, _ = backend()
    assert card.minor_number == 0
    fake.renumber_on_reset(0, 5)
    fresh = b.enter_sliced(card)
    assert fresh is not None and fresh.minor_number == 5
    assert b.enter_sliced(card) is None  # already on: nothing changed, nothing to read
    assert b.leave_sliced(card).minor_number == 5


def test_in_a_vm_the_switch_resets_the_card_through_the_runner():
    fake = FakeNvml("dgx-h100", passthrough=True)
    nvml = Nvml(fake)
    tools = FakeNvidiaTools(fake)
    b = backend_on(fake, nvml, tools)
    b.enter_sliced(b.card)
    assert nvml.mig_mode(0) == (1, 1)
    resets = [argv for argv, _, _ in tools.calls if argv[0] == "nvidia-smi"]
    assert resets == [("nvidia-smi", "--gpu-reset", "-i", b.card.pci_bus_id)]


def test_a_switch_on_a_card_another_client_holds_fails_clearly_and_leaves_nothing_pending():
    # Regression (issue 11, item 1): the driver left MIG pending (IN_USE) and xpud reset the card, which
    # nvidia-smi refused; the pending mode stayed, for any later reset to flip the card silently.
    b, card, fake, nvml, _, clock = backend()
    fake.add_client(0, "dcgm")
    with pytest.raises(Conflict, match=r"another NVML client holds the card.*DCGM.*MIG stays off"):
        b.enter_sliced(card)
    assert nvml.mig_mode(0) == (0, 0)  # nothing pending
    assert "another NVML client" in b.switch_blocker(card, True) and not b.fits(card, [], HALF)
    fake.remove_client(0, "dcgm")
    clock.t += 61  # tried again after SWITCH_RETRY_S
    assert b.fits(card, [], HALF)
    b.enter_sliced(card)
    assert nvml.mig_mode(0) == (1, 1)
    fake.add_client(0, "dcgm")
    with pytest.raises(Conflict, match=r"did not switch MIG off.*MIG stays on"):
        b.leave_sliced(card)
    assert nvml.mig_mode(0) == (1, 1)


def test_in_a_vm_a_refused_reset_cancels_the_pending_mode():
    fake = FakeNvml("dgx-h100", passthrough=True)
    nvml = Nvml(fake)
    b = backend_on(fake, nvml, FakeNvidiaTools(fake))
    fake.add_client(0, "monitoring-agent")
    with pytest.raises(Conflict, match="nvidia-smi --gpu-reset refused"):
        b.enter_sliced(b.card)
    assert nvml.mig_mode(0) == (0, 0)
    fake.remove_client(0, "monitoring-agent")
    fake.reset(0)  # an operator's later reset does not flip the card
    assert nvml.mig_mode(0) == (0, 0)


def test_the_switch_lets_go_of_our_event_registration_and_takes_it_back():
    # Regression (issue 11, item 1): xpud's own event set held the card, so the driver refused the switch.
    b, card, fake, nvml, _, _ = backend()
    w = nvml.event_waiter()
    got: list = []
    t = threading.Thread(target=lambda: [got.extend(w.wait(200)) for _ in range(15)])
    t.start()  # a thread waits on the set meanwhile, as the daemon's event thread does
    try:
        b.enter_sliced(card)
        assert nvml.mig_mode(0) == (1, 1) and 0 in w.registered
        fake.inject_xid(0, 31)
        t.join(5)
    finally:
        w.close()
    assert [(e.card_index, e.xid) for e in got] == [(0, 31)]


def test_half_and_two_quarters_get_their_instances_and_devices():
    b, card, fake, _, _, _ = backend()
    got = []
    for lid, spec in (("q1", QUARTER), ("h", HALF), ("q2", QUARTER)):
        s, env = b.prepare(card, [x for x, _ in got], spec, lid, 1000)
        got.append((s, env))
    assert sorted(layout(fake)) == [("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)]
    uuids = {u for g in fake.mig_layout(0) for u in g["uuids"]}
    for s, env in got:
        assert env["CUDA_VISIBLE_DEVICES"] == s.handle and s.handle in uuids
        assert s.handle.startswith("MIG-") and env["XPU_MEMORY_LIMIT_BYTES"] == str(s.memory_bytes)
    half = got[1][0]
    assert half.placement == 4 and half.memory_bytes == 40448 << 20 and half.compute_pct == 43
    assert got[1][1]["XPU_MIG_PROFILE"] == "3g.40gb"
    # Full for halves now; a quarter still fits nowhere with 2g (three at most, compute 7).
    assert not b.fits(card, [s for s, _ in got], HALF)
    with pytest.raises(NoCapacity, match="no room for vxpu-half"):
        b.prepare(card, [s for s, _ in got], HALF, "x", 1000)
    for s, _ in got:
        b.teardown(card, s)
    assert layout(fake) == []  # keep = 0: destroyed at release


def test_idle_instances_are_reused_then_expire():
    b, card, fake, _, _, clock = backend(keep=30.0)
    s1, _ = b.prepare(card, [], QUARTER, "a", 1000)
    b.teardown(card, s1)
    assert layout(fake) == [("2g.20gb", 0)]  # kept, idle
    assert b.instances() == {1: (None, "idle")}
    s2, _ = b.prepare(card, [], QUARTER, "b", 1000)
    assert s2.handle == s1.handle  # reused: same MIG device
    b.teardown(card, s2)
    clock.t += 29
    assert b.tidy() == [] and layout(fake) == [("2g.20gb", 0)]
    clock.t += 1
    assert len(b.tidy()) == 1 and layout(fake) == []


def test_idle_instance_in_the_way_of_a_half_is_destroyed():
    b, card, fake, _, _, _ = backend(keep=600.0)
    quarters = [b.prepare(card, [], QUARTER, f"q{n}", 1000)[0] for n in range(3)]
    assert sorted(layout(fake)) == [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4)]
    b.teardown(card, quarters[1])  # idle at 2
    b.teardown(card, quarters[2])  # idle at 4
    s, _ = b.prepare(card, [quarters[0]], HALF, "h", 1000)
    assert s.placement == 4 and sorted(layout(fake)) == [("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)]


def test_an_instance_with_processes_left_is_not_reused_and_goes_when_they_exit():
    b, card, fake, _, _, clock = backend(keep=600.0)
    s, _ = b.prepare(card, [], HALF, "a", 1000)
    gi = fake.mig_layout(0)[0]["gpu_instance_id"]
    fake.add_process(0, 4242, gpu_instance_id=gi)  # a grandchild that outlived its lease
    b.teardown(card, s)
    assert b.instances()[gi][1].startswith("blocked: released with processes 4242")
    s2, _ = b.prepare(card, [], HALF, "b", 1000)
    assert s2.handle != s.handle and s2.placement != s.placement  # the other half
    assert b.switch_blocker(card, False).startswith("card 0: MIG instances")
    fake.remove_process(0, 4242)
    clock.t += 10
    assert len(b.tidy()) == 1
    assert [g["start"] for g in fake.mig_layout(0)] == [s2.placement]


def test_switching_is_refused_while_processes_run_or_when_never():
    b, card, fake, _, _, _ = backend()
    fake.add_process(0, 77)
    assert "process(es) run on it (pid 77)" in b.switch_blocker(card, True)
    assert not b.fits(card, [], HALF)
    assert "pid 77" in b.why_not(card, [], HALF)
    with pytest.raises(Conflict, match="pid 77"):
        b.enter_sliced(card)
    fake.remove_process(0, 77)
    never, card, fake, _nvml, _, _ = backend(switch="never")
    assert "mig_switch" in never.switch_blocker(card, True) and not never.fits(card, [], QUARTER)
    fake.nvmlDeviceSetMigMode(fake.nvmlDeviceGetHandleByIndex(0), 1)
    fake.reset(0)  # the operator switched MIG on
    assert never.fits(card, [], QUARTER) and "mig_switch" in never.switch_blocker(card, False)


def test_a_card_without_mig_serves_no_mig_slices():
    b, card, *_ = backend("pcie-8x-l40s")
    assert not b.fits(card, [], QUARTER) and "has no MIG" in b.why_not(card, [], QUARTER)


def test_reconcile_adopts_destroys_orphans_leaves_busy_ones_and_reports_lost():
    b, card, fake, nvml, tools, _ = backend()
    kept, _ = b.prepare(card, [], QUARTER, "kept", 1000)
    orphan, _ = b.prepare(card, [], QUARTER, "orphan", 1000)
    _busy, _ = b.prepare(card, [], HALF, "busy", 1000)
    busy_gi = next(g["gpu_instance_id"] for g in fake.mig_layout(0) if g["name"] == "3g.40gb")
    fake.add_process(0, 999, gpu_instance_id=busy_gi)
    gone = Slice(0, "vxpu-quarter", 1, 1, handle="MIG-00000000-0000-0000-0000-000000000000")
    # A new daemon: same card, fresh backend; the ledger knows "kept" and "gone".
    again = MigIsolation(card, nvml, tools, mig_map.load(), DEFAULT_SLICES, idle_keep_s=0, book=b.book)
    found = again.reconcile(card, CardMode.SLICED, [Held("kept", 1000, kept), Held("gone", 1000, gone)])
    assert found.mode is CardMode.SLICED and found.lost == ["gone"]
    text = "\n".join(found.notes)
    assert "adopted MIG 2g.20gb@0 of lease kept" in text
    assert "destroyed orphaned MIG 2g.20gb@2" in text
    assert "has processes (999) and no lease; left alone" in text
    assert sorted(layout(fake)) == [("2g.20gb", 0), ("3g.40gb", 4)]
    assert orphan.handle not in {u for g in fake.mig_layout(0) for u in g["uuids"]}
    assert again.instances()[busy_gi][1].startswith("blocked")
    # The adopted slice is torn down as usual.
    again.teardown(card, kept)
    assert sorted(layout(fake)) == [("3g.40gb", 4)]


def test_reconcile_switches_an_empty_mig_card_the_ledger_has_whole_back_off_and_reports_lost_slices():
    b, card, _fake, nvml, tools, _ = backend()
    b.enter_sliced(card)
    again = MigIsolation(card, nvml, tools, mig_map.load(), DEFAULT_SLICES, book=b.book)
    found = again.reconcile(card, CardMode.WHOLE, [])
    assert found.mode is CardMode.WHOLE and nvml.mig_mode(0) == (0, 0)
    assert "switched off" in found.notes[0]
    # MIG off, but the ledger says a MIG slice is held: that slice is gone.
    gone = Slice(0, "vxpu-half", 1, 1, handle="MIG-11111111-1111-1111-1111-111111111111")
    found = again.reconcile(card, CardMode.SLICED, [Held("y", 1, gone)])
    assert found.mode is CardMode.WHOLE and found.lost == ["y"]


def test_reconcile_keeps_an_empty_mig_card_sliced_when_a_monitoring_agent_holds_it():
    b, card, fake, nvml, tools, _ = backend()
    b.enter_sliced(card)
    fake.add_client(0, "dcgm")
    again = MigIsolation(card, nvml, tools, mig_map.load(), DEFAULT_SLICES, book=b.book)
    found = again.reconcile(card, CardMode.WHOLE, [])  # start-up goes on
    assert found.mode is CardMode.SLICED and nvml.mig_mode(0) == (1, 1)
    assert "another NVML client holds the card" in found.notes[0]


def test_create_conflict_with_an_instance_made_behind_our_back_is_resolved_by_reading_the_card():
    b, card, fake, nvml, _, _ = backend()
    b.enter_sliced(card)
    nvml.create_mig_instance(0, 14, 0)  # someone else made a 2g.20gb at 0
    s, _ = b.prepare(card, [], QUARTER, "a", 1000)  # the chooser wanted 0; it re-reads and goes elsewhere
    assert s.placement != 0 and len(fake.mig_layout(0)) == 2
    assert any(state.startswith("blocked: found on the card") for _, state in b.instances().values())
    # Nothing runs in it, but it is not ours: upkeep never destroys it.
    b.tidy(1e9)
    assert ("2g.20gb", 0) in layout(fake)


@pytest.mark.parametrize("switch", ["idle", "never"])
def test_start_up_destroys_only_the_instances_xpud_made_and_leaves_other_tools_ones(switch):
    """mig-parted (NVIDIA/mig-parted) and the GPU Operator's MIG manager make instances from their own
    config; a restarted xpud must not take an unheld one of theirs for its own orphan."""
    b, card, fake, nvml, tools, clock = backend(switch=switch)
    if switch == "never":
        fake.nvmlDeviceSetMigMode(fake.nvmlDeviceGetHandleByIndex(0), 1)
        fake.reset(0)  # the operator switched MIG on
    b.prepare(card, [], QUARTER, "orphan", 1000)  # ours, its lease gone while xpud was down
    theirs = nvml.create_mig_instance(0, 9, 4)  # mig-parted's 3g.40gb at 4
    assert sorted(layout(fake)) == [("2g.20gb", 0), ("3g.40gb", 4)]
    again = MigIsolation(
        card, nvml, tools, mig_map.load(), DEFAULT_SLICES, switch=switch, clock=clock, book=b.book
    )
    found = again.reconcile(card, CardMode.WHOLE, [])
    text = "\n".join(found.notes)
    assert "destroyed orphaned MIG 2g.20gb@0" in text
    assert "MIG 3g.40gb@4 was not made by this xpud" in text and "left alone" in text
    assert layout(fake) == [("3g.40gb", 4)]
    assert found.mode is CardMode.SLICED and nvml.mig_mode(0) == (1, 1)  # not switched off under it
    assert again.instances()[theirs.gpu_instance_id][1].startswith("blocked: made by another tool")
    # Upkeep, leaving sliced mode and the chooser leave it too.
    again.tidy(1e9)
    with pytest.raises(Conflict, match="made by another tool" if switch == "idle" else "never"):
        again.leave_sliced(card)
    s, _ = again.prepare(card, [], HALF, "h", 1000)
    assert s.placement == 0 and ("3g.40gb", 4) in layout(fake)


def test_the_ledger_records_the_instances_xpud_makes_across_a_restart(tmp_path):
    from xpud.isolation.mig_book import LedgerBook
    from xpud.ledger.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    b, card, fake, nvml, tools, clock = backend()
    b.book = LedgerBook(ledger)
    kept, _ = b.prepare(card, [], QUARTER, "kept", 1000)
    orphan, _ = b.prepare(card, [], QUARTER, "orphan", 1000)
    rows = ledger.mig_made(card.uuid)
    assert [(start, uuid) for start, _, uuid in rows] == [(0, kept.handle), (2, orphan.handle)]
    b.teardown(card, kept)  # idle_keep_s 0: destroyed, and its row with it
    assert [start for start, _, _ in ledger.mig_made(card.uuid)] == [2]
    ledger.close()
    nvml.create_mig_instance(0, 9, 4)  # another tool's
    reopened = Ledger(tmp_path / "ledger.sqlite")
    again = MigIsolation(
        card, nvml, tools, mig_map.load(), DEFAULT_SLICES, clock=clock, book=LedgerBook(reopened)
    )
    found = again.reconcile(card, CardMode.SLICED, [])
    assert "destroyed orphaned MIG 2g.20gb@2" in "\n".join(found.notes)
    assert layout(fake) == [("3g.40gb", 4)] and reopened.mig_made(card.uuid) == []
    reopened.close()


def test_custom_size_and_derived_mapping_and_bad_map_files(tmp_path):
    eighth = SliceSpec("vxpu-eighth", 0.125, 8)
    b, card, _fake, *_ = backend(slices={**DEFAULT_SLICES, "vxpu-eighth": eighth})
    s, env = b.prepare(card, [], eighth, "e", 1)
    assert env["XPU_MIG_PROFILE"] == "1g.10gb" and s.memory_bytes == 9984 << 20
    bad = tmp_path / "map.toml"
    bad.write_text('[models."X"]\nvxpu-half = "3g.40gb"\n')
    with pytest.raises(ConfigError, match="non-empty list"):
        mig_map.load(bad)
    bad.write_text("[model]\n")
    with pytest.raises(ConfigError, match="unknown table"):
        mig_map.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        mig_map.load(tmp_path / "missing.toml")
    bad.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        mig_map.load(bad)
    # A map naming a profile the card lacks falls back to the derived mapping.
    odd = {"NVIDIA H100 80GB HBM3": {"vxpu-half": ("5g.50gb",)}}
    b2, card2, _fake2, *_ = backend(table=odd)
    s, env = b2.prepare(card2, [], HALF, "h", 1)
    assert env["XPU_MIG_PROFILE"] == "3g.40gb"


def test_mig_processes_reads_each_instance():
    b, card, fake, nvml, _, _ = backend()
    b.prepare(card, [], QUARTER, "a", 1)
    b.prepare(card, [], HALF, "b", 1)
    gis = [g["gpu_instance_id"] for g in fake.mig_layout(0)]
    fake.add_process(0, 11, gpu_instance_id=gis[1])
    fake.add_process(0, 12, gpu_instance_id=gis[1])
    assert nvml.mig_processes(0) == {gis[0]: [], gis[1]: [11, 12]}
    assert nvml.mig_processes(1) == {}  # MIG off


def test_a_switch_goes_on_when_the_event_set_cannot_be_made_again(caplog):
    import pynvml

    b, card, fake, nvml, _, _ = backend()
    w = nvml.event_waiter()
    fake.fail("nvmlEventSetCreate", pynvml.NVML_ERROR_UNKNOWN)
    b.enter_sliced(card)  # the old set is freed: nothing of ours holds the card
    assert nvml.mig_mode(0) == (1, 1) and "event set not left" in caplog.text
    with pytest.raises(NvmlError, match="no event set"):
        w.wait(10)  # its thread backs off and makes a new one (xpud.controllers.health.EventThread)
    fake.unfail()
    w.close()
