"""Detached jobs (`xpu submit`, issue #31) against real daemons: the CLI as a subprocess (as root, and as
another uid in-process after dropping privileges), the job started by a real per-job supervisor, the
daemon killed with SIGKILL and started again on the same state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, ROOT, alive, wait_until, xpu_env
from tests.otheruser import NOBODY
from xpud.errors import BadRequest, NotFound

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")

# The CLI (or the client) run as another uid: everything imported as root, then the uid dropped (the
# interpreter and the checkout may be unreadable to that uid).
AS_USER = """
import json, os, sys
import grpc, grpc._channel, grpc._interceptor, grpc._utilities
import xpu_cli.main, xpu_cli.jobs, xpu_cli.entry, xpu_cli.leases, xpu_cli.showing, xpu_cli.output
import xpu_cli.submitting, xpu_cli.runopts, xpu_cli.joblist, xpu_cli.session, xpu_cli.events, xpu_cli.usage
from xpud.api.client import Client
from xpud.errors import XpudError
args = json.loads(sys.argv[2])
if args[0] != "client":  # Typer imports what parsing needs at first use: do it now, as root
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            xpu_cli.main.app([args[0], "--help"], prog_name="xpu", standalone_mode=False)
        except SystemExit:
            pass
os.setgroups([]); os.setgid({uid}); os.setuid({uid})
os.chdir(sys.argv[1])
if args[0] == "client":  # one client call: prints [error class, message] or ["ok", result]
    with Client() as c:
        try:
            what = args[1]
            if what == "logs":
                out = b"".join(c.job_logs(args[2])).decode()
            elif what == "cancel":
                out = [j.state for j in c.cancel_jobs([args[2]])]
            elif what == "job":
                out = c.job(args[2]).state
            elif what == "submit":
                out = c.submit_job(**args[2]).id
            print(json.dumps(["ok", out]))
        except XpudError as e:
            print(json.dumps([type(e).__name__, str(e)]))
    sys.exit(0)
