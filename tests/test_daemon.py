"""End to end: real daemons on temp sockets, the real `xpu` CLI, real SQLite, real subprocesses."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import defaultdict

import pytest

from tests.conftest import BIN, wait_until, xpu_env
from xpud.errors import BadRequest, Forbidden, NoCapacity, NotFound, Unauthenticated, XpudError


def active_leases(d):
    with d.client() as c:
        return list(c.leases().leases)


def test_run_passes_environment_and_exit_code(daemon):
    out = daemon.xpu(
        "run",
        "--mode",
        "vxpu-half",
        "--",
        "sh",
        "-c",
        'echo "$XPU_LEASE_ID|$XPU_MODE|$CUDA_VISIBLE_DEVICES"; exit 7',
    )
    assert out.returncode == 7, out.stderr
    lease_id, mode, cvd = out.stdout.strip().split("|")
    assert mode == "vxpu-half" and lease_id
    with daemon.client() as c:
        uuids = {card.uuid for card in c.cards().cards}
    assert cvd in uuids
    assert active_leases(daemon) == []  # released on exit
    out = daemon.xpu("run", "--mode", "xpu", "--gpus", "4", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert out.returncode == 0 and len(out.stdout.strip().split(",")) == 4


def test_64_concurrent_quarters_never_exceed_capacity(daemon, short_tmp):
    log = short_tmp / "jobs.log"
    script = (
        f'echo "$CUDA_VISIBLE_DEVICES start $(date +%s.%N)" >> {log}; sleep 0.4; '
        f'echo "$CUDA_VISIBLE_DEVICES end $(date +%s.%N)" >> {log}'
    )
    procs = [
        daemon.xpu_popen(
            "run",
            "--mode",
            "vxpu-quarter",
            "--wait",
            "300",
            "--",
            "sh",
            "-c",
            script,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for _ in range(64)
    ]
    seen_max = defaultdict(float)
    with daemon.client() as c:
        while any(p.poll() is None for p in procs):
            for card in c.cards().cards:
                used = sum(s.memory_bytes for s in card.slices) / card.memory_total_bytes
                assert used <= 1.0 + 1e-9 and len(card.slices) <= 4
                assert sum(s.compute_pct for s in card.slices) <= 100
                seen_max[card.index] = max(seen_max[card.index], len(card.slices))
            time.sleep(0.05)
    codes = [p.wait() for p in procs]
    assert codes == [0] * 64, [p.stderr.read() for p in procs if p.returncode][:3]
    events = []
    for line in log.read_text().splitlines():
        card, what, t = line.split()
        events.append((float(t), 0 if what == "end" else 1, card))
    assert len(events) == 128
    running = defaultdict(int)
    for _t, start, card in sorted(events):
        running[card] += 1 if start else -1
        assert running[card] <= 4, f"card {card} ran {running[card]} quarters at once"
    assert max(seen_max.values()) == 4  # the cards really were shared
    assert active_leases(daemon) == []


@pytest.mark.parametrize(
    ("machine", "expect"),
    [
        ("pcie-8x-l40s", [{0, 1, 2, 3}, {4, 5, 6, 7}]),  # one socket, two switches
    ],
)
def test_four_card_lease_gets_the_best_connected_group(daemon_factory, machine, expect):
    d = daemon_factory(machine)
    with d.client() as c:
        g = c.acquire_lease("xpu", gpus=4)
        assert set(g.lease.cards) in expect
        c.release(g.lease.id, g.token)
        # with card 1 busy, the only intact socket is 4-7
        one = c.acquire_lease("xpu", gpus=1)
        if one.lease.cards[0] // 4 == 0:
            g = c.acquire_lease("xpu", gpus=4)
            assert set(g.lease.cards) == {4, 5, 6, 7}


def test_four_cards_on_dgx_a100_are_nvlinked_and_socket_local(daemon_factory):
    d = daemon_factory("dgx-a100")
    with d.client() as c:
        topo = c.topology()
        g = c.acquire_lease("xpu", gpus=4)
        cards = list(g.lease.cards)
        n = topo.size
        assert all(topo.labels[a * n + b].startswith("NV") for a in cards for b in cards if a != b)
        numa = {card.numa_node for card in topo.cards if card.index in cards}
        assert len(numa) == 1


def test_killed_wrapper_lease_is_reclaimed_after_grace(daemon_factory, short_tmp):
    daemon = daemon_factory(config="[leases]\ngrace_s = 1.0\n")
    pidfile = short_tmp / "child.pid"
    p = daemon.xpu_popen("run", "--mode", "xpu", "--", "sh", "-c", f"echo $$ > {pidfile}; exec sleep 60")
    lease = wait_until(lambda: [x for x in active_leases(daemon) if x.held])[0]
    child = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip()))
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = time.monotonic()
    # the child dies with its wrapper
    wait_until(lambda: not _alive(child), timeout=5)
    time.sleep(0.5)  # within the 1 s grace the lease still stands
    assert [x.id for x in active_leases(daemon)] == [lease.id]
    wait_until(lambda: active_leases(daemon) == [], timeout=5)
    assert time.monotonic() - killed_at < 1.0 + 1.0  # grace + 1 s
    with daemon.client() as c:
        ended = next(x for x in c.leases(all=True).leases if x.id == lease.id)
    assert ended.state == "reclaimed"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_daemon_killed_mid_load_restarts_with_every_acknowledged_lease(daemon_factory):
    d = daemon_factory("pcie-8x-l40s", config="[leases]\ngrace_s = 30.0\n")
    acknowledged, lock, stop = {}, threading.Lock(), threading.Event()

    def load(seed):
        rng = random.Random(seed)
        with d.client() as c:
            while not stop.is_set():
                mode = rng.choice(["vxpu-quarter", "vxpu-half", "xpu"])
                try:
                    g = c.acquire_lease(mode, gpus=1)
                except XpudError:
                    continue
                with lock:
                    acknowledged[g.lease.id] = g
                if rng.random() < 0.3:
                    try:
                        c.release(g.lease.id, g.token)
                    except XpudError:
                        # The daemon died under us: the release may or may not have been committed.
                        with lock:
                            del acknowledged[g.lease.id]
                        return
                    with lock:
                        del acknowledged[g.lease.id]

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(acknowledged) >= 8, timeout=20)
    d.kill(signal.SIGKILL)
    stop.set()
    for t in threads:
        t.join(10)
    d.start()
    with d.client() as c:
        restored = {x.id: x for x in c.leases().leases}
        cards = c.cards().cards
    assert set(acknowledged) <= set(restored), "an acknowledged lease was lost"
    for lid, g in acknowledged.items():
        assert list(restored[lid].cards) == list(g.lease.cards)
    for card in cards:  # nothing granted twice
        holders = [x for x in restored.values() if card.index in x.cards]
        whole = [x for x in holders if x.mode == "xpu"]
        assert len(whole) <= 1 and not (whole and len(holders) > 1)
        assert sum(s.memory_bytes for s in card.slices) <= card.memory_total_bytes
    # and the restored state is consistent with new grants: fill the host and check again
    with d.client() as c:
        while True:
            try:
                c.acquire_lease("vxpu-quarter")
            except NoCapacity:
                break
        for card in c.cards().cards:
            assert card.whole_lease or sum(s.memory_bytes for s in card.slices) <= card.memory_total_bytes


def test_bad_request_and_wrong_token_leave_the_daemon_serving(daemon):
    with daemon.client() as c:
        with pytest.raises(BadRequest, match="mode 'vxpu-huge'"):
            c.acquire_lease("vxpu-huge")
        with pytest.raises(BadRequest, match="this host has 8"):
            c.acquire_lease("xpu", gpus=99)
        g = c.acquire_lease("xpu", gpus=1)
        with pytest.raises(Forbidden, match="wrong token"):
            c.release(g.lease.id, "forged-token")
        with pytest.raises(Forbidden):
            list(c.iterate(c.hold(g.lease.id, "forged-token")))
        with pytest.raises(NotFound):
            c.release("ffffffff")
        assert [x.id for x in c.leases().leases] == [g.lease.id]  # nothing granted was lost
        c.release(g.lease.id, g.token)
    r = daemon.xpu("run", "--mode", "vxpu-huge", "--", "true")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "vxpu-huge" in r.stderr
    r = daemon.xpu("release", "nope")
    assert r.returncode == 1 and "no active lease" in r.stderr
    assert daemon.alive()
    assert daemon.xpu("ls").returncode == 0


def test_calls_without_a_credential_are_refused(daemon):
    import grpc

    from xpud.api.v1 import xpu_pb2 as pb
    from xpud.api.v1 import xpu_pb2_grpc as pbg

    with grpc.insecure_channel(f"unix:{daemon.runtime_dir / 'xpud.sock'}") as ch:
        stub = pbg.NodeStub(ch)
        for md in ((), (("x-xpud-credential", "made-up"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.ListCards(pb.ListCardsRequest(), metadata=md, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert Unauthenticated.code == "UNAUTHENTICATED"


def test_bad_config_is_refused_with_file_line_and_key(daemon_factory):
    d = daemon_factory(config="[leases]\n\ngrace = 3\n", start=False)
    r = subprocess.run(
        [
            str(BIN / "xpud"),
            "--config",
            str(d.config),
            "--simulate",
            "dgx-h100",
            "--runtime-dir",
            str(d.runtime_dir),
            "--state-dir",
            str(d.state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=xpu_env(d.runtime_dir),
    )
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"xpud: {d.config}:3: [leases] grace: unknown key (did you mean 'grace_s'?); "
        "etc/xpud.toml lists every key"
    )


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("leases", "grace_s"),
        ("leases", "credential_ttl_s"),
        ("leases", "max_wait_s"),
        ("health", "poll_interval_s"),
    ],
)
def test_nan_in_the_config_is_refused_at_start_up(short_tmp, table, key):
    (short_tmp / "x.toml").write_text(f"[{table}]\n{key} = nan\n")
    dirs = ["--runtime-dir", str(short_tmp / "run"), "--state-dir", str(short_tmp / "state")]
    r = subprocess.run(
        [str(BIN / "xpud"), "--config", str(short_tmp / "x.toml"), "--simulate", "dgx-h100", *dirs],
        capture_output=True,
        text=True,
        timeout=30,
        env=xpu_env(short_tmp / "run"),
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"xpud: {short_tmp / 'x.toml'}:2: [{table}] {key}: nan is not a finite number")
    r = subprocess.run(
        [str(BIN / "xpud"), "--simulate", "dgx-h100", "--seed", "-1", *dirs],
        capture_output=True,
        text=True,
        timeout=30,
        env=xpu_env(short_tmp / "run", XPUD_LOG_LEVEL="debug"),
    )
    assert (
        r.returncode == 2
        and r.stderr
        == "xpud: --seed: [devices] seed: -1 is below the minimum 0 (range 0..9223372036854775807)\n"
    )


def test_a_machine_with_impossible_numbers_is_refused_at_start_up(short_tmp):
    machine = short_tmp / "huge.toml"
    machine.write_text(
        'name = "huge"\nnuma_cpus = ["0-7"]\n[models.m]\nname = "X"\nmemory_mib = 9223372036854775807\n'
        '[[cards]]\nmodel = "m"\nbus_id = "00000000:01:00.0"\n'
    )
    dirs = ["--runtime-dir", str(short_tmp / "run"), "--state-dir", str(short_tmp / "state")]
    r = subprocess.run(
        [str(BIN / "xpud"), "--simulate", str(machine), *dirs],
        capture_output=True,
        text=True,
        timeout=30,
        env=xpu_env(short_tmp / "run"),
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"{machine}: models.m.memory_mib: 9223372036854775807 is outside 1..16777216" in r.stderr


def test_unknown_simulated_machine_is_one_line_naming_the_choices(short_tmp):
    dirs = ["--runtime-dir", str(short_tmp / "run"), "--state-dir", str(short_tmp / "state")]
    r = subprocess.run(
        [str(BIN / "xpud"), "--simulate", "dgx-h999", *dirs],
        capture_output=True,
        text=True,
        timeout=30,
        env=xpu_env(short_tmp / "run"),
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("xpud: unknown machine 'dgx-h999': choose one of dgx-a100, dgx-h100")


def test_without_nvml_and_without_simulate_the_daemon_explains(short_tmp):
    if any(
        os.path.exists(p)
        for p in ("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "/usr/lib64/libnvidia-ml.so.1")
    ):
        pytest.skip("this machine has an NVIDIA driver")
    r = subprocess.run(
        [str(BIN / "xpud"), "--runtime-dir", str(short_tmp / "r"), "--state-dir", str(short_tmp / "s")],
        capture_output=True,
        text=True,
        timeout=30,
        env=xpu_env(short_tmp / "r"),
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "NVML" in lines[0] and "--simulate" in lines[0], r.stderr


def test_two_daemons_side_by_side_and_a_second_on_the_same_socket_is_refused(daemon_factory):
    a = daemon_factory("workstation-2x")
    b = daemon_factory("pcie-8x-l40s")
    assert len(json.loads(a.xpu("ls", "--json").stdout)) == 2
    assert len(json.loads(b.xpu("ls", "--json").stdout)) == 8
    r = subprocess.run(
        [
            str(BIN / "xpud"),
            "--simulate",
            "dgx-h100",
            "--runtime-dir",
            str(a.runtime_dir),
            "--state-dir",
            str(a.base / "other"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=xpu_env(a.runtime_dir),
    )
    assert r.returncode == 1 and "another xpud answers" in r.stderr
    assert "xpud stopped; active leases" not in r.stderr and "xpud did not start" in r.stderr  # #28 item 12
    assert a.xpu("ls").returncode == 0  # the refused daemon cleaned up only what it made: a serves on


def test_queue_is_visible_and_wait_expires(daemon):
    with daemon.client() as c:
        g = c.acquire_lease("xpu", gpus=8)
        p = daemon.xpu_popen(
            "run",
            "--mode",
            "xpu",
            "--gpus",
            "2",
            "--wait",
            "30",
            "--",
            "true",
            stderr=subprocess.PIPE,
            text=True,
        )
        q = wait_until(lambda: list(c.leases().queue))
        assert q[0].gpus == 2 and q[0].position == 1
        listing = daemon.xpu("leases").stdout.splitlines()
        row = next(line for line in listing if line.startswith(q[0].ticket))  # the ticket stands for the id
        assert " queued " in row and " Resources (position 1, gives up in " in row
        c.release(g.lease.id, g.token)
        assert p.wait(20) == 0
        r = daemon.xpu("run", "--mode", "xpu", "--gpus", "8", "--wait", "0.3", "--", "true")
        assert r.returncode == 0
        c.acquire_lease("xpu", gpus=8)
        r = daemon.xpu("run", "--mode", "xpu", "--wait", "0.3", "--", "true")
        assert r.returncode == 1 and "waited 0.3 s" in r.stderr


def test_operator_verbs_and_json_listings(daemon):
    assert daemon.xpu("drain", "3", "--reason", "fan noise").returncode == 0
    cards = json.loads(daemon.xpu("ls", "--json").stdout)
    assert cards[3]["drained"] and cards[3]["drain_reason"] == "fan noise"
    # numbers stay numbers (protobuf's JSON mapping would quote 64-bit ones), fields in the proto's order
    assert list(cards[0])[:2] == ["index", "uuid"] and cards[0]["index"] == 0
    assert cards[0]["memory_total_bytes"] == 46068 * 2**20 and cards[0]["sample"]["memory_used_bytes"] >= 0
    assert daemon.xpu("mode", "5", "sliced").returncode == 0
    assert json.loads(daemon.xpu("ls", "--json").stdout)[5]["mode"] == "sliced"
    with daemon.client() as c:
        g = c.acquire_lease("vxpu-half")
        assert g.lease.cards[0] == 5  # the sliced card is used first
    r = daemon.xpu("mode", "5", "whole")
    assert r.returncode == 1 and "holds 1 slice" in r.stderr
    assert daemon.xpu("undrain", "3").returncode == 0
    leases = json.loads(daemon.xpu("leases", "--json").stdout)
    assert [x["id"] for x in leases["leases"]] == [g.lease.id]
    topo = json.loads(daemon.xpu("topo", "--json").stdout)
    assert topo["labels"][0][1] == "PIX" and topo["labels"][0][4] == "SYS"
    text = daemon.xpu("topo").stdout
    assert text.splitlines()[0].split()[:2] == ["GPU0", "GPU1"] and "Legend" in text
    assert daemon.xpu("release", g.lease.id[:6]).returncode == 0
    assert json.loads(daemon.xpu("leases", "--json").stdout)["leases"] == []


def test_running_job_survives_a_daemon_restart(daemon_factory, short_tmp):
    d = daemon_factory("pcie-8x-l40s", config="[leases]\ngrace_s = 5.0\n")
    go = short_tmp / "go"
    p = d.xpu_popen(
        "run",
        "--mode",
        "vxpu-half",
        "--",
        "sh",
        "-c",
        f"while [ ! -e {go} ]; do sleep 0.05; done; echo finished $XPU_LEASE_ID",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lease = wait_until(lambda: [x for x in active_leases(d) if x.held])[0]
    d.kill(signal.SIGKILL)
    d.start()
    # the wrapper's hold reconnects within the grace period, so the lease is not reclaimed
    wait_until(lambda: [x for x in active_leases(d) if x.id == lease.id and x.held], timeout=5)
    time.sleep(5.5)  # past the grace period
    assert [x.id for x in active_leases(d)] == [lease.id]
    go.touch()
    out, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    assert out.strip() == f"finished {lease.id}"
    assert active_leases(d) == []


def test_the_start_ups_objects_are_kept_out_of_garbage_collection(daemon_factory):
    """Once serving, what the start made is frozen out of the collector's generations (a full collection
    walked all of it: ~45 ms pauses of the loop under load); the daemon then serves as before."""
    import re

    d = daemon_factory(args=("--log-level", "debug"))
    kept = r"kept (\d+) start-up objects out of garbage"
    found = wait_until(lambda: re.search(kept, d.log.read_text()), 30)
    assert int(found.group(1)) > 10_000  # modules, protobuf descriptors, the engine's state
    with d.client() as c:
        g = c.acquire_lease("vxpu-quarter", wait_s=10.0, command="after")
        assert c.release(g.lease.id, g.token).state == "released"
