"""`xpu defrag` end to end: real daemons on a simulated PCIe box, real `xpu run --restartable` jobs that
restart on their new cards, the queue that gets the freed cards, and the daemon's own runs (periodic, and
making room for a waiting whole-card request), which report their plan before they move anything."""

from __future__ import annotations

import json

import pytest

from tests.conftest import wait_until
from tests.test_health_faults import Job

CONFIG = """
[leases]
grace_s = 30.0
[health]
move_ack_timeout_s = 10.0
[defrag]
make_room = false
"""


@pytest.fixture
def jobs():
    made: list[Job] = []
    yield made
    for j in made:
        j.stop()


def held_leases(d):
    with d.client() as c:
        return [x for x in c.leases().leases if x.held]


def uuids(d) -> dict[str, int]:
    with d.client() as c:
        return {card.uuid: card.index for card in c.cards().cards}


def events(d) -> list:
    """The daemon's recent events (oldest first), as the first Watch update carries them."""
    with d.client() as c:
        call = c.watch(1.0)
        try:
            for update in c.iterate(call):
                return list(update.events)
        finally:
            call.cancel()
    return []


def fragmented(d, tmp, jobs) -> dict[str, object]:
    """Eight restartable quarter jobs (the engine packs them on two cards, four each), then releases that
    leave one on the first card and two on the second, then one job that is not restartable (it joins one
    of those cards). Returns the leases ("a", "b1", "b2", "fixed") and the two cards ("cards")."""
    for n in range(8):
        jobs.append(Job(d, tmp, "--restartable", "--kill-grace", "1", mode="vxpu-quarter", name=f"q{n}"))
    wait_until(lambda: len(held_leases(d)) == 8 and all(j.starts() for j in jobs), timeout=30)
    by_card: dict[int, list] = {}
    for lease in held_leases(d):
        by_card.setdefault(lease.cards[0], []).append(lease)
    (ca, on_a), (cb, on_b) = sorted(by_card.items())
    assert len(on_a) == len(on_b) == 4
    with d.client() as c:
        for lease in on_a[1:] + on_b[2:]:
            c.release(lease.id)
    wait_until(lambda: len(held_leases(d)) == 3)
    fixed_job = Job(d, tmp, "--kill-grace", "1", mode="vxpu-quarter", name="fixed")
    jobs.append(fixed_job)
    wait_until(lambda: len(held_leases(d)) == 4 and fixed_job.starts(), timeout=15)
    [fixed] = [x for x in held_leases(d) if not x.restartable]
    return {"a": on_a[0], "b1": on_b[0], "b2": on_b[1], "fixed": fixed, "cards": (ca, cb)}


def job_of(jobs, lease) -> Job:
    """The `xpu run` that holds ``lease`` (its command names the job's marks file)."""
    return next(j for j in jobs if str(j.marks) in lease.command)


