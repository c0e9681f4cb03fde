"""`xpu slurm`: the hooks slurm.conf points at (Prolog, Epilog, TaskProlog, HealthCheckProgram) and the
gres.conf lines for this host. The decisions are ``xpud.bridges.slurm``'s; this parses, calls, prints.

The CLI's main module adds the commands with ``register(app)``.
"""

from __future__ import annotations

import os
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
    from xpu_cli.main import state

    return state.runtime_dir


def _job_leases(c: Client, job: str) -> list:
    return [le for le in c.leases().leases if le.anchor == slurm.anchor(job)]


@slurm_app.command()
def prolog(
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the cards when xpud users hold them.", min=0, max=86400)
    ] = 0.0,
    shards: Annotated[
        int,
        typer.Option(
            help="Shards per card in gres.conf (`xpu slurm gres --shards N`): a --gres=shard:K job gets the "
            "smallest slice covering K/N of its card (0: shards are not used).",
            min=0,
            max=1024,
        ),
    ] = 0,
    as_json: JsonOpt = False,
) -> None:
    """slurm.conf Prolog (root): lease the job's GPUs in xpud for the job's lifetime, owned by its user.
    A failure exits 1 with the reason, and Slurm drains the node and requeues the job."""
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
            held = slurm.job_shards(slurm.job_detail(job)) if shards and gpus and size is None else 0
            if held:
                size = slurm.size_for_shards(held, shards, sizes)
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
    """gres.conf lines for this host from xpud's inventory (AutoDetect=off; GPUs in xpud's index order)."""
    try:
        with Client(_runtime()) as c:
            cards = [(x.index, x.name) for x in c.cards().cards]
    except XpudError as e:
        output.fail(str(e))
    lines = slurm.gres_lines(node or slurm.node_name(os.environ), cards, dev_dir.rstrip("/") or "/", shards)
    if as_json:
        return output.print_json({"lines": lines, "gpus": len(cards)})
    print("\n".join(lines))


def register(app: typer.Typer) -> None:
    app.add_typer(slurm_app, name="slurm")
