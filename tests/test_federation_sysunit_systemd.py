"""Ranks as transient units of a REAL systemd (tests/systemd_ns.py: systemd as pid 1 of new namespaces):
what the stand-in of tests/test_federation_sysunit.py cannot show — systemd's environment-file parser,
the user switch, where the command is looked up, ``ExecMainCode``/``ExecMainStatus`` after a signal,
``systemctl kill``/``stop`` on the unit's cgroup, the glob stop after a daemon restart. The rank path is
the daemon's own (``rankproc.Rank`` with ``sysunit.run``); only ``systemd-run``/``systemctl`` are entered
into systemd's namespaces through ``nsenter``."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.otheruser import NOBODY
from tests.systemd_ns import Systemd
from tests.test_federation_rankproc import Inputs, spec
from tests.test_federation_sysunit import run
from xpud.federation import hostjobs, rankproc, sysunit

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(bool(Systemd.unavailable()), reason=f"no real systemd: {Systemd.unavailable()}"),
]

SYSTEM_PY = "/usr/bin/python3"  # one user nobody may run (this test's own may be under /root)


@pytest.fixture(scope="module")
def systemd():
    try:
        sd = Systemd().__enter__()
    except RuntimeError as e:  # the namespaces or systemd would not start here: the exact error
        pytest.skip(f"systemd does not start in new namespaces here: {e}")
    yield sd
    sd.__exit__()


@pytest.fixture
def units(systemd, tmp_path):
    wrapper = tmp_path / "systemd-run"
    wrapper.write_text(f'#!/bin/sh\nexec {" ".join(systemd.prefix)} systemd-run "$@"\n')
    wrapper.chmod(0o755)
    calls = []

    async def runner(argv):
        calls.append(list(argv))
        return await sysunit.run([*systemd.prefix, *argv])

    return sysunit.Units(tmp_path / "env", runner=runner, systemd_run=str(wrapper)), calls


@pytest.fixture
def workdir():
    """A directory user nobody may enter (pytest's tmp_path is under a 0700 directory)."""
    with tempfile.TemporaryDirectory(prefix="xpu-unit-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


def out(events, fd=1):
    return b"".join(e.output.data for e in events if e.HasField("output") and e.output.fd == fd).decode()


def show(systemd, unit, *props):
    r = systemd.run(["systemctl", "show", f"--property={','.join(props)}", unit])
    return sysunit.parse_show(r.stdout)


def test_the_rank_gets_exactly_its_environment_its_user_and_directory_and_its_exit_code(
    systemd, units, workdir
):
    u, _ = units
    if not os.access(SYSTEM_PY, os.X_OK):
        pytest.skip(f"no {SYSTEM_PY}")
    env = {
        "PATH": f"{workdir}/bin:/usr/bin:/bin",  # the command is found in the rank's PATH, not systemd-run's
        "A": 'x "y" $HOME `id` \\ end',
        "B": "two\nlines",
        "C": "",
        "D": "trail\\",
        "E": "tab\there  sp ",
        "F": "'single' #not a comment",
        "G": "${PATH} \\n",
        "U": "héllo ∑",
        "USER": "alice",  # the submitter's, not the one systemd would set
    }
    (workdir / "bin").mkdir()
    tool = workdir / "bin" / "show-env"
    tool.write_text(  # as exec'd: Python's own locale coercion changes os.environ
        f"#!{SYSTEM_PY}\nimport json, os\nenv = open('/proc/self/environ', 'rb').read().split(b'\\0')[:-1]\n"
        "env = dict(e.decode().split('=', 1) for e in env)\n"
        "print(json.dumps([env, os.getcwd(), os.getuid(), os.getgid(), sorted(os.getgroups())]))\n"
        "raise SystemExit(3)\n"
    )
    tool.chmod(0o755)
    group = workdir / "group"  # nobody in a group of its own, in systemd's mount namespace only
    group.write_text(Path("/etc/group").read_text() + "xpu-test-extra:x:4242:nobody\n")
    assert systemd.run(["mount", "--bind", str(group), "/etc/group"]).returncode == 0
    try:
        _, events = run(spec(["show-env"], cwd=workdir, env=env, uid=NOBODY, gid=NOBODY), u)
    finally:
        systemd.run(["umount", "/etc/group"])
    assert events[-1].ended.exit_code == 3 and not events[-1].ended.error, (events[-1], out(events, 2))
    got_env, cwd, uid, gid, groups = json.loads(out(events))
    assert (cwd, uid, gid, groups) == (str(workdir), NOBODY, NOBODY, [4242, NOBODY])  # as a child's
    assert got_env == env  # nothing of systemd's own (INVOCATION_ID, LOGNAME, SHELL, LANG...)
    unit = "xpu-job-j1-a0-r0.service"
    assert not (u.env_dir / f"{unit}.env").exists()
    assert show(systemd, unit, "LoadState")["LoadState"] == "not-found"  # the failed unit was unloaded


def test_a_relative_command_is_found_in_the_working_directory(systemd, units, workdir):
    u, _ = units
    (workdir / "train.sh").write_text("#!/bin/sh\necho trained in $(pwd)\n")
    (workdir / "train.sh").chmod(0o755)
    _, events = run(spec(["./train.sh"], cwd=workdir, uid=NOBODY, gid=NOBODY), u)
    assert events[-1].ended.exit_code == 0, out(events, 2)
    assert out(events) == f"trained in {workdir}\n"


def test_a_directory_the_user_cannot_enter_fails_with_a_message(systemd, units, tmp_path):
    u, _ = units  # tmp_path is root's, 0700
    _, events = run(spec(["true"], cwd=tmp_path, uid=NOBODY, gid=NOBODY), u)
    ended = events[-1].ended
    assert ended.exit_code != 0 and str(tmp_path) in out(events, 2), (ended, out(events, 2))


def test_a_stop_terms_then_kills_every_process_of_the_unit_and_says_which_signal(systemd, units):
    u, calls = units
    script = 'trap "" TERM; sleep 300 & echo $!; while :; do sleep 0.1; done'

    async def abort(rank, inputs):
        await rank.kill()  # SIGTERM (trapped), then SIGKILL after the grace

    _, events = run(spec(["sh", "-c", script]), u, during=abort, stop_grace_s=0.5)
    ended = events[-1].ended
    assert (ended.exit_code, ended.signal) == (128 + signal.SIGKILL, signal.SIGKILL), ended
    unit = "xpu-job-j1-a0-r0.service"
    kills = [c[1:3] for c in calls if c[1] == "kill"]
    assert kills == [["kill", f"--signal={signal.SIGTERM}"], ["kill", f"--signal={signal.SIGKILL}"]]
    assert show(systemd, unit, "LoadState")["LoadState"] == "not-found"
    assert systemd.run(["pgrep", "-f", "sleep 300"]).returncode == 1  # the background child too


def test_a_forwarded_interrupt_reaches_the_rank_through_systemd(systemd, units):
    u, _ = units

    async def interrupt(rank, inputs):
        inputs.send(signal=signal.SIGINT)

    _, events = run(spec(["sh", "-c", "echo up; exec sleep 30"]), u, inputs=Inputs(), during=interrupt)
    ended = events[-1].ended
    assert (ended.exit_code, ended.signal) == (130, signal.SIGINT), ended


def test_a_restarted_daemon_stops_the_units_its_predecessor_started(systemd, units, monkeypatch):
    """systemd-run dying with the daemon leaves the unit running; the new daemon's glob stop ends it."""
    u, _ = units
    unit = "xpu-job-abc123-a2-r1.service"
    line = sysunit.run_argv(unit, ["sleep", "300"], 0, 0, "/", "/dev/null")
    systemd_run = subprocess.Popen([*systemd.prefix, *line], stdin=subprocess.DEVNULL, start_new_session=True)
    wait_until(lambda: show(systemd, unit, "ExecMainPID").get("ExecMainPID", "0") != "0", 10)
    os.killpg(systemd_run.pid, signal.SIGKILL)  # the daemon and its children are gone
    systemd_run.wait()
    assert show(systemd, unit, "ActiveState")["ActiveState"] == "activating"  # the rank runs on
    monkeypatch.setattr(rankproc, "_detected", [u])
    asyncio.run(hostjobs._stop_units("abc123"))
    assert show(systemd, unit, "LoadState")["LoadState"] == "not-found"  # stopped and unloaded: the name
    assert systemd.run(["pgrep", "-x", "sleep"]).returncode == 1  # is free for the job's next attempt


def test_a_next_attempt_runs_while_the_last_attempts_unit_is_still_there(systemd, units):
    """A restarted gang's next attempt on this host gets a unit of its own: it never collides with the
    last attempt's unit (systemd refuses a second unit of the same name while the first is loaded)."""
    u, _ = units

    async def main():
        old_in, new_in = Inputs(), Inputs()
        new_in.end()
        old = rankproc.Rank(spec(["sh", "-c", 'trap "" TERM; echo up; while :; do sleep 0.1; done']), old_in,
                            units=u, attempt=0, stop_grace_s=0.5)  # fmt: skip
        events = aiter(old.events())
        while not (ev := await anext(events)).HasField("output"):
            pass
        assert ev.output.data == b"up\n"
        new = rankproc.Rank(spec(["sh", "-c", "echo second"]), new_in, units=u, attempt=1)
        got = [ev async for ev in new.events()]
        state = show(systemd, old.unit, "ActiveState")["ActiveState"]  # the old attempt still runs
        await old.kill()
        return old, new, got, state, [ev async for ev in events]

    old, new, got, state, rest = asyncio.run(asyncio.wait_for(main(), 60))
    assert (old.unit, new.unit) == ("xpu-job-j1-a0-r0.service", "xpu-job-j1-a1-r0.service")
    assert state == "activating"
    assert got[-1].ended.exit_code == 0 and not got[-1].ended.error, (got[-1], out(got, 2))
    assert out(got) == "second\n"
    assert rest[-1].ended.signal == signal.SIGKILL, rest[-1]


def test_a_daemon_run_by_systemd_as_root_detects_it(systemd):
    """``Units.detect`` in a real service: ``INVOCATION_ID`` set, the env files under its RuntimeDirectory."""
    probe = "from xpud.federation import sysunit; print(sysunit.Units.detect().env_dir)"
    r = systemd.run(["systemd-run", "--property=RuntimeDirectory=xpud-probe", "--pipe", "--quiet", "--wait",
                     "--", sys.executable, "-c", probe])  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "/run/xpud-probe/rank-env\n"), r.stderr


def test_the_unit_runs_nothing_until_the_daemon_recorded_its_start(systemd, units, workdir):
    """The gate (rankproc.GATE) through systemd-run --pipe: the unit's stdin is systemd-run's."""
    u, _ = units
    marker = workdir / "marker"
    seen = []

    async def on_start(pid):
        await asyncio.sleep(0.5)
        seen.append(marker.exists())

    inputs = Inputs()
    inputs.send(stdin=b"input\n")
    inputs.send(stdin_eof=True)
    script = f"echo ran > {marker}; cat"
    _, events = run(spec(["sh", "-c", script], cwd=workdir), u, inputs=inputs, on_start=on_start)
    assert seen == [False] and marker.read_text() == "ran\n"
    assert out(events) == "input\n" and events[-1].ended.exit_code == 0, out(events, 2)


CLIENT = """
import json, os, sys
from tests.test_federation_jobrun import collect, run_job, spec
os.chdir(sys.argv[2])
_, call = run_job("/run/xpud", spec(["sh", "-c", sys.argv[1]], gpus_per_node=1))
print(json.dumps([json.loads(MessageToJson(e)) for e in collect(call)]))
""".replace("import json", "from google.protobuf.json_format import MessageToJson\nimport json")


def shipped_unit() -> str:
    """systemd/xpud.service with its sandbox as shipped; only what it runs and where its state lives
    (/run/xpud: this systemd's /run is a tmpfs, nothing is written to the host's /var/lib) differ, and a
    checkout under /tmp is bound into its private /tmp."""
    unit = (Path(__file__).parents[1] / "systemd" / "xpud.service").read_text()
    start = (f"ExecStart={Path(sys.executable).parent}/xpud --config /run/xpud/xpud.toml --simulate "
             "pcie-4x-h100 --runtime-dir /run/xpud --state-dir /run/xpud/state")  # fmt: skip
    unit = re.sub(
        r"(?m)^ExecStart=.*$", lambda _: start + "\nExecStartPre=/bin/touch /run/xpud/xpud.toml", unit
    )
    unit = re.sub(r"(?m)^(After|Wants|StateDirectory|StateDirectoryMode)=.*$", "", unit)
    unit = re.sub(r"(?ms)^\[Install\].*", "", unit)
    # A checkout or venv under /tmp (a clone in `mktemp -d`) is hidden by PrivateTmp: bound in, read-only
    hidden = sorted(
        {str(p) for p in (Path(sys.prefix), Path(__file__).parents[1]) if p.is_relative_to("/tmp")}
    )
    if hidden:
        unit = unit.replace("[Service]", "[Service]\nBindReadOnlyPaths=" + " ".join(hidden), 1)
    return unit.replace("[Unit]", "[Unit]\nDefaultDependencies=no", 1)


def test_xpud_under_its_shipped_unit_runs_a_job_rank_as_a_unit_outside_its_sandbox(systemd, workdir):
    """The whole path: xpud as a service of a real systemd (ProtectSystem=strict, PrivateTmp, ...) takes a
    RunJob and starts the rank with systemd-run from inside its sandbox. The rank is a unit of its own, sees
    the real /tmp, runs in the submitter's directory (before: refused, the daemon looked for it in its
    private /tmp), and its exit code comes back; the unit is gone after."""
    assert "PrivateTmp=yes" in shipped_unit() and "ProtectSystem=strict" in shipped_unit()
    Path(f"/proc/{systemd.pid}/root/run/systemd/system/xpud.service").write_text(shipped_unit())
    private = set(Path("/tmp").glob("systemd-private-*-xpud.service-*"))
    assert systemd.run(["systemctl", "daemon-reload"]).returncode == 0
    try:
        started = systemd.run(["systemctl", "start", "xpud.service"], timeout=60)
        assert started.returncode == 0, systemd.run(
            ["systemctl", "status", "--no-pager", "xpud.service"]
        ).stdout
        (workdir / "only-in-the-real-tmp").write_text("yes\n")
        script = (
            'tail -1 /proc/self/cgroup; pwd; cat only-in-the-real-tmp; echo "${INVOCATION_ID:-none}"; exit 4'
        )
        code = [
            "env",
            f"PYTHONPATH={Path(__file__).parents[1]}",
            sys.executable,
            "-c",
            CLIENT,
            script,
            str(workdir),
        ]
        r = systemd.run(code, timeout=60)
        assert r.returncode == 0, r.stderr
        events = json.loads(r.stdout)
        job = events[0]["placed"]["job"]
        out = "".join(base64.b64decode(e["output"]["data"]).decode() for e in events if "output" in e)
        want = rf"0::/system.slice/xpu-job-{job}-a\d+-r0.service\n{workdir}\nyes\nnone\n"
        assert re.fullmatch(want, out), out
        assert events[-1]["ended"]["exitCode"] == 4
        units = systemd.run(["systemctl", "list-units", "--all", "--plain", "--no-legend", "xpu-job-*"])
        assert units.stdout.strip() == ""
    finally:
        systemd.run(["systemctl", "stop", "xpud.service"], timeout=60)
        for d in set(Path("/tmp").glob("systemd-private-*-xpud.service-*")) - private:
            shutil.rmtree(d, ignore_errors=True)  # its PrivateTmp, on the host's /tmp
