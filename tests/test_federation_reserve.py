"""Two-phase reservations (xpud.federation.reserve): one host's table, and the coordinator over several
hosts' tables — refusals, dead hosts, TTL expiry and late commits leave nothing held."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from xpud.federation.reserve import Refused, Reservations, ResState, coordinate


def test_reserve_is_idempotent_per_job_and_attempt_and_cards_are_never_held_twice():
    t = Reservations()
    free = {0, 1, 2, 3}
    a = t.reserve("job1", 0, "h0", [0, 1], 10, now=0, free=free)
    assert t.reserve("job1", 0, "h0", [0, 1], 10, now=1, free=free) == a  # a retried message
    with pytest.raises(Refused, match=r"card\(s\) 1 not free"):
        t.reserve("job2", 0, "h0", [1, 2], 10, now=1, free=free)
    with pytest.raises(Refused, match="not free"):
        t.reserve("job2", 0, "h0", [3, 7], 10, now=1, free=free)  # 7 is not free on this host
    b = t.reserve("job1", 1, "h0", [1, 2], 10, now=2, free=free)  # a newer attempt replaces the older
    assert b.cards == (1, 2) and t.held_cards() == {1, 2}
    with pytest.raises(Refused, match="older than attempt 1"):
        t.reserve("job1", 0, "h0", [0], 10, now=2, free=free)


def test_slices_of_different_jobs_may_share_a_card():
    t = Reservations()
    t.reserve("job1", 0, "h0", [2], 10, now=0, free={2}, shared=True)
    t.reserve("job2", 0, "h0", [2], 10, now=0, free={2}, shared=True)  # issue #28 item 4
    assert {r.job for r in t.active()} == {"job1", "job2"}
    with pytest.raises(Refused, match="not free"):
        t.reserve("job3", 0, "h0", [3], 10, now=0, free={2}, shared=True)  # not granted here
    with pytest.raises(Refused, match="not free"):
        t.reserve("job4", 0, "h0", [2], 10, now=0, free={2})  # a whole card is one job's


def test_an_uncommitted_reservation_expires_by_itself_and_a_late_commit_is_refused():
    t = Reservations()
    t.reserve("j", 0, "h0", [0], 5, now=0, free={0})
    assert t.expire(4.9) == [] and t.held_cards() == {0}
    assert [r.state for r in t.expire(5.0)] == [ResState.EXPIRED] and t.held_cards() == set()
    with pytest.raises(Refused, match="expired"):
        t.commit("j", 0, now=5.1)
    t.reserve("k", 0, "h0", [0], 5, now=6, free={0})
    assert t.commit("k", 0, now=7).state is ResState.COMMITTED
    assert t.commit("k", 0, now=8).state is ResState.COMMITTED  # a retried commit
    assert t.abort("k", 0).state is ResState.COMMITTED  # an abort never undoes a commit


@pytest.mark.parametrize("ttl", [0, -1, math.nan, math.inf, 1e9])
def test_ttls_and_ids_from_the_wire_are_checked(ttl):
    with pytest.raises(Refused, match="ttl"):
        Reservations().reserve("j", 0, "h0", [0], ttl, now=0, free={0})
    with pytest.raises(Refused, match="job id"):
        Reservations().reserve("x" * 65, 0, "h0", [0], 5, now=0, free={0})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


class Host:
    """A host's own reservation table reached in-process (the daemon reaches it over gRPC)."""

    def __init__(self, name: str, cards: int, clock: Clock, dead: bool = False) -> None:
        self.name, self.table, self.clock, self.dead = name, Reservations(), clock, dead
        self.cards = set(range(cards))

    async def reserve(self, job, attempt, gpus, ttl_s):
        if self.dead:
            await asyncio.sleep(3600)
        free = sorted(self.cards - self.table.held_cards())
        if len(free) < gpus:
            raise Refused(f"{len(free)} free card(s)")
        return self.table.reserve(job, attempt, "coord", free[:gpus], ttl_s, self.clock.now, set(free)).cards

    async def commit(self, job, attempt):
        self.table.commit(job, attempt, self.clock.now)

    async def abort(self, job, attempt):
        r = self.table.get(job)
        if r is not None and r.attempt == attempt and r.state is ResState.COMMITTED:
            self.table.put(replace(r, state=ResState.ABORTED))  # as HostJobs.drop: the job's lease ends
        else:
            self.table.abort(job, attempt)


