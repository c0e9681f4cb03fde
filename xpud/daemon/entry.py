"""The ``xpud`` entry point: the plain ``xpud [--OPTION VALUE ...]`` that a service (or a test) runs goes
straight to ``xpud.daemon.serve``; everything else (subcommands, --help, --version, an option it is not
sure of) goes to the Typer app in ``xpud.daemon.cli``, which parses it again and answers as usual.

Typer (with pydantic behind it) and its per-parameter checks cost ~0.4 s of CPU at each start, the main
part of what a daemon spends before it serves. The options here are the Typer callback's
(``tests/test_daemon_entry.py`` checks both parse the same command lines alike).
"""

from __future__ import annotations

import sys

# long option -> (parameter, kind); kinds: "str" (a value), "int", "flag"
OPTIONS = {
    "--config": ("config_path", "str"),
    "-c": ("config_path", "str"),
    "--simulate": ("simulate", "str"),
    "--runtime-dir": ("runtime_dir", "str"),
    "--state-dir": ("state_dir", "str"),
    "--seed": ("seed", "int"),
    "--sim-state": ("sim_state", "str"),
    "--log-level": ("log_level", "str"),
    "--kubelet": ("kubelet", "flag"),
}


def parse(args: list[str]) -> dict | None:
    """The serve options in ``args``, or None when Typer should read them (anything else, a repeated
    option, a value that looks like an option or is not what the option takes)."""
    out: dict = {}
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        spec = OPTIONS.get(name)
        if spec is None:
            return None
        param, kind = spec
        if param in out:
            return None
        if kind == "flag":
            if eq:
                return None
            out[param] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args):
                return None
            value = args[i + 1]
            i += 1
        i += 1
        if not value or value.startswith("-"):
            return None
        if kind == "int":
            if not (value.isascii() and value.isdigit()):
                return None
            value = int(value)
        out[param] = value
    return out


def main() -> None:
    opts = parse(sys.argv[1:])
    if opts is None:
        from xpud.daemon.cli import main as typer_main

        typer_main()
        return
    from xpud.daemon import serve

    config_path = opts.pop("config_path", None)
    cfg, overrides = serve.load(config_path, **opts)
    serve.run(cfg, overrides)
