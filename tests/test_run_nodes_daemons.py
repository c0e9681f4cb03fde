"""`xpu run --nodes 2` end to end: the real CLI against three real daemons on 127.0.0.2-4 with mutual TLS
(the ``cluster`` fixture of test_federation_jobs_daemons.py). Each rank sees its torchrun environment, the
output comes back labelled and the exit code is the job's; stdin reaches rank 0; Ctrl-C stops both ranks
and every host lets its cards go."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import pytest

from tests.conftest import BIN, alive, wait_until, xpu_env
from tests.test_federation_daemons import site, three  # noqa: F401 (fixtures)
from tests.test_federation_jobs_daemons import cluster, leases, live_reservations  # noqa: F401
from tests.torch_needed import need_torch

pytestmark = pytest.mark.timeout(180)

TORCHRUN = ["PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT",
            "PET_RDZV_ID", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "GROUP_RANK",
            "LOCAL_WORLD_SIZE", "WORLD_SIZE"]  # fmt: skip
XPU = ["CUDA_VISIBLE_DEVICES", "XPU_JOB_ID", "XPU_NODES", "XPU_NODE_RANK", "XPU_HOSTS"]
ENV_KEYS = [*TORCHRUN, *XPU, "MARK"]


def xpu(host, *args, **kw):
    return subprocess.Popen([str(BIN / "xpu"), *args], env=xpu_env(host.daemon.runtime_dir, MARK="sub"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # fmt: skip


def test_a_two_host_job_through_the_cli_has_each_ranks_environment_stdin_and_exit_code(cluster, tmp_path):  # noqa: F811
    h1 = cluster[0]
    show = "; ".join(f'echo "{k}=${k}"' for k in ENV_KEYS)
    rank0 = 'read -r line; echo "in=$line"; exit 0'
    script = f'{show}; echo "cwd=$(pwd)"; if [ "$NODE_RANK" = 0 ]; then {rank0}; fi; exit 5'
    p = xpu(h1, "run", "--nodes", "2", "--gpus-per-node", "2", "--label", "--json", "--no-kill-on-bad-exit",
            "--", "sh", "-c", script,
            stdin=subprocess.PIPE, cwd=tmp_path)  # fmt: skip
    out, err = p.communicate(b"hello rank 0\n", timeout=120)
    assert p.returncode == 5, err
    lines = out.decode().splitlines()
    summary = json.loads(lines[-1])
    envs: dict[int, dict[str, str]] = {0: {}, 1: {}}
    for line in lines[:-1]:
        rank, _, rest = line.partition(": ")  # --label
        k, _, v = rest.partition("=")
        envs[int(rank)][k] = v
    hosts = summary["hosts"]
    assert len(set(hosts)) == 2 and summary["exit_code"] == 5
    ips = {h.name: h.ip for h in cluster}
    for r in (0, 1):
        e = envs[r]
        # a node launcher: torchrun's options (PET_*), no worker-level variable
        assert (e["PET_NODE_RANK"], e["NODE_RANK"], e["PET_NNODES"]) == (str(r), str(r), "2")
        assert e["PET_NPROC_PER_NODE"] == "2" and e["PET_RDZV_ID"] == summary["job"]
        assert all(e[k] == "" for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"))
        assert e["MASTER_ADDR"] == e["PET_MASTER_ADDR"] == ips[hosts[0]] and 0 < int(e["MASTER_PORT"]) < 65536
        assert e["XPU_HOSTS"] == ",".join(hosts) and e["XPU_NODES"] == "2" and e["XPU_NODE_RANK"] == str(r)
        assert len(e["CUDA_VISIBLE_DEVICES"].split(",")) == 2  # the host's two leased cards
        assert e["MARK"] == "sub" and e["cwd"] == str(tmp_path) and e["XPU_JOB_ID"] == summary["job"]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert envs[0]["in"] == "hello rank 0" and "in" not in envs[1]
    assert [(x["rank"], x["exit_code"]) for x in summary["ranks"]] == [(0, 0), (1, 5)]
    assert "ended with exit code 5" in err.decode()
    for h in cluster:
        wait_until(lambda h=h: not leases(h) and live_reservations(h) == 0, timeout=15)


def test_ctrl_c_on_the_cli_stops_both_ranks_and_frees_every_host(cluster, tmp_path):  # noqa: F811
    h1 = cluster[0]
    os.chmod(tmp_path, 0o755)
    script = (
        f'echo $$ > {tmp_path}/$NODE_RANK.pid; trap "" TERM; trap "echo got INT; exit 130" INT; echo up; '
        "while :; do sleep 0.1; done"
    )
    p = xpu(h1, "run", "--nodes", "2", "--label", "--", "sh", "-c", script, stdin=subprocess.DEVNULL)
    guard = threading.Timer(90, p.kill)  # a hang becomes a failure that shows xpu's stderr
    guard.start()
    ups = 0
    while ups < 2:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        ups += line.endswith(b"up\n")
    guard.cancel()
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in (0, 1)]
    assert all(alive(pid) for pid in pids)
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 130, err  # rank 0's exit code (it caught the SIGINT)
    assert sorted(rest.decode().splitlines()) == ["0: got INT", "1: got INT"]
    for pid in pids:
        wait_until(lambda pid=pid: not alive(pid), timeout=15)
    for h in cluster:
        wait_until(lambda h=h: not leases(h) and live_reservations(h) == 0, timeout=15)


TRAIN = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
run = os.environ["TORCHELASTIC_RUN_ID"]
# one write of a whole line: torchrun's workers share the host's stdout (print may write in two pieces)
os.write(1, f"rank={dist.get_rank()} world={dist.get_world_size()} sum={int(t.item())} run={run}\\n".encode())
dist.destroy_process_group()
"""


