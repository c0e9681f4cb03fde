"""`xpu submit`'s work, without Typer: checks as the submitting user, then one SubmitJob. Used by the Typer
command (``xpu_cli.jobs``) and by the fast path (``xpu_cli.entry``), which parses submit's options by hand
as it does run's."""

from __future__ import annotations

import math
import os

from xpu_cli.runopts import ACROSS_HOSTS

from xpud.errors import BadRequest

# submit's options: names -> (parameter, kind); kinds as entry.RUN_OPTIONS'. "list": repeatable.
SUBMIT_OPTIONS: dict[str, tuple[str, object]] = {
    "--mode": ("mode", "str"),
    "-m": ("mode", "str"),
    "--gpus": ("gpus", "int>=1"),
    "-g": ("gpus", "int>=1"),
    "--priority": ("priority", "int"),
    "-p": ("priority", "int"),
    "--wait": ("wait", "str"),
    "--name": ("name", "str"),
    "-J": ("name", "str"),
    "--output": ("out", "str"),
    "-o": ("out", "str"),
    "--error": ("err", "str"),
    "-e": ("err", "str"),
    "--time": ("time_limit", "str"),
    "-t": ("time_limit", "str"),
    "--after": ("after", "list"),
    "--kill-grace": ("kill_grace", "float>=0"),
    "--json": ("as_json", True),
    "--restartable": ("restartable", True),
    "--account": ("account", "str"),
    "-A": ("account", "str"),
    "--runtime-dir": ("runtime_dir", "str"),
    **ACROSS_HOSTS,
}
SUBMIT_DEFAULTS = {
    "mode": "xpu",
    "gpus": 1,
    "priority": 0,
    "wait": None,
    "name": "",
    "out": None,
    "err": None,
    "time_limit": None,
    "after": None,
    "kill_grace": 10.0,
    "as_json": False,
    "restartable": False,
    "account": "",
    "nodes": None,
    "gpus_per_node": None,
    "tasks_per_node": None,
    "replicas": None,
    "spread": False,
    "kill_on_bad_exit": True,
}


def _writable(path: str, what: str) -> None:
    """Refuse (one line) a file this user could not create or write."""
    if os.path.isdir(path):
        raise BadRequest(f"{what} {path}: is a directory; give a file name")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise BadRequest(f"{what} {path}: you cannot write it; choose another file")
        return
    parent = os.path.dirname(path) or "."
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadRequest(f"{what} {path}: you cannot create files in {parent}; choose another place")


def _time_limit(text: str | None) -> float:
    if text is None:
        return 0.0
    from xpu_cli.runopts import parse_duration

    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise BadRequest(f"--time {e}") from None
    if not 0 < seconds < math.inf or seconds > 366 * 86400:
        raise BadRequest(f"--time {text}: give a duration above 0 and within a year (e.g. 30m, 2h)")
    return seconds


def submit_with(
    c,
    command,
    mode="xpu",
    gpus=1,
    priority=0,
    wait=None,
    name="",
    out=None,
    err=None,
    time_limit=None,
    after=None,
    kill_grace=10.0,
    as_json=False,
    restartable=False,
    account="",
    nodes=None,
    gpus_per_node=None,
    tasks_per_node=None,
    replicas=None,
    spread=False,
    kill_on_bad_exit=True,
) -> None:
    """Check, submit through the client ``c`` and print the id (or ``{"id", "name"}``). With ``nodes``
    (``gpus_per_node``, ``tasks_per_node``) or ``replicas`` (``spread``): one job across hosts, each rank's
    output in a file on its host (%j %n %t %N in ``out``/``err``; default xpu-<id>-<rank>.out)."""
    if not command:
        raise BadRequest("no command: `xpu submit [OPTIONS] -- COMMAND ...`")
    multi = bool(nodes or gpus_per_node or tasks_per_node or replicas)
    if multi and gpus != 1:
        raise BadRequest("--gpus is for one host: across hosts give --nodes N --gpus-per-node G")
    if not 0 <= kill_grace <= 86400:
        raise BadRequest(f"--kill-grace {kill_grace:g}: give seconds from 0 to 86400")
    seconds = _time_limit(time_limit)
    wait_s = None
    if wait is not None:
        from xpu_cli.runopts import parse_duration

        try:
            wait_s = parse_duration(wait)
        except ValueError as e:
            raise BadRequest(f"--wait {e}") from None
    cwd = os.getcwd()
    files = {}
    for flag, path in (("--output", out), ("--error", err)):
        if path:
            full = os.path.abspath(path)
            if not multi:  # across hosts each rank's host opens its file as the user
                _writable(full, flag)
            files[flag] = full
    if not out and not os.access(cwd, os.W_OK | os.X_OK):
        what = "xpu-<id>-<rank>.out" if multi else "xpu-<id>.out"
        raise BadRequest(f"--output: you cannot create {what} in {cwd}; give --output FILE")
    deps = [a for item in (after or []) for a in item.split(",") if a]
    fields = dict(
        argv=list(command),
        cwd=cwd,
        env=dict(os.environ),
        name=name,
        mode=mode,
        gpus=gpus,
        priority=priority,
        output=files.get("--output", ""),
        error=files.get("--error", ""),
        time_limit_s=seconds,
        after=deps,
        kill_grace_s=kill_grace,
        restartable=restartable,
        account=account,
    )
    if wait_s is not None and wait_s != math.inf:
        fields["wait_s"] = wait_s
    if multi:
        fields.update(
            nodes=nodes or 0,
            gpus_per_node=gpus_per_node or 0,
            tasks_per_node=tasks_per_node or 0,
            replicas=replicas or 0,
            spread=spread,
            kill_on_bad_exit=kill_on_bad_exit,
        )
    job = c.submit_job(**fields)
    if as_json:
        from xpu_cli import output

        output.print_json({"id": job.id, "name": job.name or None})
    else:
        print(job.id)
