"""Lease warnings live in their own column (issue 18, item 4): `xpu leases` shows the daemon's note for
the holder in NOTE (as squeue's REASON), never pasted into COMMAND; the restartable flag is a FLAGS column
explained by a legend line; and a lease's warning goes when the lease ends."""

from __future__ import annotations

import json
import signal
import subprocess

from tests.conftest import wait_until

CONFIG = """
[leases]
grace_s = 30.0
[health]
poll_interval_s = 0.2
clear_s = 1.5
event_window_s = 0.5
"""


def row(d, lease_id: str, *args: str) -> str:
    return next(line for line in d.xpu("leases", *args).stdout.splitlines() if line.startswith(lease_id))


def test_a_warning_is_a_note_not_part_of_the_command_and_goes_when_the_lease_ends(daemon_factory):
    d = daemon_factory(config=CONFIG)
    job = d.xpu_popen("run", "--", "sleep", "300", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mover = d.xpu_popen(
        "run", "--restartable", "--", "sleep", "300", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        with d.client() as c:
            wait_until(lambda: len([x for x in c.leases().leases if x.held]) == 2, timeout=20)
            plain, restartable = sorted(c.leases().leases, key=lambda x: x.restartable)
        assert d.xpu("fault", "inject", str(plain.cards[0]), "xid", "79").returncode == 0

        def marked():
            (x,) = [x for x in json.loads(d.xpu("leases", "--json").stdout)["leases"] if x["id"] == plain.id]
            return x["mark"] or None

        mark = wait_until(marked, timeout=20)
        listing = d.xpu("leases").stdout.splitlines()
        header = listing[0].split()
        assert header[-2:] == ["COMMAND", "NOTE"] and "FLAGS" in header
        line = row(d, plain.id)
        assert line.rstrip().endswith(mark) and "sleep 300" in line and "[" not in line
        assert line.index("sleep 300") < line.index(mark)  # the command is itself, the note after it
        assert " R " in row(d, restartable.id) and " R " not in line
        assert listing[-1].startswith("FLAGS: R restartable")
        job.send_signal(signal.SIGTERM)
        job.wait(20)
        ended = row(d, plain.id, "--all")
        assert mark not in ended and " signal TERM " in ended
        (x,) = [
            x for x in json.loads(d.xpu("leases", "--all", "--json").stdout)["leases"] if x["id"] == plain.id
        ]
        assert x["mark"] is None and x["status"] == "signal TERM"
    finally:
        for p in (job, mover):
            p.kill()
