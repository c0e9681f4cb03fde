"""``xpud install-service`` and ``xpud uninstall-service``: from an installed package to a running unit.

``install`` writes, under a root (``/``, or an image's or a test's directory):

- ``/etc/systemd/system/xpud.service``: the shipped unit with ``ExecStart`` naming the xpud actually
  installed (venv, pipx or system);
- ``/etc/sysusers.d/xpud.conf``: the admin group (``[daemon] admin_group``), made by systemd-sysusers;
- ``/etc/xpud/xpud.toml``: the documented default config, only when there is none; an edited config is
  never overwritten (the keys this version adds are shown instead);
- the ``multi-user.target.wants`` link (what ``systemctl enable`` makes), unless ``--no-start``;
- ``/var/lib/xpud/install-manifest.json``: what it wrote, with hashes.

No tmpfiles.d entry: the unit's ``RuntimeDirectory=`` and ``StateDirectory=`` make /run/xpud and
/var/lib/xpud. On the live system (root ``/`` with systemd running) it then creates the group, reloads
systemd and runs ``systemctl enable --now xpud.service``. Running it again changes nothing.

``uninstall`` removes what the manifest lists and is unchanged since, and the directories it made if
they are empty; an edited file stays, and the report says so. The ledger and the admin group stay.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xpud import config
from xpud.errors import XpudError

UNIT = "etc/systemd/system/xpud.service"
WANTS = "etc/systemd/system/multi-user.target.wants/xpud.service"
SYSUSERS = "etc/sysusers.d/xpud.conf"
CONFIG = "etc/xpud/xpud.toml"
MANIFEST = "var/lib/xpud/install-manifest.json"
TEMPLATE_EXEC = "/usr/local/bin/xpud"  # the ExecStart path in the shipped unit
_SAFE_PATH = re.compile(r"/[A-Za-z0-9._+@/-]*")  # no quoting needed in a unit file (no space, no %)


class InstallError(XpudError):
    """Why install-service or uninstall-service cannot go on, as one line."""


@dataclass
class Report:
    """What was done, one line per path, and the commands run."""

    lines: list[str] = field(default_factory=list)
    changed: bool = False

    def add(self, line: str, changed: bool = False) -> None:
        self.lines.append(line)
        self.changed |= changed


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _template(package: str, name: str) -> str:
    return (importlib.resources.files(package) / name).read_text()


def _under(root: Path, rel: str) -> Path:
    return root / rel.lstrip("/")


def systemd_running(root: Path) -> bool:
    """Whether to talk to systemd: the live system (root /) booted with systemd (sd_booted)."""
    return root.resolve() == Path("/") and Path("/run/systemd/system").is_dir()


def find_xpud(root: Path, prefix: str | None = None) -> tuple[str, list[str]]:
    """The xpud executable the unit should run, as a path on the target, and notes for the operator.

    ``prefix``: the installation prefix on the target (``PREFIX/bin/xpud``). Without it: the xpud command
    running now, else the one in this Python's scripts directory (a venv's or pipx's bin/, /usr/local/bin)."""
    notes: list[str] = []
    if prefix:
        path = str(Path("/") / prefix / "bin" / "xpud")
        if not os.access(_under(root, path), os.X_OK):
            raise InstallError(
                f"--prefix {prefix}: no executable {_under(root, path)}; install the package there first "
                "(pip install --prefix, or a venv at that path)"
            )
    else:
        candidates = [Path(sys.argv[0])] if Path(sys.argv[0]).name == "xpud" else []  # the xpud running
        candidates += [Path(sysconfig.get_path("scripts")) / "xpud", Path(sys.executable).parent / "xpud"]
        found = shutil.which("xpud")
        candidates += [Path(found)] if found else []
        path = next((str(c.absolute()) for c in candidates if os.access(c, os.X_OK) and c.is_file()), "")
        if not path:
            raise InstallError("cannot find the installed xpud executable; pass --prefix DIR (DIR/bin/xpud)")
        r = str(root.absolute())
        if r != "/" and path.startswith(r + "/"):
            path = path[len(r) :]  # installed into the image: the path as the image sees it
        elif r != "/":
            notes.append(f"ExecStart runs {path}, which is not under {root}: the target must have it there")
    if not _SAFE_PATH.fullmatch(path):
        raise InstallError(f"{path}: a path with spaces or '%' cannot go into ExecStart; reinstall elsewhere")
    return path, notes


