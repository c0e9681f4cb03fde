"""Profile the daemon's event loop under grant load: a simulated xpud under cProfile, the clients of
``bench/load.py``, then the hottest functions.

    .venv/bin/python bench/profile_daemon.py [--mode vxpu-quarter] [--clients 8] [--seconds 8]
        [--state-dir /dev/shm/x (tmpfs: no fsync)] [--out prof.out] [--top 30]
    .venv/bin/python bench/profile_daemon.py --waiters 5000     # the waiters part of bench/load.py instead

cProfile sees the loop's thread only (the ledger's writer thread and gRPC's C threads are not in it),
and it slows Python code more than C code: read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def daemon_main(out: str) -> None:
    """Run ``xpud`` (its arguments after ``--profiled-daemon OUT``) under cProfile; dump at exit."""
    from xpud.daemon.cli import main

    sys.argv = ["xpud", *sys.argv[sys.argv.index("--profiled-daemon") + 2 :]]
    profile = cProfile.Profile()
    if "--cancel-only" in sys.argv:  # profiled between SIGUSR1 and SIGUSR2 (the cancellation) only
        sys.argv.remove("--cancel-only")
        signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
        signal.signal(signal.SIGUSR2, lambda *_: profile.disable())
    else:
        profile.enable()
    try:
        main()
    except SystemExit:
        pass
    finally:
        profile.disable()
        profile.dump_stats(out)


def main() -> None:
    if "--profiled-daemon" in sys.argv:
        return daemon_main(sys.argv[sys.argv.index("--profiled-daemon") + 1])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="pcie-8x-l40s")
    ap.add_argument("--mode", default="vxpu-quarter")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--waiters", type=int, default=0, help="profile N waiters and their cancellation")
    ap.add_argument("--cancel-only", action="store_true", help="with --waiters: the cancellation only")
    ap.add_argument("--state-dir", help="the ledger's directory (default: in the temp directory)")
    ap.add_argument("--out", help="keep the profile here (pstats format)")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()

    import load
    import simdaemon

    from xpud.api.client import Client
    from xpud.errors import XpudError

    base = Path(tempfile.mkdtemp(prefix="xpu-prof-", dir="/tmp"))
    runtime = base / "run"
    (base / "xpud.toml").write_text(load.DAEMON_CONFIG)
    out = args.out or str(base / "prof.out")
    cmd = [sys.executable, __file__, "--profiled-daemon", out, "--config", str(base / "xpud.toml")]
    cmd += ["--simulate", args.machine, "--runtime-dir", str(runtime)]
    cmd += ["--state-dir", args.state_dir or str(base / "state"), "--log-level", "warning"]
    if args.cancel_only:
        cmd.insert(cmd.index("--config"), "--cancel-only")
    daemon = subprocess.Popen(cmd, env=simdaemon.clean_env(runtime), stderr=open(base / "xpud.log", "w"))  # noqa: SIM115
    deadline = time.monotonic() + 30
    while True:
        try:
            with Client(runtime) as c:
                c.info()
            break
        except XpudError:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the profiled daemon did not start; see {base / 'xpud.log'}") from None
            time.sleep(0.05)
    spec = {"target": "xpud", "mode": args.mode, "gpus": 1, "runtime": str(runtime), "wait_s": 30.0}
    try:
        if args.waiters:
            hook = (lambda sig: daemon.send_signal(sig)) if args.cancel_only else None
            print(json.dumps(load.waiters(runtime, args.waiters, daemon.pid, 120.0, hook)))
        else:
            print(json.dumps(load.measure_cycles(spec, args.clients, args.seconds, daemon.pid)))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
    stats = pstats.Stats(out)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats("xpud/", args.top)
    if not args.out:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
