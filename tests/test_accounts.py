"""Accounts (issue #33) on real daemons: which account a lease is charged to, fair share in the queue,
reclaim to fair share and ``limit``. The test runs as root: root is a member of the accounts below by name
(``root``) or by group (``@root``)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.conftest import wait_until
from tests.test_cli_json import check
from xpud.errors import BadRequest, NoCapacity

ACCOUNTS = """
[leases]
grace_s = 30.0

[accounts]
slurm_account = "batch"

[accounts.vision]
members = ["root"]
quota = 2

[accounts.nlp]
members = ["@root"]
quota = 2

[accounts.batch]
members = ["slurm"]

[accounts.ops]
members = ["alice"]
"""


def test_a_lease_is_charged_to_the_account_named_else_the_users_first_and_keeps_it(daemon_factory):
    d = daemon_factory("workstation-2x", config=ACCOUNTS)
    with d.client() as c:
        first = c.acquire_lease("vxpu-quarter", command="a")
        named = c.acquire_lease("vxpu-quarter", command="b", account="nlp")  # a member by @group
    assert (first.lease.account, named.lease.account) == ("vision", "nlp")
    d.kill(signal.SIGTERM)  # the charge is in the ledger: a restart restores it
    d.start()
    with d.client() as c:
        assert {x.id: x.account for x in c.leases().leases} == {
            first.lease.id: "vision",
            named.lease.id: "nlp",
        }


def test_an_unknown_account_or_one_the_user_is_not_in_is_refused_in_one_line(daemon_factory):
    d = daemon_factory("workstation-2x", config=ACCOUNTS)
    with d.client() as c:
        with pytest.raises(BadRequest, match=r"--account 'nosuch': no such account \(xpud.toml \[accounts\]"):
            c.acquire_lease("vxpu-quarter", account="nosuch")
        with pytest.raises(
            BadRequest, match=r"--account ops: root is not a member \(your accounts: vision, nlp\)"
        ):
            c.acquire_lease("vxpu-quarter", account="ops")
    r = d.xpu("run", "--account", "ops", "-m", "vxpu-quarter", "--", "true")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "root is not a member" in lines[0], r.stderr
    r = d.xpu("run", "-A", "nlp", "-m", "vxpu-quarter", "--", "sh", "-c", "echo $XPU_LEASE_ID")
    assert r.returncode == 0, r.stderr
    with d.client() as c:
        ended = {x.id: x.account for x in c.leases(all=True).leases}
    assert ended[r.stdout.strip()] == "nlp"


def test_a_user_in_no_account_is_charged_to_default_and_slurm_leases_to_slurm_account(daemon_factory):
    d = daemon_factory(
        "workstation-2x",
        config=ACCOUNTS.replace('members = ["root"]', 'members = ["bob"]').replace(
            'members = ["@root"]', 'members = ["@wheel-x"]'
        ),
    )
    with d.client() as c:
        assert c.acquire_lease("vxpu-quarter").lease.account == "default"
    with d.client(admin=True) as a:
        g = a.acquire_lease("vxpu-quarter", anchor="slurm:4242", owner_uid=1000, cards=(1,))
    assert g.lease.account == "batch"


def fair(**over: str) -> str:
    """Two accounts of quota 1 each on the two cards of workstation-2x; root is in both."""
    extra = "\n".join(f"{k} = {v}" for k, v in over.items())
    return f"""
[leases]
grace_s = 30.0

[accounts]
reclaim_grace_s = 0.0

[accounts.vision]
members = ["root"]
quota = 1
{extra}

