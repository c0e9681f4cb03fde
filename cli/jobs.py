"""`xpu submit`, `xpu jobs`, `xpu cancel`, `xpu logs`: batch jobs (sbatch, squeue/sacct, scancel, tail -f).

`xpu submit` checks what it can as the submitting user, in its own process, before anything is queued: the
time limit, and that the output file(s) can be written by this user (the daemon then opens them as this
user too, never as root).
"""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer
from xpu_cli import output
from xpu_cli.joblist import STATES, end_text, row

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

WAIT_POLL_S = 0.25


def submit(
    command: Annotated[
        list[str] | None, typer.Argument(help="The command and its arguments (after --).")
    ] = None,
    mode: Annotated[str, typer.Option("--mode", "-m", help="xpu (whole cards) or a slice size.")] = "xpu",
    gpus: Annotated[int, typer.Option("--gpus", "-g", help="Whole cards (mode xpu).", min=1)] = 1,
    priority: Annotated[int, typer.Option("--priority", "-p", help="Higher goes first in the queue.")] = 0,
    wait: Annotated[
        str | None, typer.Option("--wait", help="Give up when not started within this long (default: inf).")
    ] = None,
    name: Annotated[str, typer.Option("--name", "-J", help="A name for the job (as sbatch -J).")] = "",
    out: Annotated[
        str | None, typer.Option("--output", "-o", help="Output file (default xpu-<id>.out here).")
    ] = None,
    err: Annotated[
        str | None, typer.Option("--error", "-e", help="Errors to this file (default: --output).")
    ] = None,
    time_limit: Annotated[
        str | None,
        typer.Option("--time", "-t", help="Time limit (30m, 2h, 1d): TERM, then KILL after the grace."),
    ] = None,
    after: Annotated[
        list[str] | None, typer.Option("--after", help="Start after these jobs completed with 0 (JOB[,JOB]).")
    ] = None,
    kill_grace: Annotated[
        float, typer.Option(help="Seconds between TERM and KILL (cancel, --time).", min=0, max=86400)
    ] = 10.0,
    restartable: Annotated[
        bool,
        typer.Option(
            help="When xpud moves its lease (a failing card, defrag): stop it, start it there (--nodes: a "
            "card failing under a rank restarts every rank)."
        ),
    ] = False,
    account: Annotated[
        str, typer.Option("--account", "-A", help="Charge this account (one you are a member of).")
    ] = "",
    nodes: Annotated[int | None, typer.Option("--nodes", "-N", help="Hosts, one rank each.", min=1)] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option("--gpus-per-node", help="Whole cards per host (with --nodes).", min=1)
    ] = None,
    tasks_per_node: Annotated[
        int | None, typer.Option("--tasks-per-node", help="Processes per host (with --nodes).", min=1)
    ] = None,
    replicas: Annotated[
        int | None, typer.Option("--replicas", help="Slices on distinct hosts (with --spread).", min=1)
    ] = None,
    spread: Annotated[bool, typer.Option("--spread", help="--replicas on distinct hosts.")] = False,
    kill_on_bad_exit: Annotated[
        bool,
        typer.Option("--kill-on-bad-exit/--no-kill-on-bad-exit", help="One failing rank stops all."),
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the job's id and name as JSON.")] = False,
) -> None:
    """Queue COMMAND as a detached job and print its id at once (as sbatch). The daemon starts it as you,
    in this directory, with this environment and the lease's, stdin from /dev/null, output to a file."""
    from xpu_cli.session import client
    from xpu_cli.submitting import submit_with

    with client() as c:
        opts = dict(name=name, out=out, err=err, time_limit=time_limit, after=after, kill_grace=kill_grace)
        opts["account"] = account
        opts.update(nodes=nodes, gpus_per_node=gpus_per_node, tasks_per_node=tasks_per_node)
        opts.update(replicas=replicas, spread=spread, kill_on_bad_exit=kill_on_bad_exit)
        submit_with(c, command, mode, gpus, priority, wait, **opts, as_json=as_json, restartable=restartable)


def jobs(
    all_: Annotated[bool, typer.Option("--all", "-a", help="Ended jobs too (as sacct).")] = False,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's (name or uid).")] = None,
    state: Annotated[
        str | None, typer.Option("--state", "-s", help=f"Only jobs in this state: {', '.join(STATES)}.")
    ] = None,
    since: Annotated[str | None, typer.Option("--since", help="Submitted within this long (2h, 1d).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Queued and running jobs (as squeue); with --all, ended ones too (as sacct)."""
    from xpu_cli.joblist import list_jobs
    from xpu_cli.session import client

    with client() as c:
        list_jobs(c, all_, user, state, since, as_json)


def cancel(
    selectors: Annotated[list[str], typer.Argument(help="Job ids or names (yours).", show_default=False)],
) -> None:
    """Cancel jobs in any state (as scancel): queued ones leave the queue, running ones get TERM, then KILL
    after their kill grace."""
    from xpu_cli.session import client

    with client() as c:
        for j in c.cancel_jobs(selectors):
            named = f" ({j.name})" if j.name else ""
            print(f"job {j.id}{named}: {j.state}{', ' + j.reason if j.reason else ''}")


def logs(
    selector: Annotated[str, typer.Argument(help="A job id or name (yours).")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Follow the output until the job ends.")
    ] = False,
    rank: Annotated[int, typer.Option("--rank", help="The rank (multi-host jobs).", min=0)] = 0,
    error: Annotated[bool, typer.Option("--error", help="The --error file.")] = False,
) -> None:
    """A job's output (as `tail -f slurm-N.out` with -f), read by the daemon for its owner."""
    from xpu_cli.session import client

    out = sys.stdout.buffer
    with client() as c:
        for data in c.job_logs(selector, follow=follow, rank=rank, error=error):
            out.write(data)
            out.flush()


def exit_status(j) -> int:
    """The job's end as a shell's `$?`: its exit code; 128 + the signal; 143 cancelled, 124 timeout, 1 lost
    or dependency-failed (when no process status tells more)."""
    if j.HasField("exit_signal"):
        return 128 + j.exit_signal
    if j.HasField("exit_code") and j.state in ("completed", "failed"):
        return j.exit_code
    return {"completed": 0, "cancelled": 143, "timeout": 124}.get(j.state, 1)


def wait_job(c, selector: str, timeout: float | None, as_json: bool) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    j = c.job(selector)
    while j.state in ("queued", "running"):
        if deadline is not None and time.monotonic() >= deadline:
            print(f"xpu: job {j.id} is still {j.state} after {timeout:g} s", file=sys.stderr)
            return 124
        time.sleep(
            WAIT_POLL_S if deadline is None else min(WAIT_POLL_S, max(0.0, deadline - time.monotonic()))
        )
        j = c.job(j.id)
    shown = row(j, time.time())
    if as_json:
        output.print_json(shown)
    else:
        what = end_text(shown)
        print(f"job {j.id} {j.state}{' (' + what + ')' if what else ''}{': ' + j.reason if j.reason else ''}")
    return exit_status(j)


def register(app: typer.Typer) -> None:
    from xpu_cli.output import handled

    app.command(context_settings={"allow_interspersed_args": False})(handled(submit))
    app.command("jobs")(handled(jobs))
    app.command()(handled(cancel))
    app.command()(handled(logs))
