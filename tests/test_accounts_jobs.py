"""Accounts and detached jobs (issues #33 and #31) on real daemons: `xpu submit --account`, a detached job's
lease charged to its account, and fair-share reclaim of `xpu submit --restartable` jobs (the daemon holds
their leases: it stops the command, queues the job again and starts it with XPU_RESTART_COUNT + 1 once
granted). The test runs as root: root is a member of the accounts below by name or by group."""

from __future__ import annotations

import json
import time

from tests.conftest import wait_until
from tests.test_accounts import ACCOUNTS, fair
from tests.test_cli_json import check
from tests.test_jobs import jobs, submit, workdir  # noqa: F401 (fixture)

# its restart count at each start (appended: a restart appends to the job's output), then waits
SCRIPT = 'echo "start $XPU_RESTART_COUNT"; exec sleep 300'


def _job(d, job_id: str) -> dict:
    return next(j for j in jobs(d) if j["id"] == job_id)


def _submit(d, cwd, account: str, *flags: str) -> str:
    return submit(d, cwd, "-A", account, "--kill-grace", "2", *flags, "--", "sh", "-c", SCRIPT)


def _running(d) -> dict[str, str]:
    """Running detached jobs: id -> account."""
    return {j["id"]: j["account"] for j in jobs(d) if j["kind"] == "detached" and j["state"] == "running"}


def _cancel(d, *ids: str) -> None:
    for i in ids:
        d.xpu("cancel", i)


def test_submit_charges_the_account_named_else_the_users_first_and_refuses_others_in_one_line(
    daemon_factory,
    workdir,  # noqa: F811
):
    d = daemon_factory("workstation-2x", config=ACCOUNTS)
    first = submit(d, workdir, "--", "true")
    named = submit(d, workdir, "--account", "nlp", "--", "true")  # a member by @group
    wait_until(lambda: {_job(d, first)["state"], _job(d, named)["state"]} == {"completed"}, timeout=30)
    with d.client() as c:  # an `xpu run`'s lease shows as an attached job, with its account
        run = c.acquire_lease("vxpu-quarter", command="x", account="nlp").lease.id
    rows = {j["id"]: j for j in jobs(d)}
    assert (rows[run]["kind"], rows[run]["account"]) == ("attached", "nlp")
    for r in rows.values():
        check(r, "Job", "xpu jobs")  # as docs/json.md documents it
    assert (rows[first]["account"], rows[named]["account"]) == ("vision", "nlp")
    with d.client() as c:  # the job's lease is charged to it
        ended = {x.id: x.account for x in c.leases(all=True).leases}
        assert ended[c.job(named).lease_id] == "nlp" and ended[c.job(first).lease_id] == "vision"
    for args, says in (
        (("-A", "ops"), "--account ops: root is not a member (your accounts: vision, nlp)"),
        (("--account", "nosuch"), "--account 'nosuch': no such account (xpud.toml [accounts]"),
        (("-A", "Bad!"), "account 'Bad!': not a name"),
    ):
        r = d.xpu("submit", *args, "--", "true", cwd=workdir)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and says in lines[0], r.stderr
    assert len(jobs(d)) == 3  # nothing was queued for them
    # xpu report counts detached jobs under their accounts
    r = d.xpu("report", "--by", "account", "--json")
    assert r.returncode == 0, r.stderr
    by = {x["key"]: x for x in json.loads(r.stdout)["rows"]}
    assert (by["vision"]["jobs"], by["nlp"]["jobs"]) == (1, 2)  # nlp's: a detached job and a lease


