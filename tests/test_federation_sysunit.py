"""xpud/federation/sysunit.py: the systemd-run / systemctl command lines for ranks as transient units.
No systemd runs here: the lines are checked as built, and one is run through a recording stand-in."""

from __future__ import annotations

import subprocess

import pytest

from xpud.federation import sysunit


def test_under_systemd_needs_invocation_id_and_systemd_run():
    found = {"systemd-run": "/usr/bin/systemd-run"}.get
    assert sysunit.under_systemd({"INVOCATION_ID": "abc"}, found)
    assert not sysunit.under_systemd({}, found)  # tests, a shell: spawn directly
    assert not sysunit.under_systemd({"INVOCATION_ID": "abc"}, lambda _: None)


def test_the_unit_runs_the_rank_as_the_user_with_its_env_and_pipes():
    unit = sysunit.unit_name("0123abcd", 1)
    assert unit == "xpu-job-0123abcd-r1.service"
    with pytest.raises(ValueError):
        sysunit.unit_name("a b;rm", 0)
    argv = sysunit.run_argv(
        unit, ["python", "train.py", "--x"], 1000, 1000, "/home/u/run", {"B": "2", "A": "1"}
    )
    assert argv == [
        "systemd-run", f"--unit={unit}", "--uid=1000", "--gid=1000", "--working-directory=/home/u/run",
        "--property=KillMode=control-group", "--collect", "--pipe", "--quiet", "--wait",
        "--setenv=A=1", "--setenv=B=2", "--", "python", "train.py", "--x",
    ]  # fmt: skip
    assert sysunit.signal_argv(unit, 2) == ["systemctl", "kill", "--signal=2", unit]
    assert sysunit.stop_argv(unit) == ["systemctl", "stop", unit]


def test_a_recording_systemd_run_sees_one_argument_per_word(tmp_path):
    """Through a real exec: no shell splitting, an env value with spaces stays one argument."""
    log = tmp_path / "argv"
    fake = tmp_path / "systemd-run"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {log}\n')
    fake.chmod(0o755)
    argv = sysunit.run_argv("u.service", ["echo", "a b"], 0, 0, "/", {"V": "x y"})
    subprocess.run([str(fake), *argv[1:]], check=True, timeout=10)
    assert log.read_text().splitlines() == argv[1:]
