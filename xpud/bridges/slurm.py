"""The Slurm bridge: what `xpu slurm prolog|epilog|taskprolog|healthcheck|gres` decide, and the daemon's
check that a job holding a lease still runs. Slurm's own integration points only; nothing is patched.

- Prolog (slurmd, root): the job's GPUs (``SLURM_JOB_GPUS``, else ``CUDA_VISIBLE_DEVICES``) become one
  lease in xpud owned by the job's user (``SLURM_JOB_UID``) and anchored to the job (``slurm:<id>``);
  a job constraint naming a slice size (``--constraint=vxpu-half``), or ``--gres=shard:K`` (K of the
  card's shards, read from ``scontrol show job -d``), makes it a slice instead.
- TaskProlog (the job's user): prints ``export NAME=value`` for the lease's environment.
- Epilog (root): releases the job's leases. If it never comes, the daemon's reaper asks squeue.
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

log = logging.getLogger("xpud.bridges")

REASON_PREFIX = "xpud:"
REASON_CHARS = 200  # Slurm keeps a node's reason as given; keep ours short enough to read in sinfo
COMMAND_TIMEOUT_S = 10.0
# squeue's states (%T) of a job that still has (or is about to have) its processes on the node
LIVE_STATES = frozenset(
    {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"}
)
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")


class SlurmError(Exception):
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


_SHARDS = re.compile(r"\bJOB_GRES=\S*?\bshard(?::[^:,\s()]+)?:(\d+)")


def job_shards(scontrol_job: str) -> int:
    """Shards the job holds on this node, from ``scontrol show job -d -o`` (0: none)."""
    m = _SHARDS.search(scontrol_job)
    return int(m.group(1)) if m else 0


def size_for_shards(shards: int, per_card: int, sizes: Mapping[str, float]) -> str | None:
    """The slice size for ``shards`` of a card cut in ``per_card`` (gres.conf ``Name=shard Count=``): the
    smallest whose memory fraction covers ``shards / per_card``; None: a whole card (no size is enough)."""
    if not 0 < shards <= per_card:
        raise SlurmError(f"{shards} shard(s) of a card cut in {per_card}: gres.conf and --shards disagree")
    need = shards / per_card
    fits = [(f, name) for name, f in sizes.items() if f + 1e-9 >= need]
    return min(fits)[1] if fits else None


def job_detail(job: str) -> str:
    return _run(["scontrol", "show", "job", "-d", "-o", job])


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
def gres_lines(
    node: str, cards: Sequence[tuple[int, str]], dev_dir: str = "/dev", shards: int = 0
) -> list[str]:
    """gres.conf for this host: one ``Name=gpu`` line per card in xpud's index order (so Slurm's GPU
    indices are xpud's), and ``Name=shard`` lines when ``shards`` > 0. ``cards``: (index, model name)."""
    lines = ["AutoDetect=off"]
    for index, name in sorted(cards):
        lines.append(f"NodeName={node} Name=gpu Type={gpu_type(name)} File={dev_dir}/nvidia{index}")
    if shards:
        for index, _ in sorted(cards):
            lines.append(f"NodeName={node} Name=shard Count={shards} File={dev_dir}/nvidia{index}")
    return lines


def gpu_type(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``: the model word, as Slurm's Type= (and --gres=gpu:h100:1)."""
    words = [w for w in re.split(r"[^0-9A-Za-z]+", name.lower()) if w and w not in ("nvidia", "tesla")]
    return words[0] if words else "gpu"


# ------------------------------------------------------------------------------------------- daemon
class JobCheck:
    """The reaper's question to Slurm: which of these jobs have ended? (squeue, off the event loop.)"""

    def __init__(self, squeue: str = "squeue", conf: str = "", timeout_s: float = COMMAND_TIMEOUT_S):
        self.squeue = squeue
        self.env = {**os.environ, "SLURM_CONF": conf} if conf else None
        self.timeout_s = timeout_s

    async def __call__(self, ids: set[str]) -> dict[str, str]:
        gone = {}
        for jid in sorted(ids):
            why = await self._ended(jid)
            if why:
                gone[jid] = why
        return gone

    async def _ended(self, jid: str) -> str | None:
        """Why job ``jid`` is over, or None while it runs or when Slurm cannot say."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self.squeue, "-h", "-j", jid, "--states=all", "-o", "%T",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env,
            )  # fmt: skip
        except OSError as e:
            log.warning("cannot run %s to check Slurm job %s: %s", self.squeue, jid, e)
            return None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            log.warning("%s -j %s gave no answer in %g s", self.squeue, jid, self.timeout_s)
            return None
        text, errors = out.decode(errors="replace").strip(), err.decode(errors="replace").strip()
        if proc.returncode != 0:
            if "Invalid job id" in errors:
                return "Slurm no longer knows the job (its epilog never came)"
            log.warning("%s -j %s failed: %s", self.squeue, jid, errors[:200])
            return None
        states = text.split()
        if not states:
            return "Slurm no longer knows the job (its epilog never came)"
        if any(s in LIVE_STATES for s in states):
            return None
        return f"the job is {states[0]} (its epilog never came)"