def render_unit(template: str, xpud: str) -> str:
    """The shipped unit with ExecStart running ``xpud``."""
    text, n = re.subn(r"(?m)^ExecStart=\S+", f"ExecStart={xpud}", template)
    if n != 1:
        raise InstallError("the shipped xpud.service has no single ExecStart= line; reinstall the package")
    return text


def render_sysusers(template: str, group: str) -> str:
    """The shipped sysusers.d entry for ``group``."""
    return re.sub(r"(?m)^g \S+ ", f"g {group} ", template)


def _config_keys(text: str) -> set[str]:
    """``section.key`` for every key a config file sets (slice sizes as ``slices.NAME``)."""
    data = tomllib.loads(text)
    keys = set()
    for section, table in data.items():
        if isinstance(table, dict):
            keys |= {f"{section}.{k}" for k in table}
    return keys


def documented_keys() -> dict[str, tuple[object, str]]:
    """``section.key`` -> (default, doc) for every key this version knows."""
    return {f"{s}.{k}": v for s, keys in config.documented_keys().items() for k, v in keys.items()}


@dataclass
class Manifest:
    """What install-service wrote, relative to the root: files with their hashes, links, the directories it
    made, and the config keys this version documented when it wrote the config."""

    files: dict[str, str] = field(default_factory=dict)  # path -> sha256
    links: dict[str, str] = field(default_factory=dict)  # path -> target
    dirs: list[str] = field(default_factory=list)  # in the order made
    config_keys: list[str] = field(default_factory=list)
    exec_start: str = ""

    @classmethod
    def load(cls, path: Path) -> Manifest | None:
        try:
            data = json.loads(path.read_text())
            return cls(
                files=dict(data["files"]),
                links=dict(data["links"]),
                dirs=list(data["dirs"]),
                config_keys=list(data["config_keys"]),
                exec_start=str(data["exec_start"]),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InstallError(
                f"{path}: unreadable install manifest ({e}); remove it and install again"
            ) from None

    def dumps(self) -> str:
        data = {
            "written_by": "xpud install-service",
            "exec_start": self.exec_start,
            "files": dict(sorted(self.files.items())),
            "links": dict(sorted(self.links.items())),
            "dirs": self.dirs,
            "config_keys": sorted(self.config_keys),
        }
        return json.dumps(data, indent=2) + "\n"


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Write atomically: a temporary file beside it, fsync, rename."""
    tmp = path.with_name(f".{path.name}.xpud-tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _mkdirs(root: Path, rel_dir: str, made: list[str], mode: int = 0o755) -> None:
    """Make ``rel_dir`` (with ``mode``) and its missing parents under root, recording the ones made."""
    missing = []
    d = Path(rel_dir)
    while str(d) not in (".", "/") and not _under(root, str(d)).exists():
        missing.append(str(d))
        d = d.parent
    for rel in reversed(missing):
        _under(root, rel).mkdir(mode=mode if rel == rel_dir else 0o755)
        if rel not in made:
            made.append(rel)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)


def _checked(run: Runner, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return run(argv)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InstallError(f"`{' '.join(argv)}` could not run: {e}") from None


def install(
    root: Path = Path("/"),
    prefix: str | None = None,
    start: bool = True,
    run: Runner = _run,
    live: bool | None = None,
) -> Report:
    """Install the service under ``root`` (see the module docstring). Raises InstallError before writing
    anything when a file in the way is not ours. ``live``: talk to systemd (default: root is / and systemd
    runs)."""
    root = Path(root)
    if not root.is_dir():
        raise InstallError(f"--root {root}: no such directory; make it (an image's root) first")
    live = systemd_running(root) if live is None else live
    report = Report()
    xpud, notes = find_xpud(root, prefix)
    manifest_path = _under(root, MANIFEST)
    old = Manifest.load(manifest_path) or Manifest()
    new = Manifest(dirs=list(old.dirs), exec_start=xpud)

    # The config first: the admin group comes from it.
    cfg_path = _under(root, CONFIG)
    cfg_template = _template("xpud.etc", "xpud.toml")
    cfg_text = _read(cfg_path)
    if cfg_text is not None:
        try:
            cfg = config.parse(cfg_text.decode(), str(cfg_path))
        except (XpudError, UnicodeDecodeError) as e:
            raise InstallError(f"{e}; fix the config, then run install-service again") from None
    else:
        cfg = config.Config()
    unit = render_unit(_template("xpud.systemd", "xpud.service"), xpud)
    sysusers = render_sysusers(_template("xpud.systemd", "xpud-sysusers.conf"), cfg.daemon.admin_group)

    for rel, text in ((UNIT, unit), (SYSUSERS, sysusers)):
        _refuse_foreign(root, rel, text, old)
    wants = _under(root, WANTS)
    ours = wants.is_symlink() and os.readlink(wants) == "/" + UNIT
    if start and (wants.exists() or wants.is_symlink()) and not ours:
        raise InstallError(f"{wants}: exists and is not a link to /{UNIT}; remove it and run again")
    try:
        for rel, text in ((UNIT, unit), (SYSUSERS, sysusers)):
            _put(root, rel, text, old, new, report)
        _put_config(root, cfg_path, cfg_text, cfg_template, old, new, report)
        if start:
            _link(root, WANTS, "/" + UNIT, old, new, report)
        elif WANTS in old.links:
            new.links[WANTS] = old.links[WANTS]  # made by an earlier install: uninstall still removes it
        _mkdirs(root, str(Path(MANIFEST).parent), new.dirs, mode=0o700)  # the unit's StateDirectoryMode
        text = new.dumps()
        if _read(manifest_path) != text.encode():
            _write(manifest_path, text)
            report.add(f"wrote    /{MANIFEST}", changed=True)
    except PermissionError as e:
        raise InstallError(f"{e.filename}: permission denied; run as root, or give --root DIR") from None
    for note in notes:
        report.add(f"note:    {note}")
    if live:
        commands = [["systemd-sysusers", str(_under(root, SYSUSERS))], ["systemctl", "daemon-reload"]]
        if start:
            commands.append(["systemctl", "enable", "--now", "xpud.service"])
        for argv in commands:
            done = _checked(run, argv)
            if done.returncode != 0:
                said = (done.stderr or done.stdout).strip().replace("\n", "; ")
                raise InstallError(f"`{' '.join(argv)}` failed (status {done.returncode}): {said}")
            report.add(f"ran      {' '.join(argv)}")
        if report.changed and start and old.files:  # an upgrade: the running daemon has the old ones
            report.add(
                "note:    the unit or config changed: `systemctl restart xpud` applies it (leases stay)"
            )
    elif root.resolve() == Path("/"):  # e.g. a container image being built
        report.add("note:    systemd is not running: nothing was started (the unit starts at the next boot)")
    return report


def _refuse_foreign(root: Path, rel: str, text: str, old: Manifest) -> None:
    """Raise when ``rel`` exists, differs from ``text`` and is not the copy we wrote (a hand-made unit)."""
    path = _under(root, rel)
    current = _read(path)
    if current is not None and current != text.encode() and old.files.get(rel) != sha256(current):
        raise InstallError(
            f"{path}: exists and is not the copy install-service wrote; move it away (or merge your changes "
            "into a drop-in, /etc/systemd/system/xpud.service.d/*.conf) and run install-service again"
        )


def _put(root: Path, rel: str, text: str, old: Manifest, new: Manifest, report: Report) -> None:
    """Write a file we own (unit, sysusers entry); _refuse_foreign has checked it is ours or absent."""
    path = _under(root, rel)
    current = _read(path)
    digest = sha256(text.encode())
    if current == text.encode():
        new.files[rel] = digest
        report.add(f"same     /{rel}")
        return
    _mkdirs(root, str(Path(rel).parent), new.dirs)
    _write(path, text)
    new.files[rel] = digest
    report.add(f"{'updated' if current is not None else 'wrote':<8} /{rel}", changed=True)


def _put_config(
    root: Path, path: Path, current: bytes | None, template: str, old: Manifest, new: Manifest, report: Report
) -> None:
    """Write the default config when there is none, or refresh our unedited copy; never touch an edited
    one."""
    rel = CONFIG
    keys = sorted(documented_keys())
    if current is None or (old.files.get(rel) == sha256(current) and current != template.encode()):
        _mkdirs(root, str(Path(rel).parent), new.dirs)
        _write(path, template)
        new.files[rel], new.config_keys = sha256(template.encode()), keys
        report.add(f"{'updated' if current is not None else 'wrote':<8} /{rel}", changed=True)
        return
    if old.files.get(rel) == sha256(current):  # ours, unedited and current
        new.files[rel], new.config_keys = old.files[rel], keys
        report.add(f"same     /{rel}")
        return
    # Edited by the operator (or not ours): keep it, and show what this version adds.
    if rel in old.files:
        new.files[rel] = old.files[rel]  # uninstall sees it edited and keeps it
    known = set(old.config_keys) | _config_keys(current.decode(errors="replace"))
    added = [k for k in keys if k not in known]
    new.config_keys = keys  # shown once: the next run shows only what a later version adds
    why = "edited" if rel in old.files else "not written by install-service"
    report.add(f"kept     /{rel} ({why}: never overwritten)")
    if added:
        docs = documented_keys()
        what = "keys this version adds" if old.config_keys else "keys the file does not set"
        report.add(f"         {what} (their defaults apply until set):")
        for k in added:
            section, key = k.split(".", 1)
            default, doc = docs[k]
            report.add(f"         + [{section}] {key} = {json.dumps(default)}  # {doc}")


def _link(root: Path, rel: str, target: str, old: Manifest, new: Manifest, report: Report) -> None:
    path = _under(root, rel)
    if path.is_symlink() and os.readlink(path) == target:
        if rel in old.links:
            new.links[rel] = target  # ours; a link systemctl made stays systemctl's
        report.add(f"same     /{rel} -> {target}")
        return
    _mkdirs(root, str(Path(rel).parent), new.dirs)
    path.symlink_to(target)
    new.links[rel] = target
    report.add(f"linked   /{rel} -> {target}", changed=True)


def uninstall(root: Path = Path("/"), run: Runner = _run, live: bool | None = None) -> Report:
    """Remove what install-service wrote and is unchanged since; keep and name what was edited."""
    root = Path(root)
    live = systemd_running(root) if live is None else live
    report = Report()
    manifest_path = _under(root, MANIFEST)
    m = Manifest.load(manifest_path)
    if m is None:
        raise InstallError(f"{manifest_path}: no install manifest: install-service did not install here")
    if live:
        for argv in (["systemctl", "disable", "--now", "xpud.service"],):
            done = _checked(run, argv)
            report.add(f"ran      {' '.join(argv)} (status {done.returncode})")
    try:
        for rel, target in m.links.items():
            path = _under(root, rel)
            if path.is_symlink() and os.readlink(path) == target:
                path.unlink()
                report.add(f"removed  /{rel}", changed=True)
        for rel, digest in m.files.items():
            path = _under(root, rel)
            current = _read(path)
            if current is None:
                report.add(f"gone     /{rel} (already removed)")
            elif sha256(current) == digest:
                path.unlink()
                report.add(f"removed  /{rel}", changed=True)
            else:
                report.add(f"kept     /{rel} (edited since install-service wrote it)")
        manifest_path.unlink()
        report.add(f"removed  /{MANIFEST}", changed=True)
        for rel in reversed(m.dirs):
            with contextlib.suppress(FileNotFoundError, OSError):
                _under(root, rel).rmdir()  # only if empty: a ledger or an operator's file keeps it
                report.add(f"removed  /{rel}/", changed=True)
    except PermissionError as e:
        raise InstallError(f"{e.filename}: permission denied; run as root, or give --root DIR") from None
    if live:
        done = _checked(run, ["systemctl", "daemon-reload"])
        report.add(f"ran      systemctl daemon-reload (status {done.returncode})")
    report.add(
        "note:    kept the ledger (/var/lib/xpud) and the admin group: remove them by hand if unwanted"
    )
    return report
