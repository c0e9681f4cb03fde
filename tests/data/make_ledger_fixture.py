"""Make tests/data/ledger-v2.sql and ledger-v2.json: a ledger written by a released xpud, with leases held.

The schema is that of the release before this one (ledger schema v2, xpud 0.1.0 at commit e864faf);
tests/test_upgrade.py opens it with the newest code, which must migrate it and restore the active leases.
Do not regenerate it with a newer xpud: it stands for what hosts in the field have on disk. It was made
with that commit's code (first on PYTHONPATH, so the daemon the script starts runs it too) by

    mkdir /tmp/rel && git archive e864faf | tar -x -C /tmp/rel
    PYTHONPATH=/tmp/rel .venv/bin/python tests/data/make_ledger_fixture.py e864faf

which runs a real daemon on the simulated workstation-2x, takes two slices and a whole card, releases one
slice, drains card 1 (admin socket: run as root), stops the daemon with SIGTERM (what systemctl stop does)
and dumps the ledger as SQL (with its PRAGMA user_version) next to a JSON file with the active leases'
ids and tokens, which the test needs to hold and release them.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
MACHINE = "workstation-2x"


def main() -> None:
    import xpud
    from xpud import __version__
    from xpud.api.client import Client
    from xpud.errors import XpudError

    print(f"xpud {__version__} from {Path(xpud.__file__).parent}")
    base = Path(tempfile.mkdtemp(prefix="xpu-fix-", dir="/tmp"))
    run, state = base / "run", base / "state"
    proc = subprocess.Popen(
        [str(BIN / "xpud"), "--simulate", MACHINE, "--runtime-dir", str(run), "--state-dir", str(state)],
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(400):
            try:
                with Client(run) as c:
                    c.info()
                break
            except XpudError:
                time.sleep(0.05)
        with Client(run) as c:
            half = c.acquire_lease("vxpu-half", command="python serve.py")
            quarter = c.acquire_lease("vxpu-quarter", command="python infer.py")
            whole = c.acquire_lease("xpu", gpus=1, command="python train.py")
            c.release(quarter.lease.id, quarter.token)
        with Client(run, admin=True) as a:
            a.drain("1", "fixture: drained before the upgrade")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    db = sqlite3.connect(state / "ledger.sqlite")
    version = db.execute("PRAGMA user_version").fetchone()[0]
    commit = sys.argv[1] if len(sys.argv) > 1 else "unknown"
    header = [
        f"-- xpud ledger schema v{version}, written by xpud {__version__} (commit {commit}) on the simulated",
        f"-- {MACHINE}; made by tests/data/make_ledger_fixture.py. Load with sqlite3's executescript.",
        f"PRAGMA user_version={version};",
    ]
    (HERE / f"ledger-v{version}.sql").write_text("\n".join([*header, *db.iterdump()]) + "\n")
    db.close()
    leases = {
        "schema_version": version,
        "xpud_version": __version__,
        "commit": commit,
        "machine": MACHINE,
        "active": [
            {"id": g.lease.id, "token": g.token, "mode": g.lease.mode, "cards": list(g.lease.cards)}
            for g in (half, whole)
        ],
        "released": [quarter.lease.id],
        "drained": [1],
    }
    (HERE / f"ledger-v{version}.json").write_text(json.dumps(leases, indent=2) + "\n")
    print(f"wrote {HERE}/ledger-v{version}.sql and .json")


if __name__ == "__main__":
    main()
