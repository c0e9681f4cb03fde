"""How each lease's command ended is kept (issue 18, item 3): `xpu run` reports the exit status or the
signal and the start at release, the ledger keeps it (and keeps it across a restart), and `xpu leases
--all` shows it as `sacct` / `pueue status` do: STATE `done`, `exit 3`, `signal TERM`; ELAPSED the run
time; END the end time."""

from __future__ import annotations

import json
import time

import pytest

from xpud.errors import BadRequest


def ended(d) -> dict[str, dict]:
    return {x["name"]: x for x in json.loads(d.xpu("leases", "--all", "--json").stdout)["leases"]}


def test_leases_all_shows_how_each_command_ended(daemon):
    before = time.time()
    runs = {
        "ok": (["sh", "-c", "sleep 1.2"], 0),
        "three": (["sh", "-c", "exit 3"], 3),
        "term": (["sh", "-c", "kill -TERM $$"], -15),
        "missing": (["/nonexistent/cmd"], 127),
    }
    for name, (argv, code) in runs.items():
        assert daemon.xpu("run", "--name", name, "--", *argv).returncode == code, name
    got = ended(daemon)
    assert (got["ok"]["exit_code"], got["ok"]["exit_signal"], got["ok"]["status"]) == (0, None, "done")
    assert (got["three"]["exit_code"], got["three"]["status"]) == (3, "exit 3")
    term = got["term"]
    assert (term["exit_code"], term["exit_signal"], term["status"]) == (None, 15, "signal TERM")
    assert got["missing"]["status"] == "exit 127"
    for x in got.values():
        assert x["state"] == "released" and x["mark"] is None
        assert before <= x["created"] <= x["started"] <= x["ended"] <= time.time()
    assert got["ok"]["ended"] - got["ok"]["started"] >= 1.2
    table = daemon.xpu("leases", "--all").stdout.splitlines()
    header = table[0].split()
    assert header[:9] == [
        "LEASE",
        "MODE",
        "CARDS",
        "USER",
        "STATE",
        "ELAPSED",
        "END",
        f"({time.strftime('%Z')})",
        "NAME",
    ]
    rows = {name: line for line in table[1:] for name in runs if f" {name} " in line}
    assert " done " in rows["ok"] and " 1s " in rows["ok"]
    assert " exit 3 " in rows["three"] and " signal TERM " in rows["term"] and " exit 127 " in rows["missing"]
    end = time.strftime("%H:%M:%S", time.localtime(got["three"]["ended"]))
    assert end in rows["three"]


def test_a_lease_released_without_a_report_shows_how_the_lease_ended_and_outcomes_survive_a_restart(
    daemon_factory,
):
    d = daemon_factory()
    with d.client() as c:
        g = c.acquire_lease("xpu")
        assert c.release(g.lease.id, g.token).state == "released"
        assert d.xpu("run", "-J", "kept", "--", "sh", "-c", "exit 4").returncode == 4
    listed = json.loads(d.xpu("leases", "--all", "--json").stdout)["leases"]
    plain = next(x for x in listed if x["id"] == g.lease.id)
    assert plain["status"] == "released"
    assert (plain["exit_code"], plain["exit_signal"], plain["started"]) == (None, None, None)
    assert plain["ended"] >= plain["created"]
    d.kill()
    d.start()
    assert ended(d)["kept"]["status"] == "exit 4"  # from the ledger


def test_release_refuses_an_impossible_report(daemon):
    with daemon.client() as c:
        g = c.acquire_lease("xpu")
        with pytest.raises(BadRequest, match="not both"):
            c.release(g.lease.id, g.token, exit_code=1, exit_signal=9)
        with pytest.raises(BadRequest, match=r"exit_code: 300 is outside 0\.\.255"):
            c.release(g.lease.id, g.token, exit_code=300)
        with pytest.raises(BadRequest, match=r"exit_signal: 99 is outside 1\.\.64"):
            c.release(g.lease.id, g.token, exit_signal=99)
        # a start before the grant (a skewed report) is clamped into the lease's life
        lease = c.release(g.lease.id, g.token, exit_code=0, started=1.0)
        assert lease.started == pytest.approx(lease.created)