def test_plan_then_apply_frees_whole_cards_and_a_waiting_request_gets_them(daemon_factory, short_tmp, jobs):
    d = daemon_factory("pcie-8x-l40s", config=CONFIG)
    f = fragmented(d, short_tmp, jobs)
    ca, cb = f["cards"]
    fixed_card = f["fixed"].cards[0]
    before = {x.id: list(x.cards) for x in held_leases(d)}

    r = d.xpu("defrag", "--plan", "--move-budget", "25", "--json")  # 25 % of 4 leases: one move
    assert r.returncode == 0, r.stderr
    small = json.loads(r.stdout)
    assert small["move_budget"] == 1 and len(small["moves"]) <= 1

    r = d.xpu("defrag", "--plan", "--move-budget", "50", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert not plan["applied"] and plan["move_budget"] == 2 and plan["movable_leases"] == 3
    moved = {m["lease_id"]: m for m in plan["moves"]}
    assert f["fixed"].id not in moved  # not restartable: never moved
    assert len(plan["after"]["idle"]) == 7 and len(plan["before"]["idle"]) == 6
    freed = sorted(set(plan["after"]["idle"]) - set(plan["before"]["idle"]))
    assert len(freed) == 1 and freed[0] != fixed_card and freed[0] in (ca, cb)
    assert all(m["state"] == "proposed" and m["to_cards"] == [fixed_card] for m in plan["moves"])

    table = d.xpu("defrag", "--move-budget", "50")  # --plan is the default
    assert table.returncode == 0 and "nothing moved" in table.stdout
    assert "`xpu defrag --apply --move-budget 50` moves these jobs" in table.stdout  # the plan shown
    for lid in moved:
        assert lid in table.stdout
    assert {x.id: list(x.cards) for x in held_leases(d)} == before  # planning moved nothing
    assert all(len(j.starts()) == 1 for j in jobs if j.proc.poll() is None)

    # A 7-card request waits: 6 cards are free. Applying the plan frees the 7th; the queue gets it.
    waiter = Job(d, short_tmp, "--gpus", "7", "--wait", "60", mode="xpu", name="big")
    jobs.append(waiter)
    with d.client() as c:
        wait_until(lambda: len(c.leases().queue) == 1)
    movers = {x.id: job_of(jobs, x) for x in held_leases(d) if x.id in moved}
    r = d.xpu("defrag", "--apply", "--move-budget", "50")
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout and "defrag applied" in r.stdout
    for lid, job in movers.items():
        starts = wait_until(lambda job=job: len(job.starts()) == 2 and job.starts(), timeout=10)
        assert starts[1][0] == 1 and uuids(d)[starts[1][1]] == fixed_card  # XPU_RESTART_COUNT=1
        lease = next(x for x in held_leases(d) if x.id == lid)
        assert list(lease.cards) == [fixed_card] and lease.restart_count == 1
    granted = wait_until(waiter.starts, timeout=10)
    cards = sorted(uuids(d)[u] for u in granted[0][1].split(","))
    assert freed[0] in cards and fixed_card not in cards and len(cards) == 7
    with d.client() as c:
        views = c.cards().cards
    assert views[freed[0]].mode == "whole" and views[freed[0]].whole_lease and not views[freed[0]].slices
    fixed_now = next(x for x in held_leases(d) if x.id == f["fixed"].id)
    assert list(fixed_now.cards) == [fixed_card] and fixed_now.restart_count == 0
    kinds = [e.message for e in events(d) if e.kind == "defrag"]
    assert any("plan:" in m and "operator uid" in m for m in kinds)


def test_refusals_say_why(daemon_factory):
    d = daemon_factory("pcie-8x-l40s", config=CONFIG)
    r = d.xpu("defrag", "--plan")  # nothing to do is a result: exit 0, the reason shown
    assert r.returncode == 0, r.stderr
    assert "nothing restartable to move: 0 active lease(s) (no active leases)" in r.stdout
    r = d.xpu("defrag", "--plan", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["moves"] == []
    assert "no active leases" in json.loads(r.stdout)["notes"][0]
    with d.client() as c:
        c.acquire_lease("vxpu-quarter")
        c.acquire_lease("vxpu-half", restartable=True)  # restartable, but nobody holds it to restart it
    r = d.xpu("defrag", "--apply")
    assert r.returncode == 0, r.stderr
    assert (
        "nothing restartable to move" in r.stdout and "1 no holder connected; 1 not restartable" in r.stdout
    )
    r = d.xpu("defrag", "--apply", "--move-budget", "0")
    assert r.returncode == 1 and "0 % allows no move" in r.stderr
    r = d.xpu("defrag", "--plan", "--apply")
    assert r.returncode == 2 and "give one" in r.stderr


def test_the_daemon_makes_room_for_a_waiting_whole_card_request(daemon_factory, short_tmp, jobs):
    config = CONFIG.replace(
        "make_room = false", "make_room = true\nmake_room_after_s = 0.5\nmove_budget_pct = 50.0"
    )
    d = daemon_factory("pcie-8x-l40s", config=config)
    f = fragmented(d, short_tmp, jobs)
    fixed_card = f["fixed"].cards[0]
    waiter = Job(d, short_tmp, "--gpus", "7", "--wait", "60", mode="xpu", name="big")
    jobs.append(waiter)
    granted = wait_until(waiter.starts, timeout=20)
    cards = sorted(uuids(d)[u] for u in granted[0][1].split(","))
    assert len(cards) == 7 and fixed_card not in cards
    restarted = [x for x in held_leases(d) if x.restart_count == 1]
    assert restarted and all(list(x.cards) == [fixed_card] for x in restarted)
    log = [(e.kind, e.message, e.lease_id) for e in events(d)]
    plan_at = next(i for i, (k, m, _) in enumerate(log) if k == "defrag" and "make room for request" in m)
    first_move = next(i for i, (k, m, lid) in enumerate(log) if k == "move" and "defrag" in m)
    assert plan_at < first_move  # reported before it acts


def test_periodic_defrag_reports_its_plan_before_it_moves_anything(daemon_factory, short_tmp, jobs):
    config = CONFIG + "enabled = true\ninterval_s = 1.0\nmin_gain = 1.0\nmove_budget_pct = 50.0\n"
    d = daemon_factory("pcie-8x-l40s", config=config)
    f = fragmented(d, short_tmp, jobs)  # the periodic runs may act while it is being built, too

    def settled():
        with d.client() as c:
            idle = [card for card in c.cards().cards if not card.whole_lease and not card.slices]
        # the run switches the freed card back to whole up to one settle poll after the last ack
        whole = {card.mode for card in idle} == {"whole"}
        return len(idle) == 7 and whole and not any(x.mark for x in held_leases(d)) and idle

    try:
        idle = wait_until(settled, timeout=20)
    except AssertionError:
        print(d.log.read_text()[-6000:])
        raise
    assert f["fixed"].cards[0] not in [card.index for card in idle]
    assert {card.mode for card in idle} == {"whole"}  # the card it freed went back to whole-card work
    restarted = [x for x in held_leases(d) if x.restart_count]
    assert restarted and all(x.restartable for x in restarted)
    for lease in restarted:  # the job restarted on the card it was moved to, with XPU_RESTART_COUNT=1
        job = job_of(jobs, lease)
        wait_until(lambda job=job: len(job.starts()) == 2)
        assert job.starts()[1][0] == 1 and uuids(d)[job.starts()[1][1]] == lease.cards[0]
    assert len(job_of(jobs, f["fixed"]).starts()) == 1
    log = [(e.kind, e.message, e.lease_id) for e in events(d)]
    plans = [i for i, (k, m, _) in enumerate(log) if k == "defrag" and "(periodic): plan:" in m]
    assert plans
    for i, (k, m, lid) in enumerate(log):
        if k == "move" and "defrag (periodic)" in m:  # each move comes after a plan that names it
            assert any(p < i and lid in log[p][1] for p in plans)
    assert any(k == "defrag" and "move(s) done" in m for k, m, _ in log)
