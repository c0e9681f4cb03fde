"""xpud/federation/sysunit.py and rankproc's unit path: ranks as transient systemd units. Here
``systemd-run`` is a stand-in script with the same contract (``--pipe --wait``: the command gets
its stdio, its exit code comes back; the unit's processes in a session of their own, as a cgroup) and
``systemctl`` a recording runner that acts on it. systemd's own behaviour (its environment-file parser,
the user switch, ``ExecMainCode``) is tests/test_federation_sysunit_systemd.py's, against a real one."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import alive
from tests.test_federation_rankproc import Inputs, spec
from xpud.federation import hostjobs, rankproc, sysunit

pytestmark = pytest.mark.timeout(60)


def test_under_systemd_needs_invocation_id_and_systemd_run():
    found = {"systemd-run": "/usr/bin/systemd-run"}.get
    assert sysunit.under_systemd({"INVOCATION_ID": "abc"}, found)
    assert not sysunit.under_systemd({}, found)  # tests, a shell: spawn directly
    assert not sysunit.under_systemd({"INVOCATION_ID": "abc"}, lambda _: None)
    assert sysunit.Units.detect({}) is None  # so every other rank test here runs ranks as children


def test_the_unit_runs_the_rank_as_the_user_from_an_env_file_never_on_the_command_line():
    unit = sysunit.unit_name("0123abcd", 1)
    assert unit == "xpu-job-0123abcd-a0-r1.service"
    with pytest.raises(ValueError):
        sysunit.unit_name("a b;rm", 0)
    argv = sysunit.run_argv(unit, ["python", "train.py", "--x"], 1000, 1000, "/home/u/run", "/run/e", 3.0,
                            names={"PATH", "HOME", "X"})  # fmt: skip
    unset = [n for n in sysunit.SET_BY_SYSTEMD if n not in ("PATH", "HOME")]
    assert "INVOCATION_ID" in unset and "USER" in unset
    assert argv == [
        "systemd-run", f"--unit={unit}", "--uid=1000", "--gid=1000", "--property=EnvironmentFile=/run/e",
        f"--property=UnsetEnvironment={' '.join(unset)}", "--property=Type=oneshot",
        "--property=TimeoutStartSec=infinity", "--property=TimeoutStopSec=3000ms",
        "--property=KillMode=control-group", "--pipe", "--quiet", "--wait", "--",
        "/usr/bin/env", "--chdir=/home/u/run", "--", "python", "train.py", "--x",
    ]  # fmt: skip
    assert sysunit.signal_argv(unit, 2) == ["systemctl", "kill", "--signal=2", unit]
    assert sysunit.stop_argv(unit) == ["systemctl", "stop", unit]
    globs = ["xpu-job-0123abcd-a*-r*.service", "xpu-job-0123abcd-r*.service"]  # and an older version's names
    assert sysunit.stop_job_argv("0123abcd") == ["systemctl", "stop", *globs]
    assert sysunit.unit_name("0123abcd", 1, attempt=7) == "xpu-job-0123abcd-a7-r1.service"
    with pytest.raises(ValueError):
        sysunit.unit_name("0123abcd", 1, attempt=-1)
    assert sysunit.ended(sysunit.parse_show("ExecMainPID=7\nExecMainCode=2\nExecMainStatus=15\n")) == (
        143,
        15,
    )
    assert sysunit.ended({"ExecMainCode": "1", "ExecMainStatus": "3"}) == (3, 0)
    assert sysunit.ended({}) is None


def test_the_env_file_quotes_every_value_as_a_posix_shell_reads_it_back(tmp_path):
    """systemd reads double-quoted values with a POSIX shell's rules; ``sh`` stands in for its parser."""
    env = {"A": 'x "y" $HOME `id` \\ end', "B": "two\nlines", "C": "", "BASH_FUNC_f%%": "() { :; }"}
    text, dropped = sysunit.env_file_text(env)
    assert dropped == ["BASH_FUNC_f%%"]
    path = sysunit.write_env_file(tmp_path / "d", "u.service", text)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with pytest.raises(FileExistsError):  # never written through an existing file or link
        sysunit.write_env_file(tmp_path / "d", "u.service", text)
    script = 'set -a; . "$0"; printf "%s\\0" "$A" "$B" "$C"'
    got = subprocess.run(["env", "-i", "sh", "-c", script, str(path)], capture_output=True, check=True).stdout
    assert got.decode().split("\0")[:3] == [env["A"], env["B"], ""]
    with pytest.raises(ValueError, match="U\\+0000"):
        sysunit.env_file_text({"X": "a\0b"})


