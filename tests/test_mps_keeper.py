"""The MPS keeper ([cards] mps_keeper = true): `xpud mps-keeper` owns the MPS control daemons so that they
outlive xpud's container. The backend asks it through <runtime dir>/mps/<card>/want and waits until the
pipe answers; the keeper starts, adopts and quits daemons with the same tool commands (the fake NVIDIA
tools here, shared by both as the host's one set of daemons)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from xpud.config.schema import DEFAULT_SLICES
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.isolation import mps as mps_mod
from xpud.isolation.base import Held
from xpud.isolation.faketools import FakeNvidiaTools
from xpud.isolation.mps import MpsIsolation
from xpud.isolation.mps_keeper import CHECK_S, Keeper, read_env, write_want
from xpud.isolation.runner import ToolError, check
from xpud.model import CardMode

HALF = DEFAULT_SLICES["vxpu-half"]
START = ("nvidia-cuda-mps-control", "-d")


class Host:
    """One simulated host: the fake NVML and tools, xpud's runtime dir, a keeper thread when started."""

    def __init__(self, tmp_path, missing=()):
        self.fake = FakeNvml("pcie-8x-l40s")
        self.nvml = Nvml(self.fake)
        self.nvml.open()
        self.tools = FakeNvidiaTools(self.fake, missing=missing)
        self.run_dir = tmp_path / "run"
        self.mps_dir = self.run_dir / "mps"
        self.mps_dir.mkdir(parents=True)
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def backend(self, index=0) -> MpsIsolation:
        return MpsIsolation(self.nvml.card_info(index), self.nvml, self.tools, self.run_dir, keeper=True)

    def start_keeper(self) -> Keeper:
        keeper = Keeper(self.mps_dir, self.tools)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=keeper.run, args=(self._stop, 0.01), daemon=True)
        self._thread.start()
        return keeper

    def stop_keeper(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5)
            self._thread = None

    def starts(self) -> int:
        return [argv for argv, _, _ in self.tools.calls].count(START)


@pytest.fixture
def host(tmp_path):
    h = Host(tmp_path)
    yield h
    h.stop_keeper()


def test_a_backend_in_keeper_mode_starts_no_daemon_itself_and_the_keeper_starts_it(host, monkeypatch):
    b = host.backend(3)
    card = b.card
    monkeypatch.setattr(mps_mod, "KEEPER_WAIT_S", 0.3)
    with pytest.raises(ToolError, match=r"no MPS keeper started .* run `xpud mps-keeper --dir .*/run/mps`"):
        b.prepare(card, [], HALF, "a", 1000)  # no keeper runs: nothing starts, a clear error
    assert host.starts() == 0 and host.tools.snapshot() == {}
    host.start_keeper()
    _s, env = b.prepare(card, [], HALF, "a", 1000)
    pipe = host.mps_dir / "3" / "pipe"
    assert b.running() and list(host.tools.snapshot()) == [str(pipe)]
    assert host.tools.snapshot()[str(pipe)]["devices"] == card.uuid
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe) and host.nvml.compute_mode(3) == "EXCLUSIVE_PROCESS"
    assert host.starts() == 1
    assert read_env(host.mps_dir / "3" / "want", host.mps_dir) == b._env()
    want = json.loads((host.mps_dir / "3" / "want").read_text())
    assert want == {"env": b._env()}


def test_a_restarted_xpud_and_a_restarted_keeper_adopt_the_running_daemon(host):
    keeper = host.start_keeper()
    b = host.backend()
    s = b.prepare(b.card, [], HALF, "a", 1000)[0]
    pid = host.tools.snapshot()[str(b.pipe_dir)]["pid"]
    assert host.tools.connect(str(b.pipe_dir), 4242, 1000) == "served"
    # xpud's pod is replaced (a rolling update): a new backend adopts the daemon the keeper still runs
    again = host.backend()
    found = again.reconcile(again.card, CardMode.SLICED, [Held("a", 1000, s)])
    assert "MPS control daemon adopted" in found.notes[0] and host.starts() == 1
    # the keeper restarts: it adopts the daemon (its pipe answers) instead of starting another
    host.stop_keeper()
    assert keeper._kept  # the old keeper kept it
    fresh = Keeper(host.mps_dir, host.tools)
    assert fresh.scan() == [f"card 0: MPS control daemon on {again.pipe_dir} adopted"]
    assert fresh.scan() == [] and host.starts() == 1
    snap = host.tools.snapshot()[str(b.pipe_dir)]
    assert snap["pid"] == pid and [4242] in [c for _, c in snap["servers"].values()]  # the client lives


