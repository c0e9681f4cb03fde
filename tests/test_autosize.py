"""Right-sizing in the engine: measured through the fake NVML, decided, and acted on with real moves."""

from __future__ import annotations

import os

import pytest

from tests.syncengine import sync_engine
from tests.test_engine import Clock, cards, pcie_box, req
from xpud.config.schema import Config
from xpud.controllers.rightsizer import Rightsizer
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.ledger.ledger import Ledger
from xpud.model import Caller

ME = os.getpid()  # the lease's holder: its processes are this one and its children


@pytest.fixture
def world(tmp_path):
    clock = Clock()
    cfg = Config().replace("auto", sample_s=5.0, up_after_s=60.0, down_after_s=120.0, hold_s=300.0)
    engine = sync_engine(cards(), pcie_box(), cfg, Ledger(tmp_path / "l.sqlite"), clock=clock)
    fake = FakeNvml("pcie-8x-l40s", clock=clock)
    nvml = Nvml(fake)
    nvml.open()
    rs = Rightsizer(engine.engine, nvml)
    return engine, fake, rs, clock


def running(engine, fake, rs, mode, sm, restartable=True, auto=True):
    lease, token = engine.try_grant(
        req(mode, restartable=restartable, holder_pid=ME, command="python serve.py")
    )
    q = engine.hold_opened(lease.id)
    rs.track(lease.id, "serve", auto)
    fake.add_process(lease.cards[0], ME, used_bytes=1 << 30)
    fake.set_process_load(lease.cards[0], ME, sm)
    return lease, token, q


def tick(engine, rs, clock, seconds):
    """Let time pass, polling every sample_s; the decisions made."""
    out = []
    for _ in range(int(seconds / rs.cfg.sample_s)):
        clock.t += rs.cfg.sample_s
        out += engine.run(rs.poll())
    return out


def follow(engine, fake, lease, token, sm):
    """The holder acknowledges the move and its command runs again on the new card."""
    fake.remove_process(lease.cards[0], ME)
    new = engine.ack_move(lease.id, token)
    fake.add_process(new.cards[0], ME, used_bytes=1 << 30)
    fake.set_process_load(new.cards[0], ME, sm)
    return new


def test_quarter_at_its_cap_moves_to_half_then_to_a_whole_card(world):
    engine, fake, rs, clock = world
    lease, token, _ = running(engine, fake, rs, "vxpu-quarter", 15)
    assert tick(engine, rs, clock, 55) == []  # not yet the configured time
    [d] = tick(engine, rs, clock, 10)
    assert d.move and d.to == "vxpu-half" and "throttled at its 15 % compute cap" in d.evidence
    half = follow(engine, fake, lease, token, 30)
    assert str(half.mode) == "vxpu-half" and str(engine.ledger.active_leases()[0].mode) == "vxpu-half"
    held = tick(engine, rs, clock, 250)  # at the new cap, but within the hold: said, not done
    assert held and not any(d.move for d in held) and "hold 300 s" in held[-1].evidence
    moved = [d for d in tick(engine, rs, clock, 120) if d.move]
    assert [d.to for d in moved] == ["xpu"]
    whole = follow(engine, fake, half, token, 60)
    assert str(whole.mode) == "xpu" and engine.cards[whole.cards[0]].whole_lease == lease.id
    kinds = [(e.kind, e.message) for e in engine.ledger.events() if e.kind == "auto"]
    assert [m.split(":")[1].strip() for _, m in kinds] == [
        "moving up from vxpu-quarter to vxpu-half",
        "recommend moving up from vxpu-half to xpu",  # in the hold
        "moving up from vxpu-half to xpu",
    ]
    assert all("throttled at its" in m for _, m in kinds)  # each decision with its evidence


def test_an_idle_whole_card_job_moves_to_a_slice(world):
    engine, fake, rs, clock = world
    lease, token, _ = running(engine, fake, rs, "xpu", 1)
    [d] = [d for d in tick(engine, rs, clock, 130) if d.move]
    assert d.to == "vxpu-half" and "peak compute" in d.evidence
    assert str(follow(engine, fake, lease, token, 1).mode) == "vxpu-half"


def test_a_non_restartable_job_is_never_moved_and_is_told_why(world):
    engine, fake, rs, clock = world
    lease, _, _ = running(engine, fake, rs, "vxpu-quarter", 15, restartable=False)
    decisions = tick(engine, rs, clock, 400)
    assert decisions and not any(d.move for d in decisions)
    assert engine.leases[lease.id].cards == lease.cards and lease.id not in engine.moves.pending
    assert "right-sizing recommends vxpu-half" in engine.leases[lease.id].mark
    assert sum(e.kind == "auto" for e in engine.ledger.events()) == 1  # said once, not every sample


