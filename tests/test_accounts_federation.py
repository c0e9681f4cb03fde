"""Accounts across three federated daemons (issue #33): an account's share is the cluster's, not the
host's, and a host whose [accounts] differ is reported by `xpud doctor`. Hosts as in
tests/test_federation_daemons.py: h1 and h3 workstation-2x (2 cards), h2 pcie-4x-h100 (4 cards)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.conftest import BIN, wait_until, xpu_env
from tests.test_federation_daemons import converged, make_host, site, start_together  # noqa: F401 (site: a fixture)

ACCOUNTS = """
[accounts]
reclaim_grace_s = 0.0

[accounts.vision]
members = ["root"]
quota = 4

[accounts.nlp]
members = ["root"]
quota = 4
"""
OTHER = ACCOUNTS + '\n[accounts.ops]\nmembers = ["alice"]\n'  # h3's differ: one account more


def _accounts(h) -> dict:
    r = h.daemon.xpu("accounts", "--json", timeout=30)
    assert r.returncode == 0, r.stderr
    return {a["name"]: a for a in json.loads(r.stdout)["accounts"]}


def _hold(h, account: str, gpus: int, *flags: str):
    return h.daemon.xpu_popen(
        "run", "-A", account, "-m", "xpu", "-g", str(gpus), "--kill-grace", "2", *flags, "--", "sleep", "300"
    )


def test_an_accounts_share_is_the_clusters_and_a_differing_config_is_reported_by_doctor(site):  # noqa: F811
    hosts, procs = [], []
    try:
        hosts.append(make_host(site, 1, [], extra=ACCOUNTS, start=False))
        hosts.append(make_host(site, 2, [hosts[0].addr], extra=ACCOUNTS, start=False))
        hosts.append(make_host(site, 3, [hosts[0].addr], extra=OTHER, start=False))
        start_together(hosts)
        h1, h2, h3 = hosts
        wait_until(lambda: converged(hosts), timeout=60, step=0.3)
        # a multi-host job's reservations are charged on each host to the submitter's first account
        r = h1.daemon.xpu("run", "--nodes", "2", "--gpus-per-node", "1", "--", "true", timeout=120)
        assert r.returncode == 0, r.stderr
        with h2.daemon.client() as c:
            assert {x.account for x in c.leases(all=True).leases} == {"vision"}
        # vision holds 4 cards on h2, 2 on h3, and 1 restartable on h1; nlp 1 (not restartable) on h1
        procs += [_hold(h2, "vision", 4), _hold(h3, "vision", 2)]
        procs += [_hold(h1, "vision", 1, "--restartable", "--wait", "inf"), _hold(h1, "nlp", 1)]
        # h1 sees vision's 7 cards across the cluster through the peers' summaries
        wait_until(lambda: _accounts(h1)["vision"]["allocated"] == 7.0, timeout=60, step=0.5)
        # nlp wants a second card on h1. On h1 alone (2 cards) vision deserves its 1 card there; across
        # the cluster (8 cards) vision deserves 6 (quota 4, then the idle card), holds 7: one goes to nlp.
        t0 = time.monotonic()
        with h1.daemon.client() as c:
            g = c.acquire_lease("xpu", account="nlp", wait_s=60)
            assert time.monotonic() - t0 < 20 and g.lease.account == "nlp"
            moved = [e.message for e in c.events() if e.kind == "fairshare"]
        assert len(moved) == 1 and "of account vision (holds 7, deserves 6)" in moved[0], moved
        by = _accounts(h1)
        assert (by["vision"]["share"], by["nlp"]["share"]) == (6.0, 2.0)
        # xpu report on h1 reads the ledgers of all three hosts
        r = h1.daemon.xpu("report", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        rows = {x["key"]: x for x in doc["rows"]}
        assert sorted(doc["hosts"]) == ["h1", "h2", "h3"] and doc["hosts_missing"] == []
        # vision's on h1, h2 and h3, and the two ranks of the job
        assert rows["vision"]["jobs"] == 5 and rows["nlp"]["jobs"] == 2
        assert (rows["vision"]["reclaims_suffered"], rows["nlp"]["reclaims_caused"]) == (1, 1)
        # doctor on h1: h3 publishes another [accounts] hash
        run_dir = str(h1.daemon.runtime_dir)
        cmd = [str(BIN / "xpud"), "--config", str(h1.daemon.config), "--runtime-dir", run_dir,
               "doctor", "--simulate", "workstation-2x", "--json"]  # fmt: skip
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, env=xpu_env(h1.daemon.runtime_dir)
        )
        check = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["accounts config"]
        assert check["status"] == "fail", check
        assert "differs from h3 (" in check["message"] and "h2" not in check["message"], check
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(30)
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)


# h3's nlp is alice's only: root may charge nlp on h1 and h2, not on h3
WITH_OPS = ACCOUNTS + '\n[accounts.ops]\nmembers = ["alice"]\n'
NLP_NOT_ROOTS = WITH_OPS.replace('[accounts.nlp]\nmembers = ["root"]', '[accounts.nlp]\nmembers = ["alice"]')


def _charged(h) -> list[str]:
    with h.daemon.client() as c:
        return sorted(x.account for x in c.leases(all=True).leases)


def test_a_jobs_account_across_hosts_is_checked_by_the_coordinator_and_charged_on_every_host(site):  # noqa: F811
    assert NLP_NOT_ROOTS != WITH_OPS
    hosts = []
    try:
        hosts.append(make_host(site, 1, [], extra=WITH_OPS, start=False))
        hosts.append(make_host(site, 2, [hosts[0].addr], extra=WITH_OPS, start=False))
        hosts.append(make_host(site, 3, [hosts[0].addr], extra=NLP_NOT_ROOTS, start=False))
        start_together(hosts)
        h1, h2, h3 = hosts
        wait_until(lambda: converged(hosts), timeout=60, step=0.3)
        # the coordinator refuses an account the submitter is not a member of, in one line, before any host
        r = h1.daemon.xpu(
            "run", "--nodes", "2", "--gpus-per-node", "1", "-A", "ops", "--", "true", timeout=60
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1, r.stderr
        assert "--account ops: root is not a member (your accounts: vision, nlp)" in lines[0], r.stderr
        assert _charged(h1) == _charged(h2) == _charged(h3) == []
        # every host's lease of the job is charged to the account named (not the submitter's first)
        r = h1.daemon.xpu(
            "run", "--nodes", "2", "--gpus-per-node", "1", "--account", "nlp", "--", "true", timeout=120
        )
        assert r.returncode == 0, r.stderr
        assert _charged(h1) == _charged(h2) == ["nlp"] and _charged(h3) == []  # h3 refuses nlp for root
        r = h1.daemon.xpu("jobs", "--all", "--json", timeout=30)
        (job,) = [j for j in json.loads(r.stdout)["jobs"] if j["kind"] == "multi-host"]
        assert job["account"] == "nlp"
        # each host checks membership again: h3's [accounts] say root is not in nlp there
        r = h1.daemon.xpu(
            "run", "--nodes", "3", "--gpus-per-node", "1", "-A", "nlp", "--", "true", timeout=120
        )
        assert r.returncode != 0 and "h3: --account nlp: root is not a member" in r.stderr, r.stderr
        assert _charged(h3) == []
        # slices spread over hosts likewise (a refused reservation's lease ends, charged all the same)
        r = h1.daemon.xpu(
            "run", "--replicas", "2", "--spread", "-m", "vxpu-quarter", "-A", "nlp", "--", "true", timeout=120
        )
        assert r.returncode == 0, r.stderr
        for h in (h1, h2):
            with h.daemon.client() as c:
                assert {(x.mode, x.account) for x in c.leases(all=True).leases} == {
                    ("xpu", "nlp"),
                    ("vxpu-quarter", "nlp"),
                }
        assert _charged(h3) == []
    finally:
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)


def _doctor_accounts(h) -> dict:
    run_dir = str(h.daemon.runtime_dir)
    cmd = [str(BIN / "xpud"), "--config", str(h.daemon.config), "--runtime-dir", run_dir,
           "doctor", "--simulate", "workstation-2x", "--json"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=xpu_env(h.daemon.runtime_dir))
    return {c["name"]: c for c in json.loads(r.stdout)["checks"]}["accounts config"]


def test_a_reloaded_accounts_config_is_what_the_host_publishes_and_doctor_compares(site):  # noqa: F811
    """`xpud reload` (SIGHUP) of a host whose [accounts] differed: its summary carries the new hash, and
    `xpud doctor` on its peer finds the same config on both (issue #33: no restart needed)."""
    from xpud import config
    from xpud.config.accounts import config_hash

    cfg = config.parse(ACCOUNTS)
    want = config_hash(cfg.accounts, cfg.named_accounts)
    hosts = []
    try:
        hosts.append(make_host(site, 1, [], extra=ACCOUNTS))
        hosts.append(make_host(site, 2, [hosts[0].addr], extra=OTHER))
        h1, h2 = hosts
        wait_until(lambda: converged(hosts), timeout=60, step=0.3)
        check = _doctor_accounts(h1)
        assert check["status"] == "fail" and "differs from h2 (" in check["message"], check
        h2.daemon.config.write_text(h2.daemon.config.read_text().replace(OTHER, ACCOUNTS, 1))
        h2.daemon.proc.send_signal(signal.SIGHUP)

        def h2_hash() -> str:
            return {x["name"]: x for x in h1.cluster()["hosts"]}["h2"].get("accounts_hash") or ""

        wait_until(lambda: h2_hash() == want, timeout=60, step=0.5)
        check = _doctor_accounts(h1)
        assert check["status"] == "ok" and f"hash {want} is the same on 1 peer(s)" in check["message"], check
        assert "ops" not in _accounts(h2)  # h2 dropped the account it alone had, without a restart
    finally:
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)


