"""xpud's entry point reads a plain serve command line by hand (``xpud.daemon.entry``) and hands anything
else to Typer: both must read the command lines it takes alike, and it must take no other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer

from xpud.daemon.cli import app
from xpud.daemon.entry import OPTIONS, parse

BIN = Path(sys.executable).parent

TAKEN = [
    [],
    ["--config", "/etc/x.toml"],
    ["-c", "x.toml", "--simulate", "dgx-h100", "--runtime-dir", "/r", "--state-dir", "/s"],
    ["--config=x.toml", "--simulate=pcie-8x-l40s", "--seed", "7", "--sim-state", "s.json"],
    ["--log-level", "debug", "--kubelet", "--seed=0"],
]
LEFT_TO_TYPER = [
    ["--help"],
    ["-h"],
    ["--version"],
    ["doctor"],
    ["--simulate", "dgx-h100", "doctor", "--json"],
    ["--seed", "x"],
    ["--seed", "-1"],
    ["--seed"],
    ["--config"],
    ["--config", "--simulate"],
    ["--kubelet=yes"],
    ["--simulate", "a", "--simulate", "b"],
    ["--unknown", "1"],
    ["-cx.toml"],
    ["--config", ""],
]


def typer_params(args: list[str]) -> dict:
    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("xpud", list(args), resilient_parsing=True)
    return {k: v for k, v in ctx.params.items() if v not in (None, False)}


@pytest.mark.parametrize("args", TAKEN)
def test_a_serve_command_line_reads_as_typer_reads_it(args):
    assert parse(args) is not None
    got = {k: v for k, v in parse(args).items() if v not in (None, False)}
    assert got == typer_params(args)


@pytest.mark.parametrize("args", LEFT_TO_TYPER)
def test_anything_else_is_left_to_typer(args):
    assert parse(args) is None


def test_every_option_of_the_callback_is_known_or_left_to_typer():
    """A new option of ``xpud``'s callback must be added to the entry's table (or it would be refused
    as unknown there and read by Typer: slow, but right; this test says which)."""
    cmd = typer.main.get_command(app)
    names = {n for p in cmd.params for n in p.opts}
    assert set(OPTIONS) == names - {"--version", "--help", "-h"}


def test_the_installed_xpud_says_the_same_one_line_error_either_way(tmp_path):
    bad = tmp_path / "x.toml"
    bad.write_text("[leases]\ngrace_s = -1\n")
    fast = subprocess.run([BIN / "xpud", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    typer_path = "import sys; from xpud.daemon.cli import main; sys.argv[0] = 'xpud'; main()"
    slow = subprocess.run(
        [sys.executable, "-c", typer_path, "--config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert fast.returncode == slow.returncode == 2, (fast.stderr, slow.stderr)
    assert fast.stderr == slow.stderr and fast.stderr.count("\n") == 1 and "grace_s" in fast.stderr
