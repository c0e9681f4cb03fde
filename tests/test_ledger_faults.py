"""The ledger under faults, through real daemons: locked by another process, a full file system, damaged
files at start-up, and its file modes."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from xpud.errors import Unavailable
from xpud.ledger.ledger import BUSY_TIMEOUT_S

MIG = "[leases]\ngrace_s = 60.0\n"  # MIG idle instances kept for reuse (the default): a freed one is reused


def active(d) -> list:
    with d.client() as c:
        return list(c.leases().leases)


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_release_with_the_ledger_locked_frees_nothing_and_the_daemon_keeps_serving(daemon_factory):
    d = daemon_factory("dgx-h100", config=MIG)
    with d.client() as c:
        first = c.acquire_lease("vxpu-quarter")
    device = first.lease.env["CUDA_VISIBLE_DEVICES"]
    assert device.startswith("MIG-")
    other = sqlite3.connect(d.state_dir / "ledger.sqlite", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # a backup or an open sqlite3 shell holds it
    try:
        outcome: dict = {}

        def release():
            t0 = time.monotonic()
            try:
                with d.client() as c:
                    c.release(first.lease.id, first.token)
                outcome["error"] = None
            except Exception as e:
                outcome["error"] = e
            outcome["took"] = time.monotonic() - t0

        t = threading.Thread(target=release)
        t.start()
        time.sleep(0.3)
        with d.client() as c:  # the loop is not blocked meanwhile, reads included
            assert timed(c.cards) < 1.0
            assert timed(lambda: c.leases(all=True)) < 1.0
        t.join(BUSY_TIMEOUT_S + 10)
        err = outcome["error"]
        assert isinstance(err, Unavailable) and str(err).startswith("ledger busy"), err
        assert "retry" in str(err) and outcome["took"] < BUSY_TIMEOUT_S + 3
        with d.client() as c, pytest.raises(Unavailable, match="ledger busy"):
            c.acquire_lease("vxpu-quarter")  # nothing can be granted while the ledger cannot record it
        with d.client(admin=True) as admin:
            with pytest.raises(Unavailable, match="ledger busy"):
                admin.drain("5", "maintenance")
            assert not admin.cards().cards[5].drained  # nothing changed
        assert [x.id for x in active(d)] == [first.lease.id]
    finally:
        other.execute("ROLLBACK")
        other.close()
    with d.client() as c:
        second = c.acquire_lease("vxpu-quarter")
    devices = [x.env["CUDA_VISIBLE_DEVICES"] for x in active(d)]
    assert sorted(devices) == sorted({device, second.lease.env["CUDA_VISIBLE_DEVICES"]})  # never shared
    with d.client() as c:
        c.release(first.lease.id, first.token)
        c.release(second.lease.id, second.token)
    assert active(d) == []


@pytest.fixture
def small_tmpfs(short_tmp):
    """A 3 MiB tmpfs (we run as root in the test environment; skipped where mounting is impossible)."""
    mnt = short_tmp / "fs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> Path:
    """Fill a file system to the last byte; returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_a_full_state_directory_refuses_changes_with_unavailable_and_recovers(daemon_factory, small_tmpfs):
    d = daemon_factory("pcie-8x-l40s", start=False)
    state = small_tmpfs / "state"
    d.state_dir = state
    d.start()
    with d.client() as c:
        first = c.acquire_lease("xpu")
    filler = fill(small_tmpfs)
    try:
        with d.client() as c:
            with pytest.raises(Unavailable, match="ledger full") as err:
                for _ in range(200):  # until the WAL needs a page it does not have
                    g = c.acquire_lease("vxpu-half")
                    c.release(g.lease.id, g.token)
            assert "free space" in str(err.value)
            with pytest.raises(Unavailable, match="ledger full"):
                c.release(first.lease.id, first.token)
            assert first.lease.id in {x.id for x in c.leases().leases}
            assert len(c.cards().cards) == 8  # still serving
    finally:
        filler.unlink()
    with d.client() as c:
        c.release(first.lease.id, first.token)
        assert list(c.leases().leases) == []
    assert d.alive()
    assert "Traceback" not in d.log.read_text()


