"""The command line's conventions, applied once to every `xpu` command (new commands get them too):

- global options (``--runtime-dir``) are accepted anywhere, as ``kubectl`` accepts ``-n``:
  ``xpu ls --runtime-dir D`` is ``xpu --runtime-dir D ls``;
- ``-h`` is ``--help``, everywhere;
- help shows plain metavars (``CARD``, ``SECONDS``, ``whole|sliced|auto``) instead of Typer's
  ``<str>``/``<int range>``.
"""

from __future__ import annotations

from typing import ClassVar

import typer
from typer.core import TyperGroup

# Options of the `xpu` group that may appear after the command, and whether each takes a value.
GLOBAL_OPTIONS = {"--runtime-dir": True}
HELP_OPTIONS = ["-h", "--help"]

# Metavars by parameter name where the upper-cased name would not say what to give.
METAVARS = {
    "wait": "SECONDS",
    "kill_grace": "SECONDS",
    "interval": "SECONDS",
    "gpus": "N",
    "history": "N",
    "priority": "N",
    "workers": "N",
    "runtime_dir": "DIR",
    "lease_id": "LEASE",
}


def hoist_globals(args: list[str], passthrough: dict[str, frozenset[str]]) -> list[str]:
    """``args`` with every global option (and its value) moved to the front, where the group parses
    it. Nothing after ``--`` moves, nor anything from the first word of a command a subcommand runs
    (``passthrough``: such a command's name -> its options that take a value, so that in
    ``xpu run -g 2 sleep --runtime-dir`` the ``2`` is known as -g's and ``sleep`` as the command)."""
    front: list[str] = []
    rest: list[str] = []
    i, command = 0, None
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        name, eq, _ = arg.partition("=")
        if name in GLOBAL_OPTIONS:
            takes = GLOBAL_OPTIONS[name]
            if takes and not eq and i + 1 < len(args):
                front += args[i : i + 2]
                i += 2
            else:
                front.append(arg)
                i += 1
            continue
        if arg[:1] != "-" and command is None:
            command = arg
        elif (
            command in passthrough and arg[:1] != "-" and (i == 0 or args[i - 1] not in passthrough[command])
        ):
            rest += args[i:]  # the command run by `xpu run` begins: none of its words are ours
            break
        rest.append(arg)
        i += 1
    return front + rest


def plain_metavars(command) -> None:
    """Give every parameter of ``command`` (and of its subcommands) a metavar a user reads as a word,
    and show arguments as click does (``CARD``, ``[XID]``, ``[COMMAND]...``), without a type after it."""
    for param in getattr(command, "params", []):
        if getattr(param, "is_flag", False) or param.name is None:
            continue
        param.metavar = param.metavar or METAVARS.get(param.name, param.name.upper())
        if param.param_type_name == "argument":
            usage = param.metavar if param.required else f"[{param.metavar}]"
            usage += "..." if param.nargs != 1 else ""
            param.display_type_rich = lambda ctx: None  # the metavar says it; "<str>" adds nothing
            param.get_usage_pieces = lambda ctx, usage=usage: [usage]
    for sub in getattr(command, "commands", {}).values():
        plain_metavars(sub)


class XpuGroup(TyperGroup):
    """The `xpu` group: conventions above. Typer builds it with every command already added."""

    passthrough: ClassVar[dict[str, frozenset[str]]] = {}

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("context_settings", {}).setdefault("help_option_names", HELP_OPTIONS)
        super().__init__(*args, **kwargs)
        plain_metavars(self)

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_globals(args, self.passthrough))


def version_option(value: bool) -> None:
    """``--version``: the installed package's version, then exit."""
    if value:
        from importlib.metadata import version

        typer.echo(f"xpu {version('xpud')}")
        raise typer.Exit()
