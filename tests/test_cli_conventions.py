"""The command line's conventions as a user meets them: global options anywhere, -h, --version, plain
metavars in every help page, case-insensitive modes, shell completion."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import typer
from xpu_cli.grammar import hoist_globals
from xpu_cli.main import app

from tests.conftest import xpu_env

BIN = Path(sys.executable).parent
RUN = {"run": frozenset({"-g", "--gpus", "-m", "--mode", "--wait", "-p", "--priority", "--kill-grace"})}


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["ls", "--runtime-dir", "D", "--json"], ["--runtime-dir", "D", "ls", "--json"]),
        (["ls", "--runtime-dir=D"], ["--runtime-dir=D", "ls"]),
        (
            ["fault", "inject", "0", "xid", "--runtime-dir", "D"],
            ["--runtime-dir", "D", "fault", "inject", "0", "xid"],
        ),
        # run: its own options may carry it, the command it runs may not lose it
        (["run", "-g", "2", "--runtime-dir", "D", "x"], ["--runtime-dir", "D", "run", "-g", "2", "x"]),
        (["run", "-g", "2", "sh", "--runtime-dir", "D"], ["run", "-g", "2", "sh", "--runtime-dir", "D"]),
        (["run", "--", "x", "--runtime-dir", "D"], ["run", "--", "x", "--runtime-dir", "D"]),
        (["health", "--", "--runtime-dir"], ["health", "--", "--runtime-dir"]),
    ],
)
def test_global_options_move_to_the_front_except_inside_a_command(args, want):
    assert hoist_globals(args, RUN) == want


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name)


def test_every_help_page_answers_h_with_plain_metavars():
    root = typer.main.get_command(app)
    pages = [(), *_commands(root)]
    assert len(pages) > 15 and ("fault", "inject") in pages
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"COLUMNS": "100"}
    # The installed `xpu` answers -h (its entry point hands -h to Typer); every page is then rendered by
    # the same Typer app in this process: one interpreter start per page cost CI half a minute.
    for page in [(), ("run",), ("fault", "inject")]:
        r = subprocess.run([BIN / "xpu", *page, "-h"], capture_output=True, text=True, env=env, timeout=60)
        usage = _help(app, "xpu", page).split("\n", 1)[0]
        assert r.returncode == 0 and r.stdout.split("\n", 1)[0] == usage, (page, r.stderr)
    for page in pages:
        text = _help(app, "xpu", page)
        assert text.startswith("Usage: xpu"), page
        for noise in ("<str>", "<list", "<int", "<float", "<path>", "{"):
            assert noise not in text.split("\n\n", 1)[0] + _options(text), (page, noise, text)


@functools.cache
def _click(the_app):
    return typer.main.get_command(the_app)  # built once: Typer's test runner builds it anew per call


def _help(the_app, prog: str, page: tuple[str, ...]) -> str:
    """``prog PAGE -h`` as the Typer app prints it, 100 columns wide."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), mock.patch.dict(os.environ, {"COLUMNS": "100"}):
        code = _click(the_app).main([*page, "-h"], prog_name=prog, standalone_mode=False)
    assert not code, (page, out.getvalue())
    return out.getvalue()


def test_xpud_help_looks_like_xpus_and_keeps_bracketed_text():
    """#28 item 12: xpud's help is plain text as xpu's (Rich markup ate "[kubelet]"), -h too."""
    from xpud.daemon.cli import app as daemon_app

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"COLUMNS": "100"}
    pages = [(), *_commands(typer.main.get_command(daemon_app))]
    assert ("doctor",) in pages
    r = subprocess.run([BIN / "xpud", "doctor", "-h"], capture_output=True, text=True, env=env, timeout=60)
    usage = _help(daemon_app, "xpud", ("doctor",)).split("\n", 1)[0]
    assert r.returncode == 0 and r.stdout.split("\n", 1)[0] == usage, r.stderr
    for page in pages:
        text = _help(daemon_app, "xpud", page)
        assert text.startswith("Usage: xpud"), (page, text)
        assert "╭" not in text, page  # no Rich panels
        for noise in ("<str>", "<int", "<bool>"):
            assert noise not in _options(text), (page, noise, text)
    top = subprocess.run([BIN / "xpud", "--help"], capture_output=True, text=True, env=env, timeout=60).stdout
    assert "([kubelet]" in top and "-c, --config PATH" in top, top