def test_an_account_within_its_quota_gets_a_card_back_from_restartable_submitted_jobs(
    daemon_factory,
    workdir,  # noqa: F811
):
    d = daemon_factory("workstation-2x", config=fair())
    mine = [_submit(d, workdir, "vision", "--restartable") for _ in range(2)]
    outs = {j: workdir / f"xpu-{j}.out" for j in mine}
    wait_until(lambda: all(o.exists() and o.read_text() == "start 0\n" for o in outs.values()), 30)
    assert _running(d) == dict.fromkeys(mine, "vision")  # the host is idle otherwise: vision borrows it
    t0 = time.monotonic()
    theirs = _submit(d, workdir, "nlp")  # within nlp's quota (1): one of vision's is reclaimed for it
    wait_until(lambda: _job(d, theirs)["state"] == "running", timeout=30)
    assert time.monotonic() - t0 < 15
    wait_until(lambda: sorted(_running(d).values()) == ["nlp", "vision"], timeout=20)  # vision keeps 1
    (kept,) = [j for j in _running(d) if j in mine]
    (taken,) = [j for j in mine if j != kept]
    shown = _job(d, taken)
    assert (shown["state"], shown["restarts"], shown["account"]) == ("queued", 1, "vision")
    assert shown["reason"] == "Fairshare: vision over its share"  # why it waits, as the queue has it now
    with d.client() as c:
        events = [e.message for e in c.events() if e.kind == "fairshare"]
        assert len(events) == 1 and "of account vision" in events[0] and "for account nlp" in events[0]
        (queued,) = c.leases().queue
        assert queued.account == "vision" and queued.reason == "Fairshare: vision over its share"
    doc = json.loads(d.xpu("accounts", "--json").stdout)
    by = {a["name"]: a for a in doc["accounts"]}
    assert (by["vision"]["reclaimed_from"], by["nlp"]["reclaimed_for"]) == (1, 1)
    assert (by["vision"]["allocated"], by["nlp"]["allocated"]) == (1.0, 1.0)
    assert "start" not in outs[taken].read_text().splitlines()[1:]  # stopped (TERM), not started again
    # nlp's job ends: the reclaimed job starts again, its restart counted, its output appended to
    _cancel(d, theirs)
    wait_until(lambda: outs[taken].read_text().splitlines()[-1:] == ["start 1"], timeout=30)
    assert outs[taken].read_text().startswith("start 0\n") and outs[kept].read_text() == "start 0\n"
    shown = _job(d, taken)
    assert (shown["state"], shown["restarts"]) == ("running", 1)
    _cancel(d, *mine)


def test_a_submitted_job_that_is_not_restartable_is_never_reclaimed(daemon_factory, workdir):  # noqa: F811
    d = daemon_factory("workstation-2x", config=fair())
    mine = [_submit(d, workdir, "vision") for _ in range(2)]
    wait_until(lambda: _running(d) == dict.fromkeys(mine, "vision"), timeout=30)
    theirs = _submit(d, workdir, "nlp", "--wait", "4s")  # several ticks of the accounts controller
    wait_until(lambda: _job(d, theirs)["state"] == "cancelled", timeout=30)
    assert "gave up waiting for cards" in _job(d, theirs)["reason"]
    assert _running(d) == dict.fromkeys(mine, "vision")
    assert all(_job(d, j)["restarts"] == 0 for j in mine)
    with d.client() as c:
        assert [e for e in c.events() if e.kind == "fairshare"] == []
    _cancel(d, *mine)


def test_an_accounts_limit_holds_for_submitted_jobs_with_a_card_free(daemon_factory, workdir):  # noqa: F811
    d = daemon_factory("workstation-2x", config=fair(limit="1"))
    mine = [_submit(d, workdir, "vision", "--restartable") for _ in range(2)]
    wait_until(lambda: len(_running(d)) == 1, timeout=30)
    with d.client() as c:
        wait_until(lambda: [q.reason for q in c.leases().queue][:1] == [
            "AccountLimit: vision holds 1 of its limit 1 GPU-equivalents ([accounts.vision] limit)"
        ], timeout=10)  # fmt: skip
    time.sleep(2.0)  # a few ticks: the free card stays free for vision
    assert len(_running(d)) == 1
    theirs = _submit(d, workdir, "nlp")  # others go on
    wait_until(lambda: _job(d, theirs)["state"] == "running", timeout=30)
    _cancel(d, theirs, *mine)


