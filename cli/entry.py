"""The `xpu` entry point: `xpu run` on a fast path, every other command (and every `run` it cannot parse
with certainty: --help, a bad or unknown option) through Typer in ``xpu_cli.main``.

`xpu run` wraps each job, so its start-up is paid per job. Typer, Click and the listings' modules cost
more than gRPC itself; here `run`'s options are parsed by hand (the same grammar as Click's, checked
against it by tests/test_run_entry.py) and only what a run needs is imported. Anything this parser is not
sure of goes to Typer, which parses it again and gives its usual help or error message. The options'
table is ``xpu_cli.runopts`` and the run itself ``xpu_cli.launch``, which Typer's `run` shares: this module
only imports ``xpu_cli.main`` (to hand over), never the other way round.
"""

from __future__ import annotations

import contextlib
import os
import sys

from xpu_cli.runopts import RUN_DEFAULTS, RUN_OPTIONS, parse_duration


def _value(kind: str, text: str):
    """``text`` as Click would take it for ``kind``, or None when Click might read it otherwise (or
    refuse it): then Typer handles the whole command line."""
    if kind == "str":
        return text if text[:1] != "-" else None
    if kind.startswith("int"):
        digits = text[1:] if text[:1] == "-" else text
        if not (digits.isascii() and digits.isdigit()):
            return None
        n = int(text)
        return n if kind == "int" or n >= 1 else None
    if kind == "duration":
        try:
            return parse_duration(text)
        except ValueError:
            return None
    # float>=0: plain decimals only (no sign, exponent, inf or nan)
    if not text.isascii() or not text.replace(".", "", 1).isdigit():
        return None
    return float(text)


def _global_runtime_dir(args: list[str], verb: str) -> tuple[str | None, int] | None:
    """(the --runtime-dir given before ``verb``, the index of ``verb``) for ``xpu [--runtime-dir DIR] VERB
    ...``, or None when ``args`` are anything else."""
    runtime_dir = None
    i = 0
    while i < len(args) and args[i] != verb:
        arg = args[i]
        if arg == "--runtime-dir" and i + 1 < len(args) and args[i + 1][:1] != "-":
            runtime_dir, i = args[i + 1], i + 2
        elif arg.startswith("--runtime-dir=") and len(arg) > len("--runtime-dir="):
            runtime_dir, i = arg.partition("=")[2], i + 1
        else:
            return None
    if i == len(args):
        return None
    return runtime_dir, i


def parse_verb(args: list[str], verb: str, options: dict, defaults: dict):
    """(runtime dir, the verb's options, the rest: its command) for ``xpu [--runtime-dir DIR] VERB [OPTIONS]
    [--] COMMAND``, or None when Typer should handle ``args``. ``options``: long and short names ->
    (parameter, kind), kinds as ``RUN_OPTIONS``' and "list" (repeatable)."""
    found = _global_runtime_dir(args, verb)
    if found is None:
        return None
    runtime_dir, i = found
    opts = dict(defaults)
    i += 1
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if arg[:1] != "-" or arg == "-":
            break  # the command starts; Click stops parsing options here too (no interspersed args)
        name, eq, attached = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if not arg.startswith("--") and len(arg) > 2:
            name, eq, attached = arg[:2], "", arg[2:]  # -g2: a short option with its value attached
        spec = options.get(name)
        if spec is None:
            return None  # --help, a typo, an option this parser does not know: Typer says what is wrong
        param, kind = spec
        if isinstance(kind, bool):
            if eq or attached:
                return None
            opts[param], i = kind, i + 1
            continue
        if eq or attached:
            text, i = attached, i + 1
        elif i + 1 < len(args):
            text, i = args[i + 1], i + 2
        else:
            return None
        value = _value("str" if kind == "list" else kind, text) if text else None
        if value is None:
            return None
        if param == "runtime_dir":
            runtime_dir = value  # a global option, accepted after the verb too: the later one counts
        elif kind == "list":
            opts[param] = [*(opts[param] or []), value]
        else:
            opts[param] = value
    return runtime_dir, opts, args[i:]


