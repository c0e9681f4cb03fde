"""Fair share as pure arithmetic (xpud.planning.fairshare, issue #33): worked examples, then the
invariants as properties (hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xpud.planning import fairshare as fs
from xpud.planning.fairshare import AccountSpec, Running, Waiter


def test_usage_halves_over_a_half_life_and_accrues_exactly():
    assert fs.decayed(100.0, 3600, 3600) == pytest.approx(50.0)
    assert fs.decayed(100.0, 0, 3600) == 100.0
    # holding 2 GPU for a very long time: usage tends to 2 * h / ln 2 GPU-seconds
    assert fs.accrue(0.0, 2.0, 1e9, 3600) == pytest.approx(2 * 3600 / math.log(2))
    # the same however often it is updated
    once = fs.accrue(10.0, 3.0, 7200, 3600)
    u = 10.0
    for _ in range(72):
        u = fs.accrue(u, 3.0, 100, 3600)
    assert u == pytest.approx(once)
    # a short while: about allocated * elapsed
    assert fs.accrue(0.0, 4.0, 1.0, 7 * 86400) == pytest.approx(4.0, rel=1e-5)


def test_a_slice_counts_its_memory_fraction():
    assert fs.gpu_equivalents(2) == 2.0
    assert fs.gpu_equivalents(0, [0.5, 0.25]) == 0.75


def test_quota_first_then_idle_capacity_by_weight():
    specs = {
        "a": AccountSpec("a", quota=4, weight=1),
        "b": AccountSpec("b", quota=4, weight=3),
        "c": AccountSpec("c", quota=8, weight=1),
    }
    # c idle: its quota is shared by weight among those who want more (1:3)
    got = fs.deserved(specs, {"a": 100, "b": 100, "c": 0}, 16)
    assert got == pytest.approx({"a": 6.0, "b": 10.0, "c": 0.0})
    # b wants only 5: capped by demand, a takes the rest
    got = fs.deserved(specs, {"a": 100, "b": 5, "c": 0}, 16)
    assert got == pytest.approx({"a": 11.0, "b": 5.0, "c": 0.0})
    # everyone busy: quotas
    assert fs.deserved(specs, {"a": 100, "b": 100, "c": 100}, 16) == pytest.approx({"a": 4, "b": 4, "c": 8})


def test_limit_caps_and_oversubscribed_quotas_are_cut_in_proportion():
    specs = {"a": AccountSpec("a", quota=2, limit=3), "b": AccountSpec("b", quota=2)}
    assert fs.deserved(specs, {"a": 10, "b": 1}, 10) == pytest.approx({"a": 3.0, "b": 1.0})
    over = {"a": AccountSpec("a", quota=12), "b": AccountSpec("b", quota=4)}
    assert fs.deserved(over, {"a": 50, "b": 50}, 8) == pytest.approx({"a": 6.0, "b": 2.0})


def test_a_parent_share_is_split_among_its_children():
    specs = {
        "research": AccountSpec("research", quota=8, weight=1),
        "vision": AccountSpec("vision", quota=6, parent="research"),
        "nlp": AccountSpec("nlp", quota=2, weight=1, parent="research"),
        "ops": AccountSpec("ops", quota=8, weight=1),
    }
    got = fs.deserved(specs, {"vision": 1, "nlp": 20, "ops": 20}, 16)
    # research wants 21, gets its quota 8; vision takes 1 of it, nlp the other 7
    assert got == pytest.approx({"research": 8, "vision": 1, "nlp": 7, "ops": 8})
    # ops idle: research takes everything; nlp all but vision's 1
    got = fs.deserved(specs, {"vision": 1, "nlp": 20}, 16)
    assert got["research"] == pytest.approx(16) and got["nlp"] == pytest.approx(15)


def test_an_account_not_configured_is_quota_zero_weight_one():
    got = fs.deserved({"a": AccountSpec("a", quota=4)}, {"a": 10, "default": 10}, 8)
    assert got == pytest.approx({"a": 6.0, "default": 2.0})


def test_the_queue_orders_by_distance_below_share_then_priority_then_age():
    keys = {
        "far-below": fs.queue_key(allocated=1, share=10, priority=0, created=50),
        "near": fs.queue_key(allocated=9, share=10, priority=5, created=0),
        "near-older": fs.queue_key(allocated=9, share=10, priority=5, created=-1),
        "near-low-prio": fs.queue_key(allocated=9, share=10, priority=0, created=-10),
        "no-share": fs.queue_key(allocated=0, share=0, priority=100, created=-100),
    }
    assert sorted(keys, key=keys.get) == ["far-below", "near-older", "near", "near-low-prio", "no-share"]


def _cluster(free: float):
    """A pool of GPU-equivalents: the waiter fits when what is free plus what is stopped covers it."""

    def fits_for(w: Waiter):
        return lambda stopped: free + sum(r.gpus for r in stopped) >= w.gpus - 1e-9

    return fits_for


SPECS = {"a": AccountSpec("a", quota=4), "b": AccountSpec("b", quota=4)}


def _plan(waiter, running, *, mode="fair-share", free=0.0, now=1000.0, protected=None, specs=SPECS):
    allocated: dict[str, float] = {}
    for r in running:
        allocated[r.account] = allocated.get(r.account, 0.0) + r.gpus
    demand = dict(allocated)
    demand[waiter.account] = demand.get(waiter.account, 0.0) + waiter.gpus
    shares = fs.deserved(specs, demand, 8)
    return fs.plan_reclaim(
        waiter,
        running,
        specs=specs,
        shares=shares,
        allocated=allocated,
        mode=mode,
        now=now,
        protected_until=protected or {},
        fits=_cluster(free)(waiter),
    )


def test_reclaim_takes_the_least_progress_first_and_only_what_is_needed():
    running = [Running(f"b{i}", "b", 1.0, True, started=100.0 * i) for i in range(8)]  # b holds all 8
    plan = _plan(Waiter("w", "a", 2.0), running)
    assert [r.id for r in plan] == ["b7", "b6"]  # the newest: least GPU-seconds lost


def test_reclaim_never_stops_non_restartable_work_or_goes_below_the_victims_share():
    running = [Running(f"b{i}", "b", 1.0, i >= 6, started=0.0) for i in range(8)]
    assert [r.id for r in _plan(Waiter("w", "a", 2.0), running)] == ["b6", "b7"]
    assert _plan(Waiter("w", "a", 3.0), running) == []  # only two restartable: not enough, so nothing
    # b at its share (4 of 8 with a wanting 4): nothing is taken below it
    running = [Running(f"b{i}", "b", 1.0, True, 0.0) for i in range(4)]
    assert _plan(Waiter("w", "a", 1.0), running, free=0.0) == []


def test_reclaim_waits_for_an_account_above_its_share_and_honours_the_mode_and_the_grace():
    running = [Running(f"b{i}", "b", 1.0, True, 0.0) for i in range(8)]
    # a already at its share: its waiter takes nothing
    running_a = [Running(f"a{i}", "a", 1.0, True, 0.0) for i in range(4)] + running[:4]
    assert _plan(Waiter("w", "a", 1.0), running_a) == []
    assert _plan(Waiter("w", "a", 2.0), running, mode="off") == []
    assert _plan(Waiter("w", "a", 2.0), running, protected={"b": 1001.0}) == []
    assert len(_plan(Waiter("w", "a", 2.0), running, protected={"b": 999.0})) == 2


def test_a_task_bigger_than_the_room_left_in_the_share_may_still_reclaim_but_never_past_the_limit():
    """a holds a half-card slice of its share of 4 and waits for a 4-card task: it may reclaim (else the
    big task starves while others backfill); with limit 4 it may not (4.5 > 4)."""
    running = [Running("a0", "a", 0.5, False, 0.0)] + [
        Running(f"b{i}", "b", 1.0, True, 0.0) for i in range(7)
    ]
    w = Waiter("w", "a", 4.0)
    assert len(_plan(w, running, free=1.0)) == 3  # b keeps 4 = its share
    limited = {"a": AccountSpec("a", quota=4, limit=4), "b": AccountSpec("b", quota=4)}
    assert _plan(w, running, free=1.0, specs=limited) == []


def test_quota_mode_reclaims_only_up_to_the_quota_fair_share_beyond_it():
    specs = {"a": AccountSpec("a", quota=2), "b": AccountSpec("b", quota=2), "c": AccountSpec("c", quota=4)}
    # c idle: a's fair share is 4 (quota 2 plus half of c's 4); b holds 8
    running = [Running(f"b{i}", "b", 1.0, True, 0.0) for i in range(6)]
    running += [Running(f"a{i}", "a", 1.0, True, 0.0) for i in range(2)]
    w = Waiter("w", "a", 1.0)
    assert _plan(w, running, specs=specs, mode="quota") == []  # a is at its quota already
    assert len(_plan(w, running, specs=specs, mode="fair-share")) == 1


# ---- properties ----------------------------------------------------------------------------------------

amount = st.floats(min_value=0, max_value=64, allow_nan=False, allow_infinity=False)


@st.composite
def sites(draw):
    n = draw(st.integers(1, 6))
    names = [f"a{i}" for i in range(n)]
    specs = {}
    for i, name in enumerate(names):
        quota = draw(amount)
        limit = draw(st.none() | amount.map(lambda x, q=quota: q + x))
        weight = draw(st.floats(min_value=0.01, max_value=10))
        parent = ""
        if i > 0 and draw(st.booleans()) and not specs[names[0]].parent:
            parent = names[0]
        specs[name] = AccountSpec(name, quota, limit, weight, parent)
    # a parent's quota covers its children's (as the config checks)
    kids = [s for s in specs.values() if s.parent]
    if kids:
        p = specs[names[0]]
        specs[p.name] = AccountSpec(p.name, max(p.quota, sum(k.quota for k in kids)), None, p.weight)
    leaves = [n for n in names if not any(s.parent == n for s in specs.values())]
    demand = {n: draw(amount) for n in leaves}
    capacity = draw(st.floats(min_value=0, max_value=256))
    return specs, demand, capacity, leaves


def _want(specs, demand, name):
    s = specs[name]
    return demand[name] if s.limit is None else min(demand[name], s.limit)


@settings(max_examples=150, deadline=None)
@given(sites())
def test_shares_fit_the_cluster_the_limits_and_the_demand(site):
    specs, demand, capacity, leaves = site
    got = fs.deserved(specs, demand, capacity)
    assert sum(got[n] for n in leaves) <= capacity + 1e-6
    for n in leaves:
        assert -1e-9 <= got[n] <= _want(specs, demand, n) + 1e-6
    for s in specs.values():
        if s.limit is not None:
            assert got[s.name] <= s.limit + 1e-6
    # work-conserving: the capacity goes somewhere while someone wants more
    wanted = fs.deserved(specs, demand, 1e12)
    top = [s.name for s in specs.values() if not s.parent]
    assert sum(got[n] for n in top) == pytest.approx(min(capacity, sum(wanted[n] for n in top)), abs=1e-6)


@settings(max_examples=150, deadline=None)
@given(sites())
def test_demand_within_quota_is_met_where_quotas_fit(site):
    specs, demand, capacity, leaves = site
    top = [s for s in specs.values() if not s.parent]
    if sum(s.quota for s in top) > capacity:
        return
    got = fs.deserved(specs, demand, capacity)
    for n in leaves:
        parent = specs[n].parent
        if _want(specs, demand, n) <= specs[n].quota and (not parent or specs[parent].limit is None):
            assert got[n] == pytest.approx(_want(specs, demand, n), abs=1e-6)


@settings(max_examples=150, deadline=None)
@given(sites())
def test_what_is_beyond_the_quotas_is_max_min_fair_by_weight(site):
    """Among the top-level accounts: one that could take more (below its demand and limit) has the
    highest extra per weight; no account's extra could grow without shrinking one at a lower level."""
    specs, demand, capacity, _ = site
    got = fs.deserved(specs, demand, capacity)
    wanted = fs.deserved(specs, demand, 1e12)  # each account's demand capped by its limit
    top = [s for s in specs.values() if not s.parent]
    if sum(s.quota for s in top) > capacity:
        return
    level = {s.name: (got[s.name] - min(s.quota, wanted[s.name])) / s.weight for s in top}
    for s in top:
        if got[s.name] < wanted[s.name] - 1e-6:  # unsatisfied: nobody has a higher level
            assert all(level[s.name] >= level[o] - 1e-6 for o in level), (s.name, level)


