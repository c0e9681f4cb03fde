"""The Slurm bridge: what `xpu slurm prolog|epilog|taskprolog|healthcheck|gres` decide, and the daemon's
check that a job holding a lease still runs. Slurm's own integration points only; nothing is patched.

- Prolog (slurmd, root): the job's GPUs (``SLURM_JOB_GPUS``, else ``CUDA_VISIBLE_DEVICES``) become one
  lease in xpud owned by the job's user (``SLURM_JOB_UID``) and anchored to the job (``slurm:<id>``);
  a job constraint naming a slice size (``--constraint=vxpu-half``) makes it a slice instead. Everything
  comes from slurmd's environment: a Prolog must not call Slurm commands (slurm.conf(5)). Slurm 22.05
  gives a Prolog no shard count (checked: tests/test_slurm.py), so a ``--gres=shard:K`` job names its
  slice with a constraint too (``size_for_shards`` says which; README "Slurm").
- TaskProlog (the job's user): prints ``export NAME=value`` for the lease's environment.
- Epilog (root): releases the job's leases. If it never comes, the daemon's reaper asks squeue, once per
  interval for all of the host's jobs (``squeue -j a,b,c``).
- HealthCheckProgram (root): drains the node with xpud's reason while a card is unhealthy, resumes it
  when no card is, and never resumes a drain it did not set (its reasons start with ``xpud:``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xpud.errors import XpudError

log = logging.getLogger("xpud.bridges")

REASON_PREFIX = "xpud:"
REASON_CHARS = 200  # Slurm keeps a node's reason as given; keep ours short enough to read in sinfo
COMMAND_TIMEOUT_S = 10.0
# squeue's states (%T) of a job that still has (or is about to have) its processes on the node
LIVE_STATES = frozenset(
    {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"}
)
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")


class SlurmError(XpudError):
    """A Slurm command failed or Slurm's environment is not what the hook needs; one line."""


def anchor(job_id: str) -> str:
    return f"slurm:{job_id}"


def job_id(env: Mapping[str, str]) -> str:
    """The job id from slurmd's environment, checked."""
    jid = env.get("SLURM_JOB_ID", "")
    if not _JOB_ID.fullmatch(jid):
        raise SlurmError(
            f"SLURM_JOB_ID={jid!r}: not a Slurm job id; run this as slurm.conf's Prolog/Epilog/TaskProlog"
        )
    return jid


def job_uid(env: Mapping[str, str]) -> int:
    text = env.get("SLURM_JOB_UID", "")
    if not text.isdigit() or int(text) > 2**31 - 2:
        raise SlurmError(f"SLURM_JOB_UID={text!r}: not a uid; run this as slurm.conf's Prolog")
    return int(text)


def job_gpus(env: Mapping[str, str], uuids: Sequence[str]) -> tuple[int, ...]:
    """The card indices Slurm gave the job: ``SLURM_JOB_GPUS`` (gres.conf's order, which `xpu slurm gres`
    makes xpud's index order), else ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs). ``uuids``: the cards'
    UUIDs by index."""
    text = env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES") or ""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if item.isdigit() and int(item) < len(uuids):
            out.append(int(item))
        elif item in uuids:
            out.append(uuids.index(item))
        else:
            raise SlurmError(
                f"GPU {item!r} in the job's environment is not one of this host's {len(uuids)} card(s): "
                "make gres.conf from `xpu slurm gres`"
            )
    if len(set(out)) != len(out):
        raise SlurmError(f"GPUs {text!r}: a card is named twice")
    return tuple(out)


def slice_size(env: Mapping[str, str], sizes: Sequence[str]) -> str | None:
    """The slice size the job's constraint names (``SLURM_JOB_CONSTRAINTS``, e.g. ``vxpu-half``), if any."""
    named = [w for w in re.split(r"[^0-9A-Za-z_.-]+", env.get("SLURM_JOB_CONSTRAINTS", "")) if w in sizes]
    if len(set(named)) > 1:
        raise SlurmError(f"the job's constraints name {len(set(named))} slice sizes ({', '.join(named)})")
    return named[0] if named else None


