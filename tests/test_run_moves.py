"""A real move of a `xpu run --restartable` job through the engine: the command is stopped, the move
acknowledged, the command restarted on the new card with its new isolation; the old isolation is gone."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.conftest import BIN, xpu_env
from tests.daemons import InProcDaemon

CONFIG = "[leases]\ngrace_s = 30.0\n[cards]\nmig_idle_keep_s = 0\n"


@pytest.fixture
def inproc(short_tmp):
    made = []

    def make(machine):
        d = InProcDaemon(short_tmp, machine, CONFIG)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


def lines(path, n, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().count("\n") >= n):
        assert time.monotonic() < deadline, f"{path}: fewer than {n} line(s)"
        time.sleep(0.02)
    return path.read_text().splitlines()


@pytest.mark.parametrize(
    ("machine", "var"), [("dgx-h100", "CUDA_VISIBLE_DEVICES"), ("pcie-8x-l40s", "CUDA_MPS_PIPE_DIRECTORY")]
)
def test_a_moved_job_restarts_on_its_new_slice(inproc, machine, var, tmp_path):
    d = inproc(machine)
    out = tmp_path / "out"
    script = (
        f'echo "$XPU_RESTART_COUNT ${var}" >> {out}; [ "$XPU_RESTART_COUNT" = 1 ] && exit 9; exec sleep 60'
    )
    p = subprocess.Popen(
        [str(BIN / "xpu"), "run", "-m", "vxpu-half", "--restartable", "--", "sh", "-c", script],
        env=xpu_env(d.runtime_dir),
        stderr=subprocess.PIPE,
        text=True,
    )
    first = lines(out, 1)[0]
    (lease,) = d.call(lambda: list(d.engine.leases.values()))
    old_card, old_handle = lease.cards[0], lease.slices[0].handle
    d.call(d.engine.move, lease.id, "the test moves it")
    assert p.wait(20) == 9, p.stderr.read()
    second = lines(out, 2)[1]
    assert first.startswith("0 ") and second.startswith("1 ") and first[2:] != second[2:]
    assert "restarting the command on card" in p.stderr.read()
    ended = d.call(lambda: d.engine.ledger.recent_leases(5))[0]
    assert ended.id == lease.id and ended.cards[0] != old_card and ended.restart_count == 1
    if machine == "dgx-h100":
        assert second[2:] == ended.slices[0].handle != old_handle
        assert all(d.fake.mig_layout(i) == [] for i in range(8))  # old torn down at the ack, new at release
    else:
        assert second[2:] == str(d.runtime_dir / "mps" / str(ended.cards[0]) / "pipe")
    assert d.call(lambda: list(d.engine.leases)) == []
