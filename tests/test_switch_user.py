"""Ranks and warm commands start as another user on every event loop the daemon may run: uvloop's
subprocesses refuse Popen's ``user``/``group``/``extra_groups`` (ValueError "unexpected kwargs"), which
stopped every multi-host rank and every warm command of a daemon on uvloop (``[daemon] event_loop =
auto`` picks it when installed). ``UvloopLike`` refuses them as uvloop does; uvloop itself is tested too
where it is installed."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.test_federation_rankproc import Inputs, collect, outputs, spec
from xpud.controllers import warm
from xpud.federation.rankproc import run_rank
from xpud.isolation import switch_user

REFUSED = {"user", "group", "extra_groups", "process_group", "umask"}  # what uvloop 0.21 refuses


class UvloopLike(asyncio.SelectorEventLoop):
    async def subprocess_exec(self, protocol_factory, *args, **kw):
        if bad := REFUSED & kw.keys():
            raise ValueError(f"unexpected kwargs: {', '.join(sorted(bad))}")
        return await super().subprocess_exec(protocol_factory, *args, **kw)

    async def subprocess_shell(self, protocol_factory, cmd, **kw):
        if bad := REFUSED & kw.keys():
            raise ValueError(f"unexpected kwargs: {', '.join(sorted(bad))}")
        return await super().subprocess_shell(protocol_factory, cmd, **kw)


def loops():
    yield pytest.param(UvloopLike, id="uvloop-like")
    try:
        import uvloop
    except ImportError:
        return
    yield pytest.param(uvloop.new_event_loop, id="uvloop")


def on(factory, coro):
    with asyncio.Runner(loop_factory=factory) as r:
        return r.run(coro)


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
NOBODY = pwd.getpwnam("nobody")


@pytest.mark.parametrize("factory", loops())
def test_a_rank_runs_as_the_submitter_on_every_loop(factory):
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        s = spec(["sh", "-c", "id -u; id -g; id -G; pwd"], cwd=d, uid=NOBODY.pw_uid, gid=NOBODY.pw_gid)

        async def main():
            ins = Inputs()
            ins.end()
            return await collect(run_rank(s, ins, lambda _: None))

        events = on(factory, main())
        uid, gid, groups, cwd = outputs(events, 1).decode().splitlines()
        assert (int(uid), int(gid), cwd) == (NOBODY.pw_uid, NOBODY.pw_gid, d), outputs(events, 2)
        assert sorted(map(int, groups.split())) == sorted(set(os.getgrouplist("nobody", NOBODY.pw_gid)))
        assert events[-1].ended.exit_code == 0


@pytest.mark.parametrize("factory", loops())
def test_a_warm_command_runs_as_the_warm_user_on_every_loop(factory):
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o777)
        out = f"{d}/who"
        said = on(factory, warm.run(f"echo $(id -u) $(id -g) $(id -G) > {out}", "nobody", {}, 10.0))
        assert said.startswith("warm_command exited 0"), said
        assert Path(out).read_text().split() == [str(NOBODY.pw_uid), str(NOBODY.pw_gid), str(NOBODY.pw_gid)]


def test_the_prefix_sets_every_id_and_the_groups_or_clears_them():
    assert switch_user.argv(65534, 65534, [65534, 27, 27]) == [
        switch_user.SETPRIV, "--reuid=65534", "--regid=65534", "--groups=65534,27", "--"
    ]  # fmt: skip
    assert switch_user.argv(None, 5, ())[1:] == ["--regid=5", "--clear-groups", "--"]


# ------------------------------------------------------------------ the user's environment and root
PRELOAD_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
/* Loaded by the dynamic loader into every process that starts with LD_PRELOAD naming it: one line per
   process, "uid euid program", appended to the file $XPU_TEST_MARK names. */
__attribute__((constructor)) static void mark(void) {
    const char *path = getenv("XPU_TEST_MARK");
    char comm[64] = "?", line[160];
    int fd, n;
    if (!path) return;
    fd = open("/proc/self/comm", O_RDONLY);
    if (fd >= 0) { n = read(fd, comm, sizeof comm - 1); comm[n > 0 ? n - 1 : 0] = 0; close(fd); }
    fd = open(path, O_WRONLY | O_APPEND);
    if (fd < 0) return;
    n = snprintf(line, sizeof line, "%d %d %s\n", (int)getuid(), (int)geteuid(), comm);
    if (write(fd, line, n) < 0) {}
    close(fd);
}
"""


def event_loops():
    """The loops ``[daemon] event_loop`` picks from (``xpud.daemon.app.loop_factory``)."""
    from xpud.daemon.app import loop_factory

    yield pytest.param(loop_factory("asyncio"), id="asyncio")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return
    yield pytest.param(loop_factory("uvloop"), id="uvloop")


