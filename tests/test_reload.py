"""`xpu config show|get|set` and the daemon's reload on SIGHUP (`systemctl reload xpud`): live keys change,
the others are named as needing a restart, a bad file changes nothing (real daemon, real CLI)."""

from __future__ import annotations

import json
import signal

from tests.conftest import wait_until
from xpud import config
from xpud.reload import merge

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
