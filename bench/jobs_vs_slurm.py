"""The job commands' wall time against Slurm's on this host, in the same run (issue #31).

    .venv/bin/python bench/jobs_vs_slurm.py [--runs 10] [--json bench/jobs_vs_slurm.json]

Starts a simulated xpud and a real one-node Slurm (munged, slurmctld, slurmd from Debian's slurm-wlm, in a
temp directory: tests/slurm_site.py, with its xpud Prolog/Epilog hooks as a site would have them), then
times, median of --runs each: `xpu run -- true` vs `srun -N1 true`; `xpu submit -- true` vs
`sbatch --wrap true` (both return once queued); `xpu jobs` vs `squeue`. Needs root.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import simdaemon

from tests.slurm_site import SlurmSite


def median_wall(argv: list[str], env: dict, cwd: Path, runs: int) -> float:
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True, timeout=120)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="xpu-bs-", dir="/tmp"))
    base.chmod(0o755)
    xb, sb = base / "xpud", base / "slurm"
    xb.mkdir()
    sb.mkdir()
    d = simdaemon.start("pcie-8x-l40s", xb, "[leases]\ngrace_s = 30.0\n")
    site = SlurmSite(sb, xb / "run")
    result: dict = {"runs": args.runs}
    try:
        gres = subprocess.run(
            [str(simdaemon.BIN / "xpu"), "slurm", "gres", "--dev-dir", str(sb / "dev"), "--node", site.node,
             "--shards", "4"],
            env=simdaemon.clean_env(xb / "run"), capture_output=True, text=True, check=True,
        )  # fmt: skip
        site.write_gres(gres.stdout.splitlines())
        site.start()
        xenv, senv = simdaemon.clean_env(xb / "run"), site.env
        xpu = str(simdaemon.BIN / "xpu")
        pairs = {
            "run": ([xpu, "run", "--", "true"], ["srun", "-N1", "true"]),
            "submit": ([xpu, "submit", "--", "true"], ["sbatch", "--wrap", "true", "-o", str(sb / "out/%j")]),
            "list": ([xpu, "jobs"], ["squeue"]),
        }
        for what, (ours, theirs) in pairs.items():
            a = median_wall(ours, xenv, base, args.runs)
            b = median_wall(theirs, senv, base, args.runs)
            result[what] = {"xpu_s": a, "slurm_s": b, "ratio": a / b}
    finally:
        site.stop()
        simdaemon.stop(d)
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
