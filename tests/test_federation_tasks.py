"""The task launcher of `xpu run --tasks-per-node` (xpud.federation.tasks), run as the host runs it: a real
process (`tasks.argv_for`) with real tasks. Each task's RANK/LOCAL_RANK, stdin for rank 0 only, the first
failing task's status (a signal death as 128 + N), the others stopped (or not: --keep-going), a signal
for the rank's group reaching every task once."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import alive
from xpud.api import validate
from xpud.api.v1 import xpu_pb2 as pb
from xpud.federation import tasks

pytestmark = pytest.mark.timeout(60)


def launch(n, node_rank, script, *, keep_going=False, label=False, stdin=b"", env=None, **kw):
    argv = tasks.argv_for(n, node_rank, ["sh", "-c", script], keep_going, label)
    return subprocess.run(
        argv, input=stdin, capture_output=True, timeout=40, env=env or dict(os.environ), **kw
    )


def test_each_task_has_its_rank_and_only_rank_0_reads_stdin():
    show = 'read -r line || line=none; echo "$RANK $LOCAL_RANK $WORLD_SIZE in=$line"'
    env = {**os.environ, "WORLD_SIZE": "6"}  # the host's part of the contract (launch.rank_envs)
    r = launch(3, 0, show, stdin=b"hello\n", env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.decode().splitlines()) == ["0 0 6 in=hello", "1 1 6 in=none", "2 2 6 in=none"]
    r = launch(3, 1, show, stdin=b"hello\n", env=env)  # the second host: no rank 0 there
    assert sorted(r.stdout.decode().splitlines()) == ["3 0 6 in=none", "4 1 6 in=none", "5 2 6 in=none"]


def test_with_label_every_line_is_whole_and_labelled_with_its_tasks_rank():
    """srun --label's `RANK: line`: tasks that write halves of lines at the same time never mix."""
    script = (
        'for i in 1 2 3; do printf "$RANK-"; sleep 0.05; printf "line$i\\n"; done; echo "oops $RANK" >&2; '
        'printf "no newline $RANK"'
    )
    r = launch(3, 1, script, label=True)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode().splitlines()
    assert sorted(out) == sorted(
        [f"{k}: {k}-line{i}" for k in (3, 4, 5) for i in (1, 2, 3)]
        + [f"{k}: no newline {k}" for k in (3, 4, 5)]
    )
    for k in (3, 4, 5):  # each task's lines in its order
        assert [x for x in out if x.startswith(f"{k}: {k}-")] == [f"{k}: {k}-line{i}" for i in (1, 2, 3)]
    assert sorted(r.stderr.decode().splitlines()) == [f"{k}: oops {k}" for k in (3, 4, 5)]


def test_with_label_the_status_and_the_stop_are_the_same(tmp_path):
    script = f'echo $$ > {tmp_path}/$RANK; echo up; [ "$RANK" = 1 ] && {{ sleep 0.3; exit 7; }}; sleep 50'
    started = time.monotonic()
    r = launch(2, 0, script, label=True)
    assert r.returncode == 7 and time.monotonic() - started < tasks.KILL_GRACE_S
    assert sorted(r.stdout.decode().splitlines()) == ["0: up", "1: up"]
    assert not alive(int((tmp_path / "0").read_text()))


def test_the_first_failing_task_gives_the_status_and_the_others_are_stopped(tmp_path):
    script = f'echo $$ > {tmp_path}/$LOCAL_RANK; [ "$LOCAL_RANK" = 1 ] && {{ sleep 0.3; exit 7; }}; sleep 50'
    started = time.monotonic()
    r = launch(3, 0, script)
    assert r.returncode == 7, r.stderr
    assert time.monotonic() - started < tasks.KILL_GRACE_S  # stopped by SIGTERM, not waited for
    for local in (0, 2):
        assert not alive(int((tmp_path / str(local)).read_text()))


def test_a_task_killed_by_a_signal_is_128_plus_n_as_a_shell_shows():
    r = launch(2, 0, '[ "$RANK" = 1 ] && kill -USR1 $$; sleep 50')
    assert r.returncode == 128 + signal.SIGUSR1