def _options(help_text: str) -> str:
    """The Arguments and Options sections (a command's own description may use braces)."""
    start = help_text.find("Arguments:") if "Arguments:" in help_text else help_text.find("Options:")
    return help_text[start:]


def test_version_and_completion():
    r = subprocess.run([BIN / "xpu", "--version"], capture_output=True, text=True, timeout=60)
    from importlib.metadata import version

    assert r.returncode == 0 and r.stdout == f"xpu {version('xpud')}\n"
    # The shell named, not detected: detection walks the parent processes for a shell, and a test run may
    # have none above it (seen once in a fresh clone: "Shell  not supported").
    named = dict(os.environ, _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1")
    r = subprocess.run(
        [BIN / "xpu", "--show-completion", "bash"], capture_output=True, text=True, timeout=60, env=named
    )
    assert r.returncode == 0 and "_XPU_COMPLETE" in r.stdout
    env = dict(os.environ, _XPU_COMPLETE="complete_bash", COMP_WORDS="xpu run --mode vx", COMP_CWORD="3")
    r = subprocess.run([BIN / "xpu"], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.split() == ["vxpu-half", "vxpu-quarter"]


def test_runtime_dir_after_the_command_and_modes_in_any_case(daemon):
    env = {k: v for k, v in xpu_env(daemon.runtime_dir).items() if k != "XPUD_RUNTIME_DIR"}

    def xpu(*args):
        return subprocess.run([BIN / "xpu", *args], capture_output=True, text=True, env=env, timeout=60)

    before = xpu("--runtime-dir", str(daemon.runtime_dir), "ls", "--json")
    after = xpu("ls", "--runtime-dir", str(daemon.runtime_dir), "--json")
    assert before.returncode == after.returncode == 0, after.stderr
    assert [c["uuid"] for c in json.loads(after.stdout)] == [c["uuid"] for c in json.loads(before.stdout)]
    assert xpu("ls", "--json").returncode == 1  # the default /run/xpud: no daemon there
    r = xpu("run", "--mode", "VXPU-Half", "--runtime-dir", str(daemon.runtime_dir), "--", "true")
    assert r.returncode == 0, r.stderr
    r = xpu("mode", "5", "Sliced", f"--runtime-dir={daemon.runtime_dir}")
    assert r.returncode == 0 and "card 5 is sliced" in r.stdout, r.stderr
    r = xpu("mode", "5", "sideways", "--runtime-dir", str(daemon.runtime_dir))
    assert r.returncode == 2 and "use whole, sliced or auto" in r.stderr


def test_run_refuses_values_a_request_cannot_hold_in_one_line_and_never_hangs(daemon):
    """A value protobuf cannot put in the request (an int beyond its field, text that is not UTF-8) used
    to raise inside the lease thread, leaving `xpu run` waiting forever; each gets one line and exit 1,
    on the fast path and through Typer (which parses `1e9`)."""
    env = xpu_env(daemon.runtime_dir)

    def xpu(*args):
        return subprocess.run([BIN / "xpu", "run", *args], capture_output=True, env=env, timeout=30)

    for args, want in [
        (["--priority", "99999999999"], b"--priority 99999999999: outside -1000000..1000000"),
        (["-p", "-2000000"], b"outside -1000000..1000000"),
        (["--gpus", "99999999999"], b"--gpus 99999999999: outside 1..4096"),
        (["--nodes", "99999999999"], b"--nodes 99999999999: outside 1..1024"),
        (["--kill-grace", "1e9"], b"--kill-grace 1e+09: give seconds from 0 to 86400"),
        (["--name", b"\xff"], b"--name: not UTF-8 text"),
        (["--class", b"caf\xe9", "--mode", "auto"], b"--class: not UTF-8 text"),
    ]:
        r = xpu(*args, "--", "true")
        assert r.returncode == 1 and r.stderr.startswith(b"xpu: ") and len(r.stderr.splitlines()) == 1, args
        assert want in r.stderr, (args, r.stderr)
    r = xpu("--", "sh", "-c", 'printf %s "$1"', "x", b"caf\xe9")  # a file name need not be UTF-8: it runs
    assert (r.returncode, r.stdout) == (0, b"caf\xe9"), r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["release", b"\xff"],
        ["show", b"\xff"],
        ["resize", "abc", "--mode", b"\xff"],
        ["drain", "0", "--reason", b"caf\xe9"],
        ["evict", b"\xff"],
        ["defrag", "--gpus", "99999999999"],
        ["health", b"\xff"],
        ["wait", b"\xff"],
    ],
)
def test_every_verb_refuses_what_a_request_cannot_hold_in_one_line(daemon, args):
    """Arguments that are not UTF-8, or integers beyond a field's type, raised protobuf's exception as a
    traceback from every verb; now one line naming the request's field, exit 1."""
    r = subprocess.run([BIN / "xpu", *args], capture_output=True, env=xpu_env(daemon.runtime_dir), timeout=30)
    assert r.returncode == 1 and r.stderr.startswith(b"xpu: ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert b"not UTF-8 text" in r.stderr or b"out of range" in r.stderr, r.stderr


def _short_flags(group, prefix=()):
    """(short flag, its long names, the command) for every option of every command, and of the groups."""
    for p in group.params:
        yield from _flag_meanings(p, " ".join(prefix) or "xpu")
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _short_flags(cmd, (*prefix, name))
        else:
            for p in cmd.params:
                yield from _flag_meanings(p, " ".join((*prefix, name)))


def _flag_meanings(param, where: str):
    names = [*param.opts, *getattr(param, "secondary_opts", [])]
    longs = tuple(sorted(n for n in names if n.startswith("--")))
    for short in (n for n in names if n.startswith("-") and not n.startswith("--")):
        yield short, longs, where


def test_a_short_flag_means_one_thing_in_every_verb():
    """#28 item 12: -n was --name in run, --limit in events and --interval in top; -w --wait in run and
    --watch in ls; -l --label in run and --lease in events; -c --config and --card; -p --priority and
    --policy. Each short flag now has one long name wherever it appears (-h: help everywhere)."""
    from xpu_cli.entry import RUN_OPTIONS

    meanings: dict[str, dict[tuple[str, ...], list[str]]] = {}
    for short, longs, where in _short_flags(typer.main.get_command(app)):
        meanings.setdefault(short, {}).setdefault(longs, []).append(where)
    # run's fast path (xpu_cli.entry) parses run's short flags by hand: the same meanings there.
    fast = {n: p for n, (p, _) in RUN_OPTIONS.items()}
    for short in (n for n in RUN_OPTIONS if not n.startswith("--")):
        long = next(n for n, p in fast.items() if n.startswith("--") and p == fast[short])
        meanings.setdefault(short, {}).setdefault((long,), []).append("run (fast path)")
    two = {s: m for s, m in meanings.items() if len(m) > 1}
    assert not two, f"short flags with more than one meaning: {two}"
    # The choices, as a Slurm or kubectl user reads them (see the commit that made them).
    chosen = {s: next(iter(m)) for s, m in meanings.items()}
    assert chosen["-w"] == ("--watch",) and chosen["-l"] == ("--label",) and chosen["-N"] == ("--nodes",)
    assert chosen["-J"] == ("--name",) and chosen["-n"] == ("--limit",) and chosen["-c"] == ("--config",)
