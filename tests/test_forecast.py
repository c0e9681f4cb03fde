"""Demand forecast (hour-of-week profile, exponential smoothing) on synthetic weekly patterns with stated
error bounds, pre-provisioning before a forecast peak and tear-down after, and `xpu forecast`."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timedelta

import numpy as np
import pytest

from tests.conftest import wait_until
from tests.syncengine import sync_engine
from tests.test_cli_json import check
from tests.test_engine import cards, pcie_box, req
from xpud import config
from xpud.controllers.provisioner import Provisioner
from xpud.ledger.ledger import Ledger
from xpud.model import CardMode, Lease, LeaseState, Mode
from xpud.planning import forecast

MONDAY = datetime(2026, 11, 2)  # local time, a Monday; four weeks of history end on 2026-11-30


def weekly(day: int, hour: int) -> float:
    """The true pattern: weekdays 9-17 six slices, 14-16 on Mondays eight, nights one, weekends none."""
    if day >= 5:
        return 0.0
    if day == 0 and 14 <= hour < 16:
        return 8.0
    return 6.0 if 9 <= hour < 17 else 1.0


def history(weeks: int, rng, jitter_s: float = 300.0, poisson: bool = False):
    """Lease intervals realising ``weekly``: per hour, that many (or a Poisson draw of that many) one-hour
    vxpu-half leases, each start shifted by up to ``jitter_s``."""
    out = []
    for h in range(weeks * 168):
        t = (MONDAY + timedelta(hours=h)).timestamp()
        lam = weekly(h // 24 % 7, h % 24)
        n = rng.poisson(lam) if poisson else int(lam)
        for _ in range(n):
            s = t + rng.uniform(-jitter_s, jitter_s)
            out.append(("vxpu-half", s, s + 3600.0))
    return out


def truth(start: datetime, hours: int) -> np.ndarray:
    return np.array(
        [
            weekly((start + timedelta(hours=k)).weekday(), (start + timedelta(hours=k)).hour)
            for k in range(hours)
        ]
    )


def test_occupancy_matches_a_brute_force_count():
    rng = np.random.default_rng(1)
    s = rng.uniform(0, 36_000, 300)
    e = s + rng.uniform(0, 9_000, 300)
    brute = [
        sum(max(0.0, min(b + 3600, y) - max(b, x)) for x, y in zip(s, e, strict=True)) / 3600
        for b in np.arange(10) * 3600.0
    ]
    assert np.allclose(forecast.occupancy(s, e, 0.0, 10), brute)


def test_forecast_of_a_jittered_weekly_pattern_is_within_5_percent():
    """Bound stated: MAPE < 5 % for the fifth week against the true pattern (hours with demand), after four
    weeks of history whose lease starts are jittered by up to 5 minutes."""
    rng = np.random.default_rng(7)
    now = (MONDAY + timedelta(weeks=4)).timestamp()
    t0, series = forecast.demand_by_size(history(4, rng), ["vxpu-half"], now, 28)
    fit = forecast.fit(series["vxpu-half"], t0, alpha=0.3)
    ahead = np.array([fit.forecast(now + k * 3600) for k in range(168)])
    true = truth(MONDAY + timedelta(weeks=4), 168)
    err = forecast.mape(true, ahead)
    assert err is not None and err < 0.05, err
    assert fit.forecast(now + 14.5 * 3600) == pytest.approx(8.0, rel=0.05)  # Monday's 14:00 peak
    # one step ahead over the last week (what `xpu forecast` shows) is as good
    assert forecast.mape(fit.actual[-168:], fit.predicted[-168:]) < 0.05


def test_forecast_of_a_poisson_weekly_pattern_is_within_30_percent():
    """Bound stated: with Poisson counts (the pattern is each hour's mean) and six weeks of history, MAPE
    against the true means < 30 % (one week's noise alone is ~40 % at a mean of 6)."""
    rng = np.random.default_rng(11)
    now = (MONDAY + timedelta(weeks=6)).timestamp()
    t0, series = forecast.demand_by_size(history(6, rng, poisson=True), ["vxpu-half"], now, 42)
    fit = forecast.fit(series["vxpu-half"], t0, alpha=0.2)
    ahead = np.array([fit.forecast(now + k * 3600) for k in range(168)])
    err = forecast.mape(truth(MONDAY + timedelta(weeks=6), 168), ahead)
    assert err is not None and err < 0.30, err


def test_an_unseen_hour_forecasts_the_mean_of_the_seen_ones_and_mape_skips_zero_hours():
    t0 = MONDAY.timestamp()
    fit = forecast.fit(np.array([2.0, 4.0]), t0, 0.5)
    assert fit.forecast(t0 + 5 * 3600) == 3.0 and fit.forecast(t0 + 3600) == 4.0
    assert np.isnan(fit.predicted).all()  # the first week had nothing learnt before it
    week2 = forecast.fit(np.r_[np.full(168, 2.0), 6.0], t0, 0.5)
    assert week2.predicted[168] == 2.0 and week2.forecast(t0) == 4.0
    assert forecast.mape(np.array([0.0, 2.0]), np.array([1.0, 1.0])) == 0.5
    assert forecast.mape(np.array([0.0]), np.array([1.0])) is None
    with pytest.raises(ValueError, match="alpha"):
        forecast.fit(np.array([1.0]), t0, 0.0)


# ------------------------------------------------------------------------------------- pre-provisioning
class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _engine(tmp_path, now: float, extra: str = ""):
    cfg = config.parse("[forecast]\nenabled = true\nlead_s = 900.0\n[bursts]\nhold_s = 600.0\n" + extra)
    cfg = cfg.replace("daemon", runtime_dir=str(tmp_path))
    ledger = Ledger(tmp_path / "l.sqlite")
    rng = np.random.default_rng(3)
    for n, (mode, s, e) in enumerate(history(4, rng)):
        lease = Lease(f"h{n:06d}", Mode(mode), 1000, (0,), ("GPU-0000",), created=s)
        ledger.insert_lease(lease, "t")
        ledger.end_lease(lease.id, LeaseState.RELEASED, "history", when=e)
    clock = Clock(now)
    return sync_engine(cards(), pcie_box(), cfg, ledger, clock=clock), clock


def _sliced(engine) -> list[int]:
    return sorted(i for i, c in engine.cards.items() if c.mode is CardMode.SLICED)


def test_cards_are_sliced_before_the_peak_and_whole_again_after(tmp_path):
    start = (MONDAY + timedelta(weeks=4, hours=13, minutes=50)).timestamp()  # Monday 13:50
    engine, clock = _engine(tmp_path, start)
    prov = Provisioner(engine.engine, clock=clock)
    report = engine.run(prov.run())
    # 14:05 is forecast at ~8 halves: 4 cards' worth, sliced now, before anyone asks
    assert report["sliced_cards_wanted"] == 4 and len(_sliced(engine)) == 4
    msgs = [e.message for e in engine.ledger.events(50) if e.kind == "mode"]
    pre = re.compile(r"forecast pre-provisioning: 8\.\d vxpu-half expected at Mon 14:05 \(4 sliced card")
    assert sum(bool(pre.search(m)) for m in msgs) == 4, msgs
    # the peak's requests land on them without a switch
    clock.t += 600
    for _ in range(8):
        lease, _ = engine.try_grant(req("vxpu-half"))
        assert lease.cards[0] in report["provisioned_cards"]
    assert len(_sliced(engine)) == 4 and engine.stats.conversions[("sliced", "demand")] == 0
    for lease in list(engine.leases.values()):
        engine._end(lease, LeaseState.RELEASED, "done")
    # 17:50: the forecast for 18:05 falls to 1 slice; the provisioned cards go back whole but one
    clock.t = (MONDAY + timedelta(weeks=4, hours=17, minutes=50)).timestamp()
    report = engine.run(prov.run())
    assert report["sliced_cards_wanted"] == 1 and len(_sliced(engine)) == 1
    assert engine.stats.conversions[("whole", "forecast")] == 3
    assert any("forecast falls" in e.message for e in engine.ledger.events(50))


def test_pre_provisioning_respects_the_window(tmp_path):
    start = (MONDAY + timedelta(weeks=4, hours=13, minutes=50)).timestamp()
    window = '[[windows]]\nname = "day"\ncron = "0 8 * * 1-5"\nwhole_share = 0.8\n'
    engine, clock = _engine(tmp_path, start, window)
    engine.set_window(config.parse(window).windows[0])  # 7 of 8 stay whole
    prov = Provisioner(engine.engine, clock=clock)
    engine.run(prov.run())
    assert len(_sliced(engine)) == 1  # four wanted, the window allows one


def test_tear_down_waits_for_the_hysteresis(tmp_path):
    start = (MONDAY + timedelta(weeks=4, hours=13, minutes=50)).timestamp()
    engine, clock = _engine(tmp_path, start)
    prov = Provisioner(engine.engine, clock=clock)
    engine.run(prov.run())
    assert len(_sliced(engine)) == 4
    clock.t = (MONDAY + timedelta(weeks=4, hours=17, minutes=50)).timestamp()
    for i in _sliced(engine):
        engine.engine.cards[i].switched_at = clock.t - 10  # as if switched 10 s ago (hold_s 600)
    engine.run(prov.run())
    assert len(_sliced(engine)) == 4
    clock.t += 600
    engine.run(prov.run())
    assert len(_sliced(engine)) == 1


# ------------------------------------------------------------------ pre-created slices on MIG cards
def _mig_engine(tmp_path, now: float, extra: str = "", fake=None, ledger=None):
    """An engine over the fake DGX H100 (MIG on every card, driven by the same backend as the daemon's),
    with four weeks of vxpu-half history in its ledger (unless ``ledger`` is given: a restart)."""
    from xpud.hw.fakenvml import FakeNvml
    from xpud.hw.nvml import Nvml
    from xpud.isolation import backend_for
    from xpud.isolation.faketools import FakeNvidiaTools

    cfg = config.parse(
        "[forecast]\nenabled = true\nlead_s = 900.0\n" + extra + "[bursts]\nhold_s = 600.0\n"
        "[cards]\nmig_idle_keep_s = 0.0\n"
    ).replace("daemon", runtime_dir=str(tmp_path))
    fake = fake or FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    nvml.open()
    if ledger is None:
        ledger = Ledger(tmp_path / "l.sqlite")
        for n, (mode, s, e) in enumerate(history(4, np.random.default_rng(3))):
            lease = Lease(f"h{n:06d}", Mode(mode), 1000, (0,), ("GPU-0000",), created=s)
            ledger.insert_lease(lease, "t")
            ledger.end_lease(lease.id, LeaseState.RELEASED, "history", when=e)
    clock = Clock(now)
    from xpud.isolation.mig_book import LedgerBook

    iso = backend_for(cfg, nvml, FakeNvidiaTools(fake), mig_book=LedgerBook(ledger))  # as the daemon does
    engine = sync_engine(nvml.cards(), nvml.topology(), cfg, ledger, isolation=iso, clock=clock)
    engine.restore()
    return engine, clock, fake


CREATES = ("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceCreateComputeInstance")


def created(fake) -> int:
    """GPU and compute instances created so far (the fake's call log)."""
    return sum(fake.calls[name] for name in CREATES)


def _instances(fake) -> int:
    return sum(len(fake.mig_layout(i)) for i in range(8))


def test_mig_slices_are_pre_created_before_the_peak_served_without_a_creation_and_torn_down(tmp_path):
    start = (MONDAY + timedelta(weeks=4, hours=13, minutes=50)).timestamp()  # Monday 13:50
    engine, clock, fake = _mig_engine(tmp_path, start)
    prov = Provisioner(engine.engine, clock=clock)
    report = engine.run(prov.run())
    # 14:05 is forecast at ~8 halves: 8 MIG instances made now, recorded, before anyone asks
    made = created(fake)
    assert report["slices"]["standby"]["vxpu-half"] == 8 and made == 16 and _instances(fake) == 8
    check(report, "Forecast")  # as published for `xpu forecast --json` (docs/json.md)
    assert report["sizes"]["vxpu-half"]["mape_last_week_pct"] is not None
    assert len(report["slices"]["created"]) == 8
    assert len(engine.ledger.standby()) == 8
    assert sum("vxpu-half pre-created" in e.message for e in engine.ledger.events(100)) == 8
    # the peak's requests take them: no GPU instance created in their path, none switched
    clock.t += 600
    leases = [engine.try_grant(req("vxpu-half"))[0] for _ in range(8)]
    assert created(fake) == made, "a request created an instance instead of taking a pre-created one"
    handles = {lease.slices[0].handle for lease in leases}
    assert handles == {u for i in range(8) for g in fake.mig_layout(i) for u in g["uuids"]}
    assert engine.ledger.standby() == [] and engine.standby.slices == {}  # taken, in the grants' commits
    # a ninth finds none ready: it creates one, as before
    extra = engine.try_grant(req("vxpu-half"))[0]
    assert created(fake) == made + 2
    for lease in [*leases, extra]:
        engine._end(lease, LeaseState.RELEASED, "done")
    # 17:50: the forecast for 18:05 falls to 1 slice; the pre-created ones are gone with it
    clock.t = (MONDAY + timedelta(weeks=4, hours=17, minutes=50)).timestamp()
    engine.run(prov.run())
    assert engine.standby.count("vxpu-half") == 1 == len(engine.ledger.standby()) == _instances(fake)
    # 20:50, a night hour (1 slice) after 18:00: stays 1; disabled: none
    engine.engine.cfg = engine.engine.cfg.replace("forecast", enabled=False)
    engine.run(prov.run())
    assert engine.ledger.standby() == [] and _instances(fake) == 0
    assert any("destroyed: forecast falls" in e.message for e in engine.ledger.events(200))


def test_pre_created_slices_survive_a_restart_neither_leaked_nor_offered_twice(tmp_path):
    start = (MONDAY + timedelta(weeks=4, hours=13, minutes=50)).timestamp()
    engine, clock, fake = _mig_engine(tmp_path, start)
    prov = Provisioner(engine.engine, clock=clock)
    engine.run(prov.run())
    taken = engine.try_grant(req("vxpu-half"))[0]
    assert len(engine.ledger.standby()) == 7
    # a crash between a creation and its commit: an instance on a card with no record
    orphan = created(fake)
    first = engine.ledger.standby()[0][1]
    assert engine.run(
        engine.engine.standby.drop(first.handle, "test")
    )  # record removed, instance destroyed: room
    i = first.card_index
    engine.engine._backends[i].precreate(engine.engine.cards[i].info, engine.cfg.slices["vxpu-half"])
    assert created(fake) == orphan + 2
    # and a record whose instance someone destroyed behind our back
    gone = engine.ledger.standby()[0][1]
    gi = next(g["gpu_instance_id"] for g in fake.mig_layout(gone.card_index) if gone.handle in g["uuids"])
    from xpud.hw.nvml import Nvml

    raw = Nvml(fake)
    raw.open()
    raw.destroy_mig_instance(gone.card_index, gi)
    again, _, _ = _mig_engine(tmp_path, start, fake=fake, ledger=engine.ledger)
    kept = {s.handle for _, s, _ in again.ledger.standby()}
    assert len(kept) == 5 and gone.handle not in kept and set(again.standby.slices) == kept
    on_cards = {u for i in range(8) for g in fake.mig_layout(i) for u in g["uuids"]}
    assert on_cards == kept | {taken.slices[0].handle}  # the orphan destroyed, the adopted ones kept
    made = created(fake)
    leases = [again.try_grant(req("vxpu-half"))[0] for _ in range(5)]
    assert created(fake) == made and {x.slices[0].handle for x in leases} == kept
    assert taken.slices[0].handle not in {x.slices[0].handle for x in leases}


def test_a_whole_card_request_may_take_a_card_of_pre_created_slices_and_their_records_go(tmp_path):
    start = (MONDAY + timedelta(weeks=4, hours=13, minutes=50)).timestamp()
    engine, clock, fake = _mig_engine(tmp_path, start)
    engine.run(Provisioner(engine.engine, clock=clock).run())
    whole = [engine.try_grant(req("xpu"))[0] for _ in range(8)]
    assert all(w is not None for w in whole)  # every card, the pre-provisioned ones switched back
    assert engine.ledger.standby() == [] and _instances(fake) == 0


def test_warm_command_runs_once_per_pre_created_slice_as_the_warm_user(tmp_path, request):
    start = (MONDAY + timedelta(weeks=4, hours=13, minutes=50)).timestamp()
    import shutil
    import tempfile
    from pathlib import Path

    out = Path(tempfile.mkdtemp(prefix="xpud-warm-", dir="/tmp"))  # reachable by the warm user
    out.chmod(0o777)
    request.addfinalizer(lambda: shutil.rmtree(out, ignore_errors=True))
    cmd = (
        f'echo "$(id -un) $XPU_WARM_CARD $XPU_WARM_SIZE $CUDA_VISIBLE_DEVICES $XPU_WARM_SLICE"'
        f" > {out}/$XPU_WARM_SLICE; sleep 0.3"
    )
    extra = f"warm_command = '{cmd}'\nwarm_timeout_s = 5.0\n"
    engine, clock, fake = _mig_engine(tmp_path, start, extra)
    prov = Provisioner(engine.engine, clock=clock)

    async def provision():
        await prov.run()
        # while the commands run, their instances are not handed out: a request creates its own
        n = created(fake)
        lease, _ = await engine.engine.try_grant(req("vxpu-half"))
        assert created(fake) == n + 2 and lease.slices[0].handle not in engine.standby.slices
        await prov.warmed()
        return lease

    engine.run(provision())
    files = sorted(out.iterdir())
    assert len(files) == 8
    lines = [f.read_text().split() for f in files]
    import os
    import pwd

    user = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    assert all(w[0] == user and w[2] == "vxpu-half" and w[3] == w[4].strip() for w in lines), lines
    assert {w[3] for w in lines} == set(engine.standby.slices) and all(w[3].startswith("MIG-") for w in lines)
    assert sum("warm_command exited 0" in e.message for e in engine.ledger.events(100)) == 8
    # done warming: the next request takes one, no creation
    n = created(fake)
    engine.try_grant(req("vxpu-half"))
    assert created(fake) == n


def test_on_mps_cards_the_forecast_slices_are_planned_and_warmed_with_their_limits(tmp_path, request):
    import shutil
    import tempfile
    from pathlib import Path

    from xpud.hw.fakenvml import FakeNvml

    start = (MONDAY + timedelta(weeks=4, hours=13, minutes=50)).timestamp()
    out = Path(tempfile.mkdtemp(prefix="xpud-warm-", dir="/tmp"))
    out.chmod(0o777)
    request.addfinalizer(lambda: shutil.rmtree(out, ignore_errors=True))
    cmd = (
        'echo "$CUDA_VISIBLE_DEVICES $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT'
        f' ${{CUDA_MPS_PIPE_DIRECTORY:-nopipe}}" > {out}/$(echo $XPU_WARM_SLICE | tr : _)'
    )
    engine, clock, _ = _mig_engine(
        tmp_path, start, f"warm_command = '{cmd}'\n", fake=FakeNvml("pcie-8x-l40s")
    )
    prov = Provisioner(engine.engine, clock=clock)

    async def go():
        report = await prov.run()
        await prov.warmed()
        return report

    report = engine.run(go())
    assert report["slices"]["standby"]["vxpu-half"] == 0 and report["slices"]["planned_mps"]["vxpu-half"] == 8
    lines = sorted(f.read_text().split() for f in out.iterdir())
    assert len(lines) == 8, lines
    sliced = {engine.engine.cards[i].info.uuid for i in _sliced(engine)}
    assert {w[0] for w in lines} == sliced and len(sliced) == 4
    assert all(w[1] == "30" and w[2].startswith("0=") and w[3] == "nopipe" for w in lines), lines
    # a second run plans the same slices: nothing warmed again
    engine.run(go())
    assert sum("warm_command exited 0" in e.message for e in engine.ledger.events(100)) == 8


def test_warm_command_is_killed_at_its_timeout_and_an_unknown_user_is_an_event(tmp_path):
    from xpud.controllers import warm

    async def go():
        killed = await warm.run("sleep 30 & sleep 30", "nobody", {}, 0.3)
        unknown = await warm.run("true", "no-such-user-xpud", {}, 5.0)
        return killed, unknown

    import asyncio

    t0 = time.monotonic()
    killed, unknown = asyncio.run(go())
    assert killed.startswith("warm_command killed after 0.3 s") and time.monotonic() - t0 < 5
    assert "not run" in unknown and "no-such-user-xpud" in unknown
    with pytest.raises(config.ConfigError, match="warm_user"):
        config.parse("[forecast]\nwarm_user = 'x;rm'\n")


def test_xpu_forecast_shows_the_published_forecast(daemon_factory):
    d = daemon_factory(config="[forecast]\ninterval_s = 10.0\n")
    wait_until(lambda: (d.runtime_dir / "forecast.json").exists())
    r = d.xpu("forecast", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    check(data, "Forecast", "xpu forecast")  # every key documented in docs/json.md, of its type
    assert set(data["sizes"]) == {"vxpu-half", "vxpu-quarter"} and data["enabled"] is False
    assert data["slices"]["standby"] == {"vxpu-half": 0, "vxpu-quarter": 0}
    assert abs(data["generated"] - time.time()) < 60 and data["sizes"]["vxpu-half"]["past"]
    assert len(data["sizes"]["vxpu-half"]["next"]) == 24
    text = d.xpu("forecast", "--hours", "3").stdout
    assert "MAPE over the last week" in text and "FORECAST" in text


def test_a_warm_command_still_running_is_killed_when_the_provisioner_stops(tmp_path):
    import asyncio
    import os

    from xpud.controllers import warm

    pidfile = tmp_path / "pid"
    tmp_path.chmod(0o777)

    async def go():
        task = asyncio.ensure_future(warm.run(f"echo $$ > {pidfile}; exec sleep 60", "root", {}, 60.0))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if pidfile.exists() and pidfile.read_text().strip():
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return int(pidfile.read_text())

    pid = asyncio.run(go())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
