"""bench/load.py --quick runs end to end (so the load benchmark cannot rot unnoticed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_load_quick_measures_every_part(tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--quick", "--bare-durable", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    kinds = {(g["kind"], g["clients"]) for g in res["grants"]}
    assert kinds == {(k, n) for k in ("bare", "bare_durable", "slice", "whole") for n in (1, 4)}
    for g in res["grants"]:
        assert g["cycles_per_s"] > 0 and g["errors"] == 0, g
        assert g["kind"] == "bare" or g["ratio_to_bare"] > 0
        assert g["daemon_threads_pct"]["loop"] > 0, g  # the server's main thread (its event loop) worked
        loop = g["daemon_threads_ms_per_cycle"]["loop"]
        assert loop["user"] > 0 and loop["system"] >= 0, g
    durable = [g for g in res["grants"] if g["kind"] == "bare_durable"]  # 2 rows per cycle, and warm-ups
    assert res["bare_durable_rows"] >= 2 * sum(g["cycles_per_s"] * res["seconds"] for g in durable) > 0
    assert res["xpu_run"]["xpu_run_ms"] > 0 and res["xpu_run"]["ratio"] > 0
    w = res["waiters"]
    assert w["queue"]["queued"] == w["queue_length_seen"] == 100
    assert w["cancel"]["queue_empty_after_s"] is not None and w["cancel"]["daemon_cpu_ms_per_waiter"] >= 0
    floor = res["waiters_bare"]  # the same burst against the bare server, in the same run
    assert floor["queued"] == 100 and floor["cancel"]["info_latency"]["calls"] > 0, floor
    assert res["idle_after_start"]["rss_mib"] > 0 and res["idle_after_load"]["cpu_pct"] >= 0