[accounts.nlp]
members = ["root"]
quota = 1
"""


def _run(d, account: str, out, *flags: str):
    """`xpu run` of ``account`` holding a whole card, writing its XPU_RESTART_COUNT at each start."""
    script = f'echo "$XPU_RESTART_COUNT" >> {out}; exec sleep 300'
    return d.xpu_popen(
        "run", "-A", account, "-m", "xpu", "--kill-grace", "2", *flags, "--", "sh", "-c", script
    )


def _held(d) -> dict[str, str]:
    with d.client() as c:
        return {x.id: x.account for x in c.leases().leases}


def test_an_account_below_its_share_gets_a_card_back_from_restartable_work_within_seconds(
    daemon_factory, short_tmp
):
    d = daemon_factory("workstation-2x", config=fair())
    outs = [short_tmp / f"v{i}" for i in range(2)]
    procs = [_run(d, "vision", out, "--restartable", "--wait", "inf") for out in outs]
    try:
        wait_until(lambda: list(_held(d).values()) == ["vision", "vision"], timeout=30)  # idle: it may borrow
        t0 = time.monotonic()
        with d.client() as c:
            g = c.acquire_lease("xpu", account="nlp", wait_s=60)  # within nlp's quota: reclaimed for it
            took = time.monotonic() - t0
            assert g.lease.account == "nlp" and took < 15, took
            wait_until(lambda: sorted(_held(d).values()) == ["nlp", "vision"], timeout=10)  # vision keeps 1
            wait_until(lambda: len(c.leases().queue) == 1, timeout=20)  # the reclaimed one queued again
            (queued,) = c.leases().queue
            assert queued.account == "vision" and queued.reason == "Fairshare: vision over its share"
            events = [e.message for e in c.events() if e.kind == "fairshare"]
            assert len(events) == 1 and "of account vision" in events[0] and "for account nlp" in events[0]
            r = d.xpu("accounts", "--json")
            assert r.returncode == 0, r.stderr
            doc = json.loads(r.stdout)
            check(doc, "Accounts", "xpu accounts")  # as docs/json.md documents it
            by = {a["name"]: a for a in doc["accounts"]}
            assert (doc["enabled"], doc["capacity"], doc["reclaim"]) == (True, 2.0, "fair-share")
            assert (by["vision"]["share"], by["vision"]["allocated"], by["vision"]["waiting"]) == (
                1.0,
                1.0,
                1.0,
            )
            assert (by["nlp"]["share"], by["nlp"]["allocated"], by["nlp"]["quota"]) == (1.0, 1.0, 1.0)
            assert (by["vision"]["reclaimed_from"], by["nlp"]["reclaimed_for"]) == (1, 1)
            assert by["vision"]["usage_gpu_hours"] > 0 and by["vision"]["limit"] is None
            c.release(g.lease.id, g.token)
        # the reclaimed command starts again once a card is free, XPU_RESTART_COUNT counting
        wait_until(lambda: sorted(o.read_text().split() for o in outs) == [["0"], ["0", "1"]], timeout=30)
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(30)


def test_non_restartable_work_is_never_reclaimed(daemon_factory, short_tmp):
    d = daemon_factory("workstation-2x", config=fair())
    procs = [_run(d, "vision", short_tmp / f"v{i}") for i in range(2)]
    try:
        wait_until(lambda: list(_held(d).values()) == ["vision", "vision"], timeout=30)
        with d.client() as c:
            with pytest.raises(NoCapacity, match="waited 4 s"):
                c.acquire_lease("xpu", account="nlp", wait_s=4)  # several ticks of the controller
            assert [e for e in c.events() if e.kind == "fairshare"] == []
        assert list(_held(d).values()) == ["vision", "vision"]
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(30)


def test_an_accounts_limit_holds_at_the_grant_even_with_a_card_free(daemon_factory):
    d = daemon_factory("workstation-2x", config=fair(limit="1"))
    with d.client() as c:
        c.acquire_lease("xpu", account="vision")
        with pytest.raises(NoCapacity, match=r"AccountLimit: vision holds 1 of its limit 1 GPU-equivalents"):
            c.acquire_lease("vxpu-quarter", account="vision")
        stream = c.acquire("vxpu-quarter", account="vision", wait_s=30)
        first = next(iter(c.iterate(stream)))
        assert first.HasField("queued")
        wait_until(
            lambda: (
                [q.reason for q in c.leases().queue][:1]
                == ["AccountLimit: vision holds 1 of its limit 1 GPU-equivalents ([accounts.vision] limit)"]
            ),
            timeout=10,
        )
        assert c.acquire_lease("vxpu-quarter", account="nlp").lease.account == "nlp"  # others go on
        stream.cancel()


def test_a_hosts_summary_carries_its_accounts_bounded_and_checked():
    from xpud.federation.membership import MAX_META
    from xpud.federation.view import BadSummary, HostSummary, decode, encode
    from xpud.planning.fairshare import HostAccounts

    many = HostAccounts(
        "0123456789abcdef",
        {f"a{i}": i / 100 for i in range(300)},
        {f"a{i}": 3600.0 * i for i in range(300)},
        {"a1": 0.5},
    )
    text = encode(HostSummary(cards=8, free_whole=0, accounts=many))
    assert len(text.encode()) <= MAX_META  # as many as fit, the busiest first
    got = decode(text).accounts
    assert got.config_hash == "0123456789abcdef" and got.allocated["a299"] == 2.99
    assert "a0" not in got.allocated and len(got.allocated) < 300  # holds, used and waits for nothing
    assert decode(encode(HostSummary(cards=2, free_whole=2))).accounts is None  # no accounts: as before
    over = HostAccounts("0123", {"vision": 3.0})  # never sent above the host's cards
    assert decode(encode(HostSummary(cards=2, free_whole=0, accounts=over))).accounts.allocated == {
        "vision": 2.0
    }
    plain = json.loads(encode(HostSummary(cards=2, free_whole=2)))
    for bad in (
        ["0123", [["vision", float("nan"), 0, 0]]],
        ["0123", [["vision", -1, 0, 0]]],
        ["0123", [["Vision!", 1, 0, 0]]],
        ["0123", [["vision", 1, 0, 0], ["vision", 1, 0, 0]]],
        ["not-hex", []],
        ["0123", [["vision", 1e7, 0, 0]]],
        ["0123", [["vision", 2.5, 0, 0]]],  # more than the host's 2 cards
        ["0123", [["vision", 0, float("inf"), 0]]],
        ["0123", [["vision", 0, 0, 1e7]]],
    ):
        with pytest.raises(BadSummary):
            decode(json.dumps({**plain, "a": bad}))


def test_metrics_per_account(daemon_factory):
    from tests.test_metrics import free_port, samples, scrape, value

    port = free_port()
    d = daemon_factory("workstation-2x", config=fair() + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    with d.client() as c:
        c.acquire_lease("xpu", account="vision")
        c.acquire_lease("vxpu-half", account="nlp")
        found = samples(scrape(port))
    assert value(found, "xpud_account_allocated", account="vision") == 1.0
    assert value(found, "xpud_account_allocated", account="nlp") == 0.5
    assert value(found, "xpud_account_share", account="default") == 0.0
    assert value(found, "xpud_account_reclaims_total", account="vision", direction="from") == 0.0
    assert {s.labels["account"] for s in found["xpud_account_share"]} == {"vision", "nlp", "default"}


def test_report_sums_gpu_hours_jobs_and_waits_from_the_ledger(daemon_factory):
    d = daemon_factory("workstation-2x", config=fair())
    with d.client() as c:
        whole = c.acquire_lease("xpu", gpus=2, account="vision")
        stream = c.acquire("vxpu-half", account="nlp", wait_s=30)  # waits for vision's cards
        updates = c.iterate(stream)
        assert next(updates).HasField("queued")
        time.sleep(1.0)
        c.release(whole.lease.id, whole.token)
        half = next(u for u in updates if u.HasField("granted")).granted
        time.sleep(0.5)
        c.release(half.lease.id, half.token)
    r = d.xpu("report", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    check(doc, "Report", "xpu report")
    rows = {x["key"]: x for x in doc["rows"]}
    assert set(rows) == {"vision", "nlp"} and doc["hosts"] and not doc["hosts_missing"]
    assert 2 * 1.0 / 3600 < rows["vision"]["gpu_hours"] < 2 * 30.0 / 3600  # 2 cards for a second or so
    assert 0.5 * 0.5 / 3600 < rows["nlp"]["gpu_hours"] < 0.5 * 30.0 / 3600  # half a card
    assert (rows["vision"]["jobs"], rows["nlp"]["jobs"]) == (1, 1)
    assert rows["vision"]["mean_wait_s"] == 0.0 and rows["nlp"]["p95_wait_s"] >= 1.0  # it waited in the queue
    user = json.loads(d.xpu("report", "--by", "user", "--json").stdout)
    assert [x["key"] for x in user["rows"]] == ["root"] and user["rows"][0]["jobs"] == 2
    csv = d.xpu("report", "--by", "card-model", "--csv")
    assert csv.returncode == 0 and csv.stdout.splitlines()[0].startswith("by,key,gpu_hours,jobs,")
    assert len(csv.stdout.splitlines()) == 2  # one model on this machine
    past = json.loads(d.xpu("report", "--until", "2001-01-01", "--json").stdout)
    assert past["rows"] == []
    for args, says in (
        (("--by", "team"), "--by team: use one of account, user, card-model"),
        (("--since", "yesterday"), "--since 'yesterday': give an ISO date or time"),
        (("--since", "-1h", "--until", "-2h"), "is not before --until"),
    ):
        r = d.xpu("report", *args)
        assert r.returncode != 0 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_quotas_above_the_cluster_are_a_warning_in_the_event_log_not_an_error(daemon_factory):
    d = daemon_factory("workstation-2x", config=fair().replace("quota = 1", "quota = 3"))
    with d.client() as c:
        assert c.acquire_lease("vxpu-quarter").lease.account == "vision"  # the daemon serves
        wait_until(lambda: any(e.kind == "accounts" for e in c.events()), timeout=10)
        (warning,) = [e.message for e in c.events() if e.kind == "accounts"]
    assert warning.startswith("[accounts] quotas sum to 6 GPU-equivalents, above the cluster's 2:")


@pytest.mark.parametrize("mode", ["fair-share", "quota"])
def test_reclaim_quota_takes_back_only_up_to_quotas_fair_share_up_to_the_share(
    daemon_factory, short_tmp, mode
):
    # no quotas: nlp deserves half the idle cluster (weights) but is owed nothing under "quota" (KAI's)
    config = fair().replace("quota = 1", "quota = 0").replace("reclaim_grace_s = 0.0", f'reclaim = "{mode}"')
    d = daemon_factory("workstation-2x", config=config)
    procs = [_run(d, "vision", short_tmp / f"v{i}", "--restartable", "--wait", "inf") for i in range(2)]
    try:
        wait_until(lambda: list(_held(d).values()) == ["vision", "vision"], timeout=30)
        with d.client() as c:
            if mode == "fair-share":
                assert c.acquire_lease("xpu", account="nlp", wait_s=30).lease.account == "nlp"
            else:
                with pytest.raises(NoCapacity, match="waited 4 s"):
                    c.acquire_lease("xpu", account="nlp", wait_s=4)
            reclaims = [e for e in c.events() if e.kind == "fairshare"]
        assert len(reclaims) == (1 if mode == "fair-share" else 0)
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(30)