MANY = 40  # more accounts than one summary carries with names this long (about 19 with 32 characters)


def _many_accounts() -> str:
    return '\n[accounts]\nreclaim = "off"\n' + "".join(
        f'\n[accounts.{_team(i)}]\nmembers = ["root"]\n' for i in range(MANY)
    )


def _team(i: int) -> str:
    return f"team-with-a-long-name-number-{i:03d}"  # 32 characters, the longest an account name may be


def test_every_host_computes_the_same_shares_when_its_accounts_outgrow_the_summary(site):  # noqa: F811
    """Issue #33 item 2: every host computes the same deserved shares from the view. A host's summary
    carries only the busiest accounts that fit (MAX_META); a host that counted its own accounts live
    while its peers read the cut summary computed other shares than they did. Here h1 has an account
    holding its two cards and 40 more waiting: h1 and h2 must agree on every account's share."""
    text = _many_accounts()
    hosts, procs, streams = [], [], []
    try:
        hosts.append(make_host(site, 1, [], extra=text))
        hosts.append(make_host(site, 2, [hosts[0].addr], extra=text))
        h1, h2 = hosts
        wait_until(lambda: converged(hosts), timeout=60, step=0.3)
        procs.append(_hold(h1, _team(0), 2))
        wait_until(lambda: _accounts(h1)[_team(0)]["allocated"] == 2.0, timeout=30, step=0.3)
        with h1.daemon.client() as c:
            for i in range(1, MANY):
                s = c.acquire("xpu", account=_team(i), wait_s=300)
                assert next(iter(c.iterate(s))).HasField("queued")
                streams.append(s)
            wait_until(lambda: _accounts(h1)[_team(MANY - 1)]["waiting"] == 1.0, timeout=30, step=0.3)

            def shares(h) -> dict[str, float]:
                return {n: a["share"] for n, a in _accounts(h).items() if a["share"]}

            wait_until(lambda: shares(h1) == shares(h2), timeout=30, step=0.5)
            got = shares(h1)
            assert sum(got.values()) == pytest.approx(6.0, abs=1e-3)  # the cluster's 2 + 4 cards
            for s in streams:
                s.cancel()
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(30)
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)


