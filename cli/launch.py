"""Running a command with `xpu run`'s options (as ``xpu_cli.runopts.RUN_DEFAULTS`` names them): on this
host (``xpu_cli.run``) or across hosts (``xpu_cli.jobrun``). Both ways in use it: the fast path
(``xpu_cli.entry``) and Typer's `run` (``xpu_cli.main``). What a run needs is imported when it runs."""

from __future__ import annotations

import math

from xpu_cli.runopts import MULTI_HOST_ONLY, RUN_DEFAULTS, check_values


def _job_wait(wait: float | None) -> float:
    """A multi-host job's wait: seconds (no daemon default, no `inf` across hosts)."""
    from xpud.errors import BadRequest

    if wait == math.inf:
        raise BadRequest("--wait inf is for one-host runs: give a job across hosts a duration (e.g. 2h)")
    return wait or 0.0


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
            name=opts["name"],
            account=opts["account"],
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
        account=opts["account"],
        green_deadline=green,
    )
