"""MPS: the simulated nvidia-cuda-mps-control (documented semantics) and the backend that drives it."""

from __future__ import annotations

from pathlib import Path

import pytest

from xpud.config.schema import DEFAULT_SLICES
from xpud.errors import Conflict
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.isolation.base import Held
from xpud.isolation.faketools import FakeNvidiaTools
from xpud.isolation.mps import CHECK_INTERVAL_S, MAX_CLIENTS, RESERVED_ESTIMATE, MpsIsolation
from xpud.isolation.runner import CommandRunner, ToolError, check
from xpud.model import CardMode, Slice, SliceSpec

HALF, QUARTER = DEFAULT_SLICES["vxpu-half"], DEFAULT_SLICES["vxpu-quarter"]
MIB = 1 << 20


def mps(tmp_path, machine="pcie-8x-l40s", index=0, reserved=0, keep=0.0, clock=None):
    fake = FakeNvml(machine)
    nvml = Nvml(fake)
    nvml.open()
    tools = FakeNvidiaTools(fake)
    card = nvml.card_info(index)
    kw = {"idle_keep_s": keep} | ({"clock": clock} if clock else {})
    return MpsIsolation(card, nvml, tools, tmp_path / "run", reserved, **kw), card, fake, nvml, tools


# ----------------------------------------------------------------------------------- the simulator
def control(tools, pipe, *commands, daemon=False):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(pipe.parent / "log")}
    if daemon:
        return tools.run(["nvidia-cuda-mps-control", "-d"], env=env, detach=True)
    return tools.run(["nvidia-cuda-mps-control"], env=env, input="".join(f"{c}\n" for c in commands))


def test_simulated_control_daemon_follows_the_documented_commands(tmp_path):
    tools = FakeNvidiaTools()
    pipe = tmp_path / "pipe"
    assert "Cannot find MPS control daemon" in control(tools, pipe, "get_server_list").stderr
    assert control(tools, pipe, daemon=True).returncode == 1  # directories must exist
    pipe.mkdir()
    (tmp_path / "log").mkdir()
    assert control(tools, pipe, daemon=True).ok
    assert (pipe / "control").exists() and "Startup" in (tmp_path / "log" / "control.log").read_text()
    assert "already running" in control(tools, pipe, daemon=True).stderr
    assert control(tools, pipe, "get_server_list").stdout == ""
    assert control(tools, pipe, "start_server -uid 1000").ok
    (server,) = control(tools, pipe, "get_server_list").lines()
    assert control(tools, pipe, "set_default_active_thread_percentage 40").lines() == ["40"]
    assert control(tools, pipe, "get_default_active_thread_percentage").lines() == ["40.0"]
    assert control(tools, pipe, "set_active_thread_percentage 1 50").returncode == 1  # no server 1
    assert control(tools, pipe, f"set_active_thread_percentage {server} 50").ok
    assert control(tools, pipe, "set_default_device_pinned_mem_limit 0 2G").ok
    assert control(tools, pipe, "get_default_device_pinned_mem_limit 0").lines() == ["2G"]
    assert "Unrecognized command" in control(tools, pipe, "make_coffee").stderr
    assert "another user" in control(tools, pipe, "start_server -uid 1001").stderr
    assert control(tools, pipe, f"shutdown_server {server}").ok
    assert control(tools, pipe, "get_server_list").stdout == ""
    assert control(tools, pipe, "quit").ok and not (pipe / "control").exists()
    assert control(tools, pipe, "get_server_list").returncode == 1


