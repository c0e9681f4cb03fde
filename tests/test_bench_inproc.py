"""bench/inproc.py (xpud's own work per grant+release, without gRPC) runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("mode", "engine"), [("vxpu-quarter", False), ("xpu", False), ("vxpu-quarter", True)]
)
def test_inproc_measures_cycles_that_grant_and_release(mode, engine):
    args = ["--cycles", "30", "--mode", mode, "--json", *(["--engine"] if engine else [])]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "inproc.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["mode"] == mode and out["cycles"] == 30 and out["engine_only"] is engine
    assert out["active_leases_after"] == 0  # each cycle's lease was released
    assert 0 < out["loop_thread_cpu_us_per_cycle"] <= out["cpu_us_per_cycle"]
