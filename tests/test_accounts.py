"""Accounts (issue #33) on real daemons: which account a lease is charged to, fair share in the queue,
reclaim to fair share and ``limit``. The test runs as root: root is a member of the accounts below by name
(``root``) or by group (``@root``)."""

from __future__ import annotations

import signal

import pytest

from xpud.errors import BadRequest

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
