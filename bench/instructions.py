"""Instructions per grant+release cycle, all threads of the server, under valgrind's callgrind: a cost
figure that the load of a shared machine does not move (timings there move 2x between runs).

    .venv/bin/python bench/instructions.py [--clients 2] [--seconds 30] [--mode vxpu-quarter]
    .venv/bin/python bench/instructions.py --bare        # the bare grpc-python server of bench/load.py
    .venv/bin/python bench/instructions.py --bare --durable   # the same, one SQLite commit per call
    PYTHONPATH=/path/to/other/tree .venv/bin/python bench/instructions.py   # another xpud/, to compare
    .venv/bin/python bench/instructions.py --keep cycles.callgrind   # then callgrind_annotate it

The server (a simulated ``xpud``, or the bare server) runs under callgrind; the clients of
``bench/load.py`` warm it up, then callgrind's counters are zeroed, the server idles ``--seconds / 2``
(its background work: timers, the health poll), then the clients cycle for ``--seconds``. The figure is
(instructions in the cycling window - the idle rate x its length) / cycles. Under callgrind the server
runs ~50x slower and one thread at a time: compare figures taken this way with each other only.
Needs ``valgrind`` (``callgrind_control``) on the PATH; ~2 minutes.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--mode", default="vxpu-quarter")
    ap.add_argument("--machine", default="pcie-8x-l40s")
    ap.add_argument("--bare", action="store_true", help="the bare gRPC server instead of xpud")
    ap.add_argument(
        "--durable", action="store_true", help="with --bare: its methods commit a row first (load.py's floor)"
    )
    ap.add_argument("--keep", help="copy the cycling window's callgrind dump here (callgrind_annotate)")
    ap.add_argument("--threads", action="store_true", help="also instructions per cycle in each thread")
    ap.add_argument("--bare-loop", choices=("asyncio", "uvloop"), default="asyncio", help="with --bare")
    args = ap.parse_args()
    if not shutil.which("callgrind_control"):
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")

    import load
    import simdaemon

    from xpud.api.client import Client
    from xpud.errors import XpudError

    base = Path(tempfile.mkdtemp(prefix="xpu-instr-", dir="/tmp"))
    runtime, out = base / "run", base / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
    if args.threads:  # one dump file per thread (named ...-01, -02, ... in creation order)
        cmd[2:2] = ["--separate-threads=yes"]
    if args.bare:
        sock = base / "bare.sock"
        cmd += [str(Path(load.__file__)), "--bare-server", str(sock), "--bare-loop", args.bare_loop]
        if args.durable:
            cmd += ["--durable", str(base / "durable.sqlite")]
        spec = {"target": "bare", "socket": str(sock)}
    else:
        (base / "xpud.toml").write_text(load.DAEMON_CONFIG)
        cmd += [str(simdaemon.BIN / "xpud"), "--config", str(base / "xpud.toml"), "--simulate", args.machine]
        cmd += ["--runtime-dir", str(runtime), "--state-dir", str(base / "state"), "--log-level", "warning"]
        spec = {"target": "xpud", "mode": args.mode, "gpus": 1, "runtime": str(runtime)}
    spec["wait_s"] = 60.0
    log = open(base / "server.log", "w")  # noqa: SIM115 (the server keeps it)
    env = simdaemon.clean_env(runtime)
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        if args.bare:
            if server.stdout.readline().strip() != "ready":
                raise SystemExit(f"the bare server did not start under valgrind; see {base / 'server.log'}")
        else:
            deadline = time.monotonic() + 600
            while True:
                try:
                    with Client(runtime, timeout=60) as c:
                        c.info()
                    break
                except XpudError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        why = f"xpud did not start under valgrind; see {base / 'server.log'}"
                        raise SystemExit(why) from None
                    time.sleep(1)
        load.measure_cycles(spec, args.clients, 3.0)  # warm: connections, credentials, first grants

        def window(fn) -> tuple[object, float, int]:
            """(what fn returned, its seconds, instructions the server ran meanwhile)."""
            subprocess.run(["callgrind_control", "-z", str(server.pid)], check=True, capture_output=True)
            t0 = time.monotonic()
            result = fn()
            seconds = time.monotonic() - t0
            before = set(glob.glob(f"{out}.*"))
            subprocess.run(["callgrind_control", "-d", str(server.pid)], check=True, capture_output=True)
            for _ in range(60):
                new = sorted(set(glob.glob(f"{out}.*")) - before)
                if new:
                    break
                time.sleep(0.5)
            time.sleep(0.5)  # the dump is complete
            per_file = {}
            for path in new if args.threads else new[-1:]:
                text = Path(path).read_text()
                per_file[path] = int(re.search(r"^(?:summary|totals): (\d+)", text, re.M).group(1))
            dumps.append(per_file)
            return result, seconds, sum(per_file.values())

        dumps: list[dict[str, int]] = []
        _, idle_s, idle_ir = window(lambda: time.sleep(args.seconds / 2))
        row, run_s, run_ir = window(lambda: load.measure_cycles(spec, args.clients, args.seconds))
    finally:
        server.terminate()
        server.wait(120)
    cycles = row["cycles_per_s"] * args.seconds
    if args.keep:
        for i, path in enumerate(dumps[-1]):
            shutil.copy(path, args.keep + (f".{i}" if i else ""))
    rate = idle_ir / idle_s
    threads = {}
    if args.threads:  # by thread number: idle rate subtracted thread by thread
        idle = {re.sub(r".*-(\d+)$", r"\1", p): v for p, v in dumps[0].items()}
        for p, v in dumps[-1].items():
            t = re.sub(r".*-(\d+)$", r"\1", p)
            threads[t] = round((v - idle.get(t, 0) / idle_s * run_s) / 1e6 / max(cycles, 1), 3)
    print(
        json.dumps(
            {
                "server": ("bare durable" if args.durable else "bare") if args.bare else f"xpud {args.mode}",
                "clients": args.clients,
                "cycles": cycles,
                "idle_minstr_per_s": round(rate / 1e6, 2),
                "minstr_per_cycle": round((run_ir - rate * run_s) / 1e6 / max(cycles, 1), 3),
                **({"minstr_per_cycle_by_thread": threads} if threads else {}),
            }
        )
    )
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