def test_simulated_clients_one_uid_per_server_at_a_time(tmp_path):
    fake = FakeNvml("pcie-8x-l40s")
    tools = FakeNvidiaTools(fake)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (tmp_path / "log").mkdir()
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"),
        "CUDA_VISIBLE_DEVICES": fake.machine.cards[2].uuid,
    }
    assert tools.run(["nvidia-cuda-mps-control", "-d"], env=env).ok
    p = str(pipe)
    assert tools.connect(p, 10, uid=1000) == "served"
    assert tools.connect(p, 11, uid=1000) == "served"
    ((server, (uid, clients)),) = tools.snapshot()[p]["servers"].items()
    assert uid == 1000 and clients == [10, 11]
    assert [pid for pid, _ in Nvml(fake).processes(2)] == [server]  # the server runs on its card
    assert tools.connect(p, 20, uid=1001) == "waiting"  # another user waits ...
    assert tools.connect(p, 12, uid=1000) == "waiting"  # ... and the old server takes no one new
    tools.disconnect(p, 10)
    assert tools.snapshot()[p]["waiting"] == [(20, 1001), (12, 1000)]
    tools.disconnect(p, 11)  # the last client of uid 1000 leaves: uid 1001's server starts
    ((server2, (uid2, clients2)),) = tools.snapshot()[p]["servers"].items()
    assert server2 != server and uid2 == 1001 and clients2 == [20]
    assert tools.snapshot()[p]["waiting"] == [(12, 1000)]
    assert tools.connect(str(tmp_path / "elsewhere"), 30, 1) == "no-daemon"


def test_simulated_gpu_reset_is_refused_while_processes_run():
    fake = FakeNvml("dgx-h100")
    tools = FakeNvidiaTools(fake)
    bus = fake.machine.cards[1].bus_id
    fake.add_process(1, 5)
    done = tools.run(["nvidia-smi", "--gpu-reset", "-i", bus])
    assert done.returncode != 0 and "in use" in done.stderr
    with pytest.raises(ToolError, match="nvidia-smi --gpu-reset"):
        check(done)
    fake.remove_process(1, 5)
    assert tools.run(["nvidia-smi", "-r", "-i", fake.machine.cards[1].uuid]).ok
    assert tools.run(["nvidia-smi", "-r", "-i", "99"]).returncode == 6


def test_real_runner_reports_a_missing_binary_as_127():
    done = CommandRunner().run(["/nonexistent/nvidia-cuda-mps-control", "-d"], detach=True)
    assert done.returncode == 127 and "not found" in done.stderr
    assert CommandRunner().run(["sh", "-c", "read x; echo got $x"], input="hi\n").stdout == "got hi\n"
    assert CommandRunner().run(["sleep", "5"], timeout_s=0.2).returncode == 124


# ------------------------------------------------------------------------------------- the backend
def test_first_slice_starts_the_card_s_control_daemon_with_its_own_directories(tmp_path):
    b, card, _fake, nvml, tools = mps(tmp_path, index=3)
    assert not b.running() and nvml.compute_mode(3) == "DEFAULT"
    s, env = b.prepare(card, [], HALF, "lease1", 1000)
    pipe = tmp_path / "run" / "mps" / "3" / "pipe"
    assert b.running() and list(tools.snapshot()) == [str(pipe)]
    assert tools.snapshot()[str(pipe)]["devices"] == card.uuid
    assert (tmp_path / "run" / "mps" / "3" / "log" / "control.log").exists()
    assert nvml.compute_mode(3) == "EXCLUSIVE_PROCESS"
    usable = card.memory_total_bytes - RESERVED_ESTIMATE
    mib = int(usable * 0.5) // MIB
    assert env == {
        "CUDA_VISIBLE_DEVICES": card.uuid,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={mib}M",  # device index as the client sees it
        "XPU_MEMORY_LIMIT_BYTES": str(mib * MIB),
        "XPU_COMPUTE_PCT": "30",
    }
    assert s.memory_bytes == mib * MIB and s.handle == "mps:3:lease1"
    b.prepare(card, [s], QUARTER, "lease2", 1000)
    assert [c for c, _, _ in tools.calls].count(("nvidia-cuda-mps-control", "-d")) == 1  # one per card