def test_a_grant_the_full_ledger_cannot_record_leaves_no_mig_instance_behind(daemon_factory, small_tmpfs):
    d = daemon_factory("dgx-h100", config=MIG, start=False)
    d.state_dir = small_tmpfs / "state"
    d.start()
    filler = fill(small_tmpfs)
    try:
        with d.client() as c:
            with pytest.raises(Unavailable, match="ledger full"):
                for _ in range(200):  # the first grant the WAL has no page for
                    g = c.acquire_lease("vxpu-quarter")
                    c.release(g.lease.id, g.token)
            assert list(c.leases().leases) == []
            cards = c.cards().cards
            assert not any(card.slices for card in cards)  # the prepared instance was torn down
    finally:
        filler.unlink()
    with d.client() as c:
        g = c.acquire_lease("vxpu-quarter")
        assert g.lease.env["CUDA_VISIBLE_DEVICES"].startswith("MIG-")


def test_a_full_state_directory_at_start_up_is_one_line(daemon_factory, small_tmpfs):
    d = daemon_factory("pcie-8x-l40s", start=False)
    d.state_dir = small_tmpfs / "state"
    d.state_dir.mkdir()
    filler = fill(small_tmpfs)
    try:
        code, log = start_refused(d)
    finally:
        filler.unlink()
    assert code == 1 and "Traceback" not in log, log
    assert log.strip().splitlines()[-1].startswith("xpud: ledger full: no space left in"), log
    d.start()  # space again: it starts
    assert len(active(d)) == 0


def start_refused(d) -> tuple[int, str]:
    """Start the daemon, expecting it to refuse: (exit code, what this start logged)."""
    seen = d.log.stat().st_size if d.log.exists() else 0
    d.start(wait=False)
    d.proc.wait(90)
    return d.proc.returncode, d.log.read_bytes()[seen:].decode()


def with_leases(daemon_factory, n: int = 2):
    """A daemon on dgx-a100 that granted ``n`` whole cards, then was killed (its WAL holds the grants)."""
    d = daemon_factory("dgx-a100")
    with d.client() as c:
        ids = [c.acquire_lease("xpu").lease.id for _ in range(n)]
    d.kill()
    return d, ids


