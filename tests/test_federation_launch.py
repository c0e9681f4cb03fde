"""Rank environments for multi-host jobs (xpud.federation.launch): torchrun's contract on every host."""

from __future__ import annotations

import pytest

from xpud.federation.launch import first_failure, label, rank_envs


def test_each_rank_gets_the_torchrun_contract_its_cards_and_the_submitters_environment():
    hosts = [("node-a", "127.0.0.2:7443"), ("node-b", "127.0.0.3:7443")]
    leases = {
        "node-a": {"CUDA_VISIBLE_DEVICES": "GPU-a0,GPU-a1"},
        "node-b": {"CUDA_VISIBLE_DEVICES": "GPU-b3"},
    }
    submitter = {"PATH": "/usr/bin", "HOME": "/home/u", "CUDA_VISIBLE_DEVICES": "0", "RANK": "9"}
    ranks = rank_envs("job1", hosts, 29500, leases, submitter, procs_per_node=2)
    a, b = (r.env for r in ranks)
    for env in (a, b):
        assert env["MASTER_ADDR"] == "127.0.0.2" and env["MASTER_PORT"] == "29500"
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
        assert (
            env["PATH"] == "/usr/bin" and env["XPU_JOB_ID"] == "job1" and env["XPU_HOSTS"] == "node-a,node-b"
        )
    assert (a["RANK"], a["NODE_RANK"], b["RANK"], b["NODE_RANK"]) == ("0", "0", "2", "1")
    assert a["CUDA_VISIBLE_DEVICES"] == "GPU-a0,GPU-a1" and b["CUDA_VISIBLE_DEVICES"] == "GPU-b3"


def test_bad_arguments_and_exit_codes():
    with pytest.raises(ValueError):
        rank_envs("j", [], 29500, {}, {})
    with pytest.raises(ValueError):
        rank_envs("j", [("a", "a:1")], 0, {}, {})
    assert first_failure([(1, 0), (0, 3), (2, 143)]) == 3 and first_failure([(0, 0), (1, 0)]) == 0
    assert label(3, "loss 0.1") == "3: loss 0.1"