def test_memory_and_compute_shares_and_the_client_limit(tmp_path):
    b, card, *_ = mps(tmp_path, reserved=2048 * MIB)
    held = [b.prepare(card, [], HALF, "a", 1)[0]]
    assert b.fits(card, held, HALF)
    held.append(b.prepare(card, held, HALF, "b", 1)[0])
    assert not b.fits(card, held, QUARTER)  # memory full (and compute at 60 %)
    tiny = SliceSpec("vxpu-tiny", 0.001, 1)
    many = [b.prepare(card, [], tiny, f"t{n}", 1)[0] for n in range(MAX_CLIENTS)]
    assert not b.fits(card, many, tiny) and "48 MPS clients" in b.why_not(card, many, tiny)


def test_one_user_per_card_second_user_goes_elsewhere_or_waits(tmp_path):
    b, card, *_ = mps(tmp_path)
    s = b.prepare(card, [], QUARTER, "alice", 1000)[0]
    assert b.fits(card, [s], QUARTER, owner_uid=1000)
    assert not b.fits(card, [s], QUARTER, owner_uid=1001)
    assert "serves uid 1000" in b.why_not(card, [s], QUARTER, owner_uid=1001)
    b.teardown(card, s)
    assert b.fits(card, [], QUARTER, owner_uid=1001)


def test_last_slice_shuts_the_server_down_and_leaving_sliced_mode_quits_and_restores(tmp_path):
    b, card, _fake, nvml, tools = mps(tmp_path)
    nvml.set_compute_mode(0, "PROHIBITED")  # whatever the operator had, it comes back
    s1 = b.prepare(card, [], QUARTER, "a", 1000)[0]
    s2 = b.prepare(card, [s1], QUARTER, "b", 1000)[0]
    pipe = str(b.pipe_dir)
    tools.connect(pipe, 501, 1000)  # the two children start CUDA
    tools.connect(pipe, 502, 1000)
    assert len(b.servers()) == 1
    b.teardown(card, s1)
    assert len(b.servers()) == 1  # b's client still runs
    tools.disconnect(pipe, 501)
    b.teardown(card, s2)  # the last slice: the server goes (forced: a leftover client is cut off)
    assert b.servers() == [] and tools.snapshot()[pipe]["servers"] == {}
    assert nvml.processes(0) == []  # the server's context left the card
    assert b.running()  # the control daemon stays while the card is sliced
    b.leave_sliced(card)
    assert not b.running() and tools.snapshot() == {}
    assert nvml.compute_mode(0) == "PROHIBITED" and not (b.base / "compute-mode").exists()


def test_reconcile_stops_an_orphaned_daemon_and_restarts_one_for_held_slices(tmp_path):
    b, card, _fake, nvml, tools = mps(tmp_path)
    s = b.prepare(card, [], HALF, "a", 1000)[0]
    # A restarted xpud: the ledger says card 0 is whole and nothing is held -> orphan.
    again = MpsIsolation(card, nvml, tools, tmp_path / "run")
    found = again.reconcile(card, CardMode.WHOLE, [])
    assert found.mode is CardMode.WHOLE and "orphaned MPS control daemon stopped" in found.notes[0]
    assert not again.running() and nvml.compute_mode(0) == "DEFAULT"
    # The ledger holds a slice but the daemon is gone (e.g. the host rebooted the simulated tools).
    found = again.reconcile(card, CardMode.SLICED, [Held("a", 1000, s)])
    assert found.mode is CardMode.SLICED and again.running() and found.lost == []
    assert not again.fits(card, [s], QUARTER, owner_uid=1001)  # the owner is known again
    # A compute mode saved before a crash is restored even when no daemon runs.
    check(tools.run(["nvidia-cuda-mps-control"], env=again._env(), input="quit\n"))
    assert Path(again.base / "compute-mode").exists()
    found = again.reconcile(card, CardMode.WHOLE, [])
    assert nvml.compute_mode(0) == "DEFAULT" and "compute mode restored" in found.notes[0]


