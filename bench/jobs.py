"""Batch jobs (issue #31): how soon a submitted job runs, and what a long history of jobs costs.

    .venv/bin/python bench/jobs.py [--machine pcie-8x-l40s] [--runs 10] [--history 10000]
        [--json bench/jobs.json]

Starts a real simulated daemon on temp sockets, then
1. submit-to-running on an idle host: from just before `xpu submit -- sh -c 'date +%s.%N > FILE'` is
   started to the time the job wrote, against the same for `xpu run` (the wrapper's start to the command's
   first instruction), median and max of --runs runs each; the daemon's own part (the record's
   ``started - submitted``), and the wall time of `xpu submit -- true` and `xpu run -- true`;
2. the daemon's resident memory (VmRSS) after a restart onto a ledger holding --history finished jobs,
   against the same daemon on an empty ledger (finished jobs are rows in SQLite, not objects in memory);
3. `xpu jobs` (queued and running) and `xpu jobs --all --json` (newest 1,000) against that history, the
   CLI's wall time, median of 5.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import simdaemon

from xpud.ledger import jobs as jobdb
from xpud.ledger.ledger import Ledger


def started_after(base: Path, argv_head: list[str], runs: int) -> list[float]:
    """Seconds from starting ``xpu ...`` to the job's first line, for ``runs`` runs."""
    out = []
    env = simdaemon.clean_env(base / "run")
    for i in range(runs):
        mark = base / f"mark-{argv_head[0]}-{i}"
        cmd = [str(simdaemon.BIN / "xpu"), *argv_head, "--", "sh", "-c", f"date +%s.%N > {mark}"]
        t0 = time.time()
        subprocess.run(cmd, env=env, cwd=base, check=True, capture_output=True)
        deadline = time.monotonic() + 30
        while not (mark.exists() and mark.read_text().strip()):
            if time.monotonic() > deadline:
                raise SystemExit(f"{argv_head[0]}: the job did not run within 30 s")
            time.sleep(0.005)
        out.append(float(mark.read_text()) - t0)
        time.sleep(0.2)  # the job ends and its lease is released before the next
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fill_history(state: Path, n: int) -> None:
    """``n`` finished jobs in the ledger at ``state`` (the daemon stopped)."""
    led = Ledger(state / "ledger.sqlite")
    now = time.time()
    try:
        ops = []
        for i in range(n):
            r = jobdb.JobRecord(
                id=f"{i:08x}",
                uid=1000 + i % 50,
                gid=1000,
                state=(jobdb.COMPLETED, jobdb.FAILED, jobdb.CANCELLED)[i % 3],
                submitted=now - n + i,
                name=f"train-{i % 200}",
                cwd="/home/user/project",
                argv=["python", "train.py", "--epochs", "10"],
                spec={"mode": "xpu", "gpus": 1, "priority": 0, "wait_s": 3600.0, "output": "/tmp/x.out"},
                hosts=["node-a"],
                lease_id=f"{i:08x}",
                exit_code=0 if i % 3 == 0 else 1,
                started=now - n + i,
                ended=now - n + i + 0.5,
            )
            ops.append(jobdb.save_job_op(r))
            if len(ops) == 500:
                led.write_sync(*ops)
                ops = []
        if ops:
            led.write_sync(*ops)
    finally:
        led.close()


def cli_median(base: Path, *args: str, times: int = 5) -> float:
    env = simdaemon.clean_env(base / "run")
    walls = []
    for _ in range(times):
        t0 = time.perf_counter()
        subprocess.run(
            [str(simdaemon.BIN / "xpu"), *args], env=env, cwd=base, check=True, capture_output=True
        )
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machine", default="pcie-8x-l40s")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--history", type=int, default=10_000)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="xpu-bj-", dir="/tmp"))
    result: dict = {"machine": args.machine, "runs": args.runs, "history": args.history}
    try:
        d = simdaemon.start(args.machine, base, "[leases]\ngrace_s = 30.0\n")
        try:
            time.sleep(1.0)
            result["rss_kib_empty"] = rss_kib(d.pid)
            sub = started_after(base, ["submit"], args.runs)
            run = started_after(base, ["run"], args.runs)
            result["submit_to_running_s"] = {"median": statistics.median(sub), "max": max(sub)}
            result["run_to_running_s"] = {"median": statistics.median(run), "max": max(run)}
            from xpud.api.client import Client

            with Client(base / "run") as c:  # the daemon's part: submitted -> the supervisor ran it
                recs = [j for j in c.jobs(all=True).jobs if j.kind == "detached"]
            result["daemon_submitted_to_started_s"] = statistics.median(j.started - j.submitted for j in recs)
            result["xpu_submit_cli_s"] = cli_median(base, "submit", "--", "true")
            result["xpu_run_true_cli_s"] = cli_median(base, "run", "--", "true")
        finally:
            simdaemon.stop(d)
        fill_history(base / "state", args.history)
        d = simdaemon.start(args.machine, base, "[leases]\ngrace_s = 30.0\n")
        try:
            time.sleep(1.0)
            result["rss_kib_with_history"] = rss_kib(d.pid)
            result["xpu_jobs_s"] = cli_median(base, "jobs")
            result["xpu_jobs_all_json_s"] = cli_median(base, "jobs", "--all", "--json")
            result["rss_kib_after_listings"] = rss_kib(d.pid)
        finally:
            simdaemon.stop(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