def size_for_shards(shards: int, per_card: int, sizes: Mapping[str, float]) -> str | None:
    """The slice size for ``shards`` of a card cut in ``per_card`` (gres.conf ``Name=shard Count=``): the
    smallest whose memory fraction covers ``shards / per_card``; None: a whole card (no size is enough)."""
    if not 0 < shards <= per_card:
        raise SlurmError(f"{shards} shard(s) of a card cut in {per_card}: gres.conf and --shards disagree")
    need = shards / per_card
    fits = [(f, name) for name, f in sizes.items() if f + 1e-9 >= need]
    return min(fits)[1] if fits else None


def export_lines(lease_env: Mapping[str, str]) -> list[str]:
    """TaskProlog output: Slurm adds ``export NAME=value`` lines to the task's environment (as is: no
    quoting, so a value with a newline is left out)."""
    return [f"export {k}={v}" for k, v in sorted(lease_env.items()) if "\n" not in v and "\n" not in k]


# ------------------------------------------------------------------------------------------- health
@dataclass(frozen=True)
class NodeState:
    state: str  # sinfo's %T, e.g. "idle", "drained", "draining", "mixed"
    reason: str  # sinfo's %E ("none" when there is none)

    @property
    def drained(self) -> bool:
        return "drain" in self.state

    @property
    def ours(self) -> bool:
        return self.reason.startswith(REASON_PREFIX)


def drain_reason(bad: Sequence[tuple[int, str, Sequence[str]]]) -> str:
    """``[(card, state, reasons)]`` -> ``"xpud: GPU 3 unhealthy: xid 79 ..."`` (several joined by ``; ``):
    per card its XID reason if it has one (what operators search logs for), else its first."""
    parts = []
    for i, state, reasons in bad:
        why = next((r for r in reasons if r.lower().startswith("xid")), reasons[0] if reasons else "")
        parts.append(f"GPU {i} {state}" + (f": {why}" if why else ""))
    text = f"{REASON_PREFIX} {'; '.join(parts)}"
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def health_action(node: NodeState, reason: str | None) -> tuple[str, str] | None:
    """What to do: ``("drain", reason)``, ``("resume", "")`` or None. ``reason`` None: every card is
    fine. A drain set by someone else is left alone either way."""
    if reason is not None:
        if node.drained and not node.ours:
            return None  # drained already, by someone else: theirs to lift, and the node is out anyway
        if node.drained and node.reason == reason:
            return None
        return ("drain", reason)
    if node.drained and node.ours:
        return ("resume", "")
    return None


def _run(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    try:
        p = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env, check=False
        )
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: not found; install Slurm's commands or put them on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv[:3])}: no answer in {COMMAND_TIMEOUT_S:g} s") from None
    if p.returncode != 0:
        raise SlurmError(f"{' '.join(argv[:3])}: {(p.stderr or p.stdout).strip()[:300]}")
    return p.stdout


def node_state(node: str) -> NodeState:
    out = _run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"])
    line = next((x for x in out.splitlines() if "|" in x), None)
    if line is None:
        raise SlurmError(f"sinfo knows no node {node!r}: give --node (slurm.conf's NodeName)")
    state, _, reason = line.partition("|")
    return NodeState(state.strip().rstrip("*~#!%$@^-"), reason.strip())


def apply(node: str, action: tuple[str, str]) -> None:
    what, reason = action
    argv = ["scontrol", "update", f"nodename={node}", f"state={what}"]
    _run([*argv, f"reason={reason}"] if what == "drain" else argv)


def node_name(env: Mapping[str, str]) -> str:
    return env.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]


# ------------------------------------------------------------------------------------------- gres
# gres.conf(5) (Slurm 22.05, Debian's slurm-wlm; /usr/share/man/man5/gres.conf.5.gz): ``File=`` is the
# card's device node, /dev/nvidia<minor> (the minor, not the NVML index); ``Cores=`` the core index numbers
# (Slurm's logical cores: socket by socket, as lstopo's L#) the card is local to; ``Links=`` one number per
# GPU of the node in gres.conf's order, -1 for the card itself, 0 for no link; one device per line.
# AutoDetect=nvml finds all of it (and MIG's MultipleFiles=); these lines are for a site that writes the file.
@dataclass(frozen=True)
class GresCard:
    index: int  # xpud's (NVML's) index: the line's position, so Slurm's GPU ids are xpud's indices
    name: str
    minor: int | None  # /dev/nvidia<minor>; None: the driver did not say
    cpus: tuple[int, ...] = ()  # CPU ids the card is local to (NVML's affinity)
    mig: bool = False