def test_compute_mode_without_root_is_a_clear_error(tmp_path):
    fake = FakeNvml("pcie-8x-l40s", root=False)
    nvml = Nvml(fake)
    nvml.open()
    b = MpsIsolation(nvml.card_info(0), nvml, FakeNvidiaTools(fake), tmp_path / "run")
    with pytest.raises(Conflict, match="cannot set EXCLUSIVE_PROCESS for MPS"):
        b.prepare(nvml.card_info(0), [], HALF, "a", 1)


def test_slices_on_a_running_control_daemon_run_no_tool_and_a_dead_one_is_started_by_tidy(tmp_path):
    """The control daemon runs until told to quit: the backend remembers it started one instead of asking
    at every grant (the engine then does such a grant on its loop); tidy asks every CHECK_INTERVAL_S and
    starts a daemon that died again."""
    b, card, *_rest, tools = mps(tmp_path)
    assert b.needs_tool("prepare")  # nothing known yet
    s1 = b.prepare(card, [], QUARTER, "a", 1000)[0]
    calls = len(tools.calls)
    assert not b.needs_tool("prepare") and not b.needs_tool("teardown", "b")
    s2 = b.prepare(card, [s1], QUARTER, "b", 1000)[0]
    b.teardown(card, s2)  # not the last slice
    assert len(tools.calls) == calls
    assert b.needs_tool("teardown", "a")  # the last slice: its server is shut down
    assert b.tidy_due(100.0) and b.tidy(100.0) == [] and not b.tidy_due(101.0)
    check(tools.run(["nvidia-cuda-mps-control"], env=b._env(), input="quit\n"))  # it dies behind our back
    assert b.tidy(101.0) == []  # not asked again before the interval
    notes = b.tidy(100.0 + CHECK_INTERVAL_S)
    assert "started again" in notes[0] and b.running()
    b.teardown(card, s1)
    assert b.servers() == []


# ------------------------------------------------------------------- idle servers ([cards] mps_idle_keep_s)
def shutdowns(tools) -> int:
    return sum("shutdown_server" in (text or "") for _, _, text in tools.calls)


def test_an_idle_server_serves_the_next_slice_of_its_uid_with_no_tool_run(tmp_path):
    now = [100.0]
    b, card, _fake, _nvml, tools = mps(tmp_path, keep=30.0, clock=lambda: now[0])
    s1 = b.prepare(card, [], QUARTER, "a", 1000)[0]
    pipe = str(b.pipe_dir)
    assert tools.connect(pipe, 501, 1000) == "served"
    (server,) = b.servers()
    tools.disconnect(pipe, 501)
    assert not b.needs_tool("teardown", "a")  # the last slice, but its server is kept
    calls = len(tools.calls)
    b.teardown(card, s1)
    assert len(tools.calls) == calls and b.idle_server() == 1000
    assert tools.snapshot()[pipe]["servers"] == {server: (1000, [])}  # still there, idle
    assert not b.needs_tool("prepare", "b", 1000)
    s2 = b.prepare(card, [], QUARTER, "b", 1000)[0]
    assert len(tools.calls) == calls and b.idle_server() is None
    assert tools.connect(pipe, 502, 1000) == "served"
    assert tools.snapshot()[pipe]["servers"] == {server: (1000, [502])}  # the same server, no new start
    assert not b.fits(card, [s2], QUARTER, owner_uid=1001)  # a live slice keeps uid 1001 away


