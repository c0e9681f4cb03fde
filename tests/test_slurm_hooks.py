"""The Slurm bridge's decisions (no Slurm needed) and the daemon's half: pinned cards, anchored leases
that outlive the Hold grace and a restart, and the reaper's squeue check against a stand-in squeue."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.otheruser import NOBODY, PRELUDE
from xpud.bridges import slurm
from xpud.bridges.slurm import JobCheck, NodeState, SlurmError

UUIDS = [f"GPU-{i:04d}" for i in range(4)]


def test_job_gpus_from_slurm_job_gpus_or_cuda_visible_devices():
    assert slurm.job_gpus({"SLURM_JOB_GPUS": "0,2"}, UUIDS) == (0, 2)
    assert slurm.job_gpus({"CUDA_VISIBLE_DEVICES": "GPU-0003,1"}, UUIDS) == (3, 1)
    assert slurm.job_gpus({"SLURM_JOB_GPUS": "3", "CUDA_VISIBLE_DEVICES": "0"}, UUIDS) == (3,)
    assert slurm.job_gpus({}, UUIDS) == ()
    with pytest.raises(SlurmError, match="not one of this host's 4 card"):
        slurm.job_gpus({"SLURM_JOB_GPUS": "4"}, UUIDS)
    with pytest.raises(SlurmError, match="named twice"):
        slurm.job_gpus({"SLURM_JOB_GPUS": "1,1"}, UUIDS)


def test_job_id_and_uid_are_checked():
    assert slurm.job_id({"SLURM_JOB_ID": "12"}) == "12" and slurm.job_id({"SLURM_JOB_ID": "7_3"}) == "7_3"
    for bad in ("", "x", "1;rm", "-1"):
        with pytest.raises(SlurmError, match="SLURM_JOB_ID"):
            slurm.job_id({"SLURM_JOB_ID": bad})
    with pytest.raises(SlurmError, match="SLURM_JOB_UID"):
        slurm.job_uid({"SLURM_JOB_UID": "99999999999"})


def test_a_constraint_naming_a_slice_size_picks_it():
    sizes = ["vxpu-half", "vxpu-quarter"]
    assert slurm.slice_size({"SLURM_JOB_CONSTRAINTS": "vxpu-half"}, sizes) == "vxpu-half"
    assert slurm.slice_size({"SLURM_JOB_CONSTRAINTS": "ib&vxpu-quarter"}, sizes) == "vxpu-quarter"
    assert slurm.slice_size({"SLURM_JOB_CONSTRAINTS": "ib"}, sizes) is None
    with pytest.raises(SlurmError, match="2 slice sizes"):
        slurm.slice_size({"SLURM_JOB_CONSTRAINTS": "vxpu-half|vxpu-quarter"}, sizes)


def test_shards_map_to_the_smallest_slice_that_covers_them():
    sizes = {"vxpu-half": 0.5, "vxpu-quarter": 0.25}
    assert slurm.size_for_shards(1, 4, sizes) == "vxpu-quarter"
    assert slurm.size_for_shards(2, 4, sizes) == "vxpu-half"
    assert slurm.size_for_shards(3, 4, sizes) is None  # more than any slice: the whole card
    assert slurm.size_for_shards(1, 3, sizes) == "vxpu-half"  # a third needs the half
    with pytest.raises(SlurmError, match="disagree"):
        slurm.size_for_shards(5, 4, sizes)


def test_drain_reason_names_each_card_and_prefers_its_xid():
    reason = slurm.drain_reason(
        [(3, "unhealthy", ["the card fell off the bus", "xid 79: fallen off the bus"])]
    )
    assert reason == "xpud: GPU 3 unhealthy: xid 79: fallen off the bus"
    two = slurm.drain_reason([(1, "unhealthy", ["ecc"]), (5, "unhealthy", [])])
    assert two == "xpud: GPU 1 unhealthy: ecc; GPU 5 unhealthy"
    assert len(slurm.drain_reason([(i, "unhealthy", ["x" * 100]) for i in range(8)])) == slurm.REASON_CHARS


@pytest.mark.parametrize(
    ("state", "reason", "bad", "want"),
    [
        ("idle", "none", "xpud: GPU 3 unhealthy", ("drain", "xpud: GPU 3 unhealthy")),
        ("mixed", "none", "xpud: GPU 3 unhealthy", ("drain", "xpud: GPU 3 unhealthy")),
        ("drained", "xpud: GPU 3 unhealthy", "xpud: GPU 3 unhealthy", None),  # said already
        ("drained", "xpud: GPU 3 unhealthy", "xpud: GPU 4 unhealthy", ("drain", "xpud: GPU 4 unhealthy")),
        ("drained", "maintenance", "xpud: GPU 3 unhealthy", None),  # someone else's drain
        ("drained", "xpud: GPU 3 unhealthy", None, ("resume", "")),
        ("draining", "xpud: GPU 3 unhealthy", None, ("resume", "")),
        ("drained", "maintenance", None, None),  # never lifts someone else's drain
        ("idle", "none", None, None),
    ],
)
def test_health_action(state, reason, bad, want):
    assert slurm.health_action(NodeState(state, reason), bad) == want


# gres.conf(5), Slurm 22.05 (Debian slurm-wlm: /usr/share/man/man5/gres.conf.5.gz): File= "Fully qualified
# pathname of the device files"; for GPUs "the minor number assigned by the OS and used in the device file
# (i.e. the X in /dev/nvidiaX) is not necessarily the same as the device number/index" (Links). Links= "A
# comma-delimited list of numbers identifying the number of connections between this device and other
# devices ... A -1 indicates the device itself and a 0 indicates no connection", one device per line.
# Cores= "the core index numbers for the specific cores which can use this resource", "0,1,2,3" or "0-3".
DGX_A100_MINORS = [2, 3, 0, 1, 6, 7, 4, 5]  # etc/machines/dgx-a100.toml


def test_gres_lines_name_each_cards_minor_in_xpuds_index_order():
    cards = [slurm.GresCard(i, "NVIDIA A100-SXM4-80GB", m) for i, m in enumerate(DGX_A100_MINORS)]
    lines = slurm.gres_lines("n1", list(reversed(cards)), "/dev", shards=2)
    assert lines[0] == "AutoDetect=off"
    assert lines[1:9] == [f"NodeName=n1 Name=gpu Type=a100 File=/dev/nvidia{m}" for m in DGX_A100_MINORS]
    assert lines[9:] == [f"NodeName=n1 Name=shard Count=2 File=/dev/nvidia{m}" for m in DGX_A100_MINORS]
    assert slurm.gpu_type("Tesla V100-SXM2-32GB") == "v100" and slurm.gpu_type("") == "gpu"
    with pytest.raises(SlurmError, match="no minor number for card\\(s\\) 1"):
        slurm.gres_lines("n1", [slurm.GresCard(0, "x", 0), slurm.GresCard(1, "x", None)])


def test_gres_links_and_cores(tmp_path):
    cards = [
        slurm.GresCard(0, "NVIDIA H100", 0, (0, 1, 4, 5)),
        slurm.GresCard(1, "NVIDIA H100", 1, (2, 3, 6, 7)),
    ]
    # 2 sockets x 2 cores x 2 threads, Linux numbering: cpu n and n+4 are one core's threads
    topo = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)}
    lines = slurm.gres_lines("n1", cards, nvlinks=[[0, 4], [4, 0]], topology=topo)
    assert lines[1] == "NodeName=n1 Name=gpu Type=h100 File=/dev/nvidia0 Cores=0-1 Links=-1,4"
    assert lines[2] == "NodeName=n1 Name=gpu Type=h100 File=/dev/nvidia1 Cores=2-3 Links=4,-1"
    # no NVLink at all: no Links=; a CPU this host does not have (a simulated card): no Cores=
    plain = slurm.gres_lines("n1", cards, nvlinks=[[0, 0], [0, 0]], topology={0: (0, 0)})
    assert plain[1] == "NodeName=n1 Name=gpu Type=h100 File=/dev/nvidia0"
    assert slurm.ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and slurm.ranges([3]) == "3"
    sys_cpu = tmp_path / "cpu"
    for cpu, (pkg, core) in {0: (0, 0), 1: (1, 0)}.items():
        (sys_cpu / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (sys_cpu / f"cpu{cpu}" / "topology" / "physical_package_id").write_text(f"{pkg}\n")
        (sys_cpu / f"cpu{cpu}" / "topology" / "core_id").write_text(f"{core}\n")
    (sys_cpu / "cpufreq").mkdir()
    assert slurm.cpu_topology(str(sys_cpu)) == {0: (0, 0), 1: (1, 0)}


def test_hook_scripts_run_this_xpu_by_its_absolute_path(tmp_path):
    scripts = slurm.hook_scripts("/opt/xpud/bin/xpu", "/run/xpud", "/etc/slurm/slurm.conf", "/var/log/x.log")
    assert sorted(scripts) == ["epilog.sh", "healthcheck.sh", "prolog.sh", "taskprolog.sh"]
    assert scripts["prolog.sh"].splitlines()[-1] == "exec /opt/xpud/bin/xpu slurm prolog 2>>/var/log/x.log"
    assert "export XPUD_RUNTIME_DIR=/run/xpud SLURM_CONF=/etc/slurm/slurm.conf" in scripts["healthcheck.sh"]
    assert slurm.conf_lines("/etc/slurm/xpud")[0] == "Prolog=/etc/slurm/xpud/prolog.sh"
    with pytest.raises(SlurmError, match="absolute"):
        slurm.hook_scripts("xpu")
    with pytest.raises(SlurmError, match="--log"):
        slurm.hook_scripts("/x/xpu", log_file="/tmp/a b; rm -rf /")
    # the scripts are what sh runs: checked by sh itself
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
        assert subprocess.run(["sh", "-n", str(tmp_path / name)]).returncode == 0


def test_export_lines_leave_out_what_slurm_cannot_take():
    assert slurm.export_lines({"B": "2", "A": "x y", "C": "a\nb"}) == ["export A=x y", "export B=2"]


def fake_squeue(tmp_path, body: str) -> str:
    script = tmp_path / "squeue"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    ("body", "gone"),
    [
        ("echo '5|RUNNING'", {}),
        ("echo '5|COMPLETING'", {}),
        ("echo '5|COMPLETED'", {"5": "the job is COMPLETED (its epilog never came)"}),
        ("true", {"5": "Slurm no longer knows the job (its epilog never came)"}),
        (
            'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
            {"5": "Slurm no longer knows"},
        ),
        ('echo "Unable to contact slurm controller" >&2; exit 1', {}),  # cannot tell: keep it
        ("sleep 5", {}),  # no answer: keep it
    ],
)
def test_the_reapers_squeue_check(tmp_path, body, gone):
    check = JobCheck(fake_squeue(tmp_path, body), conf="/x/slurm.conf", timeout_s=0.5)
    got = asyncio.run(check({"5"}))
    assert set(got) == set(gone)
    for k, v in gone.items():
        assert got[k].startswith(v)


def test_the_reaper_asks_squeue_once_for_all_of_a_hosts_jobs(tmp_path):
    # squeue(1): -j takes "a comma separated list of job IDs"; -o %i is the job id, %T its state
    log = tmp_path / "calls"
    squeue = fake_squeue(tmp_path, f'echo "$@" >> {log}; printf "5|RUNNING\\n7_1|COMPLETED\\n"')
    got = asyncio.run(JobCheck(squeue)({"5", "6", "7_1"}))
    assert got == {
        "6": "Slurm no longer knows the job (its epilog never came)",
        "7_1": "the job is COMPLETED (its epilog never came)",
    }
    assert log.read_text().splitlines() == ["-h -j 5,6,7_1 --states=all -o %i|%T"]


def test_a_missing_squeue_keeps_the_lease(tmp_path):
    assert asyncio.run(JobCheck(str(tmp_path / "nope"))({"5"})) == {}


def test_pinned_anchored_leases_outlive_the_hold_grace_and_a_restart(daemon_factory, tmp_path):
    squeue = fake_squeue(tmp_path, f"cat {tmp_path}/state 2>/dev/null || printf '9|RUNNING\\n10|RUNNING\\n'")
    config = (
        "[leases]\ngrace_s = 0.3\nrestore_grace_s = 0.3\n"
        f'[slurm]\ncheck_interval_s = 1.0\nsqueue = "{squeue}"\n'
    )
    d = daemon_factory(config=config)
    with d.client(admin=True) as c:
        job = c.acquire_lease("xpu", gpus=2, cards=(5, 2), anchor="slurm:9", owner_uid=1234)
        c.acquire_lease("xpu", gpus=1)  # held by nobody: reclaimed after grace_s
        sliced = c.acquire_lease("vxpu-quarter", cards=(6,), anchor="slurm:10", owner_uid=1234)
    assert list(job.lease.cards) == [5, 2] and job.lease.owner_uid == 1234 and job.lease.anchor == "slurm:9"
    assert list(sliced.lease.cards) == [6]
    time.sleep(1.5)  # the plain lease had no Hold stream: reclaimed; the anchored ones stay
    ids = {le["id"]: le for le in json.loads(d.xpu("leases", "--json").stdout)["leases"]}
    assert set(ids) == {job.lease.id, sliced.lease.id}
    d.kill()
    d.start()
    time.sleep(1.5)  # restored without a holder, past restore_grace_s: still there
    ids = {le["id"]: le for le in json.loads(d.xpu("leases", "--json").stdout)["leases"]}
    assert set(ids) == {job.lease.id, sliced.lease.id} and ids[job.lease.id]["anchor"] == "slurm:9"
    with d.client(admin=True) as c:
        with pytest.raises(Exception, match="card 5 is held by lease"):
            c.acquire_lease("xpu", gpus=1, cards=(5,), anchor="slurm:11")
        with pytest.raises(Exception, match="card 9: no such card"):
            c.acquire_lease("xpu", gpus=1, cards=(9,))
    (tmp_path / "state").write_text("9|COMPLETED\n10|COMPLETED\n")  # no epilog: the reaper ends both
    from tests.conftest import wait_until

    wait_until(lambda: not json.loads(d.xpu("leases", "--json").stdout)["leases"], timeout=10)
    ended = json.loads(d.xpu("leases", "--all", "--json").stdout)["leases"]
    assert {le["state"] for le in ended if le["anchor"]} == {"reclaimed"}


AS_NOBODY = (
    PRELUDE.format(uid=NOBODY)
    + """
out = []
with Client(sys.argv[1]) as c:
    for kw in json.loads(sys.argv[2]):
        try:
            out.append(["granted", c.acquire_lease("xpu", **kw).lease.owner_uid])
        except XpudError as e:
            out.append([type(e).__name__, str(e)])
print(json.dumps(out))
"""
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_only_operators_may_pin_cards_anchor_or_lease_for_someone_else(daemon_factory, short_tmp):
    short_tmp.chmod(0o755)  # the other uid must reach the sockets
    d = daemon_factory()
    asks = [{"cards": [1]}, {"anchor": "slurm:5"}, {"owner_uid": 0}, {}]
    r = subprocess.run(
        [sys.executable, "-c", AS_NOBODY, str(d.runtime_dir), json.dumps(asks)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    refusal = ["Forbidden", "cards, anchor and owner_uid are for operators (the Slurm and kubelet bridges)"]
    assert got == [refusal, refusal, refusal, ["granted", NOBODY]]
