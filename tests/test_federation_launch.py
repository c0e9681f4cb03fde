"""Rank environments for multi-host jobs (xpud.federation.launch): torchrun's contract on every host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.torch_needed import need_torch
from xpud.federation import tasks
from xpud.federation.launch import first_failure, label, rank_envs

WORKER_LEVEL = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


def test_each_host_gets_torchruns_options_its_cards_and_the_submitters_environment():
    hosts = [("node-a", "127.0.0.2:7443"), ("node-b", "127.0.0.3:7443")]
    leases = {
        "node-a": {"CUDA_VISIBLE_DEVICES": "GPU-a0,GPU-a1"},
        "node-b": {"CUDA_VISIBLE_DEVICES": "GPU-b3,GPU-b4"},
    }
    submitter = {
        "PATH": "/usr/bin",
        "HOME": "/home/u",
        "CUDA_VISIBLE_DEVICES": "0",
        "RANK": "9",
        "PET_NNODES": "7",
    }
    ranks = rank_envs("job1", hosts, 29500, leases, submitter, procs_per_node=2)
    a, b = (r.env for r in ranks)
    for node_rank, env in enumerate((a, b)):
        assert env["PET_MASTER_ADDR"] == env["MASTER_ADDR"] == "127.0.0.2"
        assert env["PET_MASTER_PORT"] == env["MASTER_PORT"] == "29500"
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("2", "2")
        assert env["PET_NODE_RANK"] == env["NODE_RANK"] == str(node_rank)
        assert env["PET_RDZV_ID"] == env["TORCHELASTIC_RUN_ID"] == "job1"
        # a node launcher has no worker-level variable (Lightning would take it for a torchrun worker)
        assert not set(WORKER_LEVEL) & set(env)
        assert (
            env["PATH"] == "/usr/bin" and env["XPU_JOB_ID"] == "job1" and env["XPU_HOSTS"] == "node-a,node-b"
        )
    assert a["CUDA_VISIBLE_DEVICES"] == "GPU-a0,GPU-a1" and b["CUDA_VISIBLE_DEVICES"] == "GPU-b3,GPU-b4"


PARSE = """
import json, sys
from torch.distributed.run import config_from_args, get_args_parser
args = get_args_parser().parse_args(["train.py", "--lr", "0.1"])
config, entry, cmd_args = config_from_args(args)
print(json.dumps({"nnodes": args.nnodes, "node_rank": args.node_rank, "nproc": args.nproc_per_node,
    "master": [args.master_addr, args.master_port], "rdzv_id": args.rdzv_id,
    "min_max": [config.min_nodes, config.max_nodes], "nproc_cfg": config.nproc_per_node,
    "run_id": config.run_id, "rank": config.rdzv_configs.get("rank"), "script": [entry, cmd_args]}))
"""


def test_torchruns_own_argument_parser_reads_a_two_node_rendezvous_from_each_hosts_environment():
    """torch.distributed.run's parser (torch/distributed/run.py: get_args_parser, its options `env` actions
    from torch/distributed/argparse_util.py) and config_from_args, run in each host's environment."""
    need_torch()
    hosts = [("node-a", "127.0.0.2:7443"), ("node-b", "127.0.0.3:7443")]
    ranks = rank_envs("job7", hosts, 29511, {}, {"PATH": os.environ["PATH"]}, procs_per_node=4)
    for r in ranks:
        p = subprocess.run(
            [sys.executable, "-c", PARSE], env=r.env, capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)
        assert got["nnodes"] == "2" and got["min_max"] == [2, 2]
        assert int(got["node_rank"]) == r.rank and got["nproc"] == "4" and got["nproc_cfg"] == 4
        assert got["master"] == ["127.0.0.2", 29511] and got["rdzv_id"] == got["run_id"] == "job7"
        assert got["script"][1][-3:] == ["-u", "train.py", "--lr", "0.1"][-3:]  # python train.py --lr 0.1