sys.argv = ["xpu", *args]
xpu_cli.main.main()
"""


def as_user(d, uid: int, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", AS_USER.format(uid=uid), str(cwd), json.dumps(list(args))],
        env=xpu_env(d.runtime_dir),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def jobs(d, *args: str) -> list[dict]:
    r = d.xpu("jobs", "--all", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["jobs"]


def submit(d, cwd: Path, *args: str) -> str:
    r = subprocess.run(
        [str(BIN / "xpu"), "submit", *args],
        env=xpu_env(d.runtime_dir),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def state(d, job_id: str) -> str:
    return next(j["state"] for j in jobs(d) if j["id"] == job_id)


def status_file(d, job_id: str) -> dict:
    return json.loads((d.state_dir / "jobs" / f"{job_id}.status").read_text())


@pytest.fixture
def workdir():
    """A directory every uid may write (sticky, as /tmp), for jobs' output files."""
    d = Path(tempfile.mkdtemp(prefix="xpu-jobs-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def test_a_detached_job_outlives_its_shell_and_a_sigkill_of_the_daemon(daemon, workdir):
    go = workdir / "go"
    script = f"echo started; while [ ! -e {go} ]; do sleep 0.05; done; echo finished; exit 5"
    # the submitting shell exits at once
    r = subprocess.run(
        ["sh", "-c", f'{BIN / "xpu"} submit --name train -- sh -c "{script}"; exit 0'],
        env=xpu_env(daemon.runtime_dir),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=workdir,
    )
    job_id = r.stdout.strip()
    assert r.returncode == 0 and len(job_id) == 8, r.stderr
    wait_until(lambda: state(daemon, job_id) == "running", 20)
    out = workdir / f"xpu-{job_id}.out"
    wait_until(lambda: out.exists() and out.read_text() == "started\n", 20)
    r = daemon.xpu("leases")  # its lease is kept by the job (anchor job:<id>): running, not "unheld"
    (line,) = [ln for ln in r.stdout.splitlines() if "sh -c" in ln]
    assert " running " in line and "unheld" not in line, r.stdout
    pid = wait_until(lambda: status_file(daemon, job_id).get("pid"))
    daemon.kill(signal.SIGKILL)
    time.sleep(0.5)
    assert alive(pid), "the job died with the daemon"
    go.touch()  # it ends while no daemon is there
    wait_until(lambda: not alive(pid), 20)
    wait_until(lambda: status_file(daemon, job_id).get("state") == "failed", 20)
    daemon.start()
    (job,) = [j for j in jobs(daemon) if j["id"] == job_id]
    assert job["state"] == "failed" and job["exit_code"] == 5 and job["name"] == "train"
    assert out.read_text() == "started\nfinished\n"
    r = daemon.xpu("wait", "train")
    assert r.returncode == 5 and f"job {job_id} failed (exit 5)" in r.stdout
    with daemon.client() as c:
        assert not c.leases().leases  # its lease was released at the collection


def test_a_running_job_is_collected_when_the_daemon_comes_back_while_it_runs(daemon, workdir):
    go = workdir / "go"
    job_id = submit(daemon, workdir, "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done")
    wait_until(lambda: state(daemon, job_id) == "running", 20)
    pid = wait_until(lambda: status_file(daemon, job_id).get("pid"))
    daemon.kill(signal.SIGKILL)
    daemon.start()
    assert state(daemon, job_id) == "running" and alive(pid)
    go.touch()
    r = daemon.xpu("wait", job_id, timeout=30)
    assert r.returncode == 0 and state(daemon, job_id) == "completed"


def test_cancel_by_name_of_a_queued_and_a_running_job(daemon, workdir):
    run_id = submit(daemon, workdir, "--gpus", "8", "--name", "big", "--", "sleep", "60")
    wait_until(lambda: state(daemon, run_id) == "running", 20)
    pid = wait_until(lambda: status_file(daemon, run_id).get("pid"))
    with daemon.client() as c:  # its lease carries its name and command (`xpu top`, `xpu leases`)
        (lease,) = c.leases().leases
        assert lease.name == "big" and lease.command == "sleep 60" and lease.anchor == f"job:{run_id}"
    queued_id = submit(daemon, workdir, "--gpus", "8", "--name", "next", "--", "touch", "ran")
    assert state(daemon, queued_id) == "queued"
    r = daemon.xpu("cancel", "next")
    assert r.returncode == 0, r.stderr
    assert state(daemon, queued_id) == "cancelled" and not (workdir / "ran").exists()
    r = daemon.xpu("cancel", "big")
    assert r.returncode == 0, r.stderr
    r = daemon.xpu("wait", "big", timeout=30)
    assert r.returncode == 128 + signal.SIGTERM and "cancelled" in r.stdout
    assert not alive(pid)
    (job,) = [j for j in jobs(daemon) if j["id"] == run_id]
    assert job["state"] == "cancelled" and job["exit_signal"] == signal.SIGTERM
    r = daemon.xpu("wait", "next")
    assert r.returncode != 0 and "cancelled" in r.stdout


def test_a_running_job_whose_lease_is_evicted_is_stopped_with_it(daemon, workdir):
    """An operator's eviction (or the reaper's, a health move-off's) ends the lease under a running job:
    the job is stopped as a cancel stops it, not left running on cards that are no longer its own."""
    job_id = submit(daemon, workdir, "--name", "evicted", "--kill-grace", "1", "--", "sleep", "60")
    wait_until(lambda: state(daemon, job_id) == "running", 20)
    pid = wait_until(lambda: status_file(daemon, job_id).get("pid"))
    with daemon.client(admin=True) as c:
        (lease,) = [le for le in c.leases().leases if le.anchor == f"job:{job_id}"]
        c.evict(lease.id, "test")
    r = daemon.xpu("wait", job_id, timeout=30)
    assert r.returncode == 128 + signal.SIGTERM and "cancelled" in r.stdout, r.stdout + r.stderr
    assert not alive(pid)
    (job,) = [j for j in jobs(daemon) if j["id"] == job_id]
    assert job["state"] == "cancelled" and job["reason"].startswith("its lease ended: "), job


def test_time_limit_ends_a_job_with_timeout(daemon, workdir):
    t0 = time.monotonic()
    job_id = submit(
        daemon, workdir, "--time", "1s", "--kill-grace", "1", "--", "sh", "-c", "trap '' TERM; sleep 60"
    )
    r = daemon.xpu("wait", job_id, timeout=30)
    assert time.monotonic() - t0 < 15
    assert r.returncode == 128 + signal.SIGKILL and "timeout" in r.stdout  # TERM ignored: KILL after 1 s
    assert state(daemon, job_id) == "timeout"


def test_after_starts_a_job_only_when_its_jobs_completed_with_0(daemon, workdir):
    go = workdir / "go"
    first = submit(
        daemon, workdir, "--name", "first", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done"
    )
    then = submit(daemon, workdir, "--after", "first", "--", "sh", "-c", "echo then > then")
    submit(daemon, workdir, "--name", "bad", "--", "false")
    never = submit(daemon, workdir, "--after", f"{first},bad", "--", "touch", "never")
    assert state(daemon, then) == "queued"
    wait_until(lambda: state(daemon, never) == "dependency-failed", 20)
    assert state(daemon, then) == "queued"  # first still runs
    go.touch()
    assert daemon.xpu("wait", then, timeout=30).returncode == 0
    assert (workdir / "then").read_text() == "then\n" and not (workdir / "never").exists()
    r = daemon.xpu("wait", never)
    assert r.returncode == 1 and "dependency-failed" in r.stdout


def test_the_jobs_table_and_show_print_a_jobs_times(daemon, workdir):
    """`xpu jobs` (its table, not --json) and `xpu show JOB` with a --time limit print; both died on
    ``output.age`` once age moved to vocab.py."""
    job_id = submit(daemon, workdir, "--name", "tabled", "--time", "1h", "--", "sleep", "60")
    wait_until(lambda: state(daemon, job_id) == "running", 20)
    r = daemon.xpu("jobs")
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith(job_id)]
    assert "tabled" in line and "running" in line
    r = daemon.xpu("show", "tabled")
    assert r.returncode == 0, r.stderr
    assert any(x.split() == ["time", "limit:", "1h00m"] for x in r.stdout.splitlines()), r.stdout
    assert daemon.xpu("cancel", job_id).returncode == 0


def test_wait_exits_as_the_job_ended(daemon, workdir):
    code = submit(daemon, workdir, "--", "sh", "-c", "exit 3")
    killed = submit(daemon, workdir, "--", "sh", "-c", "kill -KILL $$")
    missing = submit(daemon, workdir, "--", "no-such-command-xpu")
    assert daemon.xpu("wait", code, timeout=30).returncode == 3
    assert daemon.xpu("wait", killed, timeout=30).returncode == 128 + signal.SIGKILL
    r = daemon.xpu("wait", missing, timeout=30)
    assert r.returncode == 127 and "cannot start no-such-command-xpu" in r.stdout
    assert "cannot start no-such-command-xpu" in (workdir / f"xpu-{missing}.out").read_text()


@root_only
def test_a_job_runs_as_its_submitter_and_others_cannot_touch_it(daemon_factory, short_tmp, workdir):
    short_tmp.chmod(0o755)  # the other uid must reach the sockets
    d = daemon_factory()
    r = as_user(
        d, NOBODY, workdir, "submit", "--name", "mine", "--", "sh", "-c", "id -u; id -g; echo $XPU_TEST"
    )
    job_id = r.stdout.strip()
    assert r.returncode == 0, r.stderr
    assert d.xpu("wait", job_id, timeout=30).returncode == 0  # root is an operator
    out = workdir / f"xpu-{job_id}.out"
    assert out.stat().st_uid == NOBODY  # opened as the user, not as root
    assert out.read_text().split("\n")[:2] == [str(NOBODY), str(NOBODY)]
    r = as_user(d, NOBODY, workdir, "logs", "mine")
    assert r.returncode == 0 and r.stdout.startswith(f"{NOBODY}\n"), r.stderr
    # root's job: nobody can neither cancel it, read its logs nor wait on it
    go = workdir / "go"
    root_job = submit(
        d, workdir, "--name", "roots", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done"
    )
    wait_until(lambda: state(d, root_job) == "running", 20)
    for what in ("cancel", "logs", "job"):
        got = json.loads(as_user(d, NOBODY, workdir, "client", what, root_job).stdout)
        assert got[0] == "Forbidden" and "belongs to uid 0" in got[1], got
        got = json.loads(as_user(d, NOBODY, workdir, "client", what, "roots").stdout)
        assert got[0] == "NotFound", got  # a name is looked up among the caller's own jobs
    r = as_user(d, NOBODY, workdir, "wait", root_job)
    assert r.returncode == 1 and "belongs to uid 0" in r.stderr
    assert state(d, root_job) == "running"
    go.touch()


@root_only
def test_an_output_file_the_user_cannot_write_is_never_written(daemon_factory, short_tmp, workdir):
    short_tmp.chmod(0o755)
    d = daemon_factory()
    private = workdir / "private"
    private.mkdir(mode=0o700)
    r = as_user(d, NOBODY, workdir, "submit", "--output", str(private / "out"), "--", "true")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "you cannot create files in" in r.stderr
    assert jobs(d) == []
    # a client that skips the check: the job starts as the user, who cannot open it; root never writes it
    fields = {"argv": ["true"], "cwd": str(workdir), "output": str(private / "out"), "env": {"PATH": "/bin"}}
    got = json.loads(as_user(d, NOBODY, workdir, "client", "submit", fields).stdout)
    assert got[0] == "ok", got
    r = d.xpu("wait", got[1], timeout=30)
    assert r.returncode == 126 and "Permission denied" in r.stdout
    assert not (private / "out").exists()


def test_bad_input_is_one_line_and_queues_nothing(daemon, workdir):
    first = submit(daemon, workdir, "--name", "twice", "--", "true")
    second = submit(daemon, workdir, "--name", "twice", "--", "true")
    for job_id in (first, second):
        daemon.xpu("wait", job_id, timeout=30)
    before = jobs(daemon)
    cases = [
        (["submit", "--after", "nosuchjob", "--", "true"], "no job 'nosuchjob'"),
        (["submit", "--time", "soon", "--", "true"], "is not a duration"),
        (["submit", "--time", "0", "--", "true"], "--time 0"),
        (["submit", "--output", "/proc/nope/out", "--", "true"], "you cannot create files in"),
        (["submit", "--"], "no command"),
        (["wait", "twice"], "names 2 jobs"),
        (["show", "twice"], "names 2 jobs"),
        (["cancel", "nosuchjob"], "no job 'nosuchjob'"),
        (["logs", "nosuchjob"], "no job 'nosuchjob'"),
        # issue #31's "Bad input" list, each for every command that takes a job
        (["submit", "--after", "twice", "--", "true"], "names 2 jobs"),
        (["submit", "--after", f"{first},nosuchjob", "--", "true"], "no job 'nosuchjob'"),
        (["submit", "--time", "1x", "--", "true"], "is not a duration"),
        (["submit", "--error", "/proc/nope/err", "--", "true"], "you cannot create files in"),
        (["wait", "nosuchjob"], "no job 'nosuchjob'"),
        (["show", "nosuchjob"], "'nosuchjob' is neither a lease nor a card"),
        (["cancel", "twice"], "names 2 jobs"),
        (["logs", "twice"], "names 2 jobs"),
    ]
    for args, said in cases:
        r = subprocess.run(
            [str(BIN / "xpu"), *args],
            env=xpu_env(daemon.runtime_dir),
            capture_output=True,
            text=True,
            cwd=workdir,
        )
        assert r.returncode != 0 and said in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    assert first in daemon.xpu("wait", "twice").stderr and second in daemon.xpu("wait", "twice").stderr
    assert jobs(daemon) == before


def test_client_errors_map_to_their_classes(daemon, workdir):
    with daemon.client() as c:
        with pytest.raises(NotFound):
            c.job("nosuchjob")
        with pytest.raises(BadRequest):
            c.submit_job(argv=["true"], cwd="relative/dir", env={})


def test_xpu_run_is_a_job_too_and_a_queued_run_that_gave_up_is_recorded(daemon, workdir):
    r = daemon.xpu("run", "--name", "attached", "--", "sh", "-c", "exit 4")
    assert r.returncode == 4
    (job,) = [j for j in jobs(daemon) if j["name"] == "attached"]
    assert job["kind"] == "attached" and job["state"] == "failed" and job["exit_code"] == 4
    with daemon.client() as c:
        (lease,) = c.leases(all=True).leases
    assert job["id"] == lease.id  # one id: the lease's
    # all cards busy: a run that may queue 1 s gives up, and that is on record
    big = submit(daemon, workdir, "--gpus", "8", "--", "sleep", "60")
    wait_until(lambda: state(daemon, big) == "running", 20)
    r = daemon.xpu("run", "--name", "impatient", "--wait", "1", "--", "true")
    assert r.returncode != 0
    (gave_up,) = wait_until(lambda: [j for j in jobs(daemon) if j["name"] == "impatient"])
    assert gave_up["state"] == "cancelled" and gave_up["reason"].startswith("gave up: waited 1 s")
    # a running `xpu run` is cancelled by its lease id: evicted, and `xpu wait` says it did not complete
    daemon.xpu("cancel", big)
    go = workdir / "go"
    p = daemon.xpu_popen("run", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done")
    (running,) = wait_until(
        lambda: [j for j in jobs(daemon) if j["kind"] == "attached" and j["state"] == "running"]
    )
    assert daemon.xpu("cancel", running["id"]).returncode == 0
    r = daemon.xpu("wait", running["id"])
    assert r.returncode != 0 and "evicted" in r.stderr
    go.touch()
    p.wait(30)


def test_the_jobs_json_follows_docs_json_md(daemon, workdir):
    from tests.test_cli_json import check

    r = subprocess.run(
        [str(BIN / "xpu"), "submit", "--json", "--name", "doc", "--time", "1h", "--", "sh", "-c", "exit 2"],
        env=xpu_env(daemon.runtime_dir),
        capture_output=True,
        text=True,
        cwd=workdir,
    )
    submitted = json.loads(r.stdout)
    check(submitted, "Submitted", "xpu submit")
    assert submitted["name"] == "doc"
    r = daemon.xpu("wait", submitted["id"], "--json", timeout=30)
    assert r.returncode == 2
    check(json.loads(r.stdout), "Job", "xpu wait")
    queued = submit(daemon, workdir, "--after", submitted["id"], "--", "true")  # dependency-failed at once
    daemon.xpu("run", "--", "true")
    listing = json.loads(daemon.xpu("jobs", "--all", "--json").stdout)
    check(listing, "JobList", "xpu jobs")
    assert {j["kind"] for j in listing["jobs"]} == {"detached", "attached"} and len(listing["jobs"]) == 3
    shown = json.loads(daemon.xpu("show", queued, "--json").stdout)
    check(shown, "JobShow", "xpu show")
    assert shown["job"]["after"] == [submitted["id"]] and shown["job"]["time_limit_s"] is None


def test_a_queued_job_stays_queued_across_a_sigkill_of_the_daemon_and_runs_later(daemon, workdir):
    first = submit(daemon, workdir, "--gpus", "8", "--", "sleep", "60")
    wait_until(lambda: state(daemon, first) == "running", 20)
    second = submit(daemon, workdir, "--gpus", "8", "--", "sh", "-c", "echo $XPU_JOB_ID > second")
    assert state(daemon, second) == "queued"
    daemon.kill(signal.SIGKILL)
    daemon.start()
    assert state(daemon, first) == "running" and state(daemon, second) == "queued"
    assert daemon.xpu("cancel", first).returncode == 0
    assert daemon.xpu("wait", second, timeout=30).returncode == 0
    assert (workdir / "second").read_text() == f"{second}\n"
    with daemon.client() as c:
        wait_until(lambda: not c.leases().leases, 10)


def test_a_lease_granted_to_a_job_that_never_recorded_it_is_reclaimed_at_start(daemon):
    from xpud.ledger.ledger import Ledger
    from xpud.model import Lease, Mode

    with daemon.client() as c:
        uuid = c.cards().cards[0].uuid
    daemon.kill(signal.SIGTERM)
    led = Ledger(daemon.state_dir / "ledger.sqlite")
    orphan = Lease(
        id="0dd0dd00", mode=Mode.XPU, owner_uid=0, cards=(0,), card_uuids=(uuid,), anchor="job:0badc0de"
    )
    led.write_sync(led.insert_lease_op(orphan, "token"))
    led.close()
    daemon.start()
    with daemon.client() as c:
        assert not c.leases().leases
        (ended,) = c.leases(all=True).leases
        assert ended.id == "0dd0dd00" and ended.state == "reclaimed" and "job 0badc0de" in ended.end_reason


def test_a_queued_xpu_run_is_listed_and_cancelled_by_name(daemon, workdir):
    big = submit(daemon, workdir, "--gpus", "8", "--", "sleep", "60")
    wait_until(lambda: state(daemon, big) == "running", 20)
    p = subprocess.Popen(
        [str(BIN / "xpu"), "run", "--wait", "60", "--name", "waiting", "--", "touch", str(workdir / "ran")],
        env=xpu_env(daemon.runtime_dir),
        stderr=subprocess.PIPE,
        text=True,
    )
    (queued,) = wait_until(lambda: [j for j in jobs(daemon) if j["name"] == "waiting"], 20)
    assert queued["state"] == "queued" and queued["kind"] == "attached"
    r = daemon.xpu("cancel", "waiting")
    assert r.returncode == 0, r.stderr
    assert p.wait(20) == 1 and "cancelled by uid 0 while queued" in p.stderr.read()
    assert not (workdir / "ran").exists()
    (ended,) = wait_until(
        lambda: [j for j in jobs(daemon) if j["name"] == "waiting" and j["state"] != "queued"]
    )
    assert ended["state"] == "cancelled" and ended["id"] == queued["id"]
    daemon.xpu("cancel", big)
