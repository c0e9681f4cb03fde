"""The environment of each rank of a multi-host job. Pure.

xpud starts one process per host: a *node launcher* in torchrun's terms. It gets torchrun's own options
as ``PET_<DEST>`` variables (``torch.distributed.run``'s ``env`` actions, torch/distributed/argparse_util.py:
an option's default is read from ``PET_`` + its dest upper-cased), so a bare ``torchrun train.py`` joins one
rendezvous of ``PET_NNODES`` hosts with ``PET_NPROC_PER_NODE`` workers each (the host's cards), node rank
``PET_NODE_RANK``, at ``PET_MASTER_ADDR:PET_MASTER_PORT`` (rank 0's host, a port free there), run id
``PET_RDZV_ID`` = ``TORCHELASTIC_RUN_ID`` = the job id. The worker-level variables (``RANK``,
``LOCAL_RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``) are torchrun's to set for its workers:
a node launcher that has them is taken for a worker (Lightning's TorchElasticEnvironment), so it gets none.
``MASTER_ADDR``/``MASTER_PORT``/``NODE_RANK`` are set too, for launchers that read those.

With ``tasks_per_node`` T (``xpu run --tasks-per-node``, srun's ``--ntasks-per-node``) xpud is the launcher:
each host runs the command T times under ``xpud.federation.tasks``, and every task is a worker with
torch's ``env://`` variables: ``WORLD_SIZE`` = hosts x T, ``LOCAL_WORLD_SIZE`` = T, ``GROUP_RANK`` =
``NODE_RANK``, ``GROUP_WORLD_SIZE`` = hosts, ``MASTER_*`` here; ``RANK`` = node rank x T + ``LOCAL_RANK``
per task (``tasks.task_env``). No ``PET_*`` then: the tasks are workers, not node launchers. Every task
sees all of its host's cards (the lease's ``CUDA_VISIBLE_DEVICES``), as under srun without
``--gpu-bind`` and under torchrun: a task picks its card by ``LOCAL_RANK``
(``torch.cuda.set_device(LOCAL_RANK)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# What a rank never inherits from the submitter (the rank's host sets these itself).
NOT_INHERITED = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_MPS_PIPE_DIRECTORY",
        "CUDA_MPS_LOG_DIRECTORY",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "HOSTNAME",
        "XPU_LEASE_ID",
        "XPU_TASKS_PER_NODE",
        "TORCHELASTIC_RUN_ID",
        *(f"PET_{name}" for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")),
        "PET_RDZV_ID",
    }
)


@dataclass(frozen=True)
class RankSpec:
    rank: int  # = node rank: one launched process per host
    host: str
    addr: str  # the host's address as peers reach it
    env: dict[str, str]


def rank_envs(
    job: str,
    hosts: Sequence[tuple[str, str]],  # (name, address) in rank order: rank 0 first
    master_port: int,
    lease_env: Mapping[
        str, Mapping[str, str]
    ],  # host name -> the env its lease gives (CUDA_VISIBLE_DEVICES...)
    submitter_env: Mapping[str, str],
    procs_per_node: int = 1,  # torchrun's --nproc-per-node: the host's cards
    tasks_per_node: int = 0,  # xpu run --tasks-per-node: 0 = one node launcher per host
) -> list[RankSpec]:
    """Each host's environment: the submitter's (less what each host sets), then the host's lease env,
    then torchrun's ``PET_*`` options (or, with ``tasks_per_node``, the worker variables every task on
    the host shares), ``MASTER_*``/``NODE_RANK`` and xpud's own ``XPU_*`` variables."""
    if not hosts:
        raise ValueError("a job needs at least one host")
    if not 1 <= master_port <= 65535:
        raise ValueError(f"master port {master_port}: give 1..65535")
    if procs_per_node < 1:
        raise ValueError("procs_per_node: at least 1")
    if tasks_per_node < 0:
        raise ValueError("tasks_per_node: 0 (none) or more")
    base = {k: v for k, v in submitter_env.items() if k not in NOT_INHERITED}
    nodes = len(hosts)
    master = hosts[0][1].rsplit(":", 1)[0] if ":" in hosts[0][1] else hosts[0][1]
    out = []
    for node_rank, (name, addr) in enumerate(hosts):
        if tasks_per_node:
            launcher = {
                "WORLD_SIZE": str(nodes * tasks_per_node),
                "LOCAL_WORLD_SIZE": str(tasks_per_node),
                "GROUP_RANK": str(node_rank),
                "GROUP_WORLD_SIZE": str(nodes),
                "XPU_TASKS_PER_NODE": str(tasks_per_node),
            }
        else:
            launcher = {
                "PET_NNODES": str(nodes),
                "PET_NODE_RANK": str(node_rank),
                "PET_NPROC_PER_NODE": str(procs_per_node),
                "PET_MASTER_ADDR": master,
                "PET_MASTER_PORT": str(master_port),
                "PET_RDZV_ID": job,
            }
        env = {
            **base,
            **lease_env.get(name, {}),
            **launcher,
            "TORCHELASTIC_RUN_ID": job,
            "MASTER_ADDR": master,
            "MASTER_PORT": str(master_port),
            "NODE_RANK": str(node_rank),
            "XPU_JOB_ID": job,
            "XPU_NODES": str(nodes),
            "XPU_NODE_RANK": str(node_rank),
            "XPU_HOSTS": ",".join(h for h, _ in hosts),
        }
        out.append(RankSpec(node_rank, name, addr, env))
    return out


def label(rank: int, line: str) -> str:
    """srun ``--label``'s prefix: ``RANK: line``."""
    return f"{rank}: {line}"


def first_failure(ended: Sequence[tuple[int, int]]) -> int:
    """The job's exit code from ``(rank, code)`` in the order the ranks ended: the first failing rank's
    code (the others were then stopped, so theirs say nothing), else 0."""
    return next((code for _, code in ended if code), 0)
