"""`xpu slurm`: the hooks slurm.conf points at (Prolog, Epilog, TaskProlog, HealthCheckProgram) and the
gres.conf lines for this host. The decisions are ``xpud.bridges.slurm``'s; this parses, calls, prints.

The CLI's main module adds the commands with ``register(app)``.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Annotated

import typer
from xpu_cli import output

from xpud.api.client import Client
from xpud.bridges import slurm
from xpud.errors import XpudError

slurm_app = typer.Typer(
    no_args_is_help=True,
    help="Slurm's hooks over xpud's ledger: prolog/epilog lease a job's GPUs, healthcheck drains the node "
    "while a card is unhealthy, gres prints gres.conf.",
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _runtime() -> str | None:
    from xpu_cli.session import state

    return state.runtime_dir


def _job_leases(c: Client, job: str) -> list:
    return [le for le in c.leases().leases if le.anchor == slurm.anchor(job)]


@slurm_app.command()
def prolog(
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the cards when xpud users hold them.", min=0, max=86400)
    ] = 0.0,
    as_json: JsonOpt = False,
) -> None:
    """slurm.conf Prolog (root): lease the job's GPUs in xpud for the job's lifetime, owned by its user;
    a slice when the job's constraint names a size. Only slurmd's environment is read (a Prolog must
    not call Slurm commands). A failure exits 1 with the reason, and Slurm drains the node and requeues
    the job."""
    env = os.environ
    try:
        job, uid = slurm.job_id(env), slurm.job_uid(env)
        with Client(_runtime(), admin=True) as c:
            existing = _job_leases(c, job)
            if existing:  # run twice (a requeue on the same node): the lease is there already
                return _report(existing[0], as_json, "already leased")
            cards = c.cards().cards
            gpus = slurm.job_gpus(env, [x.uuid for x in cards])
            sizes = {s.name: s.memory_fraction for s in c.info().slice_sizes}
            size = slurm.slice_size(env, list(sizes))
            if size is None and not gpus:
                if as_json:
                    output.print_json({"job": job, "lease": None})
                return None  # a job without GPUs: nothing to lease
            granted = c.acquire_lease(
                size or "xpu",
                gpus=len(gpus) if size is None else 1,
                cards=gpus,
                anchor=slurm.anchor(job),
                owner_uid=uid,
                wait_s=wait,
                command=f"slurm job {job}",
            )
    except (XpudError, slurm.SlurmError) as e:
        output.fail(f"job {env.get('SLURM_JOB_ID', '?')}: {e}")
    _report(granted.lease, as_json, "leased")


def _report(lease, as_json: bool, what: str) -> None:
    if as_json:
        return output.print_json({"job": lease.anchor.partition(":")[2], "lease": output.to_dict(lease)})
    cards = ",".join(map(str, lease.cards))
    print(f"{what} {lease.mode} on card(s) {cards} for {lease.anchor} as lease {lease.id}")


@slurm_app.command()
def epilog(as_json: JsonOpt = False) -> None:
    """slurm.conf Epilog (root): release the job's leases (none: nothing to do)."""
    try:
        job = slurm.job_id(os.environ)
        with Client(_runtime(), admin=True) as c:
            released = [c.release(le.id) for le in _job_leases(c, job)]
    except (XpudError, slurm.SlurmError) as e:
        output.fail(f"job {os.environ.get('SLURM_JOB_ID', '?')}: {e}")
    if as_json:
        return output.print_json({"job": job, "released": [le.id for le in released]})
    for le in released:
        print(f"released lease {le.id} of slurm job {job}")


@slurm_app.command()
def taskprolog() -> None:
    """slurm.conf TaskProlog (the job's user): `export NAME=value` lines with the lease's environment."""
    try:
        job = slurm.job_id(os.environ)
        with Client(_runtime()) as c:
            leases = _job_leases(c, job)
    except (XpudError, slurm.SlurmError) as e:
        output.fail(f"job {os.environ.get('SLURM_JOB_ID', '?')}: {e}")
    for le in leases:
        print("\n".join(slurm.export_lines(dict(le.env))))