def test_removing_the_want_quits_the_daemon_even_across_a_keeper_restart(host):
    host.start_keeper()
    b = host.backend()
    s = b.prepare(b.card, [], HALF, "a", 1000)[0]
    b.teardown(b.card, s)
    b.leave_sliced(b.card)  # removes want and waits for the keeper's quit
    assert not b.running() and host.tools.snapshot() == {}
    assert host.nvml.compute_mode(0) == "DEFAULT"
    assert not (b.base / "want").exists() and not (b.base / "kept").exists()
    # the keeper is down when xpud asks for the quit: the next keeper quits the daemon it finds kept
    b.enter_sliced(b.card)
    host.stop_keeper()
    (b.base / "want").unlink()
    assert b.running()
    assert Keeper(host.mps_dir, host.tools).scan() == [f"card 0: MPS control daemon on {b.pipe_dir} quit"]
    assert not b.running() and not (b.base / "kept").exists()


def test_a_daemon_that_died_is_started_again_by_the_keeper(host):
    now = [100.0]
    keeper = Keeper(host.mps_dir, host.tools, clock=lambda: now[0])
    b = host.backend()
    b.base.mkdir(parents=True)
    write_want(b.base, b._env())
    assert keeper.scan() == [f"card 0: MPS control daemon started on {b.pipe_dir}"]
    check(host.tools.run(["nvidia-cuda-mps-control"], env=b._env(), input="quit\n"))  # killed behind its back
    assert keeper.scan() == []  # asked again only every CHECK_S
    now[0] += CHECK_S
    assert keeper.scan() == [f"card 0: MPS control daemon started on {b.pipe_dir}"] and b.running()


def test_a_failed_start_is_reported_at_once_and_a_bad_want_starts_nothing(tmp_path, monkeypatch):
    host = Host(tmp_path, missing=["nvidia-cuda-mps-control"])
    try:
        host.start_keeper()
        monkeypatch.setattr(mps_mod, "KEEPER_WAIT_S", 30.0)
        b = host.backend()
        with pytest.raises(
            ToolError, match=r"the MPS keeper could not start the control daemon: .*not found"
        ):
            b.prepare(b.card, [], HALF, "a", 1000)
    finally:
        host.stop_keeper()
    ok = Host(tmp_path / "2")
    keeper = Keeper(ok.mps_dir, ok.tools)
    card = ok.mps_dir / "0"
    card.mkdir()
    env = ok.backend()._env() | {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "elsewhere")}
    (card / "want").write_text(json.dumps({"env": env}))
    assert keeper.scan() == [] and ok.tools.snapshot() == {}
    assert "is not a directory under" in (card / "failed").read_text()
    (card / "want").write_text("x" * 5000)
    assert keeper.scan() == [] and "longer than 4096 bytes" in (card / "failed").read_text()


@pytest.mark.parametrize(
    ("args", "said"),
    [(["--interval", "nan"], "--interval nan: give 0.05 to 10 seconds"), (["--dir", "rel"], "absolute path")],
)
def test_the_keeper_command_refuses_bad_options_in_one_line(args, said):
    done = subprocess.run(
        [sys.executable, "-c", "from xpud.daemon.cli import main; main()", "mps-keeper", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_switching_to_the_keeper_hands_it_a_running_daemon_and_a_restart_withdraws_a_stale_want(host):
    """A daemon xpud started itself (mps_keeper = false before) is handed to the keeper, not started twice;
    a want left by a crash for a card that is no longer sliced is withdrawn at reconcile."""
    own = MpsIsolation(host.nvml.card_info(0), host.nvml, host.tools, host.run_dir)  # keeper off
    s = own.prepare(own.card, [], HALF, "a", 1000)[0]
    assert host.starts() == 1 and not (own.base / "want").exists()
    b = host.backend()
    b.reconcile(b.card, CardMode.SLICED, [Held("a", 1000, s)])
    assert read_env(b.base / "want", host.mps_dir) == b._env()
    keeper = Keeper(host.mps_dir, host.tools)
    assert keeper.scan() == [f"card 0: MPS control daemon on {b.pipe_dir} adopted"] and host.starts() == 1
    other = host.backend(1)
    other.base.mkdir(parents=True)
    write_want(other.base, other._env())  # asked for, then xpud crashed before the card was sliced
    other.reconcile(other.card, CardMode.WHOLE, [])
    assert not (other.base / "want").exists() and keeper.scan() == [] and host.starts() == 1
