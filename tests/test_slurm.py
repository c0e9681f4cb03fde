"""The Slurm bridge against a real Slurm (Debian's slurm-wlm: munged, slurmctld, slurmd on this host) and a
simulated xpud: slurm.conf's Prolog/Epilog/TaskProlog/HealthCheckProgram are `xpu slurm ...`, gres.conf
is `xpu slurm gres`, and jobs go in with sbatch and srun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, poll, wait_until, xpu_env
from tests.daemons import DaemonProc
from tests.slurm_site import SlurmSite, install

# real Slurm daemons: their set-up took over 120 s on a heavily loaded host
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLEAR_S = 1.5


@pytest.fixture(scope="module")
def site():
    why = install()
    if why:
        pytest.skip(why)
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their users: these tests run Slurm as root")
    base = Path(tempfile.mkdtemp(prefix="xs-", dir="/tmp"))
    slurm = d = None
    try:
        (base / "x").mkdir()
        (base / "s").mkdir()
        config = f"""
[leases]
grace_s = 30.0
[health]
clear_s = {CLEAR_S}
event_window_s = 4.0
[slurm]
check_interval_s = 1.0
conf = "{base / "s" / "slurm.conf"}"
"""
        d = DaemonProc(base / "x", "pcie-8x-l40s", config).start()
        slurm = SlurmSite(base / "s", d.runtime_dir)
        gres = d.xpu(
            "slurm", "gres", "--dev-dir", str(base / "s" / "dev"), "--node", slurm.node, "--shards", "4"
        )
        assert gres.returncode == 0, gres.stderr
        slurm.write_gres(gres.stdout.splitlines())
        slurm.start()
        yield d, slurm
    finally:
        if slurm is not None:
            slurm.stop()
        if d is not None:
            d.kill()
        shutil.rmtree(base, ignore_errors=True)


def job_leases(d, job: str, all_: bool = False) -> list[dict]:
    out = d.xpu("leases", "--json", *(["--all"] if all_ else []))
    assert out.returncode == 0, out.stderr
    return [le for le in json.loads(out.stdout)["leases"] if le["anchor"] == f"slurm:{job}"]


def env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_gres_conf_comes_from_the_inventory_and_slurmd_takes_it(site):
    d, slurm = site
    lines = slurm.gres_conf.read_text().splitlines()
    assert lines[0] == "AutoDetect=off"
    assert [x.split(" Cores=")[0] for x in lines[1:9]] == [
        f"NodeName={slurm.node} Name=gpu Type=l40s File={slurm.base}/dev/nvidia{i}" for i in range(8)
    ]
    assert lines[9:] == [
        f"NodeName={slurm.node} Name=shard Count=4 File={slurm.base}/dev/nvidia{i}" for i in range(8)
    ]
    assert slurm.run("sinfo", "-h", "-N", "-o", "%G").stdout.strip() == "gpu:8,shard:32"
    out = json.loads(d.xpu("slurm", "gres", "--shards", "4", "--json").stdout)
    assert out["gpus"] == 8 and sum("Name=shard Count=4" in x for x in out["lines"]) == 8


def test_a_batch_jobs_gpus_are_leased_for_its_lifetime_and_freed_after(site):
    d, slurm = site
    go = slurm.base / "out" / "go"
    job = slurm.sbatch(
        "--gres=gpu:2",
        "-o",
        f"{slurm.base}/out/%j.out",
        "--wrap",
        f"env > {slurm.base}/out/$SLURM_JOB_ID.env; while [ ! -e {go} ]; do sleep 0.1; done",
    )
    (lease,) = wait_until(lambda: job_leases(d, job), timeout=30)
    envfile = slurm.base / "out" / f"{job}.env"
    wait_until(lambda: envfile.exists() and "SLURM_JOB_GPUS" in envfile.read_text(), timeout=10)
    task = env_of(envfile.read_text())
    # the cards Slurm gave the job are the lease's, owned by the job's user, and the task runs with the
    # lease's environment (TaskProlog): the cards' UUIDs, the lease id
    assert lease["cards"] == [int(x) for x in task["SLURM_JOB_GPUS"].split(",")]
    assert lease["owner_uid"] == os.geteuid() and lease["mode"] == "xpu" and not lease["held"]
    assert task["CUDA_VISIBLE_DEVICES"] == lease["env"]["CUDA_VISIBLE_DEVICES"]
    assert task["XPU_LEASE_ID"] == lease["id"]
    again = hook(d, slurm, "prolog", SLURM_JOB_ID=job, SLURM_JOB_UID="0", SLURM_JOB_GPUS="6,7")
    assert again.returncode == 0 and f"already leased xpu on card(s) {task['SLURM_JOB_GPUS']}" in again.stdout
    # bare-metal users cannot have those cards meanwhile: 6 of 8 are left
    assert d.xpu("run", "--gpus", "7", "--", "true").returncode != 0
    assert d.xpu("run", "--gpus", "6", "--", "true").returncode == 0
    # no Hold stream, yet the reaper keeps it while Slurm runs the job (checked every second here)
    time.sleep(2.5)
    assert [le["id"] for le in job_leases(d, job)] == [lease["id"]]
    go.touch()
    wait_until(lambda: not job_leases(d, job), timeout=30)
    (ended,) = job_leases(d, job, all_=True)
    assert ended["state"] == "released"  # by the epilog, not the reaper
    assert d.xpu("run", "--gpus", "8", "--", "true").returncode == 0


def test_srun_with_a_slice_constraint_gets_an_enforced_slice(site):
    d, slurm = site
    p = slurm.run("srun", "--gres=gpu:1", "--constraint=vxpu-half", "env")
    assert p.returncode == 0, p.stderr + slurm.logs()
    task = env_of(p.stdout)
    assert task["XPU_MODE"] == "vxpu-half"
    assert task["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30" and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in task
    job = task["SLURM_JOB_ID"]
    wait_until(lambda: not job_leases(d, job), timeout=30)
    (ended,) = job_leases(d, job, all_=True)
    assert ended["mode"] == "vxpu-half" and ended["cards"] == [int(task["SLURM_STEP_GPUS"])]


def test_shard_jobs_get_the_slice_their_constraint_names(site):
    # Slurm 22.05 gives a Prolog no shard count (its environment has SLURM_JOB_GPUS and
    # SLURM_JOB_CONSTRAINTS, nothing of --gres=shard:K), and a Prolog must not ask slurmctld: a shard job
    # names its slice, as README "Slurm" says.
    d, slurm = site
    for shards, size in (("1", "vxpu-quarter"), ("2", "vxpu-half")):
        p = slurm.run("srun", f"--gres=shard:{shards}", f"--constraint={size}", "env")
        assert p.returncode == 0, p.stderr + slurm.logs()
        task = env_of(p.stdout)
        assert task["XPU_MODE"] == size and task["SLURM_SHARDS_ON_NODE"] == shards
        wait_until(lambda job=task["SLURM_JOB_ID"]: not job_leases(d, job), timeout=30)
        (ended,) = job_leases(d, task["SLURM_JOB_ID"], all_=True)
        assert ended["mode"] == size and ended["cards"] == [int(task["SLURM_STEP_GPUS"])]


def hook(d, slurm, name: str, **env: str):
    full = xpu_env(d.runtime_dir, SLURM_CONF=str(slurm.conf), **env)
    return subprocess.run(
        [str(BIN / "xpu"), "slurm", name], env=full, capture_output=True, text=True, timeout=60
    )


def test_a_lease_whose_epilog_never_came_is_reclaimed_once_slurm_has_no_such_job(site):
    d, slurm = site
    go = slurm.base / "out" / "go-reap"
    running = slurm.sbatch(
        "--gres=gpu:1", "-o", "/dev/null", "--wrap", f"while [ ! -e {go} ]; do sleep 0.1; done"
    )
    wait_until(lambda: job_leases(d, running), timeout=30)
    # two leases of jobs Slurm never knew, beside a running job's: one squeue for all three each interval
    for job, card in (("424242", "5"), ("424243", "6")):
        p = hook(d, slurm, "prolog", SLURM_JOB_ID=job, SLURM_JOB_UID="0", SLURM_JOB_GPUS=card)
        assert p.returncode == 0, p.stderr
        assert f"card(s) {card} for slurm:{job}" in p.stdout
    wait_until(lambda: not job_leases(d, "424242") and not job_leases(d, "424243"), timeout=15)
    for job in ("424242", "424243"):
        (ended,) = job_leases(d, job, all_=True)
        assert ended["state"] == "reclaimed"
    assert job_leases(d, running)  # its job runs: kept
    go.touch()
    wait_until(lambda: not job_leases(d, running), timeout=30)


def test_a_prolog_cannot_take_a_card_a_bare_metal_lease_holds(site):
    d, slurm = site
    with d.client() as c:
        g = c.acquire_lease("xpu", gpus=1)
        try:
            held = g.lease.cards[0]
            p = hook(d, slurm, "prolog", SLURM_JOB_ID="77", SLURM_JOB_UID="0", SLURM_JOB_GPUS=str(held))
            assert p.returncode == 1
            assert f"card {held} is held by lease {g.lease.id}" in p.stderr, p.stderr
            assert not job_leases(d, "77")
        finally:
            c.release(g.lease.id, g.token)
    bad = hook(d, slurm, "prolog", SLURM_JOB_ID="78", SLURM_JOB_UID="0", SLURM_JOB_GPUS="9")
    assert bad.returncode == 1 and "not one of this host's 8 card(s)" in bad.stderr
    assert hook(d, slurm, "epilog").returncode == 1  # not run by slurmd: says so
    assert hook(d, slurm, "epilog", SLURM_JOB_ID="78").returncode == 0  # nothing to release: fine


def test_an_unhealthy_card_drains_the_node_with_xpuds_reason_and_recovery_resumes_it(site):
    d, slurm = site
    assert d.xpu("fault", "inject", "3", "xid", "79").returncode == 0
    drained = poll(
        lambda: (s := slurm.node_state())[0].startswith("drain") and "xid" in s[1] and s, timeout=20
    )
    assert drained, f"{slurm.node_state()} {slurm.logs()}"
    reason = drained[1]
    assert reason.startswith("xpud: GPU 3 unhealthy: xid 79"), reason
    # a job is not started on a drained node
    assert d.xpu("fault", "clear", "3").returncode == 0
    wait_until(lambda: slurm.node_state()[0] == "idle", timeout=25 + CLEAR_S)
    # a drain someone else set is theirs to lift: the health check leaves it
    p = slurm.run("scontrol", "update", f"nodename={slurm.node}", "state=drain", "reason=maintenance")
    assert p.returncode == 0, p.stderr
    time.sleep(5)
    assert slurm.node_state() == ("drained", "maintenance")
    assert d.xpu("fault", "inject", "2", "xid", "79").returncode == 0
    time.sleep(5)
    assert slurm.node_state() == ("drained", "maintenance")
    assert d.xpu("fault", "clear", "2").returncode == 0
    slurm.run("scontrol", "update", f"nodename={slurm.node}", "state=resume")
    wait_until(lambda: slurm.node_state()[0] == "idle", timeout=25 + CLEAR_S)


def test_gres_conf_on_a_dgx_a100_names_each_cards_minor_and_slurm_numbers_gpus_as_xpud(tmp_path_factory):
    """dgx-a100's device minors are not in NVML order ([2, 3, 0, 1, 6, 7, 4, 5]): gres.conf's File= must be
    /dev/nvidia<minor> (gres.conf(5): File, Links). slurmd takes the lines in their order, so the GPU
    Slurm calls 0 (SLURM_JOB_GPUS) is xpud's card 0, whose device is /dev/nvidia2."""
    if install() or os.geteuid() != 0:
        pytest.skip("needs Slurm, run as root")
    base = Path(tempfile.mkdtemp(prefix="xs-", dir="/tmp"))
    slurm = d = None
    try:
        (base / "x").mkdir()
        (base / "s").mkdir()
        d = DaemonProc(base / "x", "dgx-a100", "[leases]\ngrace_s = 30.0\n").start()
        cards = json.loads(d.xpu("ls", "--json").stdout)
        rows = cards["cards"] if isinstance(cards, dict) else cards
        minors = [c["minor_number"] for c in sorted(rows, key=lambda c: c["index"])]
        assert minors == [2, 3, 0, 1, 6, 7, 4, 5]
        slurm = SlurmSite(base / "s", d.runtime_dir, minors=minors)
        gres = d.xpu("slurm", "gres", "--dev-dir", str(base / "s" / "dev"), "--node", slurm.node)
        assert gres.returncode == 0, gres.stderr
        lines = gres.stdout.splitlines()
        files = [x.split(" File=")[1].split()[0] for x in lines[1:]]
        assert files == [f"{slurm.base}/dev/nvidia{m}" for m in minors]
        links = [x.split(" Links=")[1].split()[0].split(",") for x in lines[1:]]
        assert all(row[i] == "-1" and len(row) == 8 for i, row in enumerate(links))
        assert all(int(v) > 0 for i, row in enumerate(links) for j, v in enumerate(row) if i != j)  # NVSwitch
        slurm.write_gres(lines)
        slurm.start()
        assert slurm.run("sinfo", "-h", "-N", "-o", "%G").stdout.strip().startswith("gpu:8")
        # slurmd's own reading of the file: its GPUs in the file's order, each with its Links
        log = (slurm.base / "slurmd.log").read_text()
        final = log[log.rindex("Final gres.conf list") :]
        seen = [x.split("File:")[1].split()[0] for x in final.splitlines() if "GRES[gpu]" in x]
        assert seen == files, log[-3000:]
        p = slurm.run("srun", "--gres=gpu:1", "env")
        assert p.returncode == 0, p.stderr + slurm.logs()
        task = env_of(p.stdout)
        ended = wait_until(lambda: job_leases(d, task["SLURM_JOB_ID"], all_=True), timeout=30)
        assert ended[0]["cards"] == [int(task["SLURM_STEP_GPUS"])] == [0]
    finally:
        if slurm is not None:
            slurm.stop()
        if d is not None:
            d.kill()
        shutil.rmtree(base, ignore_errors=True)
