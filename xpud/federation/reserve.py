"""Two-phase reservations for work that spans hosts: ``Reserve`` on every chosen host, ``Commit`` when all
hold, ``Abort`` otherwise. Each host is the only authority over its own cards.

``Reservations`` is one host's table (pure: the time is passed in). A reservation holds cards until it
is committed (it becomes the job's lease there), aborted, or its TTL runs out — on that host, by
itself, so a dead coordinator leaks nothing and a partition can never grant a card twice: a commit that
arrives after the TTL is refused, and the coordinator then aborts the rest.

``coordinate`` is the coordinator's side: reserve everywhere, commit when all hold, abort and re-plan on
other hosts when one refuses (bounded attempts). It talks to hosts through the ``HostLink`` protocol (the
daemon's gRPC peer client, or a host's own table in tests and simulations).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

from xpud.engine.uninterrupted import uninterrupted
from xpud.errors import XpudError

MIN_TTL_S, MAX_TTL_S = 0.5, 600.0
MAX_ID = 64  # characters of a job id


class ResState(StrEnum):
    HELD = "held"
    COMMITTED = "committed"
    ABORTED = "aborted"
    EXPIRED = "expired"


class Refused(XpudError):
    """A reservation step a host refuses; the message says why. ``committed``: hosts where the job was
    committed before a later commit failed (their leases are the caller's to release)."""

    def __init__(self, message: str, committed: dict[str, tuple[int, ...]] | None = None) -> None:
        super().__init__(message)
        self.committed = committed or {}


@dataclass(frozen=True)
class Reservation:
    job: str
    attempt: int
    coordinator: str
    cards: tuple[int, ...]
    created: float
    expires: float
    state: ResState = ResState.HELD


def check_request(job: str, attempt: int, ttl_s: float) -> None:
    if not job or len(job) > MAX_ID or not job.isprintable():
        raise Refused(f"job id {job[:MAX_ID]!r}: give 1..{MAX_ID} printable characters")
    if not 0 <= attempt < 2**31:
        raise Refused(f"attempt {attempt}: give 0..{2**31 - 1}")
    if not (math.isfinite(ttl_s) and MIN_TTL_S <= ttl_s <= MAX_TTL_S):
        raise Refused(f"ttl {ttl_s!r} s: give {MIN_TTL_S:g}..{MAX_TTL_S:g} seconds")


class Reservations:
    """One host's reservations. ``free`` says which cards may be reserved now (the engine's idle cards)."""

    def __init__(self) -> None:
        self._by_job: dict[str, Reservation] = {}

    def __len__(self) -> int:
        return len(self._by_job)

    def held_cards(self) -> set[int]:
        return {c for r in self._by_job.values() if r.state is ResState.HELD for c in r.cards}

    def get(self, job: str) -> Reservation | None:
        return self._by_job.get(job)

    def all(self) -> list[Reservation]:
        return list(self._by_job.values())

    def put(self, r: Reservation) -> None:
        """Set a job's entry as it is elsewhere (restored from a ledger, or undone after a failed write)."""
        self._by_job[r.job] = r

    def remove(self, job: str) -> None:
        """Drop a job's entry (an ended one another coordinator left, e.g. an abort that came first)."""
        self._by_job.pop(job, None)

    def active(self) -> list[Reservation]:
        return [r for r in self._by_job.values() if r.state is ResState.HELD]

    def reserve(
        self,
        job: str,
        attempt: int,
        coordinator: str,
        cards: Sequence[int],
        ttl_s: float,
        now: float,
        free: set[int],
        shared: bool = False,
    ) -> Reservation:
        """Hold ``cards`` for ``job``/``attempt``. Idempotent: the same job and attempt again returns what
        is held (a retried message); a newer attempt replaces an older one still held; an older attempt
        than the one known is refused. ``shared``: other jobs may hold the cards too (each its own slice,
        granted by the engine, the authority on room)."""
        check_request(job, attempt, ttl_s)
        self.expire(now)
        old = self._by_job.get(job)
        if old is not None:
            if attempt < old.attempt:
                raise Refused(f"job {job}: attempt {attempt} is older than attempt {old.attempt}")
            if attempt == old.attempt:
                if old.state is ResState.HELD and tuple(cards) == old.cards:
                    return old
                raise Refused(f"job {job} attempt {attempt} is {old.state} here")
            if old.state is ResState.COMMITTED:
                raise Refused(f"job {job} is committed here already (attempt {old.attempt})")
        mine = set(old.cards) if old is not None and old.state is ResState.HELD else set()
        held = set() if shared else self.held_cards() - mine
        taken = held | (set(cards) - free - mine)
        clash = sorted(set(cards) & taken)
        if clash:
            raise Refused(f"card(s) {', '.join(map(str, clash))} not free here")
        if len(set(cards)) != len(cards) or not cards:
            raise Refused("give one or more distinct cards")
        r = Reservation(job, attempt, coordinator, tuple(cards), now, now + ttl_s)
        self._by_job[job] = r
        return r

    def commit(self, job: str, attempt: int, now: float) -> Reservation:
        """Make the reservation the job's (the caller turns it into a lease, ledger first). A late or
        unknown commit is refused: the coordinator must abort the rest."""
        self.expire(now)
        r = self._by_job.get(job)
        if r is None or r.attempt != attempt:
            raise Refused(f"job {job} attempt {attempt}: no reservation here")
        if r.state is ResState.COMMITTED:
            return r  # a retried commit
        if r.state is not ResState.HELD:
            raise Refused(f"job {job} attempt {attempt}: the reservation is {r.state}")
        r = self._by_job[job] = replace(r, state=ResState.COMMITTED)
        return r

    def abort(self, job: str, attempt: int | None = None) -> Reservation | None:
        """Free a held reservation (any attempt when ``attempt`` is None). Aborting what is unknown or
        already ended is not an error (aborts are retried and may cross a commit that failed)."""
        r = self._by_job.get(job)
        if r is None or (attempt is not None and r.attempt != attempt) or r.state is not ResState.HELD:
            return r
        r = self._by_job[job] = replace(r, state=ResState.ABORTED)
        return r

    def expire(self, now: float) -> list[Reservation]:
        """Held reservations past their TTL end here, with no help from anyone."""
        gone = []
        for job, r in list(self._by_job.items()):
            if r.state is ResState.HELD and now >= r.expires:
                self._by_job[job] = replace(r, state=ResState.EXPIRED)
                gone.append(self._by_job[job])
        return gone

    def forget(self, older_than: float) -> None:
        """Drop ended reservations created before ``older_than`` (a committed one is a lease by then)."""
        for job, r in list(self._by_job.items()):
            if r.state is not ResState.HELD and r.created < older_than:
                del self._by_job[job]


# ------------------------------------------------------------------------------------ coordinator
class HostLink(Protocol):
    """How a coordinator reaches one host (gRPC in the daemon)."""

    async def reserve(self, job: str, attempt: int, gpus: int, ttl_s: float) -> tuple[int, ...]: ...
    async def commit(self, job: str, attempt: int) -> None: ...
    async def abort(self, job: str, attempt: int) -> None: ...


@dataclass(frozen=True)
class Outcome:
    hosts: dict[str, tuple[int, ...]]  # host -> cards committed there
    attempts: int
    refusals: tuple[str, ...]  # "host: why" for every refusal met on the way


async def coordinate(
    job: str,
    plan: Callable[[set[str]], Sequence[str]],
    link: Callable[[str], HostLink],
    gpus_per_host: int,
    ttl_s: float = 10.0,
    max_attempts: int = 3,
    step_timeout_s: float = 5.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    first_attempt: int = 0,
) -> Outcome:
    """Reserve ``gpus_per_host`` cards on each host ``plan(excluded)`` names, commit when all hold; on a
    refusal (or a host that does not answer within ``step_timeout_s``) abort everywhere and re-plan
    without that host. Raises ``Refused`` after ``max_attempts`` (nothing is left held anywhere that
    answered; what did not answer expires by its TTL). Cancelled, it aborts every host of the attempt in
    progress before the cancellation goes on: nothing waits for the TTL. Attempts are numbered from
    ``first_attempt`` (a queued job that tries again uses new numbers: hosts refuse an attempt older than
    one they saw)."""
    excluded: set[str] = set()
    refusals: list[str] = []
    for attempt in range(first_attempt, first_attempt + max_attempts):
        hosts = list(plan(set(excluded)))
        if not hosts:
            break
        try:
            outcome = await _attempt(
                job, attempt, hosts, link, gpus_per_host, ttl_s, step_timeout_s, excluded, refusals
            )
        except asyncio.CancelledError:  # the job went away: what this attempt holds is let go at once
            with contextlib.suppress(asyncio.CancelledError):
                await _let_go(job, attempt, hosts, link, step_timeout_s)
            raise
        if outcome is not None:
            return outcome
        await sleep(0)
    raise Refused(f"job {job}: no set of hosts held after {max_attempts} attempt(s): {'; '.join(refusals)}")


async def _attempt(
    job: str,
    attempt: int,
    hosts: list[str],
    link: Callable[[str], HostLink],
    gpus_per_host: int,
    ttl_s: float,
    step_timeout_s: float,
    excluded: set[str],
    refusals: list[str],
) -> Outcome | None:
    """One attempt of ``coordinate`` on ``hosts``: the outcome, or None (refusals and exclusions noted)."""
    results = await asyncio.gather(
        *(_reserve_one(link, h, job, attempt, gpus_per_host, ttl_s, step_timeout_s) for h in hosts)
    )
    bad = [(h, r) for h, r in results if isinstance(r, Exception)]
    if not bad:
        committed: dict[str, tuple[int, ...]] = {}
        try:
            for h, cards in results:
                await asyncio.wait_for(link(h).commit(job, attempt), step_timeout_s)
                committed[h] = cards  # type: ignore[assignment]
            return Outcome(committed, attempt + 1, tuple(refusals))
        except Exception as e:
            late = next(h for h, _ in results if h not in committed)
            bad = [(late, e)]
            await _abort_all(job, attempt, [h for h, _ in results], link, step_timeout_s)
            if committed:  # some hosts hold the job already: the caller must release it there
                raise Refused(
                    f"job {job}: commit failed on {late} ({e}) after {', '.join(committed)} committed",
                    committed,
                ) from e
    else:
        await _abort_all(
            job, attempt, [h for h, r in results if not isinstance(r, Exception)], link, step_timeout_s
        )
    for h, e in bad:
        excluded.add(h)
        refusals.append(f"{h}: {str(e) or type(e).__name__}")
    return None


async def _reserve_one(link, h: str, job: str, attempt: int, gpus: int, ttl_s: float, timeout: float):
    try:
        return h, await asyncio.wait_for(link(h).reserve(job, attempt, gpus, ttl_s), timeout)
    except Exception as err:  # a refusal, a dead host, a time-out: all the same to the coordinator
        return h, err


async def _abort_all(job: str, attempt: int, hosts: Sequence[str], link, timeout: float) -> None:
    async def one(h: str) -> None:
        with contextlib.suppress(Exception):  # what does not answer expires there by its TTL
            await asyncio.wait_for(link(h).abort(job, attempt), timeout)

    await asyncio.gather(*(one(h) for h in hosts))


# a coordinator being cancelled aborts the hosts of its attempt (reserves may still be in flight there:
# an abort that overtakes one is remembered there, and the reserve is refused), whatever else is cancelled
_let_go = uninterrupted(_abort_all)
