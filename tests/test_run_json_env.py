"""`xpu run --json-env`: the environment for another launcher, and the lease held until stdin closes."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from tests.conftest import BIN, xpu_env


def start(daemon, *opts: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "xpu"), "run", "-m", "vxpu-half", "--json-env", *opts],
        env=xpu_env(daemon.runtime_dir),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def leases(daemon):
    with daemon.client() as c:
        return {x.id: x for x in c.leases().leases}


def wait_gone(daemon, lease_id, timeout=5.0):
    deadline = time.monotonic() + timeout
    while lease_id in leases(daemon):
        assert time.monotonic() < deadline, f"lease {lease_id} still active"
        time.sleep(0.05)


def test_prints_one_json_line_and_holds_until_stdin_closes(daemon):
    p = start(daemon)
    record = json.loads(p.stdout.readline())
    assert set(record) == {"lease_id", "mode", "cards", "env"}
    env = record["env"]
    assert env["XPU_LEASE_ID"] == record["lease_id"] and env["XPU_MODE"] == "vxpu-half"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].startswith("0=") and "CUDA_VISIBLE_DEVICES" in env
    active = leases(daemon)[record["lease_id"]]
    assert active.held and list(active.cards) == record["cards"]
    p.stdin.write(b"anything typed is ignored\n")
    p.stdin.flush()
    time.sleep(0.3)
    assert p.poll() is None and record["lease_id"] in leases(daemon)
    p.stdin.close()
    assert p.wait(10) == 0 and p.stdout.read() == b""
    wait_gone(daemon, record["lease_id"], timeout=1.0)  # released, not left to the reaper


def test_a_signal_releases_and_exits_0(daemon):
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        p = start(daemon)
        lid = json.loads(p.stdout.readline())["lease_id"]
        p.send_signal(sig)
        assert p.wait(10) == 0
        wait_gone(daemon, lid, timeout=1.0)


def test_an_evicted_lease_ends_the_wrapper_with_1_and_a_reason(daemon):
    p = start(daemon)
    lid = json.loads(p.stdout.readline())["lease_id"]
    with daemon.client(admin=True) as c:
        c.evict(lid, "maintenance")
    assert p.wait(10) == 1
    assert b"ended by the daemon" in p.stderr.read() and p.stdout.read() == b""


def test_json_env_takes_no_command_and_is_not_restartable(daemon):
    r = daemon.xpu("run", "-m", "vxpu-half", "--json-env", "--", "true")
    assert r.returncode == 1 and "give no command" in r.stderr
    r = daemon.xpu("run", "-m", "vxpu-half", "--json-env", "--restartable")
    assert r.returncode == 1 and "cannot be --restartable" in r.stderr
    assert leases(daemon) == {}


def test_stdin_at_end_of_file_from_the_start_releases_at_once(daemon):
    r = subprocess.run(
        [str(BIN / "xpu"), "run", "-m", "vxpu-quarter", "--json-env"],
        env=xpu_env(daemon.runtime_dir),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["env"]["XPU_MODE"] == "vxpu-quarter"
    assert leases(daemon) == {}
