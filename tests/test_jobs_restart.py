"""`xpu submit --restartable` (issue #31): the daemon holds a restartable detached job's lease and, when it
moves the lease (here: the health monitor, off a card with an injected Xid 79 on the fake NVML), stops the
command and starts it again on the new card with XPU_RESTART_COUNT=1, its output appended. A job that is
not restartable is not moved: it runs on, its lease marked (xpud.controllers.health)."""

from __future__ import annotations

import json
import signal

from tests.conftest import wait_until
from tests.test_jobs import submit, workdir  # noqa: F401 (fixture)

CONFIG = """
[leases]
grace_s = 30.0
[health]
poll_interval_s = 0.2
clear_s = 600.0
event_window_s = 0.5
move_ack_timeout_s = 20.0
"""
# prints its restart count and card, then waits; on TERM says so and ends as a shell would
SCRIPT = (
    'echo "start $XPU_RESTART_COUNT $CUDA_VISIBLE_DEVICES"; trap "echo term; exit 143" TERM; '
    "while :; do sleep 0.1; done"
)


def job_json(d, job_id: str) -> dict:
    r = d.xpu("show", job_id, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["job"]


def cards_of(d, job_id: str) -> list[int]:
    with d.client() as c:
        return list(c.lease(c.job(job_id).lease_id).cards)


def uuid(d, card: int) -> str:
    with d.client() as c:
        return c.cards().cards[card].uuid


def test_a_restartable_job_moves_off_a_failing_card_and_a_plain_one_is_marked(daemon_factory, workdir):  # noqa: F811
    d = daemon_factory("pcie-4x-h100", config=CONFIG)
    plain = submit(d, workdir, "--name", "plain", "--", "sh", "-c", SCRIPT)
    again = submit(
        d, workdir, "--restartable", "--name", "again", "--kill-grace", "3", "--", "sh", "-c", SCRIPT
    )
    plain_out, again_out = workdir / f"xpu-{plain}.out", workdir / f"xpu-{again}.out"
    wait_until(lambda: again_out.exists() and again_out.read_text().startswith("start 0"), 20)
    wait_until(lambda: plain_out.exists() and plain_out.read_text().startswith("start"), 20)
    (src,), (plain_card,) = cards_of(d, again), cards_of(d, plain)
    shown = job_json(d, again)
    assert shown["restartable"] and shown["restarts"] == 0 and shown["state"] == "running"
    with d.client(admin=True) as c:
        for card in (src, plain_card):
            c.inject_fault(str(card), "xid", 79)
    wait_until(lambda: again_out.read_text().count("start") == 2, 30)
    lines = again_out.read_text().splitlines()  # (sh may say "Terminated" for its sleep too)
    first, second = lines[0], lines[-1]
    assert first == f"start 0 {uuid(d, src)}" and "term" in lines[1:-1]  # appended, not truncated
    (dst,) = cards_of(d, again)
    assert dst not in (src, plain_card) and second == f"start 1 {uuid(d, dst)}"
    shown = job_json(d, again)
    assert shown["state"] == "running" and shown["restarts"] == 1
    assert shown["reason"].startswith("restart 1: ") and f"card {src} is unhealthy" in shown["reason"]
    # the job that is not restartable runs on where it was, its lease marked, never started again
    with d.client() as c:
        lease = c.lease(c.job(plain).lease_id)
    assert list(lease.cards) == [plain_card] and "--restartable" in lease.mark
    assert plain_out.read_text().count("start") == 1 and job_json(d, plain)["state"] == "running"
    # the restarted job ends as any job: cancelled by name, its record keeps the restart count
    assert d.xpu("cancel", "again").returncode == 0 and d.xpu("cancel", "plain").returncode == 0
    assert d.xpu("wait", "again", timeout=30).returncode == 143
    ended = job_json(d, again)
    assert ended["state"] == "cancelled" and ended["restarts"] == 1


def test_a_restartable_job_is_held_again_after_a_sigkill_of_the_daemon_and_moves(daemon_factory, workdir):  # noqa: F811
    """The restarted daemon holds a running restartable job's lease again (no token kept anywhere a user can
    read: the daemon acknowledges its own jobs' moves by their anchor), so a failing card moves it."""
    d = daemon_factory("pcie-4x-h100", config=CONFIG)
    job = submit(
        d, workdir, "--restartable", "--name", "durable", "--kill-grace", "3", "--", "sh", "-c", SCRIPT
    )
    out = workdir / f"xpu-{job}.out"
    wait_until(lambda: out.exists() and out.read_text().startswith("start 0"), 20)
    (src,) = cards_of(d, job)
    d.kill(signal.SIGKILL)
    d.start()
    assert job_json(d, job)["state"] == "running"
    with d.client(admin=True) as c:
        c.inject_fault(str(src), "xid", 79)
    wait_until(lambda: out.read_text().count("start") == 2, 30)
    lines = out.read_text().splitlines()
    (dst,) = cards_of(d, job)
    assert lines[0] == f"start 0 {uuid(d, src)}" and "term" in lines[1:-1]  # appended, not truncated
    assert dst != src and lines[-1] == f"start 1 {uuid(d, dst)}"
    shown = job_json(d, job)
    assert shown["state"] == "running" and shown["restarts"] == 1
    with d.client() as c:
        assert not c.lease(c.job(job).lease_id).mark  # moved, not marked
    assert d.xpu("cancel", job).returncode == 0
    assert d.xpu("wait", job, timeout=30).returncode == 143


def test_a_job_whose_move_a_sigkill_of_the_daemon_cut_short_is_started_again(daemon_factory, workdir):  # noqa: F811
    """The daemon dies after it stopped a restartable job for a move and before it started it again (the
    command ignores TERM: its supervisor KILLs it after the kill grace, with no daemon there). The job's row
    says it was moving, so the restarted daemon starts it again (not ``cancelled``, not ``lost``), and it
    ends up off the failing card."""
    d = daemon_factory("pcie-4x-h100", config=CONFIG)
    stubborn = SCRIPT.replace('trap "echo term; exit 143" TERM', 'trap "echo term" TERM')
    job = submit(d, workdir, "--restartable", "--kill-grace", "3", "--", "sh", "-c", stubborn)
    out = workdir / f"xpu-{job}.out"
    wait_until(lambda: out.exists() and out.read_text().startswith("start 0"), 20)
    (src,) = cards_of(d, job)
    with d.client(admin=True) as c:
        c.inject_fault(str(src), "xid", 79)
    wait_until(lambda: "term" in out.read_text(), 20)  # being stopped for the move
    d.kill(signal.SIGKILL)
    status = d.state_dir / "jobs" / f"{job}.status"
    wait_until(lambda: json.loads(status.read_text()).get("state") == "cancelled", 20)  # KILLed at 3 s
    d.start()
    wait_until(lambda: "start 1" in out.read_text(), 30)
    shown = job_json(d, job)
    assert shown["state"] == "running" and shown["restarts"] >= 1, shown
    wait_until(lambda: cards_of(d, job) != [src] and out.read_text().splitlines()[-1].startswith("start"), 30)
    (dst,) = cards_of(d, job)
    assert out.read_text().splitlines()[-1].endswith(uuid(d, dst)) and job_json(d, job)["state"] == "running"
    assert d.xpu("cancel", job).returncode == 0
    assert d.xpu("wait", job, timeout=30).returncode != 0