def damage_cases():
    def truncate(ledger: Path) -> None:
        _checkpoint(ledger)
        data = ledger.read_bytes()
        ledger.write_bytes(data[: len(data) // 2 + 100])

    def garbage(ledger: Path) -> None:
        _checkpoint(ledger)
        ledger.write_bytes(os.urandom(ledger.stat().st_size))

    def bad_row(ledger: Path) -> None:
        db = sqlite3.connect(ledger)
        db.execute("UPDATE leases SET slices='{not json' WHERE rowid=1")
        db.commit()
        db.close()

    def wal_garbage(ledger: Path) -> None:
        wal = Path(f"{ledger}-wal")
        data = bytearray(wal.read_bytes())
        assert len(data) > 32 + 2 * (24 + 4096), "the killed daemon's grants are in its WAL"
        data[32 + 24 + 100 : 32 + 24 + 200] = os.urandom(100)  # inside the first frame's page
        wal.write_bytes(bytes(data))

    def wal_header(ledger: Path) -> None:
        wal = Path(f"{ledger}-wal")
        data = bytearray(wal.read_bytes())
        data[:32] = os.urandom(32)
        wal.write_bytes(bytes(data))

    def sql(*statements: str):  # issue #28 item 6: a 53-line traceback and exit 1, or a lease lost silently
        def damage(ledger: Path) -> None:
            db = sqlite3.connect(ledger)
            for stmt in statements:
                db.execute(stmt)
            db.commit()
            db.close()

        return damage

    return {
        "no-events-table": (sql("DROP TABLE events"), "table events is missing"),
        "no-leases-table": (sql("DROP TABLE leases"), "table leases is missing"),
        "no-column": (
            sql("ALTER TABLE leases DROP COLUMN name"),  # (not rank_pid: schema.REPAIRS adds that one back)
            "leases has no column name",
        ),
        "unknown-state": (sql("UPDATE leases SET state='paused' WHERE rowid=1"), "has state 'paused'"),
        "truncated": (truncate, "damaged"),
        "garbage": (garbage, "damaged"),
        "bad-row": (bad_row, "is unreadable"),
        "wal-garbage": (wal_garbage, "WAL file ledger.sqlite-wal is damaged"),
        "wal-header": (wal_header, "WAL file ledger.sqlite-wal is damaged"),
    }


def _checkpoint(ledger: Path) -> None:
    db = sqlite3.connect(ledger)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


@pytest.mark.parametrize("case", list(damage_cases()))
def test_a_damaged_ledger_is_refused_in_one_line_and_kept_aside(daemon_factory, case):
    damage, words = damage_cases()[case]
    d, _ = with_leases(daemon_factory)
    ledger = d.state_dir / "ledger.sqlite"
    damage(ledger)
    before = ledger.read_bytes()
    code, log = start_refused(d)
    assert code == 3, log
    lines = [ln for ln in log.splitlines() if ln.strip()]
    assert "Traceback" not in log and len(lines) <= 2, log
    assert lines[-1].startswith(f"xpud: ledger {ledger} is damaged") and words in lines[-1], lines[-1]
    copies = sorted(p.name for p in d.state_dir.glob("ledger.sqlite.damaged-*"))
    assert copies and copies[0] in lines[-1]
    assert (d.state_dir / copies[0]).read_bytes() == before  # kept as it was
    code, log = start_refused(d)  # a restart loop makes no more copies
    assert code == 3 and sorted(p.name for p in d.state_dir.glob("ledger.sqlite.damaged-*")) == copies


def test_a_crash_keeps_every_lease_of_an_intact_wal(daemon_factory):
    d, ids = with_leases(daemon_factory, 3)
    d.start()
    assert sorted(x.id for x in active(d)) == sorted(ids)


def test_the_ledger_and_its_wal_are_private_whatever_the_umask(daemon_factory):
    old = os.umask(0)
    try:
        d = daemon_factory("pcie-8x-l40s")
    finally:
        os.umask(old)
    with d.client() as c:
        c.acquire_lease("xpu")
    for name in ("ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"):
        mode = (d.state_dir / name).stat().st_mode & 0o777
        assert mode == 0o600, f"{name} is {mode:o}"


def test_a_slice_grant_on_a_full_runtime_directory_is_one_line_and_grants_nothing(
    daemon_factory, small_tmpfs
):
    """#28 item 5: the MPS control daemon of a first slice writes into the runtime directory; a full one
    answered "internal error in Acquire". Now: one line that says what is full, nothing granted, the card
    left whole, and the same slice granted once there is room."""
    d = daemon_factory("pcie-8x-l40s", start=False)
    d.runtime_dir = small_tmpfs / "run"
    d.start()
    filler = fill(small_tmpfs)
    try:
        with d.client() as c:
            with pytest.raises(Unavailable) as err:
                c.acquire_lease("vxpu-half")
            text = str(err.value)
            assert "no space left" in text and "nothing granted" in text and "\n" not in text, text
            assert list(c.leases().leases) == []
            assert all(card.mode == "whole" and not card.slices for card in c.cards().cards)
    finally:
        filler.unlink()
    with d.client() as c:
        g = c.acquire_lease("vxpu-half")
        assert g.lease.env["CUDA_MPS_PIPE_DIRECTORY"].startswith(str(small_tmpfs))
        c.release(g.lease.id, g.token)
    assert d.alive()
    assert "Traceback" not in d.log.read_text()
