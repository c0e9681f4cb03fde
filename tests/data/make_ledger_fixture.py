"""Make tests/data/ledger-vN.sql and ledger-vN.json: a ledger written by a released xpud, with leases held.

One recorded ledger per released schema version N (v2 .. v9; the current schema's ledger is made by every
test). tests/test_upgrade.py opens each with the newest code, which must migrate it to the current schema
and restore the active leases. Do not regenerate them with a newer xpud: they stand for what hosts in the
field have on disk. Each was made with the code of the first commit on main whose migrations are today's
first N (first on PYTHONPATH, so the daemon the script starts runs it too):

    v2  e864faf  xpud 0.1.0 (the first release)
    v3  b3105e7  reservations (multi-host jobs), with rank_pid: main's e9caced..767ac28 had a v3 without
                 rank_pid, changed in place by b3105e7; ledger-v3-e9caced stands for those ten commits'
                 ledgers (made as below with C = e9caced, then renamed), which the repair step of
                 xpud.ledger.schema.REPAIRS upgrades
    v4  f01a597  how each lease's command ended (started, exit_code, exit_signal, name)
    v5  dc40702  leases anchored to a Slurm job or a pod (anchor)
    v6  428825a  right-sizing state (usage_readings, auto_leases)
    v7  5d8a0af  standby slices (standby)
    v8  27416cc  the MIG instances xpud made (mig_made)
    v9  b636624  jobs (xpu submit, every command the daemon runs)

v2 was made by

    mkdir /tmp/rel && git archive e864faf | tar -x -C /tmp/rel
    PYTHONPATH=/tmp/rel .venv/bin/python tests/data/make_ledger_fixture.py e864faf

and v3 .. v9 by (N and COMMIT from the table; the first commits were found with the migrations of
`git rev-list --first-parent` compared to today's)

    git worktree add --detach /tmp/ledger-vN COMMIT
    ln -s ../etc /tmp/ledger-vN/xpud/etc; ln -s ../systemd /tmp/ledger-vN/xpud/systemd  # package-dir data
    python3 -m venv /tmp/fixvenv   # the dependencies without the editable xpud, whose finder beats PYTHONPATH
    echo $PWD/.venv/lib/python3.*/site-packages > /tmp/fixvenv/lib/python3.*/site-packages/deps.pth
    (cd /tmp && PYTHONPATH=/tmp/ledger-vN /tmp/fixvenv/bin/python $REPO/tests/data/make_ledger_fixture.py C)
    # (C: the COMMIT; from /tmp: a -c child puts its directory first on sys.path, ahead of PYTHONPATH)
    git worktree remove --force /tmp/ledger-vN

which runs a real daemon on the simulated workstation-2x, takes two slices and a whole card, releases one
slice (from v4 on, reporting that its command exited 3), drains card 1 (admin socket: run as root), stops
the daemon with SIGTERM (what systemctl stop does) and dumps the ledger as SQL (with its PRAGMA
user_version) next to a JSON file with the active leases' ids and tokens, which the test needs to hold and
release them.
"""

from __future__ import annotations

import inspect
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MACHINE = "workstation-2x"


def main() -> None:
    import xpud
    from xpud import __version__
    from xpud.api.client import Client
    from xpud.errors import XpudError

    print(f"xpud {__version__} from {Path(xpud.__file__).parent}")
    base = Path(tempfile.mkdtemp(prefix="xpu-fix-", dir="/tmp"))
    run, state = base / "run", base / "state"
    # the daemon's entry point of the code on PYTHONPATH (xpud.daemon:main before the daemon/ package)
    entry = (
        "import sys\ntry:\n    from xpud.daemon.cli import main\nexcept ImportError:\n"
        "    from xpud.daemon import main\nsys.exit(main())"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            entry,
            "--simulate",
            MACHINE,
            *("--runtime-dir", str(run), "--state-dir", str(state)),
        ],
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
            reports_exit = "exit_code" in inspect.signature(c.release).parameters  # schema v4 on
            if reports_exit:
                c.release(quarter.lease.id, quarter.token, exit_code=3, started=time.time() - 1.0)
            else:
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
        **({"released_exit_code": 3} if reports_exit else {}),
        "drained": [1],
    }
    (HERE / f"ledger-v{version}.json").write_text(json.dumps(leases, indent=2) + "\n")
    print(f"wrote {HERE}/ledger-v{version}.sql and .json")


if __name__ == "__main__":
    main()