def run(coro):
    return asyncio.run(coro)


def test_the_coordinator_commits_when_all_hold():
    clock = Clock()
    hosts = {n: Host(n, 8, clock) for n in ("a", "b", "c")}
    out = run(coordinate("job", lambda ex: [h for h in "ab" if h not in ex], hosts.__getitem__, 4))
    assert out.hosts == {"a": (0, 1, 2, 3), "b": (0, 1, 2, 3)} and out.attempts == 1
    assert all(hosts[h].table.get("job").state is ResState.COMMITTED for h in "ab")


def test_a_refusal_or_a_dead_host_aborts_the_others_and_replans_elsewhere():
    clock = Clock()
    hosts = {"a": Host("a", 8, clock), "b": Host("b", 2, clock), "c": Host("c", 8, clock, dead=True)}
    hosts["d"] = Host("d", 8, clock)
    order = ["a", "b", "c", "d"]

    def plan(excluded):
        return [h for h in order if h not in excluded][:3]

    out = run(coordinate("job", plan, hosts.__getitem__, 4, step_timeout_s=0.2))
    assert set(out.hosts) == {"a", "d"}
    assert out.attempts == 2 and any(r.startswith("b:") for r in out.refusals)
    assert any(r.startswith("c:") for r in out.refusals)
    assert hosts["a"].table.get("job").state is ResState.COMMITTED


def test_nothing_stays_held_when_every_attempt_fails():
    clock = Clock()
    hosts = {"a": Host("a", 8, clock), "b": Host("b", 1, clock)}
    with pytest.raises(Refused, match="no set of hosts held after 1 attempt"):
        run(coordinate("job", lambda ex: ["a", "b"], hosts.__getitem__, 4, max_attempts=1))
    assert hosts["a"].table.held_cards() == set() and hosts["a"].table.get("job").state is ResState.ABORTED


def test_a_coordinator_that_dies_after_reserving_leaks_nothing_once_the_ttl_passes():
    clock = Clock()
    a = Host("a", 8, clock)
    run(a.reserve("job", 0, 4, 10.0))  # ... and the coordinator is never heard of again
    assert a.table.held_cards() == {0, 1, 2, 3}
    clock.now = 10.0
    a.table.expire(clock.now)
    assert a.table.held_cards() == set()
    with pytest.raises(Refused):
        run(a.commit("job", 0))  # a late commit from a coordinator that comes back


@pytest.mark.parametrize("stage", ["reserve", "commit"])
def test_a_coordinator_cancelled_mid_attempt_lets_go_at_once_and_not_by_the_ttl(stage):
    """The job's caller went away while the coordinator waited on a slow host (its reserve or its commit):
    every host of the attempt is aborted before the cancellation goes on (before: what was held stayed
    held for the whole TTL; a cancelled queued job kept cards from everyone for 10 s)."""
    clock = Clock()
    a, b = Host("a", 8, clock), Host("b", 8, clock)
    started = asyncio.Event()
    slow_op = getattr(b, stage)

    async def slow(*args):
        started.set()
        await asyncio.sleep(3600)
        return await slow_op(*args)

    setattr(b, stage, slow)
    hosts = {"a": a, "b": b}

    async def main():
        task = asyncio.ensure_future(coordinate("job", lambda ex: ["a", "b"], hosts.__getitem__, 4))
        await started.wait()
        assert a.table.get("job").state is (ResState.HELD if stage == "reserve" else ResState.COMMITTED)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert a.table.held_cards() == set() and a.table.get("job").state is ResState.ABORTED
