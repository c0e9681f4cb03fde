"""``[accounts]`` changes without a restart (issue #33): a reload (SIGHUP, ``systemctl reload xpud``) hands
new, changed and removed accounts to the accounts controller for its next decision; a removed account keeps
its running leases (charged to it, shown as removed) while new requests naming it are refused in one line;
a bad ``[accounts]`` is refused in one line and the running accounts stay. Real daemons; the test runs as
root (a member of the accounts below by name)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.conftest import wait_until
from tests.test_cli_json import check
from xpud import config
from xpud.config.accounts import config_hash
from xpud.errors import BadRequest, NoCapacity

BASE = """
[leases]
grace_s = 30.0

[accounts]
reclaim_grace_s = 0.0

[accounts.vision]
members = ["root"]
quota = 1

[accounts.nlp]
members = ["root"]
quota = 1
"""

CHANGED = """
[leases]
grace_s = 30.0

[accounts]
reclaim = "quota"
usage_half_life = "1d"
reclaim_grace_s = 60.0

[accounts.nlp]
members = ["root"]
quota = 0.5
limit = 0.5
weight = 3

[accounts.ops]
members = ["root"]
quota = 0.5
"""


def _reload(d, text: str, says: str) -> None:
    d.config.write_text(text)
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: says in d.log.read_text(), timeout=20)


def _accounts(d) -> dict:
    r = d.xpu("accounts", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    check(doc, "Accounts", "xpu accounts")
    return doc


def _hash(text: str) -> str:
    cfg = config.parse(text)
    return config_hash(cfg.accounts, cfg.named_accounts)


def test_a_reload_changes_accounts_live_and_a_removed_one_keeps_its_leases(daemon_factory):
    d = daemon_factory("workstation-2x", config=BASE)
    with d.client() as c:
        held = c.acquire_lease("xpu", account="vision")
    before = _accounts(d)
    assert before["config_hash"] == _hash(BASE) and before["reclaim"] == "fair-share"

    _reload(d, CHANGED, "config reloaded from")
    assert "needs a restart" not in d.log.read_text()  # [accounts] and its tables are live
    assert "[accounts.vision]" in d.log.read_text() and "[accounts] reclaim" in d.log.read_text()
    doc = _accounts(d)
    by = {a["name"]: a for a in doc["accounts"]}
    assert doc["config_hash"] == _hash(CHANGED) != before["config_hash"] and doc["reclaim"] == "quota"
    assert [a["name"] for a in doc["accounts"]] == ["nlp", "ops", "vision", "default"]
    assert (by["nlp"]["quota"], by["nlp"]["limit"], by["nlp"]["weight"]) == (0.5, 0.5, 3.0)
    assert by["ops"]["quota"] == 0.5 and not by["ops"]["removed"]
    # vision is gone from xpud.toml: its running lease stays, charged to it, and it is shown as removed
    assert by["vision"]["removed"] and by["vision"]["allocated"] == 1.0 and by["vision"]["quota"] == 0.0
    table = d.xpu("accounts")
    assert "vision (removed)" in table.stdout, table.stdout
    with d.client() as c:
        assert {x.id: x.account for x in c.leases().leases} == {held.lease.id: "vision"}
        # a new request naming it is refused in one line; the user's default is now nlp
        with pytest.raises(BadRequest, match=r"--account 'vision': no such account"):
            c.acquire_lease("vxpu-quarter", account="vision")
        assert c.acquire_lease("vxpu-quarter").lease.account == "nlp"
        # nlp's new limit holds at the grant, with room on card 1 for the half
        with pytest.raises(NoCapacity, match=r"AccountLimit: nlp holds 0.25 of its limit 0.5 GPU"):
            c.acquire_lease("vxpu-half", account="nlp")
    r = d.xpu("run", "-A", "vision", "-m", "vxpu-quarter", "--", "true")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "no such account" in r.stderr, r.stderr

    # vision's lease ends: nothing of it holds or waits, so it is no longer listed
    with d.client() as c:
        c.release(held.lease.id, held.token)
    wait_until(lambda: "vision" not in {a["name"] for a in _accounts(d)["accounts"]}, timeout=10)


def test_a_bad_accounts_config_on_reload_is_refused_and_the_running_accounts_stay(daemon_factory):
    d = daemon_factory("workstation-2x", config=BASE)
    bad = BASE.replace("quota = 1\n", "quota = 1\nlimit = 0.5\n", 1)
    _reload(d, bad, "reload refused, the running config stays")
    lines = [x for x in d.log.read_text().splitlines() if "reload refused" in x]
    assert lines and all("[accounts.vision] limit: 0.5 is below quota (1)" in x for x in lines), lines
    assert d.alive()
    doc = _accounts(d)
    assert doc["config_hash"] == _hash(BASE)
    assert {a["name"]: a.get("limit") for a in doc["accounts"]}["vision"] is None
    with d.client() as c:
        assert c.acquire_lease("xpu", account="vision").lease.account == "vision"
        assert c.acquire_lease("xpu", account="vision").lease.account == "vision"  # no limit came in


def test_accounts_added_by_a_reload_to_a_daemon_that_had_none_start_fair_share(daemon_factory):
    d = daemon_factory("workstation-2x", config="[leases]\ngrace_s = 30.0\n")
    assert _accounts(d)["enabled"] is False
    _reload(d, BASE, "config reloaded from")
    doc = _accounts(d)
    assert doc["enabled"] and doc["config_hash"] == _hash(BASE)
    assert [a["name"] for a in doc["accounts"]] == ["vision", "nlp", "default"]
    with d.client() as c:
        assert c.acquire_lease("xpu").lease.account == "vision"
        assert c.acquire_lease("xpu", account="nlp").lease.account == "nlp"
    wait_until(lambda: {a["name"]: a["allocated"] for a in _accounts(d)["accounts"]}["nlp"] == 1.0)
    # and every account removed again: the controller stays for the leases still charged to them
    _reload(d, "[leases]\ngrace_s = 30.0\n", "[accounts.vision], [accounts.nlp]")
    doc = _accounts(d)
    assert doc["enabled"] and doc["config_hash"] is None
    removed = {a["name"]: a["removed"] for a in doc["accounts"]}
    assert removed == {"vision": True, "nlp": True, "default": False}


def test_reclaim_turned_on_by_a_reload_gives_an_account_its_share_back(daemon_factory, short_tmp):
    """``[accounts] reclaim`` is read by the controller at its next tick: with "off" nlp waits while vision
    borrows both cards; a reload to "fair-share" stops one of vision's restartable commands for it. (A
    reload also used to drop the controller's periodic tick: nothing was reclaimed after any reload.)"""
    from tests.test_accounts import _held, _run

    off = BASE.replace("reclaim_grace_s = 0.0\n", 'reclaim_grace_s = 0.0\nreclaim = "off"\n')
    d = daemon_factory("workstation-2x", config=off)
    procs = [_run(d, "vision", short_tmp / f"v{i}", "--restartable", "--wait", "inf") for i in range(2)]
    try:
        wait_until(lambda: list(_held(d).values()) == ["vision", "vision"], timeout=30)
        with d.client() as c:
            stream = c.acquire("xpu", account="nlp", wait_s=120)
            updates = c.iterate(stream)
            assert next(updates).HasField("queued")
            time.sleep(3.0)  # several ticks: nothing is reclaimed with reclaim = "off"
            assert sorted(_held(d).values()) == ["vision", "vision"]
            assert not [e for e in c.events() if e.kind == "fairshare"]
            _reload(d, BASE, "changed [accounts] reclaim")
            granted = next(u for u in updates if u.HasField("granted")).granted  # within the tick or two
            assert granted.lease.account == "nlp"
            wait_until(lambda: sorted(_held(d).values()) == ["nlp", "vision"], timeout=20)
            assert len([e for e in c.events() if e.kind == "fairshare"]) == 1
            stream.cancel()
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(30)