def test_an_account_that_just_got_cards_back_is_not_reclaimed_from_within_reclaim_grace_s(
    daemon_factory,
    workdir,  # noqa: F811
):
    # a borrows both cards; b (quota 1) takes one back by reclaim and, once a is gone, holds both; then c
    # (quota 1) is owed one of b's: not before b's grace after its reclaim has run out, but then
    grace = 20.0
    config = f"""
[leases]
grace_s = 30.0

[accounts]
reclaim_grace_s = {grace}

[accounts.a]
members = ["root"]

[accounts.b]
members = ["root"]
quota = 1

[accounts.c]
members = ["root"]
quota = 1
"""
    d = daemon_factory("workstation-2x", config=config)
    a = [_submit(d, workdir, "a", "--restartable") for _ in range(2)]
    wait_until(lambda: sorted(_running(d).values()) == ["a", "a"], timeout=30)
    b = [_submit(d, workdir, "b", "--restartable") for _ in range(2)]
    wait_until(lambda: sorted(_running(d).values()) == ["a", "b"], timeout=30)
    with d.client() as c:
        (reclaim,) = [e for e in c.events() if e.kind == "fairshare"]
    assert "of account a" in reclaim.message and "for account b" in reclaim.message
    _cancel(d, *a)
    wait_until(lambda: sorted(_running(d).values()) == ["b", "b"], timeout=30)
    later = _submit(d, workdir, "c")
    submitted = time.time()
    assert submitted < reclaim.timestamp + grace - 5.0, "too slow to see the grace"
    wait_until(lambda: _job(d, later)["state"] == "running", timeout=grace + 30)
    started = _job(d, later)["started"]
    assert started >= reclaim.timestamp + grace - 0.5, (started - reclaim.timestamp, grace)
    assert sorted(_running(d).values()) == ["b", "c"]
    with d.client() as c:
        second = [e.message for e in c.events() if e.kind == "fairshare"][1:]
    assert len(second) == 1 and "of account b" in second[0] and "for account c" in second[0]
    _cancel(d, later, *b)


def test_a_reclaimed_job_whose_kill_grace_outlasts_the_controllers_stop_is_queued_again_not_cancelled(
    inproc,
    workdir,  # noqa: F811
    monkeypatch,
):
    """The accounts controller ends a reclaimed lease whose holder has not released it after STOP_S (60 s);
    a job given a longer --kill-grace was then still stopping, and its lease's end cancelled it. In process,
    with STOP_S at 1 s and a job that takes 4 s to stop on TERM."""
    from xpud.controllers import accounts as controller

    monkeypatch.setattr(controller, "STOP_S", 1.0)
    d = inproc("workstation-2x", fair())
    slow = 'echo "start $XPU_RESTART_COUNT"; trap "sleep 4; exit 143" TERM; while :; do sleep 0.2; done'
    mine = [
        submit(d, workdir, "-A", "vision", "--restartable", "--kill-grace", "30", "--", "sh", "-c", slow)
        for _ in range(2)
    ]
    outs = {j: workdir / f"xpu-{j}.out" for j in mine}
    wait_until(lambda: all(o.exists() and o.read_text() == "start 0\n" for o in outs.values()), 30)
    theirs = _submit(d, workdir, "nlp")
    wait_until(lambda: _job(d, theirs)["state"] == "running", timeout=30)
    with d.client() as c:  # the controller did end the lease before the job stopped
        assert any("did not release it within 1 s" in x.end_reason for x in c.leases(all=True).leases)
    wait_until(lambda: any(_job(d, j)["state"] != "running" for j in mine), timeout=30)  # it stopped
    taken = [j for j in mine if _job(d, j)["state"] != "running"]
    assert [(_job(d, j)["state"], _job(d, j)["restarts"]) for j in taken] == [("queued", 1)]
    _cancel(d, theirs)
    wait_until(lambda: outs[taken[0]].read_text().splitlines()[-1:] == ["start 1"], timeout=30)
    _cancel(d, *mine)
