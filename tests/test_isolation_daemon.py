"""Isolation through a real daemon: mixed quarter/half/whole demand on simulated MIG (dgx-h100) and MPS
(pcie-8x-l40s) hosts, every grant's isolation handle checked against the fake hardware after every step;
the one-user-per-MPS-server rule; reconciliation at restart; check-hardware's MIG mapping."""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import random
import time

import pytest

from tests.conftest import wait_until
from tests.daemons import InProcDaemon
from xpud.api.client import Client
from xpud.errors import Conflict, NoCapacity
from xpud.hw.check import check_hardware
from xpud.hw.fakenvml import FakeNvml
from xpud.model import Caller, Mode, Request

CONFIG = "[leases]\ngrace_s = 120.0\n[cards]\nmig_idle_keep_s = {keep}\nmps_idle_keep_s = {keep}\n"
_pids = itertools.count(7_000_000)


def snapshot(d):
    """Leases, per-card backend state and the fake cards' MIG state, read together on the daemon's loop
    once no card has backend work in flight and no engine task runs (a teardown may finish after its
    Release answered when its card was busy: the card is out of placement until then)."""

    async def read():
        e = d.engine
        while e.busy_cards() or e._tasks:
            await asyncio.sleep(0.005)
        return (
            [(lease, lease.slices) for lease in e.leases.values()],
            {i: (c.mode.value, sorted(c.slices), c.whole_lease) for i, c in e.cards.items()},
            {i: getattr(e._backends[i], "instances", lambda: {})() for i in e.cards},
            {i: (d.fake.card_state(i).mig, d.fake.mig_layout(i)) for i in e.cards},
        )

    return d.call(read)


def check_mig(d, keep: float) -> None:
    """Every lease's isolation is real on the fake cards; nothing overlaps; nothing leaks."""
    leases, cards, books, fake = snapshot(d)
    held_uuids = {}
    for lease, slices in leases:
        if lease.mode is Mode.XPU:
            for i in lease.cards:
                assert fake[i][0] == 0, f"whole lease {lease.id} on card {i} with MIG on"
                assert fake[i][1] == []
            continue
        (s,) = slices
        assert fake[s.card_index][0] == 1
        inst = [g for g in fake[s.card_index][1] if s.handle in g["uuids"]]
        assert len(inst) == 1, f"lease {lease.id}: {s.handle} is not a MIG device of card {s.card_index}"
        assert inst[0]["start"] == s.placement and inst[0]["name"] == lease.env["XPU_MIG_PROFILE"]
        assert lease.env["CUDA_VISIBLE_DEVICES"] == s.handle
        assert s.handle not in held_uuids, "two leases share a MIG device"
        held_uuids[s.handle] = lease.id
    for i in range(len(cards)):
        layout = fake[i][1]
        slots = [x for g in layout for x in range(g["start"], g["start"] + g["size"])]
        assert len(slots) == len(set(slots)), f"card {i}: instances overlap"
        for g in layout:
            owner = next((held_uuids[u] for u in g["uuids"] if u in held_uuids), None)
            state = books[i].get(g["gpu_instance_id"], (None, "unknown"))
            if owner is None:
                foreign = state[1].startswith("blocked: made by another tool")  # never ours to destroy
                assert foreign or (keep > 0 and state == (None, "idle")), (
                    f"card {i}: leaked instance {g} ({state})"
                )
            else:
                assert state == (owner, "held")
        mode, slices, _whole = cards[i]
        if mode == "whole":
            assert fake[i][0] == 0 and not slices
        elif slices:
            assert fake[i][0] == 1


def check_mps(d, clients: dict[str, tuple[str, int]], keep: float = 0.0) -> None:
    leases, cards, _, _ = snapshot(d)
    idle = d.call(lambda: {i: b.idle_server() for i, b in d.engine._backends.items()})
    tools, nvml = d.tools, d.hw
    daemons = tools.snapshot()
    usable = {}
    for lease, slices in leases:
        if lease.mode is Mode.XPU:
            for i in lease.cards:
                assert nvml.compute_mode(i) == "DEFAULT"
            continue
        (s,) = slices
        pipe = lease.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert pipe == str(d.runtime_dir / "mps" / str(s.card_index) / "pipe")
        assert pipe in daemons, f"lease {lease.id}: no MPS control daemon on {pipe}"
        assert daemons[pipe]["devices"] == lease.env["CUDA_VISIBLE_DEVICES"] == lease.card_uuids[0]
        assert nvml.compute_mode(s.card_index) == "EXCLUSIVE_PROCESS"
        limit = lease.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
        assert limit == f"0={s.memory_bytes >> 20}M"
        usable[s.card_index] = usable.get(s.card_index, 0) + s.memory_bytes
    for i, (mode, slices, _) in cards.items():
        pipe = str(d.runtime_dir / "mps" / str(i) / "pipe")
        if mode == "whole":
            assert pipe not in daemons and nvml.compute_mode(i) == "DEFAULT"
        if not slices and pipe in daemons and daemons[pipe]["servers"]:  # only one kept idle
            assert keep > 0 and idle[i] is not None, f"card {i}: MPS server without slices"
            assert len(daemons[pipe]["servers"]) == 1
        card_total = nvml.card_info(i).memory_total_bytes
        assert usable.get(i, 0) <= card_total - (1 << 30)
    connected = {lid for lid, _ in clients.values()}
    assert connected <= {lease.id for lease, _ in leases}