FAKE_RUN = r"""#!PYTHON
# systemd-run --pipe --wait, as far as a rank sees it: the command runs with the env file's environment in
# the working directory, in a session of its own (the unit's cgroup), with this process's stdio; the exit
# code comes back; a death by a signal is "failed" (exit 1) and ExecMainCode/ExecMainStatus say which.
import os, shutil, subprocess, sys

log, args = "LOG", sys.argv[1:]
with open(f"{log}/argv", "w") as f:
    f.write("\n".join(args) + "\n")
with open(f"{log}/own-env", "w") as f:
    f.write("".join(f"{k}={v}\n" for k, v in sorted(os.environ.items())))
cut = args.index("--")
opts = dict(a.removeprefix("--").removeprefix("property=").split("=", 1) for a in args[:cut] if "=" in a)
cmd, unit = args[cut + 1 :], opts["unit"]
shutil.copy(opts["EnvironmentFile"], f"{log}/env-file")
with open(f"{log}/env-mode", "w") as f:
    f.write(oct(os.stat(opts["EnvironmentFile"]).st_mode & 0o777)[2:] + "\n")
sh = ["env", "-i", "sh", "-c", 'set -a; . "$0"; exec "$@"', f"{log}/env-file", *cmd]
p = subprocess.Popen(sh, cwd="/", start_new_session=True)  # the command is env --chdir=CWD -- ...
with open(f"{log}/{unit}.pid.new", "w") as f:
    f.write(str(p.pid))
os.rename(f"{log}/{unit}.pid.new", f"{log}/{unit}.pid")
st = p.wait()
with open(f"{log}/{unit}.end", "w") as f:
    f.write(f"2 {-st}" if st < 0 else f"1 {st}")
sys.exit(1 if st < 0 else st)
"""


class Systemctl:
    """The recording runner: ``kill`` signals the unit's session, ``show`` reads what the stand-in wrote."""

    def __init__(self, log: Path):
        self.log, self.calls = log, []

    async def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        verb, unit = argv[1], argv[-1]
        pid_file, end_file = self.log / f"{unit}.pid", self.log / f"{unit}.end"
        if verb == "kill":
            sig = int(argv[2].removeprefix("--signal="))
            for _ in range(200):  # the unit exists from its start: wait for the stand-in to say its pid
                if pid_file.exists():
                    break
                await asyncio.sleep(0.01)
            try:
                os.killpg(int(pid_file.read_text()), sig)
            except (FileNotFoundError, ValueError, ProcessLookupError):
                return 1, ""
            return 0, ""
        if verb == "show":
            out = f"ExecMainPID={pid_file.read_text().strip()}\n" if pid_file.exists() else "ExecMainPID=0\n"
            if end_file.exists():
                code, status = end_file.read_text().split()
                out += f"ExecMainCode={code}\nExecMainStatus={status}\n"
            return 0, out
        return 0, ""

    def verbs(self, unit):
        return [a[1:-1] for a in self.calls if a[-1] == unit]


