"""`xpu simulate` through typer's CliRunner on a tiny cluster and trace: table, JSON rows, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner
from xpu_cli.simulate import register

CLUSTER = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
    f"n{i},{32000 if i % 2 else 96000},262144,{2 if i % 2 else 8},{'T4' if i % 2 else 'G2'}\n"
    for i in range(12)
)
TRACE = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" + "".join(
    f"p{i},{[4000, 12000, 3000, 8000, 16000][i % 5]},{[8192, 16384, 4096, 2048, 65536][i % 5]},"
    f"{[1, 1, 1, 0, 2][i % 5]},{[470, 1000, 810, 0, 1000][i % 5]},\n"
    for i in range(60)
)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    c, t = tmp_path / "cluster.csv", tmp_path / "trace.csv"
    c.write_text(CLUSTER)
    t.write_text(TRACE)
    return c, t


@pytest.fixture
def app() -> typer.Typer:
    a = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @a.callback()
    def _root() -> None:
        pass

    register(a)
    return a


def invoke(app, *args: str):
    return CliRunner().invoke(app, ["simulate", *args])


def test_table_has_a_row_per_policy_and_arrived_columns(app, files):
    c, t = files
    r = invoke(
        app,
        "--cluster",
        str(c),
        "--trace",
        str(t),
        "--policy",
        "fgd",
        "--policy",
        "xpud",
        "--seeds",
        "1-2",
        "--workers",
        "1",
    )
    assert r.exit_code == 0, r.output
    lines = r.stdout.split("\n\n")[0].splitlines()  # the allocation table (the CPU-only table follows)
    header = next(line for line in lines if line.startswith("policy"))
    assert header.split()[1:] == ["50", "60", "70", "80", "90", "95", "100", "110", "120", "130"]
    assert [line.split()[0] for line in lines if line.startswith(("fgd", "xpud"))] == ["fgd", "xpud"]
    assert "[1/4]" in r.stderr  # progress goes to stderr


def test_json_rows(app, files):
    c, t = files
    r = invoke(
        app,
        "--cluster",
        str(c),
        "--trace",
        str(t),
        "--policy",
        "best-fit,random",
        "--seeds",
        "3",
        "--json",
        "-q",
        "--workers",
        "1",
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert {tuple(sorted(row)) for row in rows} == {("alloc_pct", "arrived_pct", "policy", "seed")}
    assert len(rows) == 2 * 1 * 131
    assert {(row["policy"], row["seed"]) for row in rows} == {("best-fit", 3), ("random", 3)}
    assert sorted({row["arrived_pct"] for row in rows}) == list(range(131))
    assert all(0 <= row["alloc_pct"] <= row["arrived_pct"] + 1e-9 for row in rows)


def test_json_extras_slices_and_defrag(app, files):
    c, t = files
    args = [
        "--cluster",
        str(c),
        "--trace",
        str(t),
        "--seeds",
        "1",
        "--json",
        "--extras",
        "-q",
        "--workers",
        "1",
    ]
    r = invoke(app, *args, "--slices", "quarter-half", "--defrag", "--move-budget", "5")
    assert r.exit_code == 0, r.output
    row = json.loads(r.stdout)[-1]
    assert set(row) == {"policy", "seed", "arrived_pct", "alloc_pct", "occupied_pct", "moves"}
    assert row["occupied_pct"] >= row["alloc_pct"]


def test_all_policies_and_terminal_plot(app, files, tmp_path):
    c, t = files
    png = tmp_path / "curves.png"
    r = invoke(
        app,
        "--cluster",
        str(c),
        "--trace",
        str(t),
        "--policy",
        "all",
        "--seeds",
        "1",
        "-q",
        "--plot",
        str(png),
    )
    assert r.exit_code == 0, r.output
    assert png.stat().st_size > 1000
    assert "whole-only" in r.stdout and "share held on cards" in r.stdout
    r = invoke(
        app, "--cluster", str(c), "--trace", str(t), "--seeds", "1", "-q", "--plot", "term", "--workers", "1"
    )
    assert "arrived workload, % of capacity" in r.stdout


def test_bound_rows(app, files):
    c, t = files
    r = invoke(app, "--cluster", str(c), "--trace", str(t), "--seeds", "1", "-q", "--bound", "--workers", "1")
    assert r.exit_code == 0, r.output
    bound = next(line for line in r.stdout.splitlines() if line.startswith("bound"))
    ours = next(line for line in r.stdout.splitlines() if line.startswith("xpud"))
    assert float(bound.split()[-1]) >= float(ours.split()[-1]) - 1e-6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--seeds", "9-1"], "bad seed list"),
        (["--slices", "eighths"], "unknown --slices"),
        (["--plot", "out.pdf"], "--plot takes a .png"),
        (["--move-budget", "-1"], "--move-budget is a percentage of the tasks, 0 to 100"),
        (["--move-budget", "nan"], "--move-budget is a percentage of the tasks, 0 to 100; got nan"),
        (["--workers", "100000"], "--workers must be 0 (one per core) to 256"),
        # said before the replay, not after it (a replay of the default trace takes minutes)
        (["--save", "/nonexistent-dir/r.json"], "--save /nonexistent-dir/r.json: cannot write there"),
        (["--plot", "/nonexistent-dir/r.png"], "--plot /nonexistent-dir/r.png: cannot write there"),
        (["--cpu-reserve", "sometimes"], "unknown --cpu-reserve 'sometimes'"),
    ],
)
def test_bad_options_give_one_line_and_non_zero_exit(app, files, args, message):
    c, t = files
    r = invoke(app, "--cluster", str(c), "--trace", str(t), *args)
    assert r.exit_code == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_or_broken_files(app, files, tmp_path):
    c, t = files
    r = invoke(app, "--cluster", str(tmp_path / "none.csv"), "--trace", str(t))
    assert r.exit_code == 1 and "cluster file not found" in r.stderr and "--cluster FILE" in r.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,2000\n")
    r = invoke(app, "--cluster", str(c), "--trace", str(bad))
    assert r.exit_code == 1 and f"{bad}:2" in r.stderr


def test_save_writes_table_facts_and_curves(app, files, tmp_path):
    c, t = files
    out = tmp_path / "bench.json"
    r = invoke(
        app,
        "--cluster",
        str(c),
        "--trace",
        str(t),
        "--seeds",
        "1-2",
        "-q",
        "--workers",
        "1",
        "--save",
        str(out),
    )
    assert r.exit_code == 0, r.output
    saved = json.loads(out.read_text())
    assert saved["seeds"] == [1, 2] and set(saved["table"]) == {"xpud"}
    assert len(saved["curves"]["xpud"]["1"]) == 81  # arrived 50..130 %
    assert saved["policies"]["xpud"]["replay_wall_s_mean"] >= 0


def test_cli_start_does_not_import_numpy():
    # ``xpu_cli.main`` registers ``simulate`` for every command: its module-level imports must stay light
    # (NumPy and the placement code are imported inside the command).
    code = (
        "import sys, xpu_cli.main\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'scipy')"
        " or m in ('xpud.placement.cluster', 'xpud.placement.registry', 'xpud.sim.runner')]\n"
        "assert 'simulate' in [c.name for c in xpu_cli.main.app.registered_commands]\n"
        "print(heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_light_names_match_the_registry():
    from xpud.placement import names, registry, slices
    from xpud.sim import defaults, protocol, trace

    assert registry.POLICY_NAMES is names.POLICY_NAMES and slices.PROFILE_SETS is names.PROFILE_SETS
    assert trace.TraceError is defaults.TraceError and protocol.DEFAULT_RATIO == defaults.DEFAULT_RATIO
    for name in names.POLICY_NAMES:
        assert registry.make_policy(name).name == name


def test_terminal_plot_fits_80_columns_and_draws_every_point_where_it_is(app, files, monkeypatch):
    """At COLUMNS=80 no line is wider than 80, and the 50 % point is drawn on the row of its value (an
    earlier chart zoomed on 90..130 % and pinned lower points to the axis minimum)."""
    c, t = files
    monkeypatch.setenv("COLUMNS", "80")
    r = invoke(app, "--cluster", str(c), "--trace", str(t), "--seeds", "1", "-q", "--json", "--plot", "term")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    at50 = next(row["alloc_pct"] for row in rows if row["arrived_pct"] == 50)
    chart = r.stderr.splitlines()
    assert chart and max(map(len, chart)) <= 80
    full = [line for line in chart if "|" in line[:8]][:12]  # the first panel: 50..130 %
    labels = [float(line.split("|")[0]) for line in full]
    step = labels[0] - labels[1]
    row = next(i for i, line in enumerate(full) if line.split("|", 1)[1][:1] == "x")
    assert abs(labels[row] - at50) <= step / 2 + 0.05
    assert labels[-1] <= min(row["alloc_pct"] for row in rows if 50 <= row["arrived_pct"] <= 130)


def test_policy_accepts_the_fgd_papers_spellings(app, files):
    c, t = files
    r = invoke(
        app, "--cluster", str(c), "--trace", str(t), "--seeds", "1", "-q", "--json", "--workers", "1",
        "--policy", "bestfit,DotProd", "--policy", "packing", "--policy", "clustering,best-fit",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    policies = list(dict.fromkeys(row["policy"] for row in json.loads(r.stdout)))
    assert policies == ["best-fit", "dot-product", "gpu-packing", "gpu-clustering"]


def test_cpu_reserve_modes_and_the_cpu_only_table(app, files, tmp_path):
    c, t = files
    for mode in ("off", "prefer", "reserve"):
        out = tmp_path / f"{mode}.json"
        r = invoke(
            app,
            "--cluster",
            str(c),
            "--trace",
            str(t),
            "--policy",
            "xpud,bestfit",
            "--seeds",
            "1",
            "--cpu-reserve",
            mode,
            "--save",
            str(out),
        )
        assert r.exit_code == 0, r.stderr
        assert "CPU-only tasks not placed" in r.stdout and "refused@100" in r.stdout
        facts = json.loads(out.read_text())
        assert facts["cpu_reserve"] == mode
        assert {"refused_mean", "cpu_only_dropped_mean"} <= set(facts["policies"]["xpud"])
        assert facts["policies"]["best-fit"]["refused_mean"] == 0  # only xpud's reserve refuses