def mixed_demand(d, steps: int, seed: int, on_grant=None, on_release=None, check=None) -> dict:
    rng = random.Random(seed)
    held, counts = [], {"granted": 0, "refused": 0, "released": 0}
    with Client(d.runtime_dir) as c:
        for _ in range(steps):
            if held and rng.random() < 0.4:
                g = held.pop(rng.randrange(len(held)))
                if on_release:
                    on_release(g)
                c.release(g.lease.id, g.token)
                counts["released"] += 1
            else:
                mode = rng.choice(["vxpu-quarter", "vxpu-quarter", "vxpu-half", "xpu"])
                gpus = rng.choice([1, 1, 2]) if mode == "xpu" else 1
                try:
                    g = c.acquire_lease(mode, gpus=gpus)
                except NoCapacity:
                    counts["refused"] += 1
                else:
                    held.append(g)
                    counts["granted"] += 1
                    if on_grant:
                        on_grant(g)
            check()
        for g in held:
            if on_release:
                on_release(g)
            c.release(g.lease.id, g.token)
        check()
    return counts


@pytest.mark.parametrize("keep", [0.0, 600.0])
def test_mixed_demand_on_mig_cards_matches_the_fake_hardware_after_every_step(inproc, keep):
    d = inproc("dgx-h100", CONFIG.format(keep=keep))
    with Client(d.runtime_dir) as c:
        # Fill every card with slices, free them, then take all eight whole: every card switches back.
        quarters = [c.acquire_lease("vxpu-quarter") for _ in range(8 * 4)]
        with pytest.raises(NoCapacity, match="no card has room for a vxpu-quarter"):
            c.acquire_lease("vxpu-quarter")
        check_mig(d, keep)
        assert all(d.fake.card_state(i).mig == 1 for i in range(8))
        for g in quarters:
            c.release(g.lease.id, g.token)
        check_mig(d, keep)
        assert all(card.mig_enabled for card in c.cards().cards)  # listings follow the switches
        whole = c.acquire_lease("xpu", gpus=8)
        check_mig(d, keep)
        assert all(d.fake.card_state(i).mig == 0 and d.fake.mig_layout(i) == [] for i in range(8))
        assert not any(card.mig_enabled for card in c.cards().cards)
        c.release(whole.lease.id, whole.token)
    counts = mixed_demand(d, 160, seed=int(keep) + 1, check=lambda: check_mig(d, keep))
    assert counts["granted"] > 60 and counts["released"] > 40
    # On and off on every card at least once, each time with the daemon's event set let go of the card
    # (else the driver leaves the mode pending) and taken back after.
    assert d.fake.calls["nvmlDeviceSetMigMode"] >= 16
    assert all(d.fake.card_state(i).mig == d.fake.card_state(i).mig_pending for i in range(8))
    assert sorted(d.call(lambda: d.daemon.monitor.thread.waiter.registered)) == list(range(8))


@pytest.mark.parametrize("keep", [0.0, 600.0])
def test_mixed_demand_on_mps_cards_matches_the_simulated_control_daemons(inproc, keep):
    d = inproc("pcie-8x-l40s", CONFIG.format(keep=keep))
    clients: dict[str, tuple[str, int]] = {}  # lease id -> (pipe, client pid)

    def started(g):  # the child starts CUDA: it connects to its card's MPS server
        if g.lease.mode != "xpu":
            pid = next(_pids)
            pipe = g.lease.env["CUDA_MPS_PIPE_DIRECTORY"]
            assert d.tools.connect(pipe, pid, uid=1000) == "served"
            clients[g.lease.id] = (pipe, pid)

    def ended(g):
        if g.lease.id in clients:
            pipe, pid = clients.pop(g.lease.id)
            d.tools.disconnect(pipe, pid)

    check = lambda: check_mps(d, {}, keep)  # noqa: E731
    counts = mixed_demand(d, 160, seed=7, on_grant=started, on_release=ended, check=check)
    assert counts["granted"] > 60
    servers = [snap["servers"] for snap in d.tools.snapshot().values()]
    assert all(not x for x in servers) if keep == 0 else any(servers)


