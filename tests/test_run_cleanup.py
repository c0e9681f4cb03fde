"""Wrappers killed at random points: before the grant (queued), right after it, while the command runs, and
in the middle of a move. Within the grace period plus one second nothing may be left: no lease, no queued
request, no MIG instance (dgx-h100), no MPS server once no slice remains (pcie-8x-l40s), no process of
the command's group."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import time

import pytest

from tests.conftest import BIN, alive, poll, xpu_env
from xpud.api.client import Client

GRACE = 1.0
CONFIG = f"[leases]\ngrace_s = {GRACE}\n[cards]\nmig_idle_keep_s = 0\nmps_idle_keep_s = 0\n"
POINTS = ("queued", "granted", "running", "moving")
_pids = itertools.count(8_000_000)


@pytest.fixture
def inproc(inproc):
    """conftest's in-process daemons, with this module's config."""
    return lambda machine: inproc(machine, CONFIG)


def leftovers(d, blocker_id: str | None) -> list[str]:
    """What is still there that should not be."""
    out = []
    leases, queue = d.call(lambda: (list(d.engine.leases.values()), d.engine.queue_view()))
    out += [f"lease {x.id} ({x.mode})" for x in leases if x.id != blocker_id]
    out += [f"queued request {q.ticket}" for q in queue]
    for i in range(len(d.engine.cards)):
        if d.fake.mig_layout(i):
            out.append(f"card {i}: MIG instances {d.fake.mig_layout(i)}")
    sliced = d.call(lambda: {s.card_index for x in d.engine.leases.values() for s in x.slices})
    for pipe, snap in d.tools.snapshot().items():
        card = int(pipe.split("/")[-2])
        if card not in sliced and snap["servers"]:
            out.append(f"card {card}: MPS server(s) {snap['servers']} with no slice")
    return out


def connect_clients(d, seen: set[str]) -> None:
    """Stand in for CUDA: each new MPS slice's command connects to its card's server."""
    for x in d.call(lambda: list(d.engine.leases.values())):
        pipe = x.env.get("CUDA_MPS_PIPE_DIRECTORY")
        if pipe and x.id not in seen:
            seen.add(x.id)
            d.tools.connect(pipe, next(_pids), os.getuid())


SCRIPT = 'echo $$ > {dir}/child; sleep 600 & echo $! > {dir}/grandchild; trap "" TERM; wait; wait'


@pytest.mark.parametrize("machine", ["dgx-h100", "pcie-8x-l40s"])
def test_killed_wrappers_leave_nothing_behind_within_grace_plus_one_second(inproc, machine, tmp_path):
    d = inproc(machine)
    rng = random.Random(f"{machine}-cleanup")
    env = xpu_env(d.runtime_dir)
    seen: set[str] = set()
    points = [*POINTS, *(rng.choice(POINTS) for _ in range(6))]
    for n, point in enumerate(points):
        work = tmp_path / f"t{n}"
        work.mkdir()
        mode = rng.choice(["vxpu-quarter", "vxpu-half", "xpu"])
        blocker, blocker_id = None, None
        if point == "queued":  # the host is full (a held lease): the wrapper waits in the queue
            blocker = subprocess.Popen(
                [str(BIN / "xpu"), "run", "-m", "xpu", "--gpus", "8", "--json-env"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            blocker_id = json.loads(blocker.stdout.readline())["lease_id"]
        argv = [str(BIN / "xpu"), "run", "-m", mode, "--wait", "60", "--kill-grace", "5"]
        if point == "moving":
            argv.append("--restartable")
        p = subprocess.Popen(
            [*argv, "--", "sh", "-c", SCRIPT.format(dir=work)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def lease_of(blocker_id=blocker_id):
            return [x for x in d.call(lambda: list(d.engine.leases.values())) if x.id != blocker_id]

        if point == "queued":
            assert poll(lambda: d.call(d.engine.queue_view), 10)
            time.sleep(rng.uniform(0, 0.3))
        elif point == "granted":
            assert poll(lease_of, 10, step=0.002)  # killed as soon as the lease exists
        else:
            assert poll(lambda work=work: (work / "grandchild").exists(), 10)
            connect_clients(d, seen)
            if point == "moving":
                (lease,) = lease_of()
                d.call(d.engine.move, lease.id, "the test moves it")  # reserves a new placement too
                time.sleep(0.2 + rng.uniform(0, 0.3))  # the wrapper is waiting for its command to stop
            else:
                time.sleep(rng.uniform(0, 0.3))
        p.kill()
        p.wait()
        killed = time.monotonic()
        pids = [int((work / f).read_text()) for f in ("child", "grandchild") if (work / f).exists()]

        def clean(blocker_id=blocker_id, pids=pids):
            return not leftovers(d, blocker_id) and not any(alive(x) for x in pids)

        ok = poll(clean, GRACE + 1.0)
        took = time.monotonic() - killed
        alive_pids = [x for x in pids if alive(x)]
        assert ok, f"{point}: after {took:.2f} s still {leftovers(d, blocker_id)}, live pids {alive_pids}"
        assert took <= GRACE + 1.0
        if blocker is not None:
            blocker.stdin.close()  # released
            assert blocker.wait(10) == 0
    # and the host still serves every size afterwards
    with Client(d.runtime_dir) as c:
        g = c.acquire_lease("xpu", gpus=8)
        c.release(g.lease.id, g.token)
