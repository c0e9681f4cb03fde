"""`xpu config show|get|set` and the daemon's reload on SIGHUP (`systemctl reload xpud`): live keys change,
the others are named as needing a restart, a bad file changes nothing (real daemon, real CLI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import BIN, wait_until, xpu_env
from tests.otheruser import NOBODY
from xpud import config
from xpud.config.live import merge

BASE = "[leases]\ngrace_s = 30.0\n\n[bursts]\nhold_s = 60.0\n"


def test_merge_takes_live_sections_and_names_the_rest():
    running = config.parse(BASE)
    new = config.parse(
        BASE.replace("60.0", "120.0")
        + '[cards]\nisolation = "mps"\n[[windows]]\nname = "d"\ncron = "0 8 * * *"\nwhole_share = 0.5\n'
    )
    merged, live, restart = merge(running, new)
    assert live == ["[bursts] hold_s", "[[windows]]"] and restart == ["[cards] isolation"]
    assert merged.bursts.hold_s == 120.0 and merged.cards.isolation == "auto" and len(merged.windows) == 1


def test_sighup_reloads_live_keys_and_names_what_needs_a_restart(daemon_factory):
    d = daemon_factory(config=BASE)
    r = d.xpu("config", "set", "bursts.hold_s", "120", "--config", str(d.config))
    assert r.returncode == 0, r.stderr
    assert "bursts.hold_s = 120" in r.stdout and "asked xpud (pid" in r.stdout
    assert config.parse(d.config.read_text()).bursts.hold_s == 120.0
    assert (d.base / "xpud.toml.bak").read_text() == BASE
    wait_until(lambda: "changed [bursts] hold_s" in d.log.read_text())
    assert d.alive()

    r = d.xpu("config", "set", "cards.isolation", "mps", "--config", str(d.config))
    assert r.returncode == 0, r.stderr
    wait_until(lambda: "needs a restart to apply: [cards] isolation" in d.log.read_text())
    assert d.alive()
    with d.client() as c:  # still serving, with the old isolation on an L40S (MPS either way)
        assert c.acquire_lease("vxpu-half").lease.slices[0].handle.startswith("mps:")


def test_a_bad_file_on_reload_changes_nothing(daemon_factory):
    d = daemon_factory(config=BASE)
    d.config.write_text(BASE + "[bursts]\n")  # a table twice: not valid TOML
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload refused, the running config stays" in d.log.read_text())
    assert d.alive()
    with d.client() as c:
        c.info()


def test_set_validates_the_whole_file_before_writing(daemon_factory):
    d = daemon_factory(config=BASE)
    for args, why in [
        (("bursts.hold_s", "-5"), "[bursts] hold_s: -5.0 is below the minimum"),
        (("bursts.hold", "5"), "unknown key (did you mean 'hold_s'?)"),
        (("metrics.listen", "nowhere"), "[metrics] listen: 'nowhere' is not host:port"),
        (("windows.name", "x"), "[[windows]] is a list of tables"),
        (("hold_s", "5"), "give section.key"),
    ]:
        r = d.xpu("config", "set", *args, "--config", str(d.config))
        assert r.returncode == 1 and why in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    assert d.config.read_text() == BASE and not (d.base / "xpud.toml.bak").exists()


def test_show_and_get(daemon_factory):
    d = daemon_factory(config=BASE, start=False)
    r = d.xpu("config", "show", "--json", "--config", str(d.config))
    data = json.loads(r.stdout)
    assert data["bursts"]["hold_s"] == 60.0 and data["leases"]["grace_s"] == 30.0
    assert data["metrics"]["listen"] == ""  # defaults fill in
    assert d.xpu("config", "get", "bursts.hold_s", "--config", str(d.config)).stdout.strip() == "60.0"
    assert "[bursts]" in d.xpu("config", "show", "--config", str(d.config)).stdout
    r = d.xpu("config", "get", "bursts.nope", "--config", str(d.config))
    assert r.returncode == 1 and "no key 'bursts.nope'" in r.stderr
    r = d.xpu("config", "set", "leases.grace_s", "12", "--no-reload", "--json", "--config", str(d.config))
    assert json.loads(r.stdout)["value"] == 12.0 and "not signalled" in json.loads(r.stdout)["reload"]


def _env_without_runtime(d, **extra):
    env = xpu_env(d.runtime_dir, **extra)
    del env["XPUD_RUNTIME_DIR"]
    return env


def test_config_commands_use_the_file_the_running_daemon_reads(daemon_factory, short_tmp):
    """#28 item 9: not $XPUD_CONFIG or /etc/xpud/xpud.toml but the file `xpu info` names; --runtime-dir given
    after the command finds the daemon (and its xpud.pid) too."""
    d = daemon_factory(config=BASE + WINDOW)
    other = short_tmp / "other.toml"
    other.write_text("[bursts]\nhold_s = 5.0\n")
    env = _env_without_runtime(d, XPUD_CONFIG=str(other))
    where = ("--runtime-dir", str(d.runtime_dir))

    def xpu(*args):
        return subprocess.run([str(BIN / "xpu"), *args, *where], env=env, capture_output=True, text=True)

    assert xpu("config", "get", "bursts.hold_s").stdout.strip() == "60.0"
    assert json.loads(xpu("config", "show", "--json").stdout)["windows"][0]["name"] == "day"
    assert json.loads(xpu("windows", "--json").stdout)["windows"][0]["name"] == "day"
    r = xpu("config", "set", "bursts.hold_s", "120")
    assert r.returncode == 0, r.stderr
    assert f"{d.config}: bursts.hold_s = 120" in r.stdout and "asked xpud (pid" in r.stdout, r.stdout
    assert other.read_text() == "[bursts]\nhold_s = 5.0\n"
    wait_until(lambda: "changed [bursts] hold_s" in d.log.read_text())
    # a file named with --config that the daemon does not read is written, and the daemon left alone
    r = xpu("config", "set", "bursts.hold_s", "7", "--config", str(other))
    assert r.returncode == 0 and f"the running xpud reads {d.config}, not {other}" in r.stdout, r.stdout


WINDOW = '\n# office hours\n[[windows]]\nname = "day"\ncron = "0 8 * * 1-5"\nwhole_share = 0.5\n'


def test_set_edits_in_place_and_says_when_a_key_needs_a_restart(daemon_factory):
    """#28 item 9: comments and [[windows]] tables stay as written; a key that only a restart applies is
    named as such."""
    text = "# site config\n[leases]\ngrace_s = 30.0  # half a minute\n\n[bursts]\nhold_s = 60.0\n" + WINDOW
    d = daemon_factory(config=text)
    r = d.xpu("config", "set", "bursts.hold_s", "90")
    assert r.returncode == 0, r.stderr
    assert d.config.read_text() == text.replace("hold_s = 60.0", "hold_s = 90")
    assert "needs a restart" not in r.stdout
    r = d.xpu("config", "set", "cards.isolation", "mps")
    assert r.returncode == 0, r.stderr
    assert (
        d.config.read_text()
        == text.replace("hold_s = 60.0", "hold_s = 90") + '\n[cards]\nisolation = "mps"\n'
    )
    assert "[cards] isolation needs a restart to apply (`systemctl restart xpud`)" in r.stdout, r.stdout
    r = d.xpu("config", "set", "leases.max_wait_s", "600", "--json")
    record = json.loads(r.stdout)
    assert record["restart"] is None and "[leases]\ngrace_s = 30.0  # half a minute\nmax_wait_s = 600\n" in (
        d.config.read_text()
    )
    assert "[[windows]]" in d.xpu("config", "show").stdout


def test_set_on_a_missing_file_or_one_it_may_not_write_is_one_line(short_tmp):
    """#28 item 9: no traceback: a missing file is created, a missing directory or a refused write is one
    line saying what to do."""
    env = xpu_env(short_tmp / "run")
    new = short_tmp / "new.toml"
    r = subprocess.run(
        [str(BIN / "xpu"), "config", "set", "bursts.hold_s", "30", "--config", str(new)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and new.read_text() == "[bursts]\nhold_s = 30\n", r.stderr
    assert "no running xpud found" in r.stdout
    gone = short_tmp / "no" / "such" / "xpud.toml"
    r = subprocess.run(
        [str(BIN / "xpu"), "config", "set", "bursts.hold_s", "30", "--config", str(gone)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and f"no directory {gone.parent}" in r.stderr


# The same command run once as root on a scratch file first: it imports all it needs (after the drop the
# interpreter's own files may be unreadable: tests/otheruser.py).
AS_NOBODY = """
import os, sys
from xpu_cli.main import app
scratch = sys.argv[-1] + ".scratch"
try:
    app([*sys.argv[1:-1], scratch, "--no-reload"], prog_name="xpu")
except SystemExit:
    pass
os.setgroups([]); os.setgid({uid}); os.setuid({uid})
app(sys.argv[1:], prog_name="xpu")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_set_by_someone_who_may_not_write_the_file_is_one_line(short_tmp):
    short_tmp.chmod(0o755)
    path = short_tmp / "xpud.toml"
    path.write_text(BASE)
    path.chmod(0o644)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            AS_NOBODY.format(uid=NOBODY),
            "config",
            "set",
            "bursts.hold_s",
            "5",
            "-c",
            path,
        ],
        env=xpu_env(short_tmp / "run"),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot write: Permission denied; run it as root" in r.stderr
    assert path.read_text() == BASE
