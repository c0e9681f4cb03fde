"""Upgrades keep every lease and running job: the ledger of every released schema version
(tests/data/ledger-vN.sql, made by tests/data/make_ledger_fixture.py) opens with the newest code, and a
running daemon restarted onto a new version of the code (as `pip install -U xpud && systemctl restart xpud`
does: SIGTERM to the daemon only, then the new code on the same directories) migrates its ledger while a
wrapper's job runs on."""

from __future__ import annotations

import importlib.resources
import json
import re
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.daemons import DaemonProc
from xpud.api.client import Client
from xpud.errors import XpudError
from xpud.ledger.ledger import SCHEMA_VERSION

DATA = Path(__file__).resolve().parent / "data"
# schema versions with a recorded ledger; the current one is made by every test
RECORDED = (2, 3, 4, 5, 6, 7, 8, 9)
# ledgers that dev commits of main wrote with a released version number but another schema
# (xpud.ledger.schema.REPAIRS): v3 as e9caced..767ac28 made it, without reservations.rank_pid
ODD = ("3-e9caced",)
FIXTURE = json.loads((DATA / "ledger-v2.json").read_text())
NEXT_VERSION = "99.0.0+upgrade-test"


def load_fixture(state_dir: Path, version: int | str = 2) -> Path:
    state_dir.mkdir(parents=True)
    path = state_dir / "ledger.sqlite"
    db = sqlite3.connect(path)
    db.executescript((DATA / f"ledger-v{version}.sql").read_text())
    db.close()
    return path


def user_version(path: Path) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("PRAGMA user_version").fetchone()[0]
    finally:
        db.close()


