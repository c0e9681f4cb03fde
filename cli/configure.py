"""`xpu config show|get|set`: read and edit xpud.toml, then ask the daemon to reload (SIGHUP).

The file is the one the running daemon reads (``xpu info``'s config_path: its socket is in the runtime
directory, ``--runtime-dir`` or ``$XPUD_RUNTIME_DIR``); with no daemon answering, ``$XPUD_CONFIG`` or
/etc/xpud/xpud.toml; ``--config`` names another.

``set`` parses VALUE as a TOML value (``30``, ``0.5``, ``true``, ``[1, 2]``; anything else is a string),
sets it in the file's text in place (``xpud.config.write``: comments, order and ``[[windows]]`` stay; the keys
the file did not give stay defaults), validates the whole new file with the daemon's own checks before
writing anything, keeps the old file as ``xpud.toml.bak``, replaces the file atomically, signals the daemon
named by ``xpud.pid`` in the runtime directory (what ``systemctl reload xpud`` does), and says when the key
needs a restart instead (``xpud.config.live``: the running value stays until then).
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

import typer
from xpu_cli.output import handled

from xpud import config
from xpud.api.client import Client
from xpud.api.client import runtime_dir as resolve_runtime
from xpud.config import live
from xpud.config import write as configedit
from xpud.errors import BadRequest, ConfigError, XpudError

config_app = typer.Typer(no_args_is_help=True, help="Show and change xpud.toml; the daemon reloads it.")


def register(app: typer.Typer) -> None:
    """Add the ``config`` group to the ``xpu`` application."""
    app.add_typer(config_app, name="config")


ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        "-c",
        help="The file (default: the one the running xpud reads, as `xpu info` shows; with no xpud "
        "answering, $XPUD_CONFIG or /etc/xpud/xpud.toml).",
    ),
]


def _runtime() -> str | None:
    """``xpu --runtime-dir`` (accepted after the command too: ``xpu_cli.grammar`` moves it to the group)."""
    from xpu_cli.session import state

    return state.runtime_dir


def running_config(runtime: str | None) -> str | None:
    """The config file of the daemon whose socket is in ``runtime`` (its ``info``, absolute), "" where it
    runs on defaults, None where no daemon answers there."""
    directory = resolve_runtime(runtime)
    if not (directory / "xpud.sock").exists():
        return None
    try:
        with Client(directory, timeout=5.0) as c:
            path = c.info().config_path
    except XpudError:
        return None
    return path and str(Path(path).absolute())


def target(given: str | None, runtime: str | None) -> tuple[Path | None, str | None]:
    """The file to read or edit and the running daemon's own (as ``running_config``): ``--config``, else the
    daemon's file, else ``$XPUD_CONFIG`` or the default path. The first is None where the daemon runs on
    defaults and no file was named."""
    running = running_config(runtime)
    if given:
        return Path(given), running
    if running is not None:
        return (Path(running) if running else None), running
    return Path(os.environ.get("XPUD_CONFIG") or config.DEFAULT_PATH), None


def load_running(given: str | None, runtime: str | None) -> config.Config:
    """The configuration ``target`` names: the running daemon's file (its defaults where it has none)."""
    path, running = target(given, runtime)
    if given or running:
        return config.load(path)
    if running == "":
        return config.load(environ={})  # the daemon runs on defaults: that is its configuration
    return config.load()  # no daemon answers: $XPUD_CONFIG, or /etc/xpud/xpud.toml where it exists


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


def restart_note(old_text: str, new_text: str, path: Path) -> str | None:
    """A line naming the changed keys that apply only at a restart (``xpud.config.live.merge``), or None."""
    try:
        old = config.parse(old_text, str(path))
    except XpudError:
        return None  # the old file did not load: the daemon runs on what it had; its reload says the rest
    _, _, restart = live.merge(old, config.parse(new_text, str(path)))
    if not restart:
        return None
    return (
        f"{', '.join(restart)} needs a restart to apply (`systemctl restart xpud`); a reload keeps the "
        "running value"
    )


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
    return f"asked xpud (pid {pid}) to reload; its log (and `xpu events`) says what it changed"


@config_app.command("show")
@handled
def show(
    config_path: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of TOML.")] = False,
) -> None:
    """The effective configuration: the file's values over the defaults (every key)."""
    cfg = load_running(config_path, _runtime())
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
    value = _walk(config.to_dict(load_running(config_path, _runtime())), key)
    typer.echo(json.dumps(value) if as_json or not isinstance(value, str) else value)


@config_app.command("set", context_settings={"ignore_unknown_options": True})
@handled
def set_(
    key: Annotated[str, typer.Argument(help="section.key, e.g. bursts.hold_s")],
    value: Annotated[str, typer.Argument(help="A TOML value: 30, 0.5, true, [1, 2] or text.")],
    config_path: ConfigOpt = None,
    no_reload: Annotated[bool, typer.Option("--no-reload", help="Write the file; signal nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was done as JSON.")] = False,
) -> None:
    """Set one key in the file (validated whole first, old file kept as .bak), then reload the daemon."""
    runtime = _runtime()
    path, running = target(config_path, runtime)
    if path is None:  # the daemon runs on defaults: the file it would read at its next start
        path = Path(os.environ.get("XPUD_CONFIG") or config.DEFAULT_PATH)
    try:
        text = config.read_text(path)
    except FileNotFoundError:
        text = ""
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}{_HOW}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}; fix it by hand first") from None
    parsed = parse_value(value)
    wanted = edited(raw, key, parsed)
    *table, name = key.split(".")
    new_text = configedit.set_key(text, table, name, parsed, wanted)
    if new_text is None:
        raise ConfigError(
            f"{path}: [{'.'.join(table)}] is written in a form `xpu config set` does not edit in place "
            f"(dotted keys, an inline table or a value over several lines): set {name} there by hand"
        )
    config.parse(new_text, str(path))  # the whole new file, as the daemon will read it
    backup = path.with_name(path.name + ".bak")
    _write(path, new_text, backup)
    restart = restart_note(text, new_text, path)
    if no_reload:
        said = "not signalled (--no-reload)"
    elif running == "":
        said = (
            f"the running xpud reads no config file (it runs on defaults): it reads {path} at its next "
            "start if started without --config (`systemctl restart xpud`)"
        )
        restart = None
    elif running is not None and running != str(path.absolute()):
        said = f"the running xpud reads {running}, not {path}: not signalled"
        restart = None
    else:
        said = signal_daemon(resolve_runtime(runtime))
    new_value = _walk(config.to_dict(config.parse(new_text, str(path))), key)
    if as_json:
        record = {"file": str(path), "backup": str(backup), "key": key, "value": new_value, "reload": said}
        typer.echo(json.dumps(record | {"restart": restart}))
        return
    typer.echo(f"{path}: {key} = {json.dumps(new_value)} (old file: {backup})")
    typer.echo(said)
    if restart:
        typer.echo(restart)


_HOW = "; run it as root (sudo xpu config set ...), or give --config a file you may write"


def _write(path: Path, text: str, backup: Path) -> None:
    """``text`` into ``path`` atomically (a temporary file renamed over it, with the old file's mode), the old
    file copied to ``backup`` first; a file system's refusal is one line."""
    if not path.parent.is_dir():
        raise ConfigError(
            f"{path}: cannot write: no directory {path.parent}; create it (mkdir -p {path.parent}) or give "
            "--config another file"
        )
    tmp = None
    try:
        if path.exists():
            shutil.copy2(path, backup)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        where = e.filename or path
        raise ConfigError(f"{where}: cannot write: {e.strerror}{_HOW}") from None
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