def test_a_bare_torchrun_on_two_hosts_is_one_rendezvous(cluster, tmp_path):  # noqa: F811
    """`xpu run --nodes 2 --gpus-per-node 2 -- torchrun train.py`, no torchrun flags: the real torchrun
    (torch's CPU build, gloo) on two daemons makes one rendezvous of 2 hosts x 2 workers (a card each)."""
    need_torch()
    os.chmod(tmp_path, 0o755)
    (tmp_path / "train.py").write_text(TRAIN)
    torchrun = str(BIN / "torchrun")
    p = xpu(cluster[0], "run", "--nodes", "2", "--gpus-per-node", "2", "--json", "--", torchrun, "train.py",
            stdin=subprocess.DEVNULL, cwd=tmp_path)  # fmt: skip
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    job = json.loads(lines[-1])["job"]
    got = sorted(x for x in lines[:-1] if x.startswith("rank="))
    assert got == [f"rank={r} world=4 sum=10 run={job}" for r in range(4)], (
        out.decode() + err.decode()[-2000:]
    )


def test_more_hosts_than_the_cluster_has_fail_at_once_without_suggesting_wait(cluster):  # noqa: F811
    """#28 item 10: on a 3-host cluster `--nodes 4` can never fit: say so, even with --wait, at once."""
    p = xpu(cluster[0], "run", "--nodes", "4", "--gpus-per-node", "1", "--wait", "10m", "--", "true")
    _, err = p.communicate(timeout=30)
    text = err.decode()
    assert p.returncode != 0 and text.count("\n") == 1, text
    assert "4 hosts asked; the cluster has 3 (`xpu cluster`): waiting cannot help" in text, text
    assert "add --wait" not in text


def test_tasks_per_node_starts_each_hosts_tasks_with_their_ranks(cluster, tmp_path):  # noqa: F811
    """`--nodes 2 --tasks-per-node 2`: four tasks, each with its RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE and the master; --label prefixes a task's lines with its RANK; stdin reaches RANK 0;
    the job ends with the failing task's status."""
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "PET_NNODES", "CUDA_VISIBLE_DEVICES"]  # fmt: skip
    show = " ".join(f"{k}=${k}" for k in keys)
    script = f'read -r line || line=none; echo "{show} in=$line"; [ "$RANK" = 2 ] && exit 9; exit 0'
    p = xpu(cluster[0], "run", "--nodes", "2", "--gpus-per-node", "2", "--tasks-per-node", "2", "--label",
            "--json", "--no-kill-on-bad-exit", "--", "sh", "-c", script,
            stdin=subprocess.PIPE, cwd=tmp_path)  # fmt: skip
    out, err = p.communicate(b"for rank 0\n", timeout=120)
    assert p.returncode == 9, err
    lines = out.decode().splitlines()
    summary = json.loads(lines[-1])
    tasks = {}
    for line in lines[:-1]:
        labelled, _, rest = line.partition(": ")  # --label: the task's RANK
        words, _, stdin = rest.partition(" in=")
        env = dict(w.split("=", 1) for w in words.split(" "))
        assert labelled == env["RANK"]
        tasks[int(env["RANK"])] = (int(env["NODE_RANK"]), env, stdin)
    assert sorted(tasks) == [0, 1, 2, 3], out
    ips = {h.name: h.ip for h in cluster}
    for rank, (node, env, stdin) in tasks.items():
        assert node == rank // 2 and env["LOCAL_RANK"] == str(rank % 2)
        assert env["GROUP_RANK"] == env["NODE_RANK"] == str(node)
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["PET_NNODES"]) == ("4", "2", "")
        assert env["MASTER_ADDR"] == ips[summary["hosts"][0]] and 0 < int(env["MASTER_PORT"]) < 65536
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 2  # every task sees its host's two cards
        assert stdin == ("for rank 0" if rank == 0 else "none")
    assert len({env["MASTER_PORT"] for _, env, _ in tasks.values()}) == 1
    assert tasks[0][1]["CUDA_VISIBLE_DEVICES"] == tasks[1][1]["CUDA_VISIBLE_DEVICES"]
    assert [(x["rank"], x["exit_code"]) for x in summary["ranks"]] == [(0, 0), (1, 9)]
    for h in cluster:
        wait_until(lambda h=h: not leases(h) and live_reservations(h) == 0, timeout=15)


ENV_TRAIN = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
# one write of a whole line: the host's tasks share its stdout
os.write(1, f"rank={dist.get_rank()} world={dist.get_world_size()} sum={int(t.item())} "
            f"local={os.environ['LOCAL_RANK']}\\n".encode())
dist.destroy_process_group()
"""


def test_tasks_per_node_is_one_torch_env_rendezvous(cluster, tmp_path):  # noqa: F811
    """`xpu run --nodes 2 --tasks-per-node 2 -- python -c '...init_process_group("gloo", init_method="env://")
    ... all_reduce'`: the real torch (CPU build) on two daemons makes one group of 4."""
    need_torch()
    os.chmod(tmp_path, 0o755)
    p = xpu(cluster[0], "run", "--nodes", "2", "--tasks-per-node", "2", "--json", "--",
            str(BIN / "python"), "-c", ENV_TRAIN, stdin=subprocess.DEVNULL, cwd=tmp_path)  # fmt: skip
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    got = sorted(x for x in lines[:-1] if x.startswith("rank="))
    assert got == [f"rank={r} world=4 sum=10 local={r % 2}" for r in range(4)], out.decode() + err.decode()
