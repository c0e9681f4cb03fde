"""A real Slurm on localhost for the bridge's tests: munged, slurmctld and slurmd from Debian's
`slurm-wlm`, run as root in a temp directory, with slurm.conf's Prolog, Epilog, TaskProlog and
HealthCheckProgram pointing at `xpu slurm ...` for one xpud. Nothing outside the directory is touched
(own munge socket and key, own ports, own state)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import BIN, wait_until

PACKAGES = ("slurm-wlm", "munge")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scontrol")


def missing() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def install() -> str | None:
    """Install Slurm with apt-get when it is not there. Returns why it cannot be used, or None."""
    if not missing():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        absent = ", ".join(missing())
        return f"Slurm is not installed ({absent} missing) and apt-get cannot run here (needs root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for attempt in (0, 1):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode == 0 or attempt:
            break
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
    if missing():
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
        return f"`apt-get install {' '.join(PACKAGES)}` failed: {tail[0]}"
    return None


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmSite:
    """One node (this host) with eight GPUs in gres.conf (device files linked to /dev/null), each cut in
    ``shards`` shards."""

    def __init__(
        self, base: Path, runtime_dir: Path, gpus: int = 8, health_interval_s: int = 2, shards: int = 4,
        minors: list[int] | None = None,
    ):  # fmt: skip
        self.base = base
        self.node = os.uname().nodename.split(".")[0]
        self.conf = base / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[Path] = []
        base.chmod(0o755)
        for d in ("state", "spool", "dev", "out"):
            (base / d).mkdir()
        (base / "out").chmod(0o777)
        for i in minors or range(gpus):  # Slurm wants character devices: /dev/null stands in for /dev/nvidiaN
            (base / "dev" / f"nvidia{i}").symlink_to("/dev/null")
        key = base / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # the hook scripts as a site gets them: `xpu slurm install-hooks` (slurmd gives the health check
        # no SLURM_CONF: a site's is /etc/slurm/slurm.conf, ours is in the temp directory)
        hooks = subprocess.run(
            [str(BIN / "xpu"), "--runtime-dir", str(runtime_dir), "slurm", "install-hooks", "--prefix",
             str(base / "hooks"), "--slurm-conf", str(self.conf), "--log", str(base / "hooks.log")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if hooks.returncode != 0:
            raise RuntimeError(f"xpu slurm install-hooks failed: {hooks.stderr.strip()}")
        self.conf_hooks = hooks.stdout.strip()
        self.gres_conf = base / "gres.conf"
        gres = f"gpu:{gpus},shard:{gpus * shards}"
        self.conf.write_text(
            f"""ClusterName=xputest
SlurmctldHost={self.node}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={base}/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu,shard
{self.conf_hooks}
PrologFlags=Alloc
HealthCheckInterval={health_interval_s}
HealthCheckNodeState=ANY
ReturnToService=2
MinJobAge=2
SlurmdDebug=debug
NodeName={self.node} CPUs={os.cpu_count() or 2} Gres={gres} Features=vxpu-half,vxpu-quarter State=UNKNOWN
PartitionName=main Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def write_gres(self, lines: list[str]) -> None:
        self.gres_conf.write_text("\n".join(lines) + "\n")

    def start(self) -> SlurmSite:
        b = self.base
        self._daemon(
            [
                _sbin("munged"),
                "--force",
                f"--socket={b}/munge.sock",
                f"--key-file={b}/munge.key",
                f"--pid-file={b}/munged.pid",
                f"--log-file={b}/munged.log",
                f"--seed-file={b}/munge.seed",
            ],
            b / "munged.pid",
        )
        self._daemon([_sbin("slurmctld"), "-f", str(self.conf)], b / "slurmctld.pid")
        self._daemon([_sbin("slurmd"), "-f", str(self.conf)], b / "slurmd.pid")
        wait_until(lambda: self.node_state()[0] in ("idle", "mixed", "allocated"), timeout=30, step=0.2)
        return self

    def _daemon(self, argv: list[str], pid_file: Path) -> None:
        p = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {p.stderr.strip()} {self.logs()}")
        self.procs.append(pid_file)
        wait_until(pid_file.exists, timeout=10)

    def stop(self) -> None:
        for pid_file in reversed(self.procs):
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.05)

    def run(self, *argv: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, **kw)

    def sbatch(self, *args: str) -> str:
        p = self.run("sbatch", "--parsable", *args)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        return self.run("squeue", "-h", "-j", job, "--states=all", "-o", "%T").stdout.strip()

    def node_state(self) -> tuple[str, str]:
        out = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T|%E").stdout.strip()
        state, _, reason = out.partition("|")
        return state, reason

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "hooks.log", "munged.log"):
            f = self.base / name
            if f.exists():
                parts.append(f"--- {name}\n" + "\n".join(f.read_text().splitlines()[-15:]))
        return "\n".join(parts)