def gres_lines(
    node: str,
    cards: Sequence[GresCard],
    dev_dir: str = "/dev",
    shards: int = 0,
    nvlinks: Sequence[Sequence[int]] | None = None,
    topology: Mapping[int, tuple[int, int]] | None = None,
) -> list[str]:
    """gres.conf for this host: one ``Name=gpu`` line per card in xpud's index order (Slurm numbers a
    node's GPUs in gres.conf's order: SLURM_JOB_GPUS are then xpud's indices), ``File=`` the card's minor,
    ``Cores=`` when ``topology`` (cpu -> (socket, core id), `cpu_topology()`) knows every CPU of the card,
    ``Links=`` when a card has NVLink (``nvlinks[i][j]``: links between cards i and j), and ``Name=shard``
    lines when ``shards`` > 0. A card without a minor cannot be written (a site uses AutoDetect=nvml)."""
    cards = sorted(cards, key=lambda c: c.index)
    if [c.index for c in cards] != list(range(len(cards))):
        raise SlurmError("the cards' indices are not 0..N-1: use AutoDetect=nvml")
    missing = [c.index for c in cards if c.minor is None]
    if missing:
        raise SlurmError(
            f"the driver gave no minor number for card(s) {', '.join(map(str, missing))}: "
            "their device files are unknown; use AutoDetect=nvml in gres.conf"
        )
    links = nvlinks if nvlinks is not None and any(any(row) for row in nvlinks) else None
    lines = ["AutoDetect=off"]
    for c in cards:
        line = f"NodeName={node} Name=gpu Type={gpu_type(c.name)} File={dev_dir}/nvidia{c.minor}"
        cores = core_list(c.cpus, topology) if topology else None
        if cores:
            line += f" Cores={cores}"
        if links is not None:
            line += " Links=" + ",".join(
                "-1" if j == c.index else str(int(n)) for j, n in enumerate(links[c.index])
            )
        if c.mig:
            line += "  # MIG mode: write MultipleFiles= for its instances, or use AutoDetect=nvml"
        lines.append(line)
    if shards:
        for c in cards:
            lines.append(f"NodeName={node} Name=shard Count={shards} File={dev_dir}/nvidia{c.minor}")
    return lines


def core_list(cpus: Sequence[int], topology: Mapping[int, tuple[int, int]]) -> str | None:
    """gres.conf's ``Cores=`` for CPU ids ``cpus``: the indices of their cores among all of ``topology``'s
    cores ordered by (socket, core id), as ranges (``0-3,8``); None when a CPU is not in ``topology`` (a
    simulated card's CPUs, or an affinity NVML did not give)."""
    if not cpus or any(c not in topology for c in cpus):
        return None
    order = {core: i for i, core in enumerate(sorted(set(topology.values())))}
    return ranges(sorted({order[topology[c]] for c in cpus}))


def ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (sorted, distinct ids)."""
    out: list[str] = []
    start = prev = None
    for i in [*ids, None]:
        if i is not None and prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    return ",".join(out)


def cpu_topology(root: str = "/sys/devices/system/cpu") -> dict[int, tuple[int, int]]:
    """This host's CPUs: cpu id -> (socket, core id), from sysfs (empty when it cannot be read)."""
    out = {}
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    for name in names:
        if not re.fullmatch(r"cpu[0-9]+", name):
            continue
        try:
            pkg = int(Path(root, name, "topology", "physical_package_id").read_text())
            core = int(Path(root, name, "topology", "core_id").read_text())
        except (OSError, ValueError):
            continue
        out[int(name[3:])] = (pkg, core)
    return out


