"""The verbs a Slurm / kubectl / pueue user types (issue 18, item 10): `xpu show LEASE|CARD`, `xpu events`
(with --follow, --card, --lease, --json), `xpu wait LEASE`, `-w/--watch` on `ls` and `leases`, the
filters and the sort of `xpu leases`, and job names (`xpu run --name`) shown in each."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from tests.conftest import wait_until


def lines_until(stream, pred, timeout: float = 20.0) -> list[str]:
    """Lines read from ``stream`` until one satisfies ``pred`` (that one included)."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        got.append(line)
        if pred(line):
            return got
    raise AssertionError(f"no such line in {got!r}")


def test_show_a_lease_and_a_card(daemon):
    assert daemon.xpu("run", "--name", "train-7", "--", "sh", "-c", "exit 5").returncode == 5
    (le,) = json.loads(daemon.xpu("leases", "--all", "--json").stdout)["leases"]
    text = daemon.xpu("show", le["id"][:5]).stdout
    assert "name:        train-7" in text and "status:      exit 5 (shell status 5)" in text
    assert f"cards:       {le['cards'][0]} (" in text and "events (latest 10):" in text
    assert f"lease {le['id']} released: released by root" in text and "(its command exited 5)" in text
    shown = json.loads(daemon.xpu("show", le["id"], "--json").stdout)
    assert shown["lease"]["id"] == le["id"] and shown["lease"]["status"] == "exit 5"
    assert [e["kind"] for e in shown["events"]] == ["grant", "release"]

    with daemon.client() as c:
        g = c.acquire_lease("xpu", command="sleep 1", name="held-one")
        card = g.lease.cards[0]
        text = daemon.xpu("show", str(card)).stdout
        assert f"card:      {card} (" in text and "health:    healthy, score 100" in text
        assert f"leases:    {g.lease.id} (xpu, held-one)" in text
        shown = json.loads(daemon.xpu("show", g.lease.card_uuids[0], "--json").stdout)
        assert shown["card"]["index"] == card and [x["id"] for x in shown["leases"]] == [g.lease.id]
        assert shown["health"]["health_state"] == "healthy" and shown["events"][-1]["lease_id"] == g.lease.id
    r = daemon.xpu("show", "nosuch")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("xpu: 'nosuch' is neither a lease nor a card") and r.stderr.count("\n") == 1


def test_events_filters_json_and_follow(daemon):
    with daemon.client() as c:
        a = c.acquire_lease("xpu")
        b = c.acquire_lease("xpu")
        c.release(a.lease.id, a.token)
    mine = daemon.xpu("events", "--lease", a.lease.id).stdout.splitlines()
    assert len(mine) == 2 and "grant" in mine[0] and "release" in mine[1]
    assert mine[1].endswith("released by root") and "uid 0" not in mine[0], (
        mine
    )  # as tables say (#28 item 12)
    assert all(a.lease.id in line for line in mine) and f" {time.strftime('%Z')} " in mine[0]
    card = b.lease.cards[0]
    on_card = json.loads(daemon.xpu("events", "--card", str(card), "--json").stdout)
    assert on_card and all(e["card"] == card for e in on_card)
    assert [e["id"] for e in on_card] == sorted(e["id"] for e in on_card)
    assert list(on_card[0]) == ["timestamp", "kind", "card", "lease_id", "message", "id"]
    assert len(json.loads(daemon.xpu("events", "-n", "1", "--json").stdout)) == 1

    p = daemon.xpu_popen("events", "--follow", "--json", stdout=subprocess.PIPE, text=True)
    try:
        seen = lines_until(p.stdout, lambda line: a.lease.id in line and '"release"' in line)
        assert all(json.loads(line)["id"] for line in seen)  # JSON Lines
        with daemon.client() as c:
            c.release(b.lease.id, b.token)
        new = lines_until(p.stdout, lambda line: json.loads(line)["lease_id"] == b.lease.id)
        assert json.loads(new[-1])["kind"] == "release"
        ids = [json.loads(line)["id"] for line in seen + new]
        assert ids == sorted(set(ids))  # nothing twice, in order
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(10)


def test_wait_ends_as_the_command_did(daemon, short_tmp):
    go = short_tmp / "go"
    job = daemon.xpu_popen("run", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; exit 7")
    with daemon.client() as c:
        (le,) = wait_until(lambda: list(c.leases().leases))
    r = daemon.xpu("wait", le.id, "--timeout", "0.3")
    assert r.returncode == 124 and "still active after 0.3 s" in r.stderr
    waiter = daemon.xpu_popen("wait", le.id, stdout=subprocess.PIPE, text=True)
    go.touch()
    assert job.wait(20) == 7
    assert waiter.wait(20) == 7 and waiter.stdout.read().startswith(f"lease {le.id} exit 7 after ")
    r = daemon.xpu("wait", le.id, "--json")  # already ended: at once
    assert r.returncode == 7 and json.loads(r.stdout)["status"] == "exit 7"
    assert daemon.xpu("wait", "ffffffff").returncode == 1


def test_watch_redraws_leases_and_cards_at_each_change(daemon):
    p = daemon.xpu_popen("leases", "--watch", stdout=subprocess.PIPE, text=True)
    q = daemon.xpu_popen("ls", "-w", "--json", stdout=subprocess.PIPE, text=True)
    try:
        first = lines_until(p.stdout, lambda line: line.startswith("LEASE"))
        assert "Ctrl-C ends" in first[0]
        with daemon.client() as c:
            g = c.acquire_lease("xpu", name="watched")
            lines_until(p.stdout, lambda line: line.startswith(g.lease.id) and " watched" in line)
            lines_until(q.stdout, lambda line: f'"whole_lease": "{g.lease.id}"' in line)
    finally:
        for proc in (p, q):
            proc.send_signal(signal.SIGINT)
            assert proc.wait(10) in (130, -signal.SIGINT)


def test_leases_filters_and_sort(daemon):
    for name, code in (("a-ok", 0), ("b-bad", 2), ("c-ok", 0)):
        assert daemon.xpu("run", "-J", name, "--", "sh", "-c", f"exit {code}").returncode == code
    with daemon.client() as c:
        c.acquire_lease("vxpu-half", name="half")

    def names(*args: str) -> list[str]:
        return [x["name"] for x in json.loads(daemon.xpu("leases", *args, "--json").stdout)["leases"]]

    assert names() == ["half"]
    assert names("--state", "done") == ["c-ok", "a-ok"]  # ended states imply --all (newest first)
    assert names("--state", "exit") == ["b-bad"]
    assert names("--all", "--mode", "vxpu-half") == ["half"]
    assert names("--all", "--sort", "name") == ["a-ok", "b-bad", "c-ok", "half"]
    assert names("--all", "--sort", "-name") == ["half", "c-ok", "b-bad", "a-ok"]
    assert names("--all", "--user", "root") == names("--all", "--user", "0") != []
    assert names("--all", "--user", "4242") == []
    r = daemon.xpu("leases", "--state", "finished")
    assert r.returncode == 2 and "--state 'finished': use one of running" in r.stderr
    r = daemon.xpu("leases", "--sort", "size")
    assert r.returncode == 2 and "--sort 'size': use one of lease" in r.stderr
    r = daemon.xpu("leases", "--user", "no-such-user-x")
    assert r.returncode == 2 and "no user 'no-such-user-x' on this host" in r.stderr
    r = daemon.xpu("run", "--name", "bad name!", "--", "true")
    assert r.returncode == 1 and "AcquireRequest.name 'bad name!': not a name" in r.stderr
