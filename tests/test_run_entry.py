"""The `xpu` entry point's fast path for `run`: it reads a command line exactly as Typer does, hands
anything it is not sure of to Typer, and keeps the heavy modules out of `xpu run`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from xpu_cli.entry import RUN_DEFAULTS, RUN_OPTIONS, parse_run
from xpu_cli.main import app

from tests.conftest import BIN

GROUP = typer.main.get_command(app)
RUN = GROUP.commands["run"]


def typer_reads(args: list[str], monkeypatch):
    """(runtime dir, options, command) as the Typer command passes them on (None: Typer refuses them)."""
    from typer.testing import CliRunner
    from xpu_cli import child, launch, session

    seen = []

    class Recorder:
        def __init__(self, runtime=None, admin=False):
            seen.append(runtime)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    def run_with(client, opts, argv):
        seen.append((opts, argv))
        return child.Outcome(0)

    monkeypatch.setattr(session, "Client", Recorder)
    monkeypatch.setattr(launch, "run_with", run_with)
    monkeypatch.delenv("XPUD_RUNTIME_DIR", raising=False)
    r = CliRunner().invoke(app, args)
    if r.exit_code != 0 or len(seen) != 2:
        return None
    runtime, (opts, argv) = seen
    return runtime, opts, argv


CASES = [
    ["run", "--", "true"],
    ["run", "true"],
    ["run", "true", "--", "x", "-m", "y"],
    ["run", "--mode", "vxpu-half", "--", "sh", "-c", "exit 3"],
    ["run", "-m", "vxpu-quarter", "-g", "2", "--wait", "1.5", "-p", "-3", "--", "true"],
    ["run", "-mvxpu-half", "-g2", "-Jjob.5", "-p7", "true"],
    ["run", "-m=odd", "--", "true"],
    ["run", "--mode=xpu", "--gpus=4", "--wait=10", "--priority=007", "--kill-grace=0", "true"],
    ["run", "--restartable", "--no-restartable", "--restartable", "--", "true"],
    ["run", "--json-env", "-m", "vxpu-half"],
    ["run", "--json-env", "--", "true"],
    ["run"],
    ["run", "--"],
    ["run", "-", "x"],
    ["--runtime-dir", "/tmp/x", "run", "--", "true"],
    ["--runtime-dir=/tmp/y", "run", "-m", "vxpu-half", "true"],
    ["--runtime-dir", "", "run", "true"],
    ["run", "-m", "a", "-m", "b", "--", "true"],
    ["run", "--kill-grace", "2.", "--", "true"],
    ["run", "--wait", "1m", "--", "true"],
    ["run", "--wait", "1h30m", "-J", "train-1", "true"],
    ["run", "--wait=inf", "--name=x", "true"],
    ["run", "-q", "--", "true"],
    ["run", "--nodes", "2", "--gpus-per-node", "4", "--label", "--json", "--", "torchrun", "x.py"],
    ["run", "-N2", "-l", "--no-kill-on-bad-exit", "--kill-on-bad-exit", "--wait", "30", "true"],
    ["run", "-m", "vxpu-half", "--replicas=3", "--spread", "--quiet", "--", "serve"],
    ["run", "--when-green", "--deadline", "+6h", "--wait", "60", "--", "true"],
    ["run", "--deadline=06:00", "true"],
    ["run", "--runtime-dir", "/tmp", "--", "true"],  # global options are accepted after the command
    ["--runtime-dir", "/a", "run", "-g", "2", "--runtime-dir=/b", "true"],
]
# Typer refuses these: the fast path must leave them to it, for its usual message.
REFUSED = [
    ["run", "--gpus", "0", "--", "true"],
    ["run", "--gpus", "x", "--", "true"],
    ["run", "--gpus", "²", "--", "true"],
    ["run", "--wait", "-1", "--", "true"],
    ["run", "--wait", "nan", "--", "true"],
    ["run", "--wait", "1e3", "--", "true"],
    ["run", "--wait", "5x", "--", "true"],
    ["run", "--wait", "30m1h", "--", "true"],
    ["run", "--mode"],
    ["run", "--bogus", "--", "true"],
    ["run", "-x", "--", "true"],
    ["run", "-w2h", "true"],  # -w is --watch elsewhere: run's --wait has no short name
    ["run", "-n", "job", "true"],  # -n is a count elsewhere (events --limit): the name is -J
    ["run", "--restartable=yes", "--", "true"],
    ["--runtime-dir", "run"],
    ["run", "--nodes", "0", "--", "true"],
    ["run", "--replicas", "x", "--", "true"],
    ["run", "--spread=1", "--", "true"],
]
# Typer takes these, but they are rare and odd: the fast path leaves them to it rather than mimic it.
DEFERRED = [
    ["run", "--gpus", " 2", "--", "true"],
    ["run", "--kill-grace", "inf", "--", "true"],
    ["run", "--mode", "--", "true"],
    ["run", "--mode=", "true"],
]
# Not a run, or help.
OTHERS = [["run", "--help"], ["run", "-m", "vxpu-half", "--help", "--", "true"], ["--help", "run"], ["ls"]]
OTHERS += [["leases", "run"], []]


@pytest.mark.parametrize("args", CASES, ids=" ".join)
def test_the_fast_path_reads_a_run_command_line_as_typer_does(args, monkeypatch):
    fast = parse_run(args)
    assert fast is not None, "the fast path should take this command line"
    typer = typer_reads(args, monkeypatch)
    assert fast == typer
    assert [type(v) for v in fast[1].values()] == [type(v) for v in typer[1].values()]  # 2 == 2.0


@pytest.mark.parametrize("args", REFUSED + DEFERRED + OTHERS, ids=" ".join)
def test_what_the_fast_path_is_unsure_of_goes_to_typer(args):
    assert parse_run(args) is None


@pytest.mark.parametrize("args", REFUSED, ids=" ".join)
def test_typer_refuses_what_the_fast_path_leaves_to_it(args, monkeypatch):
    assert typer_reads(args, monkeypatch) is None


def test_the_fast_path_knows_every_option_of_run_and_its_default():
    """A new option on `xpu run` must be taught to the fast path (else every run with it goes slow)."""
    for p in RUN.params:
        if p.name in ("command", "help"):
            continue
        assert RUN_DEFAULTS[p.name] == p.default, p.name
        assert {o for o in p.opts + p.secondary_opts} <= set(RUN_OPTIONS), p.name
    assert set(RUN_DEFAULTS) == {p.name for p in RUN.params} - {"command", "help"}


def test_xpu_run_imports_neither_typer_nor_the_listings(tmp_path):
    """`xpu run` against no daemon: the usual one-line error, without Typer, Click or the CLI's other
    modules having been imported."""
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['xpu', '--runtime-dir', sys.argv[1], 'run', '-m', 'vxpu-half', '--', 'true']\n"
        "import os\n"
        "real_exit = os._exit\n"
        "def report(code):\n"
        "    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'click', 'rich')\n"
        "                   or m in ('xpu_cli.main', 'xpu_cli.output', 'xpud.model', 'xpud.engine.engine'))\n"
        "    sys.stdout.write(repr(heavy) + '\\n'); sys.stdout.flush(); real_exit(code)\n"
        "os._exit = report\n"
        "from xpu_cli.entry import main\n"
        "main()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert r.stdout.strip() == "[]"
    assert r.stderr.startswith("xpu: cannot reach xpud at ") and r.stderr.count("\n") == 1


def test_the_installed_xpu_script_uses_the_fast_entry_point():
    assert "xpu_cli.entry" in (BIN / "xpu").read_text()