@slurm_app.command()
def healthcheck(
    node: Annotated[
        str | None, typer.Option(help="Slurm's name for this node (default: SLURMD_NODENAME, the hostname).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """slurm.conf HealthCheckProgram (root): drain this node while xpud has an unhealthy card (reason
    "xpud: GPU 3 unhealthy: XID 79"); resume it once none is, if the drain was xpud's."""
    name = node or slurm.node_name(os.environ)
    try:
        with Client(_runtime()) as c:
            bad = [(h.index, h.state, list(h.reasons)) for h in c.health().cards if h.state == "unhealthy"]
        reason = slurm.drain_reason(bad) if bad else None
    except XpudError as e:  # no xpud: no job here can get its GPUs
        reason = f"{slurm.REASON_PREFIX} daemon not reachable: {str(e)[:120]}"
    try:
        state = slurm.node_state(name)
        action = slurm.health_action(state, reason)
        if action:
            slurm.apply(name, action)
    except slurm.SlurmError as e:
        output.fail(str(e))
    if as_json:
        return output.print_json(
            {"node": name, "state": state.state, "reason": state.reason, "unhealthy": reason}
            | {"action": action[0] if action else None}
        )
    if action:
        print(f"node {name}: {action[0]}" + (f" ({action[1]})" if action[1] else ""))


@slurm_app.command()
def gres(
    dev_dir: Annotated[str, typer.Option(help="Where the cards' device files are.")] = "/dev",
    shards: Annotated[
        int, typer.Option(help="Also Name=shard lines with this Count per card (0: none).", min=0, max=1024)
    ] = 0,
    node: Annotated[str | None, typer.Option(help="NodeName= (default: the hostname).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """gres.conf lines for this host from xpud's inventory, for a site that writes the file itself
    (AutoDetect=nvml finds the same: prefer it). GPUs in xpud's index order; File= the card's minor
    number (/dev/nvidia<minor>); Cores= from this host's CPU topology; Links= the NVLink counts."""
    try:
        with Client(_runtime()) as c:
            topo = c.topology()
    except XpudError as e:
        output.fail(str(e))
    cards = [
        slurm.GresCard(
            x.index,
            x.name,
            x.minor_number if x.HasField("minor_number") else None,
            tuple(x.cpu_affinity),
            x.mig_enabled,
        )
        for x in topo.cards
    ]
    n = topo.size
    nvlinks = (
        [list(topo.nvlinks[i * n : (i + 1) * n]) for i in range(n)] if len(topo.nvlinks) == n * n else None
    )
    try:
        lines = slurm.gres_lines(
            node or slurm.node_name(os.environ),
            cards,
            dev_dir.rstrip("/") or "/",
            shards,
            nvlinks=nvlinks,
            topology=slurm.cpu_topology(),
        )
    except slurm.SlurmError as e:
        output.fail(str(e))
    if as_json:
        return output.print_json({"lines": lines, "gpus": len(cards)})
    print("\n".join(lines))


def _this_xpu() -> str:
    """The absolute path of the xpu running now (the hooks run exactly this one)."""
    here = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(here) == "xpu" and os.access(here, os.X_OK):
        return os.path.abspath(sys.argv[0])
    beside = os.path.join(os.path.dirname(sys.executable), "xpu")
    return beside if os.access(beside, os.X_OK) else shutil.which("xpu") or beside


@slurm_app.command("install-hooks")
def install_hooks(
    prefix: Annotated[
        str,
        typer.Option(help="The directory to write prolog.sh, epilog.sh, taskprolog.sh, healthcheck.sh to."),
    ] = "/etc/slurm/xpud",
    slurm_conf: Annotated[
        str, typer.Option(help="slurm.conf's path, for the health check's sinfo/scontrol.")
    ] = "/etc/slurm/slurm.conf",
    log: Annotated[
        str, typer.Option(help="Append the hooks' errors to this file ('' : slurmd drops them).")
    ] = "",
    as_json: JsonOpt = False,
) -> None:
    """Write the four hook scripts slurm.conf points at, each running this xpu by its absolute path, and
    print the slurm.conf lines that name them."""
    from xpu_cli.session import state

    try:
        scripts = slurm.hook_scripts(_this_xpu(), state.runtime_dir or "", slurm_conf, log)
        if not os.path.isabs(prefix):
            raise slurm.SlurmError(f"--prefix {prefix}: give an absolute path")
        os.makedirs(prefix, mode=0o755, exist_ok=True)
        for name, text in scripts.items():
            path = os.path.join(prefix, name)
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
    except (OSError, slurm.SlurmError) as e:
        output.fail(f"install-hooks: {e}")
    lines = slurm.conf_lines(os.path.normpath(prefix))
    if as_json:
        return output.print_json({"prefix": prefix, "files": sorted(scripts), "slurm_conf": lines})
    print("\n".join(lines))


def register(app: typer.Typer) -> None:
    app.add_typer(slurm_app, name="slurm")
