"""Import hygiene: the daemon and the CLI must not need Textual (a dependency for `xpu top` only: a host
may install xpud without it, and the daemon must not pay for importing it).

Each check runs in a fresh interpreter whose meta-path refuses ``textual``, as on a host where the
extra is not installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_TEXTUAL = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTextual(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "textual" or name.startswith("textual."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoTextual())
    """
)


def run_without_textual(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TEXTUAL + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_blocker_really_blocks():
    # Otherwise the tests below would pass for the wrong reason.
    r = run_without_textual("import textual")
    assert r.returncode != 0 and "blocked by the test" in r.stderr


def test_daemon_cli_and_tui_data_side_import_without_textual():
    r = run_without_textual(
        """
        import pkgutil, importlib
        import xpud
        for m in pkgutil.walk_packages(xpud.__path__, "xpud."):
            importlib.import_module(m.name)
        import xpu_cli.main, xpu_cli.top
        # The dashboard's data side is plain Python too (federation may feed HostRow).
        import xpu_tui.hoststate, xpu_tui.hostrow, xpu_tui.source, xpu_tui.topogroups
        import xpu_tui.mailbox, xpu_tui.render, xpu_tui.demo
        assert not [m for m in sys.modules if m.split(".")[0] == "textual"]
        assert "top" in [c.name for c in xpu_cli.main.app.registered_commands]
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_xpu_top_without_textual_says_how_to_get_it():
    r = run_without_textual(
        """
        import sys
        from xpu_cli.main import main
        sys.argv = ["xpu", "top", "--demo"]
        main()
        """
    )
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "xpu top: the dashboard needs Textual (an xpud dependency): reinstall xpud, or "
        "pip install 'textual>=8.2.8,<9'"
    )
