"""`xpu top` (also `xpu-top`, ``main``): the live dashboard.

Textual is imported inside the command, never at module level: `xpu` and the daemon must work where the
`tui` extra is not installed (tests/test_tui_imports.py checks it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from xpud.api.client import Client, runtime_dir
from xpud.errors import XpudError


def _fail(message: str, code: int = 1):
    typer.echo(f"xpu top: {message}", err=True)
    raise typer.Exit(code)


def top(
    ctx: typer.Context,
    runtime: Annotated[
        str | None,
        typer.Option(
            "--runtime-dir",
            metavar="DIR",
            envvar="XPUD_RUNTIME_DIR",
            help="The daemon shown in the host view (its socket directory; default /run/xpud).",
        ),
    ] = None,
    host: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            metavar="[DOMAIN/][NAME=]DIR",
            help="A host for the cluster view: a local daemon's runtime dir, optionally named and placed "
            "in a network domain (e.g. rack-3/node-a=/run/xpud-a). Repeat for more hosts. Without it, a "
            "daemon with [cluster] configured feeds the cluster view from its federation.",
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", min=0.1, max=60.0, help="Refresh every this many seconds.")
    ] = 1.0,
    admin: Annotated[
        bool | None,
        typer.Option(
            "--admin/--no-admin",
            help="Connect to admin.sock so operator keys work (default: when you may write to it).",
        ),
    ] = None,
    demo: Annotated[bool, typer.Option("--demo", help="Show constructed data; no daemon needed.")] = False,
) -> None:
    """Live dashboard: cards by topology, leases and queue, events, cluster; operator actions."""
    try:
        from xpu_tui.app import XpuTop
        from xpu_tui.source import FederationHosts, HostSpec, LocalHosts
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "textual":
            raise
        _fail(
            "the dashboard needs Textual (an xpud dependency): reinstall xpud, or "
            "pip install 'textual>=8.2.8,<9'"
        )

    if demo:
        from xpu_tui import demo as data

        XpuTop(data.dgx_source(admin=True), data.cluster(), clock=data.now).run()
        return

    specs = [HostSpec.parse(h) for h in host or []]
    parent = ctx.parent.params.get("runtime_dir") if ctx.parent else None  # `xpu --runtime-dir X top`
    explicit = runtime or parent
    main_dir = runtime_dir(explicit) if explicit or not specs else specs[0].runtime_dir
    if specs and all(s.runtime_dir.resolve() != main_dir.resolve() for s in specs):
        specs.insert(0, HostSpec(main_dir))
    if admin is None:
        sock = Path(main_dir) / "admin.sock"
        admin = sock.exists() and os.access(sock, os.R_OK | os.W_OK)
    try:
        client = Client(main_dir, admin=admin)
        client.info()  # fail here, with the client's one-line reason, rather than inside the screen
    except XpudError as e:
        _fail(str(e))
    cluster = None
    if specs:
        cluster = LocalHosts(specs, interval, clock=time.time)
    else:
        try:
            if client.cluster().enabled:  # the daemon has peers: its federation view feeds the cluster tab
                cluster = FederationHosts(client, interval, clock=time.time)
        except XpudError:
            pass  # an older daemon without GetCluster: no cluster view, as before
    try:
        XpuTop(client, cluster, interval_s=interval).run()
    finally:
        client.close()


def register(app: typer.Typer) -> None:
    app.command("top")(top)


def main() -> None:
    """The ``xpu-top`` console script: the same command as ``xpu top``."""
    from xpu_cli.grammar import HELP_OPTIONS, plain_metavars

    app = typer.Typer(
        add_completion=False, rich_markup_mode=None, context_settings={"help_option_names": HELP_OPTIONS}
    )
    app.command()(top)
    command = typer.main.get_command(app)
    plain_metavars(command)
    command(prog_name="xpu-top")
