"""End to end: a job of `true` through Node.RunJob on 1 and on 2 hosts of a 3-daemon cluster (127.0.0.2-4,
mutual TLS), against single-host `xpu run -- true` on the same coordinator; then `xpu run --nodes 1|2 -- true`
through the CLI. Each timing is one whole call: placement, Reserve/Commit on every host, Launch, the ranks'
ends, Abort on every host (and for the CLI rows, the `xpu` process's start-up and GetCluster).

    .venv/bin/python bench/multihost_run.py --runs 30 --out bench/multihost_run.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xpud.api.client import Client
from xpud.api.v1 import xpu_pb2 as pb
from xpud.federation.certs import init_ca, issue

BIN = Path(sys.executable).parent
MACHINE = "pcie-4x-h100"


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def start(base: Path, i: int, seed: str) -> tuple[subprocess.Popen, Path, str]:
    name, ip = f"h{i}", f"127.0.0.{i + 1}"
    issue(name, base / "ca", base / name, ips=[ip])
    addr = f"{ip}:{free_port(ip)}"
    d = base / f"d{i}"
    d.mkdir()
    cfg = d / "xpud.toml"
    certs = base / name
    cfg.write_text(
        "[cluster]\n"
        f'name = "{name}"\nlisten = "{addr}"\nseeds = {json.dumps([seed] if seed else [])}\n'
        f'domain = "r1"\nca = "{base / "ca" / "ca.crt"}"\ncert = "{certs / f"{name}.crt"}"\n'
        f'key = "{certs / f"{name}.key"}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUD_", "XPU_"))}
    cmd = [str(BIN / "xpud"), "--config", str(cfg), "--simulate", MACHINE]
    cmd += ["--runtime-dir", str(d / "run"), "--state-dir", str(d / "state")]
    with open(d / "log", "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, d / "run", addr


def wait(pred, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError("cluster not ready")


def run_job(c: Client, nodes: int) -> float:
    spec = pb.JobSpec(
        mode="xpu", nodes=nodes, gpus_per_node=1, argv=["true"], cwd="/", env={"PATH": os.environ["PATH"]}
    )
    t0 = time.perf_counter()
    events = list(c.node.RunJob(iter([pb.JobInput(start=spec)]), metadata=c._metadata(), timeout=60))
    dt = time.perf_counter() - t0
    assert events[-1].ended.exit_code == 0 and len(events[0].placed.ranks) == nodes, events
    return dt


def xpu_run(run_dir: Path, *opts: str) -> float:
    """One `xpu run [opts] -- true` through the CLI (its process start-up included)."""
    env = {**os.environ, "XPUD_RUNTIME_DIR": str(run_dir)}
    t0 = time.perf_counter()
    subprocess.run([str(BIN / "xpu"), "run", *opts, "--", "true"], check=True, env=env, capture_output=True)
    return time.perf_counter() - t0


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "runs": len(xs),
        "p50_ms": round(statistics.median(xs) * 1000, 1),
        "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1000, 1),
        "min_ms": round(xs[0] * 1000, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="xpu-bench-", dir="/tmp"))
    procs = []
    try:
        init_ca(base / "ca")
        p, run1, addr1 = start(base, 1, "")
        procs.append(p)
        for i in (2, 3):
            procs.append(start(base, i, addr1)[0])
        c = Client(run1)
        wait(lambda: sum(h.state == "alive" and h.summary_valid for h in c.cluster().hosts) == 3, 60)
        results = {}
        for what, fn in (
            ("xpu run -- true", lambda: xpu_run(run1)),
            ("xpu run --nodes 1 --gpus-per-node 1 -- true", lambda: xpu_run(run1, "--nodes", "1")),
            ("xpu run --nodes 2 --gpus-per-node 1 -- true", lambda: xpu_run(run1, "--nodes", "2")),
            ("RunJob nodes=1", lambda: run_job(c, 1)),
            ("RunJob nodes=2", lambda: run_job(c, 2)),
            ("xpu run --nodes 1 -- true (CLI)", lambda: xpu_run(run1, "--nodes", "1")),
            ("xpu run --nodes 2 -- true (CLI)", lambda: xpu_run(run1, "--nodes", "2")),
        ):
            fn()  # warm: channels, credentials
            results[what] = summary([fn() for _ in range(args.runs)])
            print(what, results[what], flush=True)
        load = os.getloadavg()
        results["machine"] = f"{os.cpu_count()} cores, load average {load[0]:.1f} at the end"
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(10)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
