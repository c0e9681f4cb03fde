"""`xpu config show|get|set`: read and edit xpud.toml, then ask the daemon to reload (SIGHUP).

``set`` parses VALUE as a TOML value (``30``, ``0.5``, ``true``, ``[1, 2]``; anything else is a string),
writes it into the file's own tables (the keys the file did not give stay defaults), validates the whole
new file with the daemon's own checks before writing anything, keeps the old file as ``xpud.toml.bak``,
replaces the file atomically, and signals the daemon named by ``xpud.pid`` in the runtime directory (what
``systemctl reload xpud`` does). tomli-w writes the file: comments are not kept (the backup has them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import tomllib
from pathlib import Path
from typing import Annotated, Any

import tomli_w
import typer
from xpu_cli.output import handled

from xpud import config
from xpud.api.client import runtime_dir as resolve_runtime
from xpud.errors import BadRequest, ConfigError

config_app = typer.Typer(no_args_is_help=True, help="Show and change xpud.toml; the daemon reloads it.")


def register(app: typer.Typer) -> None:
    """Add the ``config`` group to the ``xpu`` application."""
    app.add_typer(config_app, name="config")


ConfigOpt = Annotated[
    str | None,
    typer.Option("--config", "-c", help="The file (default $XPUD_CONFIG or /etc/xpud/xpud.toml)."),
]


def _path(given: str | None) -> Path:
    return Path(given or os.environ.get("XPUD_CONFIG") or config.DEFAULT_PATH)


def _walk(data: dict, key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise BadRequest(f"no key {key!r}: give section.key, e.g. bursts.hold_s (see `xpu config show`)")
        node = node[part]
    return node


def parse_value(text: str) -> Any:
    """VALUE as TOML (number, boolean, array, quoted string), else the text itself as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def edited(raw: dict, key: str, value: Any) -> dict:
    """``raw`` (the file's tables) with ``key`` (section.key or slices.NAME.key) set to ``value``."""
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise BadRequest(f"{key!r}: give section.key, e.g. bursts.hold_s")
    if parts[0] == "windows":
        raise BadRequest(
            "[[windows]] is a list of tables: edit the file for it, then `systemctl reload xpud`"
        )
    out = json.loads(json.dumps(raw))  # a deep copy of plain TOML data
    node = out
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise BadRequest(f"{key!r}: {part!r} is not a table")
    node[parts[-1]] = value
    return out


def signal_daemon(runtime_dir: Path) -> str:
    """SIGHUP to the daemon named by ``xpud.pid``; returns what happened, as a line for the user."""
    pid_file = runtime_dir / "xpud.pid"
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return f"no running xpud found ({pid_file}): the change applies at its next start"
    if b"xpud" not in cmdline:
        return f"{pid_file} names pid {pid}, which is not xpud: not signalled; `systemctl reload xpud`"
    try:
        os.kill(pid, signal.SIGHUP)
    except PermissionError:
        return f"cannot signal xpud (pid {pid}): run as root, or `sudo systemctl reload xpud`"
    except ProcessLookupError:
        return "xpud is not running: the change applies at its next start"
    return (
        f"asked xpud (pid {pid}) to reload; its log (and `xpu top`'s events) says what changed and what "
        "needs a restart"
    )


@config_app.command("show")
@handled
def show(
    config_path: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of TOML.")] = False,
) -> None:
    """The effective configuration: the file's values over the defaults (every key)."""
    cfg = config.load(config_path)
    data = config.to_dict(cfg)
    typer.echo(json.dumps(data, indent=2) if as_json else config.dumps(cfg).rstrip())


@config_app.command("get")
@handled
def get(
    key: Annotated[str, typer.Argument(help="section.key, e.g. bursts.hold_s")],
    config_path: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the value as JSON.")] = False,
) -> None:
    """One key's effective value."""
    value = _walk(config.to_dict(config.load(config_path)), key)
    typer.echo(json.dumps(value) if as_json or not isinstance(value, str) else value)


@config_app.command("set", context_settings={"ignore_unknown_options": True})
@handled
def set_(
    key: Annotated[str, typer.Argument(help="section.key, e.g. bursts.hold_s")],
    value: Annotated[str, typer.Argument(help="A TOML value: 30, 0.5, true, [1, 2] or text.")],
    config_path: ConfigOpt = None,
    runtime_dir: Annotated[
        str | None, typer.Option(envvar="XPUD_RUNTIME_DIR", help="Where the daemon's xpud.pid is.")
    ] = None,
    no_reload: Annotated[bool, typer.Option("--no-reload", help="Write the file; signal nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was done as JSON.")] = False,
) -> None:
    """Set one key in the file (validated whole first, old file kept as .bak), then reload the daemon."""
    path = _path(config_path)
    try:
        text = config.read_text(path)
    except FileNotFoundError:
        text = ""
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}; fix it by hand first") from None
    new_text = tomli_w.dumps(edited(raw, key, parse_value(value)))
    config.parse(new_text, str(path))  # the whole new file, as the daemon will read it
    backup = path.with_name(path.name + ".bak")
    if path.exists():
        shutil.copy2(path, backup)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new_text)
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    said = "not signalled (--no-reload)" if no_reload else signal_daemon(resolve_runtime(runtime_dir))
    new_value = _walk(config.to_dict(config.parse(new_text, str(path))), key)
    if as_json:
        typer.echo(
            json.dumps(
                {"file": str(path), "backup": str(backup), "key": key, "value": new_value, "reload": said}
            )
        )
        return
    typer.echo(f"{path}: {key} = {json.dumps(new_value)} (old file: {backup})")
    typer.echo(said)
