"""The environment of each rank of a multi-host job, as torchrun and srun give it. Pure.

xpud starts one process per host (a *node* in torchrun's terms); that process may start its own local
workers. ``WORLD_SIZE`` counts processes (nodes x ``procs_per_node``); the process xpud starts on node
``n`` has ``RANK`` = ``n`` x ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` 0. ``MASTER_ADDR``/``MASTER_PORT`` point
at rank 0's host and a port free there.
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
        "LOCAL_WORLD_SIZE",
        "HOSTNAME",
        "XPU_LEASE_ID",
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
    procs_per_node: int = 1,
) -> list[RankSpec]:
    """Each rank's environment: the submitter's (less what each host sets), then the host's lease env,
    then the torchrun contract and xpud's own ``XPU_*`` variables."""
    if not hosts:
        raise ValueError("a job needs at least one host")
    if not 1 <= master_port <= 65535:
        raise ValueError(f"master port {master_port}: give 1..65535")
    if procs_per_node < 1:
        raise ValueError("procs_per_node: at least 1")
    base = {k: v for k, v in submitter_env.items() if k not in NOT_INHERITED}
    nodes = len(hosts)
    master = hosts[0][1].rsplit(":", 1)[0] if ":" in hosts[0][1] else hosts[0][1]
    out = []
    for node_rank, (name, addr) in enumerate(hosts):
        env = {
            **base,
            **lease_env.get(name, {}),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(master_port),
            "WORLD_SIZE": str(nodes * procs_per_node),
            "RANK": str(node_rank * procs_per_node),
            "LOCAL_RANK": "0",
            "NODE_RANK": str(node_rank),
            "GROUP_RANK": str(node_rank),
            "LOCAL_WORLD_SIZE": str(procs_per_node),
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