def next_release(dest: Path) -> Path:
    """A copy of the installed xpud package as the next release: another version and one more ledger
    migration (a new table), as a release that changes the schema would ship."""
    import xpud

    pkg = dest / "xpud"
    shutil.copytree(Path(xpud.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("etc", "systemd"):  # package data mapped from elsewhere in an editable install
        src = Path(str(importlib.resources.files(f"xpud.{sub}")))
        if not (pkg / sub).exists():
            shutil.copytree(src, pkg / sub, ignore=shutil.ignore_patterns("__pycache__"))
    init = pkg / "__init__.py"
    text, n = re.subn(r'__version__ = "[^"]*"', f'__version__ = "{NEXT_VERSION}"', init.read_text())
    assert n == 1
    init.write_text(text)
    ledger = pkg / "ledger" / "schema.py"
    text, n = re.subn(
        r"(?m)^SCHEMA_VERSION = len\(MIGRATIONS\)$",
        'MIGRATIONS.append("CREATE TABLE upgrade_probe (id INTEGER PRIMARY KEY, note TEXT NOT NULL);")\n'
        "SCHEMA_VERSION = len(MIGRATIONS)",
        ledger.read_text(),
    )
    assert n == 1, "ledger/schema.py no longer ends its migrations with SCHEMA_VERSION = len(MIGRATIONS)"
    ledger.write_text(text)
    return dest


class Holder:
    """Holds a lease by its token as a holder process does: a Hold stream, reopened whenever it breaks."""

    def __init__(self, runtime_dir: Path, lease_id: str, token: str):
        self.runtime_dir, self.lease_id, self.token = runtime_dir, lease_id, token
        self.stop = threading.Event()
        self.call = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with Client(self.runtime_dir) as c:
                    self.call = c.hold(self.lease_id, self.token)
                    for _ in c.iterate(self.call):
                        pass
            except XpudError:
                pass
            self.stop.wait(0.1)

    def close(self) -> None:
        self.stop.set()
        if self.call is not None:
            self.call.cancel()
        self.thread.join(10)


def leases(d: DaemonProc) -> dict[str, object]:
    with d.client() as c:
        return {x.id: x for x in c.leases().leases}


def test_every_released_schema_has_a_recorded_ledger():
    # a schema change records the ledger of the schema it replaces (tests/data/make_ledger_fixture.py)
    assert RECORDED[-1] == SCHEMA_VERSION - 1
    recorded = {p.stem.removeprefix("ledger-v") for p in DATA.glob("ledger-v*.sql")}
    assert recorded == {str(v) for v in RECORDED} | set(ODD)


@pytest.mark.parametrize("version", [str(v) for v in RECORDED] + list(ODD))
def test_the_previous_release_ledger_opens_with_the_newest_code(short_tmp, version):
    fixture = json.loads((DATA / f"ledger-v{version}.json").read_text())
    d = DaemonProc(short_tmp, fixture["machine"], "[leases]\ngrace_s = 30.0\n")
    path = load_fixture(d.state_dir, version)
    assert user_version(path) == fixture["schema_version"] == int(version.split("-")[0])
    d.start()
    try:
        assert user_version(path) == SCHEMA_VERSION
        active = leases(d)
        assert set(active) == {x["id"] for x in fixture["active"]}
        for x in fixture["active"]:
            assert active[x["id"]].mode == x["mode"] and list(active[x["id"]].cards) == x["cards"]
        with d.client() as c:
            cards = {card.index: card for card in c.cards().cards}
            assert cards[1].drained and not cards[0].drained
            ended = {x.id: x for x in c.leases(all=True).leases}
            assert ended[fixture["released"][0]].state == "released"
            if "released_exit_code" in fixture:  # reported from schema v4 on
                assert ended[fixture["released"][0]].exit_code == fixture["released_exit_code"]
            for x in fixture["active"]:  # the tokens the old daemon gave still work
                assert c.release(x["id"], x["token"]).state == "released"
        assert leases(d) == {}
    finally:
        d.kill(signal.SIGTERM)


@pytest.mark.slow
def test_an_upgrade_restart_keeps_held_leases_and_a_running_job(short_tmp, tmp_path, monkeypatch):
    grace = 5.0  # as test_running_job_survives_a_daemon_restart: holders retry at most 1 s apart
    d = DaemonProc(short_tmp, FIXTURE["machine"], f"[leases]\ngrace_s = {grace}\n")
    upgraded = DaemonProc(short_tmp, FIXTURE["machine"], f"[leases]\ngrace_s = {grace}\n")
    ledger = load_fixture(d.state_dir)
    d.start()  # this code on the previous release's ledger (migrated at start)
    holders = [Holder(d.runtime_dir, x["id"], x["token"]) for x in FIXTURE["active"]]
    old = {x["id"] for x in FIXTURE["active"]}
    go = short_tmp / "go"
    job = d.xpu_popen(
        "run",
        "--mode",
        "vxpu-quarter",
        "--",
        "sh",
        "-c",
        f"while [ ! -e {go} ]; do sleep 0.05; done; echo finished $XPU_LEASE_ID",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: sum(x.held for x in leases(d).values()) == 3, timeout=20)
        (new,) = set(leases(d)) - old
        with d.client() as c:
            assert c.info().version != NEXT_VERSION
        assert user_version(ledger) == SCHEMA_VERSION

        # pip install -U: the new code; systemctl restart: SIGTERM to the daemon, the new one on the same dirs
        site = next_release(tmp_path / "site")
        d.kill(signal.SIGTERM)
        assert job.poll() is None, "the job died with the daemon"
        monkeypatch.setenv("PYTHONPATH", str(site))
        upgraded.start()
        monkeypatch.delenv("PYTHONPATH")
        with upgraded.client() as c:
            assert c.info().version == NEXT_VERSION
        assert user_version(ledger) == SCHEMA_VERSION + 1
        with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
            assert db.execute("SELECT count(*) FROM upgrade_probe").fetchone() == (0,)

        # every holder reconnects within the grace period; past it, every lease is still there
        wait_until(lambda: {k for k, x in leases(upgraded).items() if x.held} == old | {new}, timeout=10)
        time.sleep(grace + 1.0)
        assert {k for k, x in leases(upgraded).items() if x.held} == old | {new}
        go.touch()
        out, err = job.communicate(timeout=30)
        assert job.returncode == 0, err
        assert out.strip() == f"finished {new}"
        for h in holders:
            h.close()
        with upgraded.client() as c:
            for x in FIXTURE["active"]:
                assert c.release(x["id"], x["token"]).state == "released"
        assert leases(upgraded) == {}
    finally:
        for h in holders:
            h.close()
        if job.poll() is None:
            job.kill()
        d.kill()
        upgraded.kill()
