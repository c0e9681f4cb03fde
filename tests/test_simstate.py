"""The simulated machine's MIG and MPS state outlives the daemon, as the real driver's does (issue 10,
defect 9): a state file beside the ledger, written at each change, read at start-up."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import pytest

from tests.conftest import wait_until
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.hw.simstate import FILE_NAME, SimState, SimStateError
from xpud.isolation.faketools import FakeNvidiaTools
from xpud.ledger.ledger import Ledger


def _machine(path, machine: str = "dgx-h100"):
    fake = FakeNvml(machine)
    SimState(path).attach(fake)
    tools = FakeNvidiaTools(fake)
    fake.sim_state.attach_tools(tools)
    hw = Nvml(fake)
    hw.open()
    return fake, tools, hw


def test_mig_instances_modes_and_mps_daemons_come_back_from_the_file(tmp_path):
    path = tmp_path / FILE_NAME
    fake, tools, hw = _machine(path)
    hw.set_mig_mode(2, True)
    fake.reset(2)
    a = hw.create_mig_instance(2, 9, 0)  # 3g.40gb at 0
    b = hw.create_mig_instance(2, 14, 4)  # 2g.20gb at 4
    hw.destroy_mig_instance(2, a.gpu_instance_id)
    hw.set_compute_mode(5, "EXCLUSIVE_PROCESS")
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir(), log.mkdir()
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(log),
        "CUDA_VISIBLE_DEVICES": "5",
    }
    assert tools.run(["nvidia-cuda-mps-control", "-d"], env=env).ok
    assert tools.run(
        ["nvidia-cuda-mps-control"], env=env, input="set_default_active_thread_percentage 30\n"
    ).ok
    assert tools.connect(str(pipe), 77, 1000) == "served"
    before_layout, before_mps = fake.mig_layout(2), tools.snapshot()
    server = next(iter(before_mps[str(pipe)]["servers"]))
    hw.close()

    fake2, tools2, hw2 = _machine(path)  # a new daemon: new fake, new tools, the same hardware
    assert fake2.mig_layout(2) == before_layout and fake2.card_state(2).mig == 1
    assert [m.device_uuids for m in hw2.mig_instances(2)] == [m.device_uuids for m in [b]]
    assert hw2.compute_mode(5) == "EXCLUSIVE_PROCESS" and hw2.compute_mode(4) == "DEFAULT"
    assert tools2.snapshot() == before_mps and before_mps[str(pipe)]["default_pct"] == 30
    assert server in {p.pid for p in fake2.card_state(5).procs.values()}  # the server runs on its card
    again = hw2.create_mig_instance(2, 9, 0)  # new instances get new UUIDs, never a former one's
    assert set(again.device_uuids).isdisjoint(a.device_uuids + b.device_uuids)
    assert tools2.run(["nvidia-cuda-mps-control"], env=env, input="get_server_list\n").stdout.split() == [
        str(server)
    ]
    assert tools2.run(["nvidia-cuda-mps-control", "-d"], env=env).returncode == 1  # it still runs
    assert tools2.connect(str(pipe), 78, 1000) == "served"
    assert tools2.run(["nvidia-cuda-mps-control"], env=env, input="quit\n").ok
    hw2.destroy_mig_instance(2, again.gpu_instance_id)
    fake3, tools3, _ = _machine(path)
    assert tools3.snapshot() == {} and not fake3.card_state(5).procs
    assert [g["start"] for g in fake3.mig_layout(2)] == [4]


def test_a_file_of_another_machine_is_ignored_and_a_broken_one_refused(tmp_path):
    path = tmp_path / FILE_NAME
    fake, _, hw = _machine(path, "dgx-h100")
    hw.set_mig_mode(0, True)
    fake.reset(0)
    hw.close()
    other, _, _ = _machine(path, "dgx-a100")  # other cards: fresh hardware
    assert other.card_state(0).mig == 0
    assert json.loads(path.read_text())["cards"] == [c.uuid for c in other.machine.cards]
    for text, why in [
        ("{", "Expecting"),
        ('{"version": 9}', "not a version-1"),
        ("[]", "not a version-1"),
        ("[" * 100_000 + "]" * 100_000, "recursion"),
    ]:
        path.write_text(text)
        with pytest.raises(SimStateError, match=f"{path}: .*{why}.*delete the file"):
            SimState(path).attach(FakeNvml("dgx-h100"))


def _saved(tmp_path, machine: str = "dgx-h100") -> tuple:
    path = tmp_path / FILE_NAME
    fake, _, hw = _machine(path, machine)
    hw.set_mig_mode(1, True)
    fake.reset(1)
    hw.create_mig_instance(1, 9, 0)
    hw.create_mig_instance(1, 9, 4)
    hw.close()
    return path, json.loads(path.read_text())


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d: d["nvml"]["cards"][1]["gpu_instances"][1].update(start=2), "cannot exist"),
        (lambda d: d["nvml"]["cards"][1]["gpu_instances"][1].update(start=0, id=7), "overlaps"),
        (lambda d: d["nvml"]["cards"][1].update(mig=0), "with MIG off"),
        (lambda d: d["nvml"]["cards"][1]["gpu_instances"][0].update(profile_id=99), "no MIG profile"),
        (lambda d: d["nvml"]["cards"][0].update(compute_mode=float("nan")), "compute_mode"),
        (lambda d: d["nvml"]["cards"][0].update(compute_mode=1), "not a mode"),
        (lambda d: d["nvml"]["cards"][1]["gpu_instances"][0]["compute_instances"][0].update(uuid=5), "UUID"),
        (lambda d: d["nvml"]["cards"].pop(), "cards saved"),
        (lambda d: d["mps"].update(daemons=[{"pid": -1}]), "pid"),
    ],
)
def test_values_the_hardware_could_not_hold_are_refused(tmp_path, change, why):
    path, data = _saved(tmp_path)
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(SimStateError, match=why):
        _machine(path)


# ------------------------------------------------------------------------------ real daemons


def _events(d) -> list[str]:
    led = Ledger(d.state_dir / "ledger.sqlite")
    try:
        return [e.message for e in led.events(limit=200)]
    finally:
        led.close()


@pytest.mark.parametrize(
    ("machine", "adopted"),
    [("dgx-h100", "adopted MIG 3g.40gb@"), ("pcie-8x-l40s", "MPS control daemon adopted")],
)
def test_a_slice_lease_and_its_isolation_survive_a_daemon_crash(daemon_factory, machine, adopted):
    d = daemon_factory(machine, config="[leases]\ngrace_s = 5.0\n")
    p = d.xpu_popen(
        "run",
        "--mode",
        "vxpu-half",
        "--",
        "sh",
        "-c",
        "echo $CUDA_VISIBLE_DEVICES; exec sleep 60",
        stdout=subprocess.PIPE,
        text=True,
    )
    device = p.stdout.readline().strip()
    with d.client() as c:
        lease = wait_until(lambda: [x for x in c.leases().leases if x.held], 30)[0]
    d.kill(signal.SIGKILL)
    d.start()
    with d.client() as c:
        assert [x.id for x in c.leases().leases] == [lease.id]
        ended = [x for x in c.leases(all=True).leases if x.state != "active"]
        assert ended == []
        wait_until(lambda: [x for x in c.leases().leases if x.held], 30)
        assert c.leases().leases[0].slices[0].handle == lease.slices[0].handle
    events = _events(d)
    assert any(adopted in m for m in events), events
    assert not any("gone" in m for m in events), events
    state = json.loads((d.state_dir / FILE_NAME).read_text())
    if machine == "dgx-h100":
        uuids = [
            ci["uuid"]
            for card in state["nvml"]["cards"]
            for gi in card["gpu_instances"]
            for ci in gi["compute_instances"]
        ]
        assert uuids == [device]  # the child's MIG device is still there, and nothing else
    else:
        assert [x["devices"] for x in state["mps"]["daemons"]] == [device]
    p.send_signal(signal.SIGTERM)
    p.wait(20)
    with d.client() as c:
        assert wait_until(lambda: not c.leases().leases, 30)


def test_a_broken_state_file_stops_the_daemon_with_one_line(daemon_factory):
    d = daemon_factory("dgx-h100", start=False)
    d.state_dir.mkdir(parents=True)
    (d.state_dir / FILE_NAME).write_text('{"version": 1, "cards": ')
    with pytest.raises(RuntimeError, match=r"xpud exited with 1"):
        d.start()
    lines = [x for x in d.log.read_text().splitlines() if x.startswith("xpud:")]
    assert len(lines) == 1 and FILE_NAME in lines[0] and "delete the file" in lines[0], lines


def test_a_mig_switch_is_not_held_up_by_an_event_wait_started_in_between(tmp_path):
    """Writing the state file (I/O) inside a MIG switch lets the event thread run: it must not start a
    new wait between ``card_released``'s two rebuilds, or the switch ends a whole wait timeout later."""
    _, _, hw = _machine(tmp_path / FILE_NAME)
    waiter = hw.event_waiter()
    stop = threading.Event()

    def events():
        while not stop.is_set():
            waiter.wait(500)

    t = threading.Thread(target=events, daemon=True)
    t.start()
    time.sleep(0.1)
    ends = []
    try:
        for i in range(3):
            with hw.card_released(i):
                hw.set_mig_mode(i, True)
                time.sleep(0.02)  # more I/O: the event thread certainly runs meanwhile
                body_done = time.monotonic()
            ends.append(time.monotonic() - body_done)
    finally:
        stop.set()
        t.join(2)
        waiter.close()
    assert max(ends) < 0.25, ends