def test_a_lease_not_asking_for_auto_is_only_measured(world):
    engine, fake, rs, clock = world
    lease, _, _ = running(engine, fake, rs, "vxpu-quarter", 15, auto=False)
    decisions = tick(engine, rs, clock, 100)
    assert decisions and not any(d.move for d in decisions) and "not --mode auto" in decisions[0].evidence
    assert len(rs.book.history(lease.id)) == 20


def test_xpu_run_mode_auto_starts_a_class_with_no_history_in_first(daemon):
    """Through the socket: --mode auto with --class, the lease in [auto] first, measured in --usage."""
    import json

    p = daemon.xpu_popen("run", "--mode", "auto", "--class", "serve", "--", "sleep", "30")
    try:
        from tests.conftest import wait_until

        with daemon.client() as c:
            wait_until(lambda: len(c.leases().leases) == 1, timeout=20)
            [lease] = c.leases().leases
        assert lease.mode == "vxpu-half"
        r = daemon.xpu("leases", "--usage", "--json")
        [row] = json.loads(r.stdout)["rows"]
        assert row["auto"] and row["job_class"] == "serve" and row["cap_pct"] == 30
        assert "serve" in daemon.xpu("leases", "--usage").stdout
        bad = daemon.xpu("run", "--mode", "auto", "--class", "bad\nname", "--", "true")
        assert bad.returncode != 0 and "job_class" in bad.stderr
    finally:
        p.terminate()
        p.wait(20)


def test_resize_restarts_a_restartable_job_and_refuses_the_others(world):
    from xpud.controllers.rightsizer import resize
    from xpud.errors import Conflict, Forbidden

    engine, fake, rs, _clock = world
    lease, token, q = running(engine, fake, rs, "vxpu-quarter", 5)
    owner, stranger = Caller(uid=1000, gid=1000, pid=ME), Caller(uid=1001, gid=1001, pid=ME)
    with pytest.raises(Forbidden):
        engine.run(resize(engine.engine, lease.id, "xpu", stranger))
    _new, how = engine.run(resize(engine.engine, lease.id, "xpu", owner))
    assert "restarting on xpu" in how and "new clients only" in how
    kinds = []
    while not q.empty():
        kinds.append(q.get_nowait().kind)
    assert kinds == ["move", "resize"]  # the holder restarts on the move, and is told why
    done = engine.ack_move(lease.id, token)
    assert str(done.mode) == "xpu" and "XPU_COMPUTE_PCT" not in done.env and done.env["XPU_MODE"] == "xpu"
    assert engine.cards[done.cards[0]].whole_lease == lease.id
    assert any(e.kind == "resize" for e in engine.ledger.events())
    fixed, _, _ = running(engine, fake, rs, "vxpu-half", 5, restartable=False)
    with pytest.raises(Conflict, match="not restartable: its size cannot change while it runs"):
        engine.run(resize(engine.engine, fixed.id, "xpu", owner))
    assert engine.leases[fixed.id].mode == fixed.mode and fixed.id not in engine.moves.pending


def test_each_lease_live_load_is_published_for_its_server(world, tmp_path):
    import json

    engine, fake, rs, clock = world
    engine.engine.cfg = engine.cfg.replace("daemon", runtime_dir=str(tmp_path))
    lease, _, _ = running(engine, fake, rs, "vxpu-quarter", 15)
    engine.try_grant(req("vxpu-quarter", wait_s=60, uid=1001))  # fits: no queue
    for _ in range(3):
        clock.t += 5
        engine.run(rs.poll_logged())
    load = json.loads((tmp_path / "load" / f"{lease.id}.json").read_text())
    assert load["throttled"] and load["cap_pct"] == 15 and load["used_pct"] == 15
    assert load["mode"] == "vxpu-quarter" and load["waiting_for_size"] == 0 and not load["moving"]
    engine.release(lease.id, Caller(uid=1000))
    engine.run(rs.poll_logged())
    assert not (tmp_path / "load" / f"{lease.id}.json").exists()  # its file goes with it


