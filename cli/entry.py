"""The `xpu` entry point: `xpu run` on a fast path, every other command (and every `run` it cannot parse
with certainty: --help, a bad or unknown option) through Typer in ``xpu_cli.main``.

`xpu run` wraps each job, so its start-up is paid per job. Typer, Click and the listings' modules cost
more than gRPC itself; here `run`'s options are parsed by hand (the same grammar as Click's, checked
against it by tests/test_run_entry.py) and only what a run needs is imported. Anything this parser is not
sure of goes to Typer, which parses it again and gives its usual help or error message.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys

# run's options: long and short names -> (parameter, kind). Kinds: "str", "int", "int>=1", "float>=0",
# "duration", a flag's value (True/False). tests/test_run_entry.py checks this against the Typer command.
RUN_OPTIONS: dict[str, tuple[str, object]] = {
    "--mode": ("mode", "str"),
    "-m": ("mode", "str"),
    "--gpus": ("gpus", "int>=1"),
    "-g": ("gpus", "int>=1"),
    "--wait": ("wait", "duration"),
    "--name": ("name", "str"),
    "--account": ("account", "str"),
    "-A": ("account", "str"),
    "-J": ("name", "str"),
    "--priority": ("priority", "int"),
    "-p": ("priority", "int"),
    "--kill-grace": ("kill_grace", "float>=0"),
    "--restartable": ("restartable", True),
    "--no-restartable": ("restartable", False),
    "--json-env": ("json_env", True),
    "--when-green": ("when_green", True),
    "--deadline": ("deadline", "str"),
    "--runtime-dir": ("runtime_dir", "str"),  # a global option, accepted after the command too
    "--quiet": ("quiet", True),
    "-q": ("quiet", True),
    # jobs across hosts (xpu_cli.jobrun)
    "--nodes": ("nodes", "int>=1"),
    "-N": ("nodes", "int>=1"),
    "--gpus-per-node": ("gpus_per_node", "int>=1"),
    "--tasks-per-node": ("tasks_per_node", "int>=1"),
    "--replicas": ("replicas", "int>=1"),
    "--spread": ("spread", True),
    "--label": ("label", True),
    "-l": ("label", True),
    "--kill-on-bad-exit": ("kill_on_bad_exit", True),
    "--no-kill-on-bad-exit": ("kill_on_bad_exit", False),
    "--json": ("as_json", True),
    "--class": ("job_class", "str"),
}
RUN_DEFAULTS = {
    "mode": "xpu",
    "gpus": 1,
    "wait": None,
    "priority": 0,
    "restartable": False,
    "kill_grace": 10.0,
    "json_env": False,
    "job_class": "",
    "name": "",
    "account": "",
    "when_green": False,
    "deadline": None,
    "quiet": False,
    "nodes": None,
    "gpus_per_node": None,
    "tasks_per_node": None,
    "replicas": None,
    "spread": False,
    "label": False,
    "kill_on_bad_exit": True,
    "as_json": False,
}
MULTI_HOST_ONLY = {"label": "--label", "as_json": "--json", "kill_on_bad_exit": "--no-kill-on-bad-exit"}
DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"(?:(\d+(?:\.\d*)?|\.\d+)([dhms]))+|\d+(?:\.\d*)?|\.\d+")
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([dhms])")


def parse_duration(text: str) -> float:
    """Seconds for a duration as `--wait` takes it: ``30`` or ``2.5`` (seconds), ``90s``, ``5m``, ``2h``,
    ``1d``, ``1h30m`` (units in falling order), or ``inf`` (``math.inf``). Raises ValueError saying what
    it accepts."""
    if text in ("inf", "infinity"):
        return math.inf
    if text.isascii() and _DURATION.fullmatch(text):
        parts = _PART.findall(text)
        units = [u for _, u in parts]
        if not parts:
            return float(text)
        if len(set(units)) == len(units) and units == sorted(units, key=list(DURATION_UNITS).index):
            return sum(float(n) * DURATION_UNITS[u] for n, u in parts)
    raise ValueError(
        f"{text!r} is not a duration: use seconds (30, 2.5), a number with a unit (90s, 5m, 2h, 1d), "
        "units together (1h30m), or inf"
    )


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


def parse_run(args: list[str]) -> tuple[str | None, dict, list[str]] | None:
    """(runtime dir, run's options, command) for ``xpu [--runtime-dir DIR] run [OPTIONS] [--] COMMAND``,
    or None when Typer should handle ``args``."""
    runtime_dir = None
    i = 0
    while i < len(args) and args[i] != "run":
        arg = args[i]
        if arg == "--runtime-dir" and i + 1 < len(args) and args[i + 1][:1] != "-":
            runtime_dir, i = args[i + 1], i + 2
        elif arg.startswith("--runtime-dir=") and len(arg) > len("--runtime-dir="):
            runtime_dir, i = arg.partition("=")[2], i + 1
        else:
            return None
    if i == len(args):
        return None
    opts = dict(RUN_DEFAULTS)
    i += 1
    after = None
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
        spec = RUN_OPTIONS.get(name)
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
        value = _value(kind, text) if text else None
        if value is None:
            return None
        if param == "runtime_dir":
            after = value
        else:
            opts[param] = value
    return (after if after is not None else runtime_dir), opts, args[i:]


def _job_wait(wait: float | None) -> float:
    """A multi-host job's wait: seconds (no daemon default, no `inf` across hosts)."""
    from xpud.errors import BadRequest

    if wait == math.inf:
        raise BadRequest("--wait inf is for one-host runs: give a job across hosts a duration (e.g. 2h)")
    return wait or 0.0


# run's numeric options -> (flag, the request field whose limit applies (xpud/api/validate.py), lowest)
_NUMBERS = {
    "gpus": ("--gpus", "AcquireRequest.gpus", 1),
    "priority": ("--priority", "AcquireRequest.priority", None),
    "nodes": ("--nodes", "JobSpec.nodes", 1),
    "gpus_per_node": ("--gpus-per-node", "JobSpec.gpus_per_node", 1),
    "tasks_per_node": ("--tasks-per-node", "JobSpec.tasks_per_node", 1),
    "replicas": ("--replicas", "JobSpec.replicas", 1),
}
KILL_GRACE_MAX_S = 86400.0  # a forwarded signal escalates to SIGKILL within a day at the latest


def is_text(value: str) -> bool:
    """Whether ``value`` can travel in a request: command-line bytes that are not UTF-8 come to Python as
    surrogates, which protobuf refuses."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


_TEXTS = {
    "mode": "--mode",
    "name": "--name",
    "account": "--account",
    "job_class": "--class",
    "deadline": "--deadline",
}


def check_values(opts: dict) -> None:
    """Every value of ``opts`` one the daemon may take, before any request: one line otherwise (a value
    a request cannot even hold, e.g. --priority 99999999999 or a name that is not UTF-8, would fail
    inside protobuf)."""
    from xpud.api.validate import LIMITS
    from xpud.errors import BadRequest

    for param, (flag, field, lowest) in _NUMBERS.items():
        value = opts.get(param)
        if value is None:
            continue
        lim = LIMITS[field]
        lo = lim.lo if lowest is None else max(lim.lo, lowest)
        if not lo <= value <= lim.hi:
            raise BadRequest(f"{flag} {value}: outside {int(lo)}..{int(lim.hi)}")
    for param, flag in _TEXTS.items():
        value = opts.get(param)
        if isinstance(value, str) and not is_text(value):
            raise BadRequest(f"{flag}: not UTF-8 text")
    grace = opts.get("kill_grace")
    if grace is not None and not 0 <= grace <= KILL_GRACE_MAX_S:
        raise BadRequest(f"--kill-grace {grace:g}: give seconds from 0 to {KILL_GRACE_MAX_S:g}")


def run_with(client, opts: dict, command: list[str]):
    """Run ``command`` with `xpu run`'s options ``opts`` (as ``RUN_DEFAULTS`` names them): on this host
    (``xpu_cli.run``), or across hosts with --nodes / --replicas (``xpu_cli.jobrun``). Returns the
    Outcome; bad combinations of options raise BadRequest (one line)."""
    from xpu_cli.green import green_deadline

    from xpud.errors import BadRequest

    check_values(opts)
    green = green_deadline(opts["when_green"], opts["deadline"])
    if opts["nodes"] is not None or opts["replicas"] is not None or opts["spread"]:
        if green:
            raise BadRequest("--when-green applies to runs on this host (its daemon plans the start)")
        from xpu_cli.jobrun import check_options, run_job

        check_options(
            opts["mode"],
            opts["nodes"],
            opts["gpus_per_node"],
            opts["replicas"],
            opts["spread"],
            gpus_given=opts["gpus"] != RUN_DEFAULTS["gpus"],
            priority=opts["priority"],
            json_env=opts["json_env"],
            kill_grace_given=opts["kill_grace"] != RUN_DEFAULTS["kill_grace"],
            tasks_per_node=opts["tasks_per_node"],
        )
        return run_job(
            client,
            command,
            mode=opts["mode"],
            nodes=opts["nodes"] or 0,
            gpus_per_node=opts["gpus_per_node"] or 1,
            tasks_per_node=opts["tasks_per_node"] or 0,
            replicas=opts["replicas"] or 0,
            spread=opts["spread"],
            wait_s=_job_wait(opts["wait"]),
            labelled=opts["label"],
            kill_on_bad_exit=opts["kill_on_bad_exit"],
            restartable=opts["restartable"],
            quiet=opts["quiet"],
            as_json=opts["as_json"],
        )
    if opts["gpus_per_node"] is not None:
        raise BadRequest("--gpus-per-node needs --nodes N (the hosts to spread the job over)")
    if opts["tasks_per_node"] is not None:
        raise BadRequest("--tasks-per-node needs --nodes N (the hosts to run the tasks on)")
    for name, flag in MULTI_HOST_ONLY.items():
        if opts[name] != RUN_DEFAULTS[name]:
            raise BadRequest(f"{flag} applies to jobs across hosts: add --nodes N (or --replicas R --spread)")
    from xpu_cli.run import run as run_leased

    return run_leased(
        client,
        command,
        mode=opts["mode"],
        gpus=opts["gpus"],
        wait_s=opts["wait"],
        priority=opts["priority"],
        restartable=opts["restartable"],
        kill_grace_s=opts["kill_grace"],
        json_env=opts["json_env"],
        quiet=opts["quiet"],
        job_class=opts["job_class"],
        name=opts["name"],
        green_deadline=green,
        account=opts["account"],
    )


def run_fast(runtime_dir: str | None, opts: dict, command: list[str]) -> int:
    """What `xpu run` does in ``xpu_cli.main``, without Typer: the exit code (or death by the command's
    signal, through ``die_like``)."""
    from xpu_cli.child import die_like

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


def main() -> None:
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