@st.composite
def reclaim_cases(draw):
    specs, _demand, capacity, leaves = draw(sites())
    running = []
    for i in range(draw(st.integers(0, 12))):
        running.append(
            Running(
                f"r{i}",
                draw(st.sampled_from(leaves)),
                draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 8.0])),
                draw(st.booleans()),
                draw(st.floats(0, 1000)),
            )
        )
    waiter = Waiter("w", draw(st.sampled_from(leaves)), draw(st.sampled_from([0.25, 1.0, 2.0, 4.0])))
    free = draw(st.floats(0, 4))
    protected = {n: draw(st.floats(0, 2000)) for n in leaves if draw(st.booleans())}
    mode = draw(st.sampled_from(["fair-share", "quota", "off"]))
    return specs, capacity, running, waiter, free, protected, mode


@settings(max_examples=200, deadline=None)
@given(reclaim_cases())
def test_reclaim_never_touches_non_restartable_work_and_keeps_victims_at_their_floor(case):
    specs, capacity, running, waiter, free, protected, mode = case
    allocated: dict[str, float] = {}
    for r in running:
        allocated[r.account] = allocated.get(r.account, 0.0) + r.gpus
    demand = dict(allocated)
    demand[waiter.account] = demand.get(waiter.account, 0.0) + waiter.gpus
    shares = fs.deserved(specs, demand, capacity)

    def fits(stopped):
        return free + sum(r.gpus for r in stopped) >= waiter.gpus

    plan = fs.plan_reclaim(
        waiter,
        running,
        specs=specs,
        shares=shares,
        allocated=allocated,
        mode=mode,
        now=1000.0,
        protected_until=protected,
        fits=fits,
    )
    if mode == "off":
        assert plan == []
    assert all(r.restartable for r in plan)
    assert all(r.account != waiter.account for r in plan)
    assert all(protected.get(r.account, -1) <= 1000.0 for r in plan)
    assert len({r.id for r in plan}) == len(plan)
    if plan:
        assert fits(plan)
        floor = fs.floors(mode, specs, shares)
        for a in {r.account for r in plan}:
            after = allocated[a] - sum(r.gpus for r in plan if r.account == a)
            assert after >= floor[a] - 1e-6
        held = allocated.get(waiter.account, 0.0)
        bound = specs[waiter.account].quota if mode == "quota" else shares[waiter.account]
        assert held < bound
        limit = specs[waiter.account].limit
        assert limit is None or held + waiter.gpus <= limit + 1e-6