def test_merge_takes_accounts_live_and_names_each_account_changed():
    from xpud.config.live import merge

    running, new = config.parse(BASE), config.parse(CHANGED)
    merged, live, restart = merge(running, new)
    assert restart == [] and merged.named_accounts == new.named_accounts and merged.accounts == new.accounts
    assert live == [
        "[accounts] usage_half_life",
        "[accounts] reclaim",
        "[accounts] reclaim_grace_s",
        "[accounts.nlp]",
        "[accounts.ops]",
        "[accounts.vision]",
    ]
    swapped = BASE.replace("[accounts.vision]", "[accounts.tmp]").replace(
        "[accounts.nlp]", "[accounts.vision]"
    )
    swapped = swapped.replace("[accounts.tmp]", "[accounts.nlp]")  # the same tables, the other order
    merged, live, _ = merge(running, config.parse(swapped))
    assert live == ["[accounts.NAME] order"] and list(merged.named_accounts) == ["nlp", "vision"]


def test_a_reload_leaves_the_controllers_periodic_jobs_scheduled(inproc):
    """A reload reschedules the jobs of the live sections (defrag, windows, forecast, carbon) and only
    those: the accounts controller's tick and the rightsizer's poll go on (a reload of any section used
    to drop them)."""
    d = inproc("workstation-2x", BASE)

    def ids() -> set[str]:
        return {j.id for j in d.daemon.jobs.scheduler.get_jobs()}

    assert {"accounts", "rightsize", "reap", "sample"} <= d.call(ids)
    d.config.write_text(BASE.replace("grace_s = 30.0", "grace_s = 40.0"))
    assert "changed [leases] grace_s" in d.call(d.daemon.reload)
    assert {"accounts", "rightsize", "reap", "sample"} <= d.call(ids)
