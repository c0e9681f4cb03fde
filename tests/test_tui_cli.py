"""`xpu top` and `xpu-top` on the command line: options, the wiring to the app, and failures as one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("textual")

from typer.testing import CliRunner
from xpu_cli.main import app as xpu_app
from xpu_tui.app import XpuTop
from xpu_tui.source import LocalHosts

from tests.daemons import InProcDaemon
from tests.test_tui_pilot import HOLDERLESS

BIN = Path(sys.executable).parent


@pytest.fixture
def launched(monkeypatch):
    """Run the command but, instead of taking over the terminal, keep the app it built."""
    apps: list[XpuTop] = []
    monkeypatch.setattr(XpuTop, "run", lambda self, *a, **kw: apps.append(self))
    return apps


def test_xpu_top_help_lists_its_options():
    r = subprocess.run([str(BIN / "xpu"), "top", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for option in ("--runtime-dir", "--host", "--interval", "--admin", "--demo"):
        assert option in r.stdout
    r = subprocess.run([str(BIN / "xpu-top"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--host" in r.stdout


def test_no_daemon_is_one_line_and_exit_1(short_tmp):
    r = CliRunner().invoke(xpu_app, ["top", "--runtime-dir", str(short_tmp)])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xpu top: cannot reach xpud")


def test_bad_interval_is_a_usage_error():
    r = CliRunner().invoke(xpu_app, ["top", "--interval", "0"])
    assert r.exit_code == 2


def test_wiring_admin_auto_hosts_and_interval(short_tmp, launched):
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    a = InProcDaemon(short_tmp / "a", "workstation-2x", HOLDERLESS)
    b = InProcDaemon(short_tmp / "b", "workstation-2x", HOLDERLESS)
    try:
        r = CliRunner().invoke(
            xpu_app,
            [
                "top",
                "--runtime-dir",
                str(a.runtime_dir),
                "--host",
                f"r2/b={b.runtime_dir}",
                "--interval",
                "0.5",
            ],
        )
        assert r.exit_code == 0, r.output
        app = launched[-1]
        assert app.source.admin  # admin.sock is ours to write: operator keys on by default
        assert app.interval_s == 0.5
        assert isinstance(app.cluster, LocalHosts)
        # The host view's daemon is part of the cluster view too.
        assert [(h.runtime_dir, h.name, h.domain) for h in app.cluster.hosts] == [
            (a.runtime_dir, "", ""),
            (b.runtime_dir, "b", "r2"),
        ]

        r = CliRunner().invoke(xpu_app, ["--runtime-dir", str(a.runtime_dir), "top", "--no-admin"])
        assert r.exit_code == 0, r.output
        assert not launched[-1].source.admin and launched[-1].cluster is None
    finally:
        a.stop()
        b.stop()


def test_demo_needs_no_daemon(launched):
    r = CliRunner().invoke(xpu_app, ["top", "--demo"])
    assert r.exit_code == 0, r.output
    assert launched[-1].cluster is not None and launched[-1].source.admin
