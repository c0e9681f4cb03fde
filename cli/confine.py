"""`xpu confine -- COMMAND`: run COMMAND in its lease's device scope (README "Isolation"), for work that
`xpu run` does not start itself: the launcher behind `xpu run --json-env`, whose processes are not the
wrapper's children.

The lease is the environment's (``XPU_LEASE_ID``, ``XPU_LEASE_TOKEN``: both in `--json-env`'s ``env``).
This process asks the daemon to put it in the scope (``Node.Confine``: the daemon moves the process it
read at the credential handshake, this one), then execs COMMAND in its place: COMMAND and all it starts
inherit the scope. The token is not passed on. Where the daemon cannot enforce isolation it says why (one
line, as `xpu run`) and COMMAND runs anyway; where it should and fails, COMMAND is not run (exit 126).
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

TOKEN_VAR = "XPU_LEASE_TOKEN"


def confine(
    command: Annotated[
        list[str] | None,
        typer.Argument(help="The command and its arguments (after --).", show_default=False),
    ] = None,
) -> None:
    """Run a command in the device scope of the lease named by XPU_LEASE_ID and XPU_LEASE_TOKEN (the
    environment `xpu run --json-env` prints): it can open only the lease's device nodes."""
    from xpu_cli.output import fail
    from xpu_cli.session import client

    from xpud.errors import XpudError

    if not command:
        fail("no command given: xpu confine -- COMMAND [ARGS...]", 2)
    lease_id, token = os.environ.get("XPU_LEASE_ID", ""), os.environ.get(TOKEN_VAR, "")
    if not lease_id or not token:
        fail(
            f"xpu confine: XPU_LEASE_ID and {TOKEN_VAR} are not both set: run it with the env of "
            "`xpu run --json-env`'s line",
            2,
        )
    try:
        with client() as c:
            reply = c.confine(lease_id, token)
    except XpudError as e:
        fail(f"not starting the command: {e}", 126)
    if not reply.enforced and reply.warn:
        print(f"xpu: device isolation is {reply.isolation}: the command can open any card's device node",
              file=sys.stderr, flush=True)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        fail(f"{command[0]}: {e.strerror}", 127 if isinstance(e, FileNotFoundError) else 126)


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(confine)
