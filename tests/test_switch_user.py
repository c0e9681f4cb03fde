"""Ranks and warm commands start as another user on every event loop the daemon may run: uvloop's
subprocesses refuse Popen's ``user``/``group``/``extra_groups`` (ValueError "unexpected kwargs"), which
stopped every multi-host rank and every warm command of a daemon on uvloop (``[daemon] event_loop =
auto`` picks it when installed). ``UvloopLike`` refuses them as uvloop does; uvloop itself is tested too
where it is installed."""

from __future__ import annotations

import asyncio
import os
import pwd
import tempfile
from pathlib import Path

import pytest

from tests.test_federation_rankproc import Inputs, collect, outputs, spec
from xpud import switch_user, warm
from xpud.federation.rankproc import run_rank

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