def test_the_documented_server_example_reads_the_load_file(tmp_path, monkeypatch):
    import importlib.util
    import json
    from pathlib import Path

    (tmp_path / "load").mkdir()
    (tmp_path / "load" / "L1.json").write_text(json.dumps({"throttled": True, "cap_pct": 15, "used_pct": 15}))
    monkeypatch.setenv("XPUD_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("XPU_LEASE_ID", "L1")
    path = Path(__file__).parent.parent / "examples" / "adaptive_batch.py"
    spec = importlib.util.spec_from_file_location("adaptive_batch", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    assert ex.next_batch(8, ex.load()) == 4  # throttled: halve
    assert ex.next_batch(8, {"used_pct": 2, "cap_pct": 15}) == 16  # idle under the cap: double
    assert ex.next_batch(8, {}) == 16 and ex.next_batch(1, {"throttled": True}) == 1
    monkeypatch.setenv("XPU_LEASE_ID", "gone")
    spec.loader.exec_module(ex)
    assert ex.load() == {}


AUTO_FAST = """
[auto]
first = "vxpu-quarter"
sample_s = 1.0
up_after_s = 2.0
hold_s = 0.0
"""


def test_end_to_end_xpu_run_mode_auto_moves_up_and_restarts_the_command(inproc):
    """A real `xpu run --mode auto --restartable` against an in-process daemon whose fake NVML shows the
    job at its quarter cap: the daemon moves it to a half slice and the wrapper restarts the command."""
    import subprocess

    from tests.conftest import BIN, wait_until, xpu_env

    d = inproc("pcie-8x-l40s", AUTO_FAST)
    p = subprocess.Popen(
        [str(BIN / "xpu"), "run", "--mode", "auto", "--class", "svc", "--restartable", "--", "sleep", "60"],
        env=xpu_env(d.runtime_dir),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: len(d.engine.leases) == 1, timeout=20)
        [lease] = d.engine.leases.values()
        assert str(lease.mode) == "vxpu-quarter" and lease.holder_pid == p.pid
        d.fake.add_process(lease.cards[0], p.pid)
        d.fake.set_process_load(lease.cards[0], p.pid, 15)
        wait_until(lambda: str(next(iter(d.engine.leases.values())).mode) == "vxpu-half", timeout=30)
        moved = next(iter(d.engine.leases.values()))
        assert moved.restart_count == 1 and moved.cards != lease.cards
        events = [e.message for e in d.engine.ledger.events() if e.kind == "auto"]
        assert any("started as vxpu-quarter" in m for m in events)
        assert any("moving up from vxpu-quarter to vxpu-half" in m and "throttled" in m for m in events)
    finally:
        p.terminate()
        _, err = p.communicate(timeout=20)
    assert "restarting the command on card" in err


def test_auto_state_survives_a_restart_of_the_engine(world, tmp_path):
    """The class histories and each auto lease's moves are in the ledger: a new engine on the same ledger
    starts the class from its history and keeps the lease's budget and hysteresis."""
    engine, fake, rs, clock = world
    lease, token, _ = running(engine, fake, rs, "vxpu-quarter", 15)
    [d] = tick(engine, rs, clock, 65)
    assert d.move and d.to == "vxpu-half"
    half = follow(engine, fake, lease, token, 30)
    tick(engine, rs, clock, 20)
    assert rs.choose("python serve.py", "serve")[0] == "xpu"  # at its half cap now: a whole card next
    engine.ledger.flush()
    engine.ledger.close()

    again = sync_engine(cards(), pcie_box(), rs.engine.cfg, Ledger(tmp_path / "l.sqlite"), clock=clock)
    assert [x.id for x in again.restore()] == [lease.id]
    rs2 = Rightsizer(again.engine, rs.nvml)
    rs2.restore()
    assert len(rs2.book.classes["serve"]) == len(rs.book.classes["serve"]) == 17
    assert rs2.choose("python serve.py", "serve")[:2] == ("xpu", "serve")
    t = rs2.tracked[lease.id]
    assert (t.cls, t.auto, t.state.moves, t.state.last_direction) == ("serve", True, 1, "up")
    assert t.state.last_move_t == rs.tracked[lease.id].state.last_move_t
    held = tick(again, rs2, clock, 65)  # at its half cap again, but moved 85 s before: in its hold
    assert held and not any(x.move for x in held) and "hold 300 s" in held[-1].evidence
    assert again.leases[half.id].mode == half.mode and half.id not in again.moves.pending
    # a fresh engine without the records: the class is unknown again
    assert Rightsizer(again.engine, rs.nvml).choose("python serve.py", "serve")[0] == "vxpu-half"


def test_class_history_survives_a_daemon_restart(short_tmp):
    """Through the socket: a class measured by one daemon is started from its history by the next one on
    the same state directory (same simulated cards, a restart without a reboot)."""
    from tests.conftest import wait_until
    from tests.daemons import InProcDaemon
    from xpud.api.client import Client

    conf = '[auto]\nfirst = "vxpu-quarter"\nsample_s = 1.0\n'
    base = short_tmp / "d"
    base.mkdir()
    d = InProcDaemon(base, "pcie-8x-l40s", conf)
    try:
        with Client(d.runtime_dir) as c:
            g = c.acquire_lease("auto", job_class="svc", command="python svc.py")
            assert g.lease.mode == "vxpu-quarter"  # no history: [auto] first
            d.fake.add_process(g.lease.cards[0], ME, used_bytes=1 << 30)
            d.fake.set_process_load(g.lease.cards[0], ME, 15, 3)
            wait_until(lambda: len(d.engine.rightsizer.book.classes.get("svc", ())) >= 4, timeout=20)
            c.release(g.lease.id, g.token)
    finally:
        d.stop()
    d = InProcDaemon(base, "pcie-8x-l40s", conf, fake=d.fake)
    try:
        with Client(d.runtime_dir) as c:
            g = c.acquire_lease("auto", job_class="svc", command="python svc.py")
            # throttled at the quarter cap before the restart: its real need is unknown, a whole card
            assert g.lease.mode == "xpu"
            c.release(g.lease.id, g.token)
        events = [e.message for e in d.engine.ledger.events() if e.kind == "auto"]
        assert any("started as xpu" in m and "class 'svc'" in m for m in events)
    finally:
        d.stop()


def test_watch_lease_streams_the_load_until_the_lease_ends(inproc, monkeypatch):
    """Node.WatchLease through the socket: the load now, then each round's (the job at its quarter cap
    shows throttled), and the stream ends once the lease has; the documented example follows it."""
    import importlib.util
    import threading
    from pathlib import Path

    from tests.conftest import wait_until
    from xpud.api.client import Client
    from xpud.errors import BadRequest, NotFound

    d = inproc("pcie-8x-l40s", "[auto]\nsample_s = 1.0\n")
    with Client(d.runtime_dir) as c:
        g = c.acquire_lease("vxpu-quarter", command="python srv.py")
        d.fake.add_process(g.lease.cards[0], ME, used_bytes=1 << 30)
        d.fake.set_process_load(g.lease.cards[0], ME, 15, 3)
        got = []
        stream = c.watch_lease(g.lease.id[:6])
        done = threading.Event()

        def read():
            for m in c.iterate(stream):
                got.append(m)
            done.set()

        threading.Thread(target=read, daemon=True).start()
        wait_until(lambda: any(m.throttled for m in got), timeout=20)
        assert got[0].lease_id == g.lease.id and got[0].mode == "vxpu-quarter"
        last = got[-1]
        assert last.cap_pct == 15 and last.used_pct == 15 and last.mem_used_bytes == 1 << 30

        monkeypatch.setenv("XPUD_RUNTIME_DIR", str(d.runtime_dir))
        path = Path(__file__).parent.parent / "examples" / "watch_load.py"
        spec = importlib.util.spec_from_file_location("watch_load", path)
        ex = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ex)
        threading.Thread(target=ex.follow, args=(g.lease.id,), daemon=True).start()
        wait_until(lambda: ex.latest.get("throttled") is True, timeout=20)
        assert ex.latest["cap_pct"] == 15 and ex.latest["waiting_for_size"] == 0

        c.release(g.lease.id, g.token)
        assert done.wait(20), "the stream did not end with the lease"
        with pytest.raises(NotFound):
            next(iter(c.iterate(c.watch_lease(g.lease.id))))
        with pytest.raises(BadRequest, match="lease_id"):
            next(iter(c.iterate(c.watch_lease("bad id!"))))


def test_only_what_a_restart_cannot_derive_is_written(world):
    engine, _fake, rs, _clock = world
    plain, _ = engine.try_grant(req("vxpu-quarter", command="python x.py"))
    named, _ = engine.try_grant(req("vxpu-quarter", command="python x.py"))
    auto, _ = engine.try_grant(req("vxpu-quarter", command="python x.py"))
    rs.track(plain.id, "python x.py", False)  # the class its command gives: nothing to keep
    rs.track(named.id, "svc", False)  # --class svc
    rs.track(auto.id, "python x.py", True)  # --mode auto
    engine.ledger.flush()
    assert set(engine.ledger.auto_leases()) == {named.id, auto.id}
    for lease in (plain, named, auto):
        engine.release(lease.id, Caller(uid=1000))
        rs.ended(lease.id)
    engine.ledger.flush()
    assert engine.ledger.auto_leases() == {}
    assert engine.ledger.db.execute("SELECT count(*) FROM auto_leases").fetchone()[0] == 0