def test_work_of_an_account_the_summary_leaves_out_is_not_reclaimed(site):  # noqa: F811
    """The shares count an account that a host's summary leaves out (more accounts than fit) as holding
    nothing there: it deserves nothing on any host. Its restartable work on that host is not taken for
    that reason (its share is not known): here the last of 40 accounts holds one of h1's cards while 38
    accounts wait for two cards each there (the summary carries the busiest first)."""
    text = _many_accounts().replace('reclaim = "off"', 'reclaim = "fair-share"\nreclaim_grace_s = 0.0')
    hosts, procs, streams = [], [], []
    last = _team(MANY - 1)
    try:
        hosts.append(make_host(site, 1, [], extra=text))
        hosts.append(make_host(site, 2, [hosts[0].addr], extra=text))
        h1, h2 = hosts
        wait_until(lambda: converged(hosts), timeout=60, step=0.3)
        procs.append(_hold(h1, _team(0), 1))
        procs.append(_hold(h1, last, 1, "--restartable", "--wait", "inf"))
        wait_until(lambda: _accounts(h1)[last]["allocated"] == 1.0, timeout=30, step=0.3)
        with h1.daemon.client() as c:
            for i in range(1, MANY - 1):
                for _ in range(2):  # busier than the last account: 2 cards wanted to its 1 held
                    s = c.acquire("xpu", account=_team(i), wait_s=300)
                    assert next(iter(c.iterate(s))).HasField("queued")
                    streams.append(s)
            # h2 reads h1's summary without the last account: the shares give it nothing
            wait_until(lambda: _accounts(h2)[_team(MANY - 2)]["waiting"] == 0.0, timeout=30, step=0.3)
            wait_until(lambda: _accounts(h2)[last]["allocated"] == 0.0, timeout=30, step=0.3)
            assert _accounts(h1)[last]["allocated"] == 1.0 and _accounts(h1)[last]["share"] == 0.0
            time.sleep(4.0)  # several ticks of h1's controller
            assert not [e.message for e in c.events() if e.kind == "fairshare"]
            assert sorted(x.account for x in c.leases().leases) == [_team(0), last]
            for s in streams:
                s.cancel()
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(30)
        for h in hosts:
            h.daemon.kill(signal.SIGTERM)