def test_another_uid_s_slice_shuts_the_idle_server_down_first_and_never_shares_it(tmp_path):
    b, card, *_rest, tools = mps(tmp_path, keep=30.0)
    s1 = b.prepare(card, [], QUARTER, "a", 1000)[0]
    pipe = str(b.pipe_dir)
    assert tools.connect(pipe, 501, 1000) == "served"  # a leftover: it outlives its lease
    b.teardown(card, s1)
    assert shutdowns(tools) == 0 and b.idle_server() == 1000
    # Only live slices keep another user away: the idle server is no reason to refuse uid 1001.
    assert b.fits(card, [], QUARTER, owner_uid=1001) and not b.serves_other_user(1001)
    assert b.why_not(card, [], QUARTER, owner_uid=1001) == ""
    assert b.needs_tool("prepare", "b", 1001) and not b.needs_tool("prepare", "b", 1000)
    b.prepare(card, [], QUARTER, "b", 1001)
    assert shutdowns(tools) == 1 and b.idle_server() is None
    assert tools.snapshot()[pipe]["servers"] == {}  # forced: the leftover client is cut off
    assert 501 in tools.daemons[pipe].killed
    assert tools.connect(pipe, 601, 1001) == "served"  # not "waiting" behind uid 1000's server
    assert [uid for uid, _ in tools.snapshot()[pipe]["servers"].values()] == [1001]
    assert not b.fits(card, [], QUARTER, owner_uid=1000)  # and uid 1000 now waits for uid 1001


def test_an_idle_server_of_an_unknown_uid_is_shut_down_before_any_slice(tmp_path):
    b, card, *_rest, tools = mps(tmp_path, keep=30.0)
    b.prepare(card, [], QUARTER, "a", 1000)
    assert tools.connect(str(b.pipe_dir), 501, 1000) == "served"
    stranger = Slice(card.index, QUARTER.name, 1 << 30, 15, handle=f"mps:{card.index}:not-ours")
    b._owners.clear()  # the books lost the slice's owner (e.g. restored without it)
    b.teardown(card, stranger)
    assert shutdowns(tools) == 0 and b.idle_server() == -1  # kept, but no uid may join it
    assert b.needs_tool("prepare", "b", 1000) and b.needs_tool("prepare", "c", 1001)
    b.prepare(card, [], QUARTER, "b", 1000)
    assert shutdowns(tools) == 1 and b.idle_server() is None


def test_tidy_shuts_an_idle_server_down_once_its_grace_is_over(tmp_path):
    now = [100.0]
    b, card, *_rest, tools = mps(tmp_path, keep=30.0, clock=lambda: now[0])
    s = b.prepare(card, [], QUARTER, "a", 1000)[0]
    pipe = str(b.pipe_dir)
    tools.connect(pipe, 501, 1000)
    tools.disconnect(pipe, 501)
    b.teardown(card, s)  # idle since 100
    assert b.tidy(100.0) == [] and not b.tidy_due(104.9)  # (the control daemon was asked at 100)
    assert b.tidy(129.9) == [] and len(b.servers()) == 1  # asked again at 129.9: next at 134.9
    assert b.tidy_due(130.0)  # the grace is over: due before the next check of the control daemon
    assert b.tidy(130.0) == ["card 0: idle MPS server of uid 1000 shut down"]
    assert b.servers() == [] and b.idle_server() is None and shutdowns(tools) == 1
    assert not b.tidy_due(131.0)
    assert not b.needs_tool("prepare", "b", 1001)  # nothing left to shut down


def test_leaving_sliced_mode_or_a_restart_drops_an_idle_server(tmp_path):
    b, card, _fake, nvml, tools = mps(tmp_path, keep=30.0)
    s = b.prepare(card, [], QUARTER, "a", 1000)[0]
    tools.connect(str(b.pipe_dir), 501, 1000)
    b.teardown(card, s)
    again = MpsIsolation(card, nvml, tools, tmp_path / "run", idle_keep_s=30.0)  # a restarted xpud
    found = again.reconcile(card, CardMode.SLICED, [])
    assert "MPS server without slices shut down" in found.notes[0] and again.servers() == []
    assert again.idle_server() is None and not again.needs_tool("prepare", "b", 1001)
    s = again.prepare(card, [], QUARTER, "b", 1000)[0]
    tools.connect(str(again.pipe_dir), 502, 1000)
    again.teardown(card, s)
    again.leave_sliced(card)
    assert tools.snapshot() == {} and again.idle_server() is None
    assert nvml.compute_mode(0) == "DEFAULT"