def test_a_second_user_s_mps_slice_goes_to_another_card_or_waits_with_the_reason(inproc):
    d = inproc("workstation-2x", CONFIG.format(keep=0))

    def grant(uid):
        return d.call(lambda: d.engine.try_grant(Request(Mode.VXPU_QUARTER, owner_uid=uid)))

    a, _ = grant(1000)
    b, _ = grant(1001)
    assert a.cards != b.cards  # one user per card's MPS server
    assert grant(1000)[0].cards == a.cards and grant(1001)[0].cards == b.cards
    assert grant(1002) is None
    with pytest.raises(NoCapacity, match=r"card \d's MPS server serves uid 100[01]"):
        d.call_async(d.engine.acquire(Request(Mode.VXPU_QUARTER, owner_uid=1002)))
    waiter = asyncio.run_coroutine_threadsafe(
        d.engine.acquire(Request(Mode.VXPU_QUARTER, owner_uid=1002, wait_s=30)), d.loop
    )
    # it waits for an MPS server of its own, and the queue says so (squeue's REASON)
    wait_until(lambda: [q.reason for q in d.call(d.engine.queue_view)] == ["MPS user"])
    admin = Caller(uid=0, admin=True)
    for lease in d.call(lambda: [x for x in d.engine.leases.values() if x.owner_uid == 1000]):
        assert not waiter.done()
        d.call(d.engine.release, lease.id, admin)
    got, _ = waiter.result(10)
    assert got.cards == a.cards


def _shutdowns(d) -> int:
    """``shutdown_server`` commands the daemon ran through the (fake) MPS control tool."""
    return sum("shutdown_server" in (text or "") for _, _, text in d.tools.calls)


def test_an_idle_mps_server_serves_its_uid_again_and_is_shut_down_for_another(inproc):
    d = inproc("workstation-2x", CONFIG.format(keep=600))
    uid, other, admin = os.getuid(), os.getuid() + 1, Caller(uid=0, admin=True)
    with Client(d.runtime_dir) as c:
        c.acquire_lease("xpu")  # one card whole: the slices below all go to the other card
        g = c.acquire_lease("vxpu-quarter")
        pipe = g.lease.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert d.tools.connect(pipe, 9001, uid) == "served"
        (server,) = d.tools.snapshot()[pipe]["servers"]
        d.tools.disconnect(pipe, 9001)
        calls = len(d.tools.calls)
        c.release(g.lease.id, g.token)  # the card's last slice: bookkeeping only, the server stays
        g2 = c.acquire_lease("vxpu-quarter")  # the same uid: it finds the server running
        assert g2.lease.env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        tool_runs = [text for _, _, text in d.tools.calls[calls:] if text != "get_server_list\n"]
        assert tool_runs == []  # (tidy's periodic check of the control daemon aside)
        assert d.tools.connect(pipe, 9002, uid) == "served"
        assert d.tools.snapshot()[pipe]["servers"] == {server: (uid, [9002])}
    # 9002 outlives its lease (a leftover); the server stays idle for uid until another user's slice comes
    d.call(d.engine.release, g2.lease.id, admin)
    assert _shutdowns(d) == 0 and d.tools.snapshot()[pipe]["servers"] == {server: (uid, [9002])}
    lease, _ = d.call(lambda: d.engine.try_grant(Request(Mode.VXPU_QUARTER, owner_uid=other)))
    assert list(lease.card_uuids) == list(g.lease.card_uuids)  # the idle server does not keep it off the card
    assert _shutdowns(d) == 1 and 9002 in d.tools.daemons[pipe].killed
    assert d.tools.connect(pipe, 9003, other) == "served"  # never behind (or beside) uid's server
    assert [u for u, _ in d.tools.snapshot()[pipe]["servers"].values()] == [other]
    check_mps(d, {}, 600)


