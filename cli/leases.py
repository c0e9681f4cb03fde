"""`xpu leases`, `xpu show`, `xpu wait`: leases and queued requests, one table, as `squeue`/`sacct` show
jobs. An ended lease shows how its command ended (``done``, ``exit 3``, ``signal TERM``) when its wrapper
reported it, else how the lease ended (``released``, ``reclaimed``, ``evicted``)."""

from __future__ import annotations

import pwd
import sys
import time
from datetime import datetime
from typing import Annotated

import typer
from xpu_cli import output, vocab
from xpu_cli.vocab import exit_status, run_time, status

from xpud.errors import BadRequest, NotFound

STATES = (
    "running",
    "unheld",
    "queued",
    "done",
    "exit",
    "signal",
    "released",
    "reclaimed",
    "evicted",
    "active",
)
WAIT_POLL_S = 0.25  # `xpu wait` asks again this often (one small call: the ledger lookup of one id)
STYLES = {"unheld": "red", "queued": "yellow", "done": "green"}
SORT_KEYS = ("lease", "name", "mode", "cards", "user", "state", "age", "elapsed", "end")
LEGEND = (
    "FLAGS: R restartable (the daemon may stop the command and start it again on other cards).  "
    "NOTE: the daemon's warning for the holder, why a request waits, or why a lease ended."
)


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def clock(ts: float, now: float) -> str:
    """A local time: HH:MM:SS today, else MM-DD HH:MM (the zone is in the column header)."""
    same_day = time.localtime(ts)[:3] == time.localtime(now)[:3]
    return time.strftime("%H:%M:%S" if same_day else "%m-%d %H:%M", time.localtime(ts))


def zone() -> str:
    return time.strftime("%Z") or time.strftime("%z")


