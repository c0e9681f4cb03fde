"""Capacity windows (cron starts, whole-card share) with frozen clocks, and the carbon window (the greenest
start before a deadline), from the pure functions through the engine to a real daemon and `xpu`."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.conftest import wait_until
from tests.syncengine import sync_engine
from tests.test_cli_json import check
from tests.test_engine import Clock, cards, pcie_box, req
from xpud import config
from xpud.config.windows import crontab_days
from xpud.errors import ConfigError, NoCapacity
from xpud.ledger.ledger import Ledger
from xpud.model import Caller, CardMode
from xpud.planning import green as carbon
from xpud.planning import windows

WEEK = """
[[windows]]
name = "day"
cron = "0 8 * * 1-5"
whole_share = 0.8
timezone = "UTC"

[[windows]]
name = "night"
cron = "0 20 * * 1-5"
whole_share = 0.2
timezone = "UTC"

[[windows]]
name = "weekend"
cron = "0 0 * * 6"
whole_share = 0.0
timezone = "UTC"
"""


def at(day: int, hour: int, minute: int = 0) -> datetime:
    """December 2026: the 7th is a Monday."""
    return datetime(2026, 12, day, hour, minute, tzinfo=UTC)


@pytest.mark.parametrize(
    ("now", "name", "next_day"),
    [
        (at(9, 7, 59), "night", at(9, 8)),  # Wednesday before 08:00: Tuesday's night
        (at(9, 8, 0), "day", at(10, 8)),  # the instant it fires
        (at(9, 19, 59), "day", at(10, 8)),
        (at(11, 21), "night", at(14, 8)),  # Friday night; the next day window is Monday's
        (at(12, 10), "weekend", at(14, 8)),
        (at(14, 7), "weekend", at(14, 8)),  # Monday morning: still the weekend's
        (at(14, 8), "day", at(15, 8)),
    ],
)
def test_window_in_force_with_a_frozen_clock(now, name, next_day):
    specs = config.parse(WEEK).windows
    states = windows.states(specs, now)
    assert [s.spec.name for s in states if s.current] == [name]
    day = next(s for s in states if s.spec.name == "day")
    assert day.next == next_day


@pytest.mark.parametrize(
    ("field", "days"),
    [
        ("1-5", "mon,tue,wed,thu,fri"),
        ("0", "sun"),
        ("7", "sun"),
        ("*/2", "sun,tue,thu,sat"),
        ("mon-fri", "mon,tue,wed,thu,fri"),
        ("5-7", "sun,fri,sat"),
        ("*", "*"),
    ],
)
def test_day_of_week_reads_as_crontab(field, days):
    # APScheduler 3's from_crontab reads "1-5" as Tuesday..Saturday (0 = Monday): translated to names
    assert crontab_days(field) == days


def test_whole_needed_rounds_up():
    assert windows.whole_needed(0.8, 8) == 7 and windows.whole_needed(0.2, 8) == 2
    assert windows.whole_needed(0.0, 8) == 0 and windows.whole_needed(1.0, 3) == 3
    assert windows.whole_needed(0.75, 8) == 6  # exact: no float rounding up to 7


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ('name = "x"\ncron = "61 8 * * *"\nwhole_share = 0.5', r"cron '61 8 \* \* \*'.*59"),
        ('name = "x"\ncron = "0 8 * *"\nwhole_share = 0.5', "Wrong number of fields"),
        ('name = "x"\ncron = "0 8 * * *"\nwhole_share = 1.5', "whole_share: expected a number in 0..1"),
        ('name = "x"\ncron = "0 8 * * *"\nwhole_share = nan', "whole_share"),
        ('name = "x"\ncron = "0 8 * * *"\nwhole_share = 0.5\nshare = 1', "unknown key 'share'"),
        ('name = "x"\ncron = "0 8 * * *"\nwhole_share = 0.5\ntimezone = "Mars/Base"', "Mars/Base"),
    ],
)
def test_a_bad_window_is_refused_with_its_line(entry, why):
    text = f"[leases]\ngrace_s = 1.0\n\n[[windows]]\n{entry}\n"
    with pytest.raises(ConfigError, match=rf"^f\.toml:4: \[\[windows\]\] #1: .*{why}"):
        config.parse(text, "f.toml")


def test_two_windows_of_one_name_are_refused():
    text = '[[windows]]\nname = "a"\ncron = "0 8 * * *"\nwhole_share = 0.5\n' * 2
    with pytest.raises(ConfigError, match="two windows are named 'a'"):
        config.parse(text)


def test_the_documented_example_parses():
    from tests.test_config import ROOT

    text = (ROOT / "etc/xpud.toml").read_text()
    example = text[text.index("# [[windows]]") :]
    uncommented = "\n".join(line.removeprefix("# ").removeprefix("#") for line in example.splitlines())
    specs = config.parse(uncommented).windows
    assert [w.name for w in specs] == ["day", "night", "weekend"]


# ---------------------------------------------------------------------------------------------- engine
@pytest.fixture
def engine(tmp_path):
    cfg = config.parse("[bursts]\nhold_s = 300.0\n")
    return sync_engine(cards(), pcie_box(), cfg, Ledger(tmp_path / "l.sqlite"), clock=Clock())


def _sliced(engine) -> list[int]:
    return [i for i, c in engine.cards.items() if c.mode is CardMode.SLICED]


def test_a_window_keeps_its_share_whole_and_never_evicts(engine):
    specs = {w.name: w for w in config.parse(WEEK).windows}
    engine.set_window(specs["day"])  # 0.8 of 8 usable: 7 stay whole, one may be sliced
    halves = [engine.try_grant(req("vxpu-half"))[0] for _ in range(2)]
    assert len(_sliced(engine)) == 1 and halves[0].cards == halves[1].cards
    assert engine.try_grant(req("vxpu-half")) is None  # would slice a second card: the window says no
    with pytest.raises(NoCapacity) as refused:  # #28 item 10: the refusal names the window, not "no room"
        engine.grant_or_queue(req("vxpu-half", wait_s=0))
    assert str(refused.value).startswith(
        "capacity window 'day' keeps 80% of the usable cards whole (7 of 8, see `xpu windows`) and no "
        "sliced card has room for a vxpu-half slice"
    ), refused.value
    big = engine.try_grant(req("xpu", 7))  # whole-card work is not held back
    assert big is not None

    engine.set_window(specs["night"])  # 0.2: 2 of 8 whole
    assert engine.try_grant(req("vxpu-half")) is None  # no idle whole card left: it waits, nobody is evicted
    assert len(engine.leases) == 3 and all(lease.id in engine.leases for lease in halves)
    engine.release(big[0].id, Caller(uid=0, admin=True))
    more = [engine.try_grant(req("vxpu-half")) for _ in range(4)]
    assert all(more) and len(_sliced(engine)) == 3  # outside the day window idle cards are sliced


def test_slices_go_back_whole_after_the_hysteresis_when_a_day_window_starts(engine):
    specs = {w.name: w for w in config.parse(WEEK).windows}
    engine.set_window(specs["weekend"])
    got = [engine.try_grant(req("vxpu-half"))[0] for _ in range(6)]  # three cards sliced
    assert len(_sliced(engine)) == 3
    for lease in got:
        engine.release(lease.id, Caller(uid=0, admin=True))
    engine.set_window(specs["day"])
    assert engine.keep_whole() == []  # switched 0 s ago: hold_s (300 s) keeps them sliced
    engine.clock.t += 301
    switched = engine.keep_whole()
    assert len(switched) == 2 and len(_sliced(engine)) == 1  # 7 whole is enough: one stays sliced
    assert engine.stats.conversions[("whole", "window")] == 2
    msgs = [e.message for e in engine.ledger.events(50) if e.kind in ("window", "mode")]
    assert any(
        "capacity window 'day' in force: keeps 80% of the usable cards whole (7 of 8)" in m for m in msgs
    )
    assert any("switched to whole: capacity window 'day' keeps 80% whole" in m for m in msgs)


def test_a_window_does_not_switch_a_card_in_use(engine):
    specs = {w.name: w for w in config.parse(WEEK).windows}
    engine.set_window(specs["weekend"])
    for _ in range(8):
        engine.try_grant(req("vxpu-half"))  # four cards sliced, each full
    engine.set_window(specs["day"])
    engine.clock.t += 10_000
    assert engine.keep_whole() == [] and len(_sliced(engine)) == 4 and len(engine.leases) == 8


# ---------------------------------------------------------------------------------------------- daemon
def test_the_daemon_applies_the_window_in_force_at_a_frozen_instant(inproc):
    d = inproc("pcie-8x-l40s", WEEK)
    wait_until(lambda: d.call(lambda: d.engine.window is not None))  # applied at start (real clock)
    jobs = d.daemon.jobs
    d.call(jobs.apply_windows, at(9, 9))
    assert d.call(lambda: d.engine.window.name) == "day"
    d.call(jobs.apply_windows, at(12, 9))
    assert d.call(lambda: d.engine.window.name) == "weekend"
    ids = {j.id for j in d.call(jobs.scheduler.get_jobs)}
    assert {"window-0-day", "window-1-night", "window-2-weekend", "window-check"} <= ids


def test_xpu_windows_lists_the_schedule(daemon_factory):
    d = daemon_factory(config=WEEK)
    r = d.xpu("windows", "--json", "--config", str(d.config))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    check(out, "Windows", "xpu windows")  # every key documented in docs/json.md, of its type
    assert [w["name"] for w in out["windows"]] == ["day", "night", "weekend"]
    assert sum(w["current"] for w in out["windows"]) == 1 and out["current"] in {"day", "night", "weekend"}
    cur = next(w for w in out["windows"] if w["current"])
    assert out["whole_share_pct"] == cur["whole_share_pct"] and 0 <= cur["whole_share_pct"] <= 100
    assert all(w["last_start"] <= out["now"] < w["next_start"] for w in out["windows"])
    assert abs(out["now"] - time.time()) < 60
    table = d.xpu("windows", "--config", str(d.config)).stdout
    assert "KEEPS WHOLE" in table and "80%" in table
    bad = d.base / "bad.toml"
    bad.write_text('[[windows]]\nname = "x"\ncron = "0 25 * * *"\nwhole_share = 0.5\n')
    r = d.xpu("windows", "--config", str(bad))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "bad.toml:1: [[windows]] #1: cron" in r.stderr


# ---------------------------------------------------------------------------------------------- carbon
def hours(start: datetime, values: list[float]) -> list[carbon.Hour]:
    return [carbon.Hour(start + timedelta(hours=i), v) for i, v in enumerate(values)]


def test_greenest_start_before_the_deadline_with_a_frozen_clock():
    sig = hours(at(3, 0), [300, 250, 120, 180, 90, 400, 100])
    now = at(3, 0, 30)
    assert carbon.greenest_start(sig, now, at(3, 4)) == (at(3, 2), sig[2])  # 90 at 04:00 is too late
    assert carbon.greenest_start(sig, now, at(3, 4, 1))[0] == at(3, 4)  # starting at 04:00 is in time
    assert carbon.greenest_start(sig, now, at(3, 1))[0] == now  # only the current hour: now
    assert carbon.greenest_start(sig, at(3, 2, 15), at(3, 3))[0] == at(3, 2, 15)  # inside the greenest
    assert carbon.greenest_start(sig, at(4, 0), at(4, 5)) == (at(4, 0), None)  # no data: now
    tie = hours(at(3, 0), [100, 50, 50])
    assert carbon.greenest_start(tie, at(3, 0), at(3, 5))[0] == at(3, 1)  # ties: the earliest


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("start,value\n2026-12-03T00:00+00:00,nan\n", "outside"),
        ("2026-12-03T00:00+00:00,-1\n", "outside"),
        ("2026-12-03T00:00+00:00,1e9\n", "outside"),
        ("2026-12-03T00:00+00:00,1,2\n", "expected start,value"),
        ("tomorrow,1\nlater,2\n", "not an ISO 8601 time"),
        ('[{"start": "2026-12-03T00:00+00:00"}]', "item 1"),
        ('{"2026-12-03T00:00+00:00": 1, "2026-12-03T00:00:00+00:00": 2}', "given twice"),
        ("[1, 2]", "expected a list"),
    ],
)
def test_a_bad_signal_is_refused_with_the_reason(text, why):
    with pytest.raises(carbon.SignalError, match=why):
        carbon.parse(text, "sig")


def test_signal_formats_agree():
    csv_text = "start,value\n2026-12-03T01:00+00:00,180\n2026-12-03T00:00+00:00,200\n"
    js = (
        '[{"start": "2026-12-03T00:00+00:00", "value": 200},'
        ' {"start": "2026-12-03T01:00+00:00", "value": 180}]'
    )
    obj = '{"2026-12-03T01:00+00:00": 180, "2026-12-03T00:00+00:00": 200}'
    parsed = [carbon.parse(t, "s") for t in (csv_text, js, obj)]
    assert parsed[0] == parsed[1] == parsed[2] and [h.value for h in parsed[0]] == [200, 180]


def _signal(now: datetime, greenest_in: int) -> str:
    base = now.replace(minute=0, second=0, microsecond=0)
    rows = [
        f"{(base + timedelta(hours=i)).isoformat()},{50 if i == greenest_in else 300 + i}" for i in range(6)
    ]
    return "start,value\n" + "\n".join(rows) + "\n"


def test_xpu_run_when_green_starts_now_or_waits_in_the_daemons_queue_for_the_greenest_hour(
    daemon_factory, short_tmp
):
    sig = short_tmp / "signal.csv"
    now = datetime.now().astimezone()
    sig.write_text(_signal(now, 0))
    d = daemon_factory(config=f'[carbon]\nsignal = "{sig}"\nrefresh_s = 10.0\n')
    published = d.runtime_dir / "carbon.json"
    wait_until(lambda: published.exists())
    r = d.xpu("run", "--when-green", "--deadline", "+3h", "--mode", "vxpu-quarter", "--", "true")
    assert r.returncode == 0 and "waiting until" not in r.stderr, r.stderr  # this hour is the greenest

    sig.write_text(_signal(now, 2))  # the greenest is two hours on
    d.kill()
    d.start()
    wait_until(lambda: json.loads(published.read_text())[2]["value"] == 50)
    p = d.xpu_popen(
        "run",
        "--when-green",
        "--deadline",
        "+5h",
        "--wait",
        "60",
        "--",
        "true",
        stderr=subprocess.PIPE,
        text=True,
    )
    line = p.stderr.readline()
    green = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=2)
    assert f"waiting until {green.isoformat(timespec='minutes')}" in line and "(50; now 300)" in line, line
    # the wait is the daemon's: the request is in its queue with its planned start and the reason
    (q,) = json.loads(d.xpu("leases", "--json").stdout)["queue"]
    assert q["reason"] == "BeginTime" and q["not_before"] == green.timestamp(), q
    assert "the greenest hour before" in q["not_before_reason"] and q["deadline"] == green.timestamp() + 60
    table = d.xpu("leases").stdout
    assert "BeginTime" in table and f"starts {green:%a %H:%M}" in table, table
    p.kill()
    p.wait(10)
    wait_until(lambda: not json.loads(d.xpu("leases", "--json").stdout)["queue"])  # as any queued request
    r = d.xpu("run", "--when-green", "--", "true")
    assert r.returncode == 1 and "--when-green and --deadline go together" in r.stderr
    r = d.xpu("run", "--when-green", "--deadline", "yesterday", "--", "true")
    assert r.returncode == 1 and "--deadline 'yesterday'" in r.stderr


def test_when_green_without_a_carbon_signal_is_refused_by_the_daemon(daemon):
    r = daemon.xpu("run", "--when-green", "--deadline", "+3h", "--", "true")
    assert r.returncode == 1 and "[carbon] signal or command" in r.stderr, r.stderr


def test_a_green_request_waits_in_the_daemons_queue_until_its_start_with_a_frozen_clock(engine):
    """The daemon side of `xpu run --when-green`: a request with a not-before time queues (reason
    BeginTime) although it fits, holds no card back meanwhile, gives up ``wait_s`` after its start, and
    is granted by the first queue pass at or after its start."""
    import asyncio

    e, clock = engine.engine, engine.engine.clock
    start = clock.t + 7200.0
    why = "the greenest hour before 2026-12-04 06:00 (50; now 300)"

    async def go():
        green = e.acquire(req("vxpu-half", wait_s=60.0, not_before=start, not_before_reason=why))
        task = asyncio.ensure_future(green)
        big = asyncio.ensure_future(e.acquire(req("xpu", 8, wait_s=60.0, not_before=start)))
        for _ in range(5):
            await asyncio.sleep(0)
        q = {x.request.mode.value: x for x in e.queue_view()}
        assert q["vxpu-half"].reason == "BeginTime" == q["xpu"].reason
        assert q["vxpu-half"].deadline == start + 60.0 and q["vxpu-half"].request.not_before_reason == why
        e.pump()
        await asyncio.sleep(0)
        assert not task.done() and all(c.mode is CardMode.WHOLE for c in e.cards.values())
        # the deferred 8-card request holds no whole card back from work that comes before its start
        now, _ = await e.try_grant(req("xpu", 1))
        clock.t = start - 1
        e.pump()
        await asyncio.sleep(0)
        assert not task.done()
        clock.t = start
        e.pump()
        lease, _ = await asyncio.wait_for(task, 5)
        q = {x.request.mode.value: x for x in e.queue_view()}
        assert lease.mode.value == "vxpu-half" and q["xpu"].reason != "BeginTime"  # it waits for room now
        big.cancel()
        return now

    engine.run(go())
    with pytest.raises(Exception, match="not_before"):
        engine.validate(req("vxpu-half", wait_s=1.0, not_before=clock.t + 40 * 86400))


def test_a_deferred_request_starts_waiting_at_its_start_behind_a_waiter_of_its_kind(engine):
    """A deferred request behind a queued one of its kind that does not fit: the queue pass stops at the
    first (every kind left failed) and never reaches it, so its own timer starts it (reason no longer
    BeginTime once its start has come). Before: it kept BeginTime until some other change."""
    import asyncio

    e, clock = engine.engine, engine.engine.clock

    async def go():
        for _ in e.cards:  # every card held whole: no room for a slice
            await e.try_grant(req("xpu", 1))
        first = asyncio.ensure_future(e.acquire(req("vxpu-half", wait_s=60.0)))
        await asyncio.sleep(0)
        start = clock.t + 0.05
        later = asyncio.ensure_future(e.acquire(req("vxpu-half", wait_s=60.0, not_before=start)))
        await asyncio.sleep(0)
        q = e.queue_view()
        assert [x.reason for x in q] == ["Resources", "BeginTime"], q
        clock.t = start
        await asyncio.sleep(0.3)
        q = e.queue_view()
        assert [x.reason for x in q] == ["Resources", "Resources"], q
        first.cancel()
        later.cancel()
        await asyncio.sleep(0)

    engine.run(go())


def test_the_daemon_plans_a_green_start_from_its_signal():
    sig = hours(at(3, 0), [300, 200, 50, 400, 90])
    start, why = carbon.plan(sig, at(3, 0, 30), at(3, 5))
    assert start == at(3, 2) and why == "the greenest hour before 2026-12-03 05:00 (50; now 300)"
    assert carbon.plan(sig, at(3, 2, 10), at(3, 5)) == (
        at(3, 2, 10),
        "this hour is the greenest before 2026-12-03 05:00 (50): starting now",
    )
    assert carbon.plan([], at(3, 0), at(3, 5))[1].startswith("the carbon signal covers no hour")