def test_a_slice_goes_to_the_card_its_uid_kept_idle_not_to_another_uid_s(inproc):
    d = inproc("workstation-2x", CONFIG.format(keep=600))
    admin = Caller(uid=0, admin=True)

    def grant(uid):
        return d.call(lambda: d.engine.try_grant(Request(Mode.VXPU_QUARTER, owner_uid=uid)))[0]

    a, b = grant(1000), grant(1001)  # one user per MPS server: two cards
    for lease in (a, b):
        d.call(d.engine.release, lease.id, admin)
    snapshot(d)
    idle = d.call(lambda: {i: b.idle_server() for i, b in d.engine._backends.items()})
    assert idle == {a.cards[0]: 1000, b.cards[0]: 1001}  # both cards sliced, empty, each server kept
    # Both fit equally: the uid whose card has the higher index would get the other one (lowest index
    # first) and pay its forced shutdown there, with a server of its own idle next door.
    uid, card = max(((1000, a.cards[0]), (1001, b.cards[0])), key=lambda x: x[1])
    again = grant(uid)
    assert again.cards == (card,)
    assert _shutdowns(d) == 0
    idle = d.call(lambda: {i: b.idle_server() for i, b in d.engine._backends.items()})
    assert idle == {card: None, 1 - card: 2001 - uid}  # the other user's server is still kept
    # With no other card, it still goes to the card kept for another user (its server shut down first).
    d.call(d.engine.release, again.id, admin)
    d.call(lambda: d.engine.try_grant(Request(Mode.VXPU_QUARTER, owner_uid=uid)))  # on its own card
    other = grant(2001 - uid)
    assert other.cards == (1 - card,) and _shutdowns(d) == 0
    # both cards hold live slices of others: no card for uid 3000
    assert d.call(lambda: d.engine.try_grant(Request(Mode.VXPU_QUARTER, owner_uid=3000))) is None


@pytest.mark.parametrize("keep", [3.0, 0.0])
def test_an_idle_mps_server_is_shut_down_when_its_grace_ends_and_at_once_with_zero(inproc, keep):
    d = inproc("workstation-2x", CONFIG.format(keep=keep))
    with Client(d.runtime_dir) as c:
        g = c.acquire_lease("vxpu-quarter")
        pipe = g.lease.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert d.tools.connect(pipe, 9101, os.getuid()) == "served"  # left running after its lease
        t0 = time.monotonic()
        c.release(g.lease.id, g.token)
    snapshot(d)  # the teardown done (it waits when tidy has the card)
    if keep == 0:  # today's behaviour: the release shuts the server down, the leftover is cut off
        assert d.tools.snapshot()[pipe]["servers"] == {} and _shutdowns(d) == 1
        assert 9101 in d.tools.daemons[pipe].killed
        return
    idle = d.call(lambda: [b.idle_server() for b in d.engine._backends.values()])
    assert idle.count(os.getuid()) == 1 and len(d.tools.snapshot()[pipe]["servers"]) == 1
    wait_until(lambda: d.tools.snapshot()[pipe]["servers"] == {}, timeout=15)
    assert time.monotonic() - t0 >= keep  # not before its grace (tidy looks every second)
    assert _shutdowns(d) == 1 and 9101 in d.tools.daemons[pipe].killed
    check_mps(d, {})


def test_restart_adopts_mig_instances_destroys_orphans_and_reclaims_lost_slices(inproc):
    d1 = inproc("dgx-h100", CONFIG.format(keep=600), name="a")
    with Client(d1.runtime_dir) as c:
        kept = [c.acquire_lease("vxpu-half"), c.acquire_lease("vxpu-quarter")]
        doomed = c.acquire_lease("vxpu-half")
        idle = c.acquire_lease("vxpu-quarter")
        c.release(idle.lease.id, idle.token)  # its instance stays, idle: made by xpud, held by no lease
    fake = d1.fake
    d1.stop()
    # While xpud is down: someone (mig-parted, an operator) leaves an empty instance on card 5, and the
    # doomed lease's instance vanishes (destroyed by hand).
    d1.hw.open()
    d1.hw.set_mig_mode(5, True)
    fake.reset(5)
    d1.hw.create_mig_instance(5, 14, 0)
    doomed_card = doomed.lease.cards[0]
    gi = next(
        g["gpu_instance_id"]
        for g in fake.mig_layout(doomed_card)
        if doomed.lease.slices[0].handle in g["uuids"]
    )
    d1.hw.destroy_mig_instance(doomed_card, gi)
    d1.hw.close()
    d2 = InProcDaemon(d1.runtime_dir.parent, "dgx-h100", CONFIG.format(keep=0), fake=fake)
    try:
        with Client(d2.runtime_dir) as c:
            active = {x.id for x in c.leases().leases}
            assert active == {g.lease.id for g in kept}
            ended = {x.id: x.state for x in c.leases(all=True).leases}
            assert ended[doomed.lease.id] == "reclaimed"
        # Not made by xpud: left alone (MIG stays on, its space blocked), under any mig_switch.
        assert [(g["name"], g["start"]) for g in fake.mig_layout(5)] == [("2g.20gb", 0)]
        assert fake.card_state(5).mig == 1
        check_mig(d2, 0)
        events = d2.call(lambda: [e.message for e in d2.engine.ledger.events(limit=50)])
        assert any("adopted MIG 3g.40gb" in m for m in events)
        idle_card = idle.lease.cards[0]
        assert any(f"card {idle_card}: destroyed orphaned MIG " in m for m in events)
        assert any("card 5: MIG 2g.20gb@0 was not made by this xpud" in m for m in events)
        assert any(f"the MIG instance of lease {doomed.lease.id} is gone" in m for m in events)
        with Client(d2.runtime_dir) as c:
            for g in kept:
                c.release(g.lease.id, g.token)
        check_mig(d2, 0)
        assert all(fake.mig_layout(i) == [] for i in range(8) if i != 5)
        assert len(fake.mig_layout(5)) == 1
    finally:
        d2.stop()


