"""Item 6 of issue 12 between real daemons: a ``--restartable`` two-host job whose card on one host fails
(an XID 79 injected through the simulated hardware) is restarted whole on a healthy set of hosts. Three
``xpud --simulate`` processes on 127.0.0.2-4 with mutual TLS (the fixtures of test_federation_daemons.py);
the old ranks are killed and the old leases and reservations released on every host."""

from __future__ import annotations

import signal
import threading

import pytest

from tests.conftest import alive, wait_until
from tests.test_federation_daemons import Host, converged, make_host, site, start_together  # noqa: F401 (fixtures)
from tests.test_federation_jobs_daemons import job, leases, live_reservations, start_job

pytestmark = pytest.mark.timeout(180)

HEALTH = """
[health]
poll_interval_s = 0.2
event_window_s = 0.5
move_ack_timeout_s = 10.0
"""


@pytest.fixture
def healthy_three(site):  # noqa: F811
    hosts: list[Host] = []
    try:
        hosts.append(make_host(site, 1, [], extra=HEALTH, start=False))
        for i in (2, 3):
            hosts.append(make_host(site, i, [hosts[0].addr], extra=HEALTH, start=False))
        start_together(hosts)
        wait_until(lambda: converged(hosts), timeout=40, step=0.3)
        yield hosts
    finally:
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)


@pytest.mark.parametrize("coordinator", ["h1", "h3"])
def test_a_failed_card_under_one_rank_restarts_the_whole_job_on_other_hosts(
    coordinator, healthy_three, tmp_path
):
    """The job lands on h1 + h2 (one domain). A card of h1 fails: h1 has one good card left, so the job
    restarts on h2 + h3. Sent to h1, the failed card is the coordinator's own; sent to h3, a peer's."""
    hosts = {h.name: h for h in healthy_three}
    cards = {"h1": 2, "h2": 4, "h3": 2}
    script = (
        f'echo $$ > {tmp_path}/$XPU_RESTART_COUNT.$NODE_RANK; echo "start $XPU_RESTART_COUNT"; exec sleep 60'
    )
    hold = threading.Event()
    call = start_job(hosts[coordinator], job(["sh", "-c", script], gpus=2, restartable=True), hold)
    it = iter(call)
    try:
        first = next(it).placed
        assert sorted(r.host for r in first.ranks) == ["h1", "h2"], first
        assert [next(it).output.data for _ in range(2)] == [b"start 0\n"] * 2
        old_pids = [int((tmp_path / f"0.{r}").read_text()) for r in (0, 1)]
        # the card fails under a rank on a two-card host: that host cannot take two cards again
        victim = next(r for r in first.ranks if cards[r.host] == 2)
        with hosts[victim.host].daemon.client(admin=True) as admin:
            admin.inject_fault(str(victim.cards[0]), "xid", 79)
        events = []
        for ev in it:
            events.append(ev)
            if sum(e.HasField("output") for e in events) == 2:
                break
        kinds = [e.WhichOneof("what") for e in events]
        assert kinds == ["rank_ended", "placed", "output", "output"], events
        ended = events[0].rank_ended
        assert ended.rank == victim.rank and ended.error.startswith("restart: "), ended
        assert f"card {victim.cards[0]} on host {victim.host} is unhealthy (" in ended.error, ended
        again = events[1].placed
        assert again.job == first.job and again.attempts > first.attempts
        assert sorted(r.host for r in again.ranks) == ["h2", "h3"], again
        assert [e.output.data for e in events[2:]] == [b"start 1\n"] * 2
        # the old ranks were killed (both: the one on the failed card and its healthy peer) ...
        for pid in old_pids:
            wait_until(lambda pid=pid: not alive(pid), timeout=15)
        # ... and every host holds the new placement's lease alone: the old leases and reservations ended
        new = {r.host: r.lease_id for r in again.ranks}
        for name, h in hosts.items():
            want = [new[name]] if name in new else []
            wait_until(lambda h=h, want=want: [lz.id for lz in leases(h)] == want, timeout=15)
            assert live_reservations(h) == len(want)
        with hosts[victim.host].daemon.client() as c:
            bad = next(x for x in c.cards().cards if x.index == victim.cards[0])
            assert bad.health_state == "unhealthy"
    finally:
        call.cancel()
        hold.set()
    for h in healthy_three:
        wait_until(lambda h=h: not leases(h) and live_reservations(h) == 0, timeout=15)
