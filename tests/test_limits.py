"""[limits]: per-user caps and the priority ceiling, enforced on a real daemon for a real other uid (the
test runs as root; the client below drops to uid/gid 65534 before it connects, so SO_PEERCRED says so)."""

from __future__ import annotations

import grp
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.otheruser import NOBODY, PRELUDE
from xpud.api.auth import member_of

CLIENT = (
    PRELUDE
    + """
out = []
with Client(sys.argv[1]) as c:
    for mode, priority in json.loads(sys.argv[2]):
        try:
            g = c.acquire_lease(mode, priority=priority)
            out.append(["granted", g.lease.owner_uid])
        except XpudError as e:
            out.append([type(e).__name__, str(e)])
print(json.dumps(out))
"""
)


def as_user(uid: int, runtime_dir, asks: list[tuple[str, int]]) -> list[list]:
    r = subprocess.run(
        [sys.executable, "-c", CLIENT.format(uid=uid), str(runtime_dir), json.dumps(asks)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_user_is_held_to_the_limits_and_an_operator_is_not(daemon_factory, short_tmp):
    short_tmp.chmod(0o755)  # the other uid must reach the sockets
    limits = "[limits]\nmax_user_priority = 0\nmax_leases_per_uid = 2\nmax_queued_per_uid = 1\n"
    d = daemon_factory("pcie-8x-l40s", config="[leases]\ngrace_s = 30.0\n" + limits)
    got = as_user(NOBODY, d.runtime_dir, [("vxpu-quarter", 5), ("vxpu-quarter", 0), ("xpu", -3), ("xpu", 0)])
    assert got[0] == [
        "Forbidden",
        "priority 5: uid 65534 may ask for 0 at most ([limits] max_user_priority; operators may go higher)",
    ]
    assert got[1:3] == [["granted", NOBODY], ["granted", NOBODY]]
    assert got[3] == [
        "NoCapacity",
        "uid 65534 has 2 lease(s) and 0 queued request(s), the most [limits] max_leases_per_uid (2) "
        "allows: release a lease first",
    ]
    with d.client() as c:  # root is an operator: no caps, any priority up to [leases] max_priority
        for _ in range(3):
            assert c.acquire_lease("vxpu-quarter", priority=50).lease.owner_uid == 0
        owners = sorted(x.owner_uid for x in c.leases().leases)
    assert owners == [0, 0, 0, NOBODY, NOBODY]
    assert d.alive()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_members_of_an_exempt_group_are_not_limited(daemon_factory, short_tmp):
    group = grp.getgrgid(NOBODY).gr_name  # nobody's primary group ("nogroup" on Debian)
    assert member_of(NOBODY, NOBODY, [group]) and not member_of(NOBODY, NOBODY, ["root", "no-such-group"])
    short_tmp.chmod(0o755)
    limits = f"[limits]\nmax_leases_per_uid = 1\nexempt_groups = [{group!r}]\n"
    d = daemon_factory("pcie-8x-l40s", config="[leases]\ngrace_s = 30.0\n" + limits)
    got = as_user(NOBODY, d.runtime_dir, [("vxpu-quarter", 7), ("vxpu-quarter", 0)])
    assert got == [["granted", NOBODY], ["granted", NOBODY]]