def parse_run(args: list[str]) -> tuple[str | None, dict, list[str]] | None:
    """(runtime dir, run's options, command) for ``xpu [--runtime-dir DIR] run [OPTIONS] [--] COMMAND``,
    or None when Typer should handle ``args``."""
    return parse_verb(args, "run", RUN_OPTIONS, RUN_DEFAULTS)


def run_fast(runtime_dir: str | None, opts: dict, command: list[str]) -> int:
    """What `xpu run` does in ``xpu_cli.main``, without Typer: the exit code (or death by the command's
    signal, through ``die_like``)."""
    from xpu_cli.child import die_like
    from xpu_cli.launch import run_with

    from xpud.api.client import Client
    from xpud.errors import XpudError

    try:
        with Client(runtime_dir) as c:
            outcome = run_with(c, opts, command)
    except XpudError as e:
        sys.stderr.write(f"xpu: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    return die_like(outcome)


JOBS_OPTIONS: dict[str, tuple[str, object]] = {
    "--all": ("all_", True),
    "-a": ("all_", True),
    "--user": ("user", "str"),
    "-u": ("user", "str"),
    "--state": ("state", "str"),
    "-s": ("state", "str"),
    "--since": ("since", "str"),
    "--json": ("as_json", True),
    "--runtime-dir": ("runtime_dir", "str"),
}
JOBS_DEFAULTS = {"all_": False, "user": None, "state": None, "since": None, "as_json": False}


def parse_submit(args: list[str]) -> tuple[str | None, dict, list[str]] | None:
    """(runtime dir, submit's options, command) for ``xpu [--runtime-dir DIR] submit [OPTIONS] [--]
    COMMAND``, or None when Typer should handle ``args`` (as ``parse_run``)."""
    from xpu_cli.submitting import SUBMIT_DEFAULTS, SUBMIT_OPTIONS

    return parse_verb(args, "submit", SUBMIT_OPTIONS, SUBMIT_DEFAULTS)


def submit_fast(runtime_dir: str | None, opts: dict, command: list[str]) -> int:
    from xpu_cli.submitting import submit_with

    from xpud.api.client import Client
    from xpud.errors import XpudError

    try:
        with Client(runtime_dir) as c:
            submit_with(c, command, **opts)
    except BrokenPipeError:
        return 1
    except XpudError as e:
        sys.stderr.write(f"xpu: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def jobs_fast(runtime_dir: str | None, opts: dict, rest: list[str]) -> int:
    from xpu_cli.joblist import list_jobs

    from xpud.api.client import Client
    from xpud.errors import XpudError

    try:
        with Client(runtime_dir) as c:
            list_jobs(c, **opts)
    except XpudError as e:
        sys.stderr.write(f"xpu: {e}\n")
        return 1
    except (BrokenPipeError, KeyboardInterrupt):  # a reader gone (| head), or Ctrl-C
        return 1
    return 0


def main() -> None:
    listed = (
        parse_verb(sys.argv[1:], "jobs", JOBS_OPTIONS, JOBS_DEFAULTS) if "jobs" in sys.argv[1:3] else None
    )
    if listed is not None and not listed[2]:  # no stray arguments: Typer says what is wrong with those
        code = jobs_fast(*listed)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os._exit(code)
    submitted = parse_submit(sys.argv[1:]) if "submit" in sys.argv[1:3] else None
    if submitted is not None:
        code = submit_fast(*submitted)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os._exit(code)
    parsed = parse_run(sys.argv[1:])
    if parsed is None:
        from xpu_cli.main import main as typer_main

        typer_main()
        return
    try:
        code = run_fast(*parsed)
    except BrokenPipeError:
        code = 1
    # The command ended and the lease is released: nothing is left to do but exit. Python's own
    # finalisation (gRPC's threads and modules torn down one by one) would add 15-30 ms to every job.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone: the status stays the command's
            stream.flush()
    os._exit(code)