@pytest.fixture
def units(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    fake = tmp_path / "systemd-run"
    fake.write_text(FAKE_RUN.replace("PYTHON", sys.executable).replace("LOG", str(log)))
    fake.chmod(0o755)
    ctl = Systemctl(log)
    return sysunit.Units(tmp_path / "env", runner=ctl, systemd_run=str(fake)), ctl, log


def run(rank_spec, units, inputs=None, during=None, **kw):
    """Events of one rank run as a unit; ``during(rank, events)`` runs once the first output came."""

    async def main():
        inp = inputs or Inputs()
        if inputs is None:
            inp.end()
        rank = rankproc.Rank(rank_spec, inp, units=units, **kw)
        events = []
        async for ev in rank.events():
            events.append(ev)
            if during is not None and ev.HasField("output") and len(events) == 2:
                await during(rank, inp)
        await rank.task
        return rank, events

    return asyncio.run(main())


def test_a_rank_runs_through_systemd_run_with_its_env_and_exit_code(units, tmp_path):
    u, ctl, log = units
    work = tmp_path / "work"
    work.mkdir()
    value = 'x "y" $HOME `id` \\ end\nline2'
    env = {"PATH": os.environ["PATH"], "SECRET": value, "BASH_FUNC_f%%": "() { :; }"}
    script = 'printf "%s|" "$SECRET"; pwd; exit 3'
    _, events = run(spec(["sh", "-c", script], cwd=work, env=env, uid=0, gid=0), u)
    out = b"".join(e.output.data for e in events if e.HasField("output")).decode()
    assert out == f"{value}|{work}\n" and events[-1].ended.exit_code == 3 and not events[-1].ended.error
    unit = "xpu-job-j1-a0-r0.service"
    env_file = u.env_dir / f"{unit}.env"
    want = sysunit.run_argv(unit, ["sh", "-c", script], 0, 0, str(work), str(env_file), rankproc.STOP_GRACE_S,
                            names={"PATH", "SECRET"})  # fmt: skip
    assert (log / "argv").read_text().splitlines() == want[1:]
    assert "SECRET" not in (log / "own-env").read_text()  # systemd-run runs with the clean environment
    assert (log / "env-mode").read_text().strip() == "600" and not env_file.exists()  # removed after start
    assert "BASH_FUNC" not in (log / "env-file").read_text()
    verbs = ctl.verbs(unit)
    assert ["show", "--property=ExecMainPID,ExecMainCode,ExecMainStatus"] in verbs
    assert verbs[-1] == ["reset-failed"]  # exit 3: the failed unit is unloaded
    assert not [v for v in verbs if v[0] in ("kill", "stop")]


def test_a_stop_goes_to_the_unit_term_then_kill_and_a_signal_death_is_reported(units):
    u, ctl, log = units
    script = 'trap "" TERM; echo up; while :; do sleep 0.1; done'

    async def abort(rank, inputs):
        await rank.kill()  # SIGTERM (trapped), then SIGKILL after the grace

    _, events = run(spec(["sh", "-c", script]), u, during=abort, stop_grace_s=0.5)
    unit = "xpu-job-j1-a0-r0.service"
    ended = events[-1].ended
    assert (ended.exit_code, ended.signal) == (128 + signal.SIGKILL, signal.SIGKILL), ended
    kills = [v for v in ctl.verbs(unit) if v[0] == "kill"]
    assert kills == [["kill", f"--signal={signal.SIGTERM}"], ["kill", f"--signal={signal.SIGKILL}"]]
    assert ctl.verbs(unit)[-1] == ["reset-failed"]
    assert not alive(int((log / f"{unit}.pid").read_text()))


def test_a_forwarded_signal_reaches_the_unit_through_systemctl(units):
    u, ctl, _ = units

    async def interrupt(rank, inputs):
        inputs.send(signal=signal.SIGINT)

    _, events = run(spec(["sh", "-c", "echo up; exec sleep 30"]), u, inputs=Inputs(), during=interrupt)
    ended = events[-1].ended
    assert (ended.exit_code, ended.signal) == (130, signal.SIGINT), ended
    assert ["kill", f"--signal={signal.SIGINT}"] in ctl.verbs("xpu-job-j1-a0-r0.service")


def test_a_restarted_daemon_stops_the_units_of_ranks_it_had_started(monkeypatch, units):
    u, ctl, _ = units
    monkeypatch.setattr(rankproc, "_detected", [u])
    asyncio.run(hostjobs._stop_units("abc123"))
    assert ctl.calls == [
        ["systemctl", "stop", "xpu-job-abc123-a*-r*.service", "xpu-job-abc123-r*.service"],
        ["systemctl", "reset-failed", "xpu-job-abc123-a*-r*.service", "xpu-job-abc123-r*.service"],
    ]
    monkeypatch.setattr(rankproc, "_detected", [None])
    ctl.calls.clear()
    asyncio.run(hostjobs._stop_units("abc123"))  # ranks as children: nothing to ask systemd
    assert ctl.calls == []


def test_without_systemd_ranks_are_children_as_before(units):
    _, ctl, _ = units
    rank, events = run(spec(["sh", "-c", "echo $$; exit 4"]), None)
    assert events[-1].ended.exit_code == 4 and rank.unit == "" and ctl.calls == []
    assert int(events[1].output.data) == events[0].started.pid  # the rank itself, not a systemd-run
