"""`xpu jobs`' work, without Typer (the fast path of ``xpu_cli.entry`` and the Typer command share it), and a
job's row as its --json prints it (docs/json.md, Job)."""

from __future__ import annotations

import functools
import pwd
import time

from xpu_cli import output, vocab

from xpud.errors import BadRequest

STATES = ("queued", "running", "completed", "failed", "cancelled", "timeout", "dependency-failed", "lost")


@functools.cache  # one lookup per uid, not per row
def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def row(j, now: float) -> dict:
    started = j.started if j.HasField("started") else None
    ended = j.ended if j.HasField("ended") else None
    return {
        "id": j.id,
        "name": j.name or None,
        "kind": j.kind,
        "user": user_name(j.uid),
        "owner_uid": j.uid,
        "state": j.state,
        "exit_code": j.exit_code if j.HasField("exit_code") else None,
        "exit_signal": j.exit_signal if j.HasField("exit_signal") else None,
        "hosts": list(j.hosts),
        "mode": j.mode or None,
        "gpus": j.gpus,
        "submitted": j.submitted,
        "started": started,
        "ended": ended,
        "elapsed_s": ((ended or now) - started) if started else None,
        "time_limit_s": j.time_limit_s or None,
        "after": list(j.after),
        "restartable": j.restartable,
        "restarts": j.restarts,
        "account": j.account or "default",
        "reason": j.reason or None,
        "command": j.command or None,
        "output": j.output or None,
        "ranks": [rank_row(x) for x in j.ranks],
    }


def rank_row(x) -> dict:
    """One rank of a submitted multi-host job (docs/json.md, JobRank)."""
    return {
        "rank": x.rank,
        "host": x.host,
        "state": x.state,
        "exit_code": x.exit_code if x.HasField("exit_code") else None,
        "exit_signal": x.exit_signal if x.HasField("exit_signal") else None,
        "reason": x.reason or None,
    }


def end_text(row: dict) -> str:
    if row["exit_signal"] is not None:
        return f"signal {row['exit_signal']}"
    if row["exit_code"] is not None:
        return f"exit {row['exit_code']}"
    return ""


def uid_of(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise BadRequest(f"--user {text!r}: no such user on this host; give a user name or a uid") from None


def list_jobs(c, all_: bool = False, user: str | None = None, state: str | None = None,
              since: str | None = None, as_json: bool = False) -> None:  # fmt: skip
    """Print the jobs (a table, or ``{"jobs", "omitted"}``) through the client ``c``."""
    from xpu_cli.runopts import parse_duration

    if state is not None and state not in STATES:
        raise BadRequest(f"--state {state!r}: use one of {', '.join(STATES)}")
    fields: dict = {"all": all_ or state is not None or since is not None, "state": state or ""}
    if user is not None:
        fields["uid"] = uid_of(user)
    if since is not None:
        try:
            fields["since"] = max(time.time() - parse_duration(since), 0.0)
        except ValueError as e:
            raise BadRequest(f"--since {e}") from None
    reply = c.jobs(**fields)
    now = time.time()
    rows = [row(j, now) for j in reply.jobs]
    if as_json:
        output.print_json({"jobs": rows, "omitted": reply.omitted})
        return
    table = [
        [
            r["id"],
            r["name"] or "-",
            r["user"],
            r["state"],
            vocab.age(r["elapsed_s"]) if r["elapsed_s"] is not None else "-",
            ",".join(r["hosts"]) or "-",
            end_text(r) or r["reason"] or "",
        ]
        for r in rows
    ]
    output.table(["JOBID", "NAME", "USER", "STATE", "TIME", "HOSTS", "END/REASON"], table)
    if reply.omitted:
        output.note(f"{reply.omitted} more not shown")