def test_cards_with_stray_processes_are_not_switched(inproc):
    d = inproc("dgx-h100", CONFIG.format(keep=0))
    for i in range(1, 8):
        d.fake.add_process(i, 100 + i)  # someone runs CUDA outside xpud on cards 1..7
    with Client(d.runtime_dir) as c:
        halves = [c.acquire_lease("vxpu-half") for _ in range(2)]
        assert {g.lease.cards[0] for g in halves} == {0}  # only card 0 may switch MIG on
        with pytest.raises(NoCapacity, match=r"card \d: 1 process\(es\) run on it \(pid 10\d\)"):
            c.acquire_lease("vxpu-half")
        for g in halves:
            c.release(g.lease.id, g.token)
        d.fake.add_process(0, 100)  # now card 0 (sliced, idle, MIG on) has a stray process too
        with pytest.raises(NoCapacity):
            c.acquire_lease("xpu", gpus=8)  # card 0 cannot switch MIG off under it
        d.fake.remove_process(0, 100)
        whole = c.acquire_lease("xpu", gpus=8)
        assert d.fake.card_state(0).mig == 0
        c.release(whole.lease.id, whole.token)


@pytest.mark.parametrize(("machine", "expect"), [("dgx-h100", "2g.20gb, 1g.20gb"), ("hgx-h200", "2g.35gb")])
def test_check_hardware_reports_the_mig_mapping_read_only(machine, expect):
    fake = FakeNvml(machine)
    out = io.StringIO()
    assert check_hardware(fake, out=out) == 0
    text = out.getvalue()
    assert "xpud uses vxpu-quarter  -> " + expect in text and "(map; profiles from etc/machines/" in text
    assert not [
        n for n in fake.calls if n.startswith(("nvmlDeviceSet", "nvmlDeviceCreate", "nvmlGpuInstance"))
    ]


def test_a_monitoring_agent_on_every_card_refuses_mig_slices_clearly_and_leaves_no_mode_pending(inproc):
    # The driver will not switch MIG while another NVML client (DCGM here) holds a card: the request fails
    # with that reason, no card is left with a pending mode, and the cards stay whole and usable.
    fake = FakeNvml("dgx-h100")
    for i in range(8):
        fake.add_client(i, "dcgm")
    d = inproc("dgx-h100", CONFIG.format(keep=0), fake=fake)
    with Client(d.runtime_dir) as c:
        with pytest.raises(Conflict, match="another NVML client holds the card") as err:
            c.acquire_lease("vxpu-half")
        assert "DCGM" in str(err.value)
        assert all(fake.card_state(i).mig == fake.card_state(i).mig_pending == 0 for i in range(8))
        whole = c.acquire_lease("xpu", gpus=8)
        c.release(whole.lease.id, whole.token)
    for i in range(8):
        fake.remove_client(i, "dcgm")


def test_a_card_renumbered_by_its_mig_switch_is_listed_with_its_new_device_node(inproc):
    # REFERENCE.md: minors "may change with a MIG mode change"; whatever hands out /dev/nvidia<minor> reads
    # the card's listing, so the listing must follow the driver.
    d = inproc("dgx-a100", CONFIG.format(keep=0.0))
    for i in range(8):
        d.fake.renumber_on_reset(i, 20 + i)
    with Client(d.runtime_dir) as c:
        before = {card.index: card.minor_number for card in c.cards().cards}
        assert before == {0: 2, 1: 3, 2: 0, 3: 1, 4: 6, 5: 7, 6: 4, 7: 5}
        g = c.acquire_lease("vxpu-half")
        (i,) = g.lease.cards
        after = {card.index: card.minor_number for card in c.cards().cards}
        assert after == {**before, i: 20 + i}
        c.release(g.lease.id, g.token)