def test_with_tasks_per_node_every_task_is_a_worker_with_torchs_env_contract():
    """--nodes 2 --tasks-per-node 3: six workers. torch's env:// reads MASTER_ADDR, MASTER_PORT, RANK and
    WORLD_SIZE (torch/distributed/rendezvous.py: _env_rendezvous_handler); torchrun's workers also get
    LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and GROUP_WORLD_SIZE
    (torch/distributed/elastic/agent/server/local_elastic_agent.py: _start_workers)."""
    hosts = [("node-a", "127.0.0.2:7443"), ("node-b", "127.0.0.3:7443")]
    leases = {
        "node-a": {"CUDA_VISIBLE_DEVICES": "GPU-a0,GPU-a1"},
        "node-b": {"CUDA_VISIBLE_DEVICES": "GPU-b3"},
    }
    submitter = {
        "PATH": "/usr/bin",
        "RANK": "9",
        "LOCAL_RANK": "4",
        "WORLD_SIZE": "99",
        "XPU_TASKS_PER_NODE": "8",
    }
    hosts_env = rank_envs("job2", hosts, 29500, leases, submitter, procs_per_node=2, tasks_per_node=3)
    seen = []
    for host in hosts_env:
        # what the host's launcher gets: the shared part, no torchrun option (the tasks are workers)
        assert not [k for k in host.env if k.startswith("PET_")]
        assert "RANK" not in host.env and "LOCAL_RANK" not in host.env
        for local in range(3):
            env = tasks.task_env(host.env, host.rank, 3, local)
            seen.append(int(env["RANK"]))
            assert env["LOCAL_RANK"] == str(local) and env["RANK"] == str(host.rank * 3 + local)
            assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("6", "3")
            assert env["GROUP_RANK"] == env["NODE_RANK"] == str(host.rank) and env["GROUP_WORLD_SIZE"] == "2"
            assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.2", "29500")
            assert env["XPU_TASKS_PER_NODE"] == "3" and env["TORCHELASTIC_RUN_ID"] == "job2"
            # every task sees all of its host's cards (it picks one by LOCAL_RANK, as under torchrun)
            assert env["CUDA_VISIBLE_DEVICES"] == leases[host.host]["CUDA_VISIBLE_DEVICES"]
    assert seen == list(range(6))


ENV_RENDEZVOUS = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
# one write of a whole line: the host's tasks share its stdout
os.write(1, f"rank={dist.get_rank()} world={dist.get_world_size()} sum={int(t.item())} "
            f"local={os.environ['LOCAL_RANK']}\\n".encode())
dist.destroy_process_group()
"""


def test_two_hosts_launchers_make_one_env_rendezvous_of_every_task(tmp_path):
    """The real torch (CPU build, gloo): two hosts' task launchers (run here as two processes, each with its
    host's environment) start 2 tasks each; ``init_process_group(init_method="env://")`` makes one group
    of 4 and an all_reduce sums every rank."""
    need_torch()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hosts = [("a", "127.0.0.1:7443"), ("b", "127.0.0.1:7444")]
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    command = [sys.executable, "-c", ENV_RENDEZVOUS]
    launchers = []
    for h in rank_envs("job3", hosts, port, {}, base, tasks_per_node=2):
        argv = tasks.argv_for(2, h.rank, command)
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "stdin": subprocess.DEVNULL}
        launchers.append(subprocess.Popen(argv, env=h.env, **pipes))
    outs = [p.communicate(timeout=120) for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], [e.decode()[-2000:] for _, e in outs]
    lines = sorted(line for o, _ in outs for line in o.decode().splitlines())
    assert lines == [f"rank={r} world=4 sum=10 local={r % 2}" for r in range(4)]


def test_bad_arguments_and_exit_codes():
    with pytest.raises(ValueError):
        rank_envs("j", [("a", "a:1")], 29500, {}, {}, tasks_per_node=-1)
    with pytest.raises(ValueError):
        rank_envs("j", [], 29500, {}, {})
    with pytest.raises(ValueError):
        rank_envs("j", [("a", "a:1")], 0, {}, {})
    assert first_failure([(1, 0), (0, 3), (2, 143)]) == 3 and first_failure([(0, 0), (1, 0)]) == 0
    assert label(3, "loss 0.1") == "3: loss 0.1"