def user_uid(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise typer.BadParameter(f"no user {text!r} on this host: give a user name or a uid") from None


def _note(le) -> str:
    if le.state == "active":
        return le.mark
    return le.end_reason if le.state in ("reclaimed", "evicted") else ""


def _lease_row(le, now: float, all_: bool) -> dict:
    return {
        "lease": le.id,
        "name": le.name or "-",
        "mode": le.mode,
        "cards": ",".join(map(str, le.cards)),
        "user": le.owner_uid,
        "pid": le.holder_pid or "-",
        "state": status(le),
        "age": le.created,
        "elapsed": run_time(le, now),
        "end": le.ended if le.HasField("ended") else None,
        "flags": "R" if le.restartable else "",
        "command": le.command,
        "note": _note(le),
    }


def _hhmm(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%a %H:%M")


def _queue_row(q, now: float) -> dict:
    return {
        "lease": q.ticket,  # the ticket stands where the lease id will be
        "name": q.name or "-",
        "mode": q.mode,
        "cards": f"({q.gpus})" if q.mode == "xpu" else "-",
        "user": q.owner_uid,
        "pid": "-",
        "state": "queued",
        "age": q.enqueued,
        "elapsed": max(0.0, now - q.enqueued),
        "end": None,
        "flags": "",
        "command": q.command,
        "note": f"{q.reason} (position {q.position}, gives up in {max(0, q.deadline - now):.0f}s)"
        + (f"; starts {_hhmm(q.not_before)}: {q.not_before_reason}" if q.not_before > now else ""),
    }


def _matches(row: dict, mode: str | None, state: str | None, uid: int | None) -> bool:
    if (mode is not None and row["mode"] != mode) or (uid is not None and row["user"] != uid):
        return False
    if state == "active":
        return row["state"] in ("running", "unheld")
    return state is None or row["state"].split()[0] == state


def _sort_value(row: dict, key: str):
    v = row["lease" if key == "lease" else key]
    if key == "end":
        return v or 0.0
    return (str(v) if not isinstance(v, int | float) else v) if v is not None else ""


def rows(reply, now: float, all_: bool, mode=None, state=None, uid=None, sort=None) -> tuple[list, list]:
    """(leases kept, queue entries kept) of a ListLeasesReply after the filters, as table rows."""
    leases = [(le, _lease_row(le, now, all_)) for le in reply.leases]
    queue = [(q, _queue_row(q, now)) for q in reply.queue]
    leases = [x for x in leases if _matches(x[1], mode, state, uid)]
    queue = [x for x in queue if _matches(x[1], mode, state, uid)]
    if sort:
        desc = sort.startswith("-")
        key = sort.lstrip("-")
        leases.sort(key=lambda x: _sort_value(x[1], key), reverse=desc)
        queue.sort(key=lambda x: _sort_value(x[1], key), reverse=desc)
    return leases, queue


COLUMNS = {  # key -> header, in table order (END with --all, PID without)
    "lease": "LEASE",
    "mode": "MODE",
    "cards": "CARDS",
    "user": "USER",
    "pid": "PID",
    "state": "STATE",
    "elapsed": "ELAPSED",
    "end": "END",
    "name": "NAME",
    "flags": "FLAGS",
    "command": "COMMAND",
    "note": "NOTE",
}


def print_table(reply, now: float, all_: bool, mode=None, state=None, uid=None, sort=None) -> None:
    leases, queue = rows(reply, now, all_, mode, state, uid, sort)
    keys = [k for k in COLUMNS if k != ("pid" if all_ else "end")]
    headers = [f"END ({zone()})" if k == "end" else COLUMNS[k] for k in keys]
    table = []
    for _, r in [*leases, *queue]:
        cells = {**r, "elapsed": vocab.age(r["elapsed"]), "user": vocab.user_name(r["user"])}
        cells["end"] = clock(r["end"], now) if r["end"] else "-"
        if r["state"] in STYLES:
            cells["state"] = output.Styled(r["state"], STYLES[r["state"]])
        table.append([cells[k] for k in keys])
    output.table(headers, table, optional=("FLAGS", "PID", "NAME"))
    if reply.leases_omitted or reply.queue_omitted:
        output.note(
            f"({reply.leases_omitted} lease(s) and {reply.queue_omitted} queued request(s) not shown)"
        )
    if table:
        output.note(LEGEND)


def print_json(reply, now: float, all_: bool, mode=None, state=None, uid=None, sort=None) -> None:
    leases, queue = rows(reply, now, all_, mode, state, uid, sort)
    out = output.to_dict(reply)
    out["leases"] = [{**output.to_dict(le), "status": r["state"]} for le, r in leases]
    out["queue"] = [output.to_dict(q) for q, _ in queue]
    output.print_json(out)


def leases(
    all_: Annotated[
        bool, typer.Option("--all", "-a", help="Include ended leases (most recent first).")
    ] = False,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's (name or uid).")] = None,
    mode: Annotated[
        str | None, typer.Option("--mode", "-m", help="Only this mode (xpu, vxpu-half, ...).")
    ] = None,
    state: Annotated[
        str | None,
        typer.Option(
            "--state",
            "-s",
            help=f"Only leases in this state: {', '.join(STATES)} (ended ones imply --all).",
        ),
    ] = None,
    sort: Annotated[
        str | None,
        typer.Option(help=f"Sort by {', '.join(SORT_KEYS)}; a leading '-' reverses (e.g. -elapsed)."),
    ] = None,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Redraw at every change until Ctrl-C (as kubectl -w).")
    ] = False,
    usage: Annotated[
        bool,
        typer.Option(
            "--usage", help="Requested vs used per lease (right-sizing): cap, use, throttled, advice."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Active leases and queued requests, one row each (with --all also ended ones, with how their
    command ended: done, exit N, signal NAME)."""
    from xpu_cli.output import fail

    if state is not None and state not in STATES:
        fail(f"--state {state!r}: use one of {', '.join(STATES)}", 2)
    if sort is not None and sort.lstrip("-") not in SORT_KEYS:
        fail(f"--sort {sort!r}: use one of {', '.join(SORT_KEYS)} (a leading '-' reverses)", 2)
    uid = user_uid(user) if user is not None else None
    all_ = all_ or state not in (None, "running", "unheld", "queued", "active")
    filters = dict(mode=mode, state=state, uid=uid, sort=sort)
    from xpu_cli.session import client

    if usage:
        from xpu_cli.usage import show_usage

        with client() as c:
            return show_usage(c.lease_usage(), as_json)
    with client() as c:

        def draw(_update=None) -> None:
            reply = c.leases(all=all_)
            (print_json if as_json else print_table)(reply, time.time(), all_, **filters)

        if watch:
            from xpu_cli.watching import follow

            follow(c, draw)
        else:
            draw()


def show(
    what: Annotated[
        str,
        typer.Argument(help="A job id or name, a lease id (or a unique prefix), or a card index or UUID."),
    ],
    as_json: JsonOpt = False,
) -> None:
    """Everything about one lease (active or ended) or one card."""
    from xpu_cli import showing
    from xpu_cli.session import client

    with client() as c:
        showing.show(c, what, as_json)


def wait_cmd(
    lease_id: Annotated[str, typer.Argument(help="A job id or name, or a lease id (or a unique prefix).")],
    timeout: Annotated[
        float | None, typer.Option(help="Give up after this many seconds (exit 124).", min=0)
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Wait until a lease ends; exit as its command did (its exit status, 128 + n for signal n, 0 when
    not reported), as the shell's `wait` does."""
    from xpu_cli.jobs import wait_job
    from xpu_cli.session import client

    deadline = None if timeout is None else time.monotonic() + timeout
    with client() as c:
        try:
            job = c.job(lease_id)
        except (NotFound, BadRequest) as e:
            if "names" in str(e):  # a name several of your jobs have: they are listed, none guessed
                raise
            job = None
        if job is not None and job.kind != "attached":
            raise typer.Exit(wait_job(c, job.id, timeout, as_json))
        try:
            le = c.lease(job.lease_id if job is not None else lease_id)
        except NotFound:
            if job is not None:
                raise
            raise NotFound(f"no job {lease_id!r} and no lease of that id (see `xpu jobs --all`)") from None
        while le.state == "active" and (deadline is None or time.monotonic() < deadline):
            time.sleep(
                WAIT_POLL_S if deadline is None else min(WAIT_POLL_S, max(0.0, deadline - time.monotonic()))
            )
            le = c.lease(le.id)
        if le.state == "active":
            print(f"xpu: lease {le.id} is still active after {timeout:g} s", file=sys.stderr)
            raise typer.Exit(124)
    if as_json:
        output.print_json({**output.to_dict(le), "status": status(le)})
    else:
        print(f"lease {le.id} {status(le)} after {vocab.age(run_time(le, time.time()))}")
    code = exit_status(le)
    if code == 0 and le.state in ("evicted", "reclaimed"):
        print(f"xpu: lease {le.id} was {le.state}: {le.end_reason or 'no reason given'}", file=sys.stderr)
        code = 1
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    from xpu_cli.output import handled

    app.command()(handled(leases))
    app.command()(handled(show))
    app.command("wait")(handled(wait_cmd))
