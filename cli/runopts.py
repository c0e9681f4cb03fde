"""`xpu run`'s options: the table both of its parsers read (the fast path in ``xpu_cli.entry``, Typer in
``xpu_cli.main``; tests/test_run_entry.py checks they agree), their defaults, durations, and the checks
every value gets before any request. Pure and light: `xpu run` imports it on every job."""

from __future__ import annotations

import math
import re

# run's options: long and short names -> (parameter, kind). Kinds: "str", "int", "int>=1", "float>=0",
# "duration", a flag's value (True/False). tests/test_run_entry.py checks this against the Typer command.
# a job across hosts: run's and submit's alike (xpu_cli.jobrun, xpu_cli.submitting)
ACROSS_HOSTS: dict[str, tuple[str, object]] = {
    "--nodes": ("nodes", "int>=1"),
    "-N": ("nodes", "int>=1"),
    "--gpus-per-node": ("gpus_per_node", "int>=1"),
    "--tasks-per-node": ("tasks_per_node", "int>=1"),
    "--replicas": ("replicas", "int>=1"),
    "--spread": ("spread", True),
    "--kill-on-bad-exit": ("kill_on_bad_exit", True),
    "--no-kill-on-bad-exit": ("kill_on_bad_exit", False),
}
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
    **ACROSS_HOSTS,
    "--label": ("label", True),
    "-l": ("label", True),
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