def gpu_type(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``: the model word, as Slurm's Type= (and --gres=gpu:h100:1)."""
    words = [w for w in re.split(r"[^0-9A-Za-z]+", name.lower()) if w and w not in ("nvidia", "tesla")]
    return words[0] if words else "gpu"


# ------------------------------------------------------------------------------------------- hooks
HOOKS = {  # file -> (slurm.conf key, the `xpu slurm` verb)
    "prolog.sh": ("Prolog", "prolog"),
    "epilog.sh": ("Epilog", "epilog"),
    "taskprolog.sh": ("TaskProlog", "taskprolog"),
    "healthcheck.sh": ("HealthCheckProgram", "healthcheck"),
}


def hook_scripts(xpu: str, runtime_dir: str = "", slurm_conf: str = "", log_file: str = "") -> dict[str, str]:
    """The four hook scripts slurm.conf points at, ``{file name: text}``: each runs ``xpu`` (an absolute
    path: slurmd runs hooks with no search path) with the verb. ``runtime_dir``: xpud's, when not the
    default; ``slurm_conf``: for the health check's sinfo/scontrol (slurmd gives it no SLURM_CONF);
    ``log_file``: where the hooks' errors go (slurmd keeps none)."""
    if not os.path.isabs(xpu):
        raise SlurmError(f"{xpu}: give the xpu command as an absolute path")
    for what, value in (("--runtime-dir", runtime_dir), ("--slurm-conf", slurm_conf), ("--log", log_file)):
        if value and (not os.path.isabs(value) or not re.fullmatch(r"[A-Za-z0-9_./+@:-]+", value)):
            raise SlurmError(f"{what} {value!r}: give an absolute path of letters, digits and ._/+@:-")
    exports = [f"XPUD_RUNTIME_DIR={runtime_dir}"] if runtime_dir else []
    if slurm_conf:
        exports.append(f"SLURM_CONF={slurm_conf}")
    out = {}
    for name, (key, verb) in HOOKS.items():
        lines = ["#!/bin/sh", f"# slurm.conf: {key}=<this file>. Written by `xpu slurm install-hooks`."]
        if exports:
            lines.append("export " + " ".join(exports))
        lines.append(f"exec {xpu} slurm {verb}" + (f" 2>>{log_file}" if log_file else ""))
        out[name] = "\n".join(lines) + "\n"
    return out


def conf_lines(prefix: str) -> list[str]:
    """The slurm.conf lines for hooks installed in ``prefix``."""
    return [f"{key}={prefix}/{name}" for name, (key, _) in HOOKS.items()]


# ------------------------------------------------------------------------------------------- daemon
class JobCheck:
    """The reaper's question to Slurm: which of these jobs have ended? (squeue, off the event loop.)"""

    def __init__(self, squeue: str = "squeue", conf: str = "", timeout_s: float = COMMAND_TIMEOUT_S):
        self.squeue = squeue
        self.env = {**os.environ, "SLURM_CONF": conf} if conf else None
        self.timeout_s = timeout_s

    async def __call__(self, ids: set[str]) -> dict[str, str]:
        """``{job: why}`` for the jobs of ``ids`` that are over: one ``squeue -j a,b,c`` for all of them.
        A job squeue does not list is over; when squeue cannot answer, none is (their leases stay)."""
        jobs = sorted(j for j in ids if _JOB_ID.fullmatch(j))
        if not jobs:
            return {}
        argv = [self.squeue, "-h", "-j", ",".join(jobs), "--states=all", "-o", "%i|%T"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env
            )
        except OSError as e:
            log.warning("cannot run %s to check %d Slurm job(s): %s", self.squeue, len(jobs), e)
            return {}
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            log.warning("%s -j %s gave no answer in %g s", self.squeue, argv[3][:100], self.timeout_s)
            return {}
        text, errors = out.decode(errors="replace"), err.decode(errors="replace").strip()
        unknown = "Slurm no longer knows the job (its epilog never came)"
        if proc.returncode != 0:
            if "Invalid job id" in errors:  # squeue says so when it knows none of them
                return dict.fromkeys(jobs, unknown)
            log.warning("%s -j %s failed: %s", self.squeue, argv[3][:100], errors[:200])
            return {}
        states: dict[str, list[str]] = {}
        for line in text.splitlines():
            jid, _, state = line.strip().partition("|")
            states.setdefault(jid, []).append(state.strip())
        gone = {}
        for jid in jobs:
            seen = states.get(jid)
            if not seen:
                gone[jid] = unknown
            elif not any(s in LIVE_STATES for s in seen):
                gone[jid] = f"the job is {seen[0]} (its epilog never came)"
        return gone