@pytest.fixture
def preload(tmp_path_factory):
    """(the library, the marker file): a real LD_PRELOAD library, built here with gcc, that records the
    uid and euid of every process it is loaded into; both readable and writable by nobody."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    d = Path(tempfile.mkdtemp(prefix="xpu-preload-"))
    os.chmod(d, 0o755)
    (d / "mark.c").write_text(PRELOAD_C)
    lib = d / "mark.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, d / "mark.c"], check=True, capture_output=True)
    os.chmod(lib, 0o755)
    marks = d / "marks"
    marks.touch()
    os.chmod(marks, 0o666)
    yield str(lib), marks
    shutil.rmtree(d, ignore_errors=True)


def marked(marks: Path) -> list[tuple[int, int, str]]:
    return [
        (int(u), int(e), prog) for u, e, prog in (ln.split(" ", 2) for ln in marks.read_text().splitlines())
    ]


@pytest.mark.parametrize("factory", event_loops())
def test_a_users_ld_preload_never_loads_into_a_root_process_of_a_rank_but_reaches_the_command(
    factory, preload
):
    lib, marks = preload
    env = {"PATH": os.environ["PATH"], "LD_PRELOAD": lib, "XPU_TEST_MARK": str(marks), "KEEP": "a b\nc"}
    s = spec(["sh", "-c", 'echo "$LD_PRELOAD"; printf %s "$KEEP"'], env=env, uid=NOBODY.pw_uid,
             gid=NOBODY.pw_gid)  # fmt: skip

    async def main():
        ins = Inputs()
        ins.end()
        return await collect(run_rank(s, ins, lambda _: None))

    events = on(factory, main())
    assert events[-1].ended.exit_code == 0, outputs(events, 2)
    seen = marked(marks)
    assert [m for m in seen if 0 in m[:2]] == [], f"the user's library ran as root: {seen}"
    assert (NOBODY.pw_uid, NOBODY.pw_uid, "sh") in seen, seen  # and reached the user's command, as the user
    assert outputs(events, 1).decode() == f"{lib}\na b\nc"  # the environment is the user's, unchanged


@pytest.mark.parametrize("factory", event_loops())
def test_a_preload_in_a_warm_commands_environment_never_loads_into_a_root_process(factory, preload):
    lib, marks = preload
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o777)
        out = f"{d}/env"
        env = {"LD_PRELOAD": lib, "XPU_TEST_MARK": str(marks)}
        said = on(factory, warm.run(f'echo "$LD_PRELOAD $(id -u)" > {out}', "nobody", env, 10.0))
        assert said.startswith("warm_command exited 0"), said
        assert Path(out).read_text().split() == [lib, str(NOBODY.pw_uid)]
    seen = marked(marks)
    assert seen and [m for m in seen if 0 in m[:2]] == [], f"a library ran as root: {seen}"


def test_the_handover_refuses_an_environment_no_process_could_have():
    for bad in ({"A": "x\0y"}, {"": "1"}, {"A=B": "1"}):
        with pytest.raises(ValueError):
            switch_user.env_bytes(bad)
    assert switch_user.env_bytes({"A": "1", "B": "x=y"}) == b"A=1\0B=x=y\0"


@pytest.mark.parametrize("factory", event_loops())
def test_no_descriptor_of_the_daemon_reaches_a_rank_on_any_loop(factory):
    """uvloop has no ``close_fds``: an fd the daemon holds without close-on-exec (inherited from whoever
    started it, or opened so by a library) reached the user's rank there; asyncio closes them."""
    r, w = os.pipe()
    os.set_inheritable(w, True)
    code = "import os; print(' '.join(sorted(os.listdir('/proc/self/fd'), key=int)))"
    s = spec([switch_user.PYTHON, "-I", "-S", "-c", code], uid=NOBODY.pw_uid, gid=NOBODY.pw_gid)

    async def main():
        ins = Inputs()
        ins.end()
        return await collect(run_rank(s, ins, lambda _: None))

    try:
        events = on(factory, main())
    finally:
        os.close(r)
        os.close(w)
    assert events[-1].ended.exit_code == 0, outputs(events, 2)
    assert outputs(events, 1).decode().split() == ["0", "1", "2", "3"]  # 3: listdir's own


def test_the_handover_runs_on_a_python_every_user_may_run(tmp_path):
    """The handover runs as the user: a Python under /root (pyenv's, a venv's base) is not theirs to run."""
    assert switch_user.reachable(switch_user.PYTHON)
    closed = tmp_path / "closed"
    (closed / "bin").mkdir(parents=True)
    os.chmod(closed, 0o700)
    assert not switch_user.reachable(str(closed / "bin"))