def test_keep_going_lets_the_others_finish():
    r = launch(2, 0, '[ "$RANK" = 0 ] && exit 3; sleep 0.3; echo still', keep_going=True)
    assert (r.returncode, r.stdout) == (3, b"still\n")


def test_a_task_that_ignores_sigterm_is_killed_after_the_grace():
    r = launch(2, 0, 'trap "" TERM; [ "$RANK" = 0 ] && { sleep 0.3; exit 4; }; while :; do sleep 0.1; done')
    assert r.returncode == 4


def test_a_signal_for_the_ranks_group_reaches_every_task_once(tmp_path):
    """xpud signals a rank's process group (rankproc): each task gets it once (the launcher forwards
    nothing) and the launcher outlives them to report the first one's status."""
    script = 'trap "echo got INT; exit 130" INT; echo up; while :; do sleep 0.1; done'
    argv = tasks.argv_for(3, 0, ["sh", "-c", script])
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    for _ in range(3):
        assert p.stdout.readline() == b"up\n"
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert out.decode().splitlines() == ["got INT"] * 3


def test_a_command_that_is_not_there_is_127_with_one_line():
    r = subprocess.run(tasks.argv_for(2, 0, ["no-such-command-xpu"]), capture_output=True, timeout=30)
    assert r.returncode == 127
    assert (
        r.stderr.decode().count("\n") == 1
        and "no-such-command-xpu: command not found on" in r.stderr.decode()
    )


@pytest.mark.parametrize(
    "args",
    [[], ["0", "0", "--", "x"], ["513", "0", "--", "x"], ["2", "1024", "--", "x"], ["2", "-1", "--", "x"],
     ["2", "0", "x"], ["2", "0", "--"], ["2", "0", "--keep-going", "x"], ["1e3", "0", "--", "x"],
     ["2", "0", "--label", "--label", "--", "x"], ["2", "0", "--other", "--", "x"]],
)  # fmt: skip
def test_bad_launcher_arguments_are_one_line_and_exit_2(args):
    argv = tasks.argv_for(1, 0, [])[:-3]  # python -I -S tasks.py (or -c its text)
    r = subprocess.run([*argv, *args], capture_output=True, timeout=30)
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1, r.stderr
    assert r.stderr.startswith(b"xpu tasks: ")


def test_bounds_match_the_requests_limits():
    assert tasks.MAX_TASKS == validate.MAX_TASKS_PER_NODE == validate.LIMITS["JobSpec.tasks_per_node"].hi
    assert validate.LIMITS["LaunchSpec.tasks_per_node"].hi == tasks.MAX_TASKS
    assert validate.LIMITS["LaunchSpec.rank"].hi == tasks.MAX_NODE_RANK


def test_wrap_puts_the_command_under_the_launcher_only_with_tasks():
    spec = pb.LaunchSpec(job="j", rank=2, argv=["train", "--x"], env={"A": "1"}, cwd="/", uid=5)
    assert tasks.wrap(spec) is spec
    spec.tasks_per_node, spec.keep_going = 4, True
    wrapped = tasks.wrap(spec)
    assert list(wrapped.argv) == tasks.argv_for(4, 2, ["train", "--x"], keep_going=True)
    assert list(spec.argv) == ["train", "--x"] and (wrapped.uid, wrapped.env["A"]) == (5, "1")
    skip = 5 if wrapped.argv[3] == "-c" else 4  # python -I -S tasks.py, or -c its text
    assert tasks.parse(list(wrapped.argv)[skip:]) == (4, 2, {"--keep-going"}, ["train", "--x"])
    spec.keep_going, spec.label = False, True
    assert tasks.parse(list(tasks.wrap(spec).argv)[skip:]) == (4, 2, {"--label"}, ["train", "--x"])


def test_the_launcher_runs_where_the_user_cannot_read_this_file(monkeypatch, tmp_path):
    """A venv under a 0700 home (as here: /root): the user's Python gets the launcher's text, not its path."""
    from xpud.isolation import switch_user

    monkeypatch.setattr(switch_user, "readable", lambda path: False)
    argv = tasks.argv_for(2, 0, ["sh", "-c", 'echo "$RANK"'])
    assert argv[:4] == [switch_user.PYTHON, "-I", "-S", "-c"] and "def main" in argv[4]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["0", "1"]
