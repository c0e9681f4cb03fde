"""`xpu cluster`: the hosts of this daemon's cluster (federation), and `xpu cluster topo`: their network tree.

The CLI's main module adds the group with ``register(app)``. The data is ``Node.GetCluster``: each host's
state (alive, suspect, dead, left), how long ago this daemon last heard of it, its network location and
what it offers (free whole cards, free slices by size, the weakest free card's health, its queue).
"""

from __future__ import annotations

from typing import Annotated

import typer
from xpu_cli import output, vocab

from xpud.api.v1 import xpu_pb2 as pb

cluster_app = typer.Typer(
    help="The hosts this daemon federates with ([cluster] in xpud.toml): state, location, free capacity.",
    invoke_without_command=True,
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
NOT_ON = "federation is off on this daemon: set [cluster] listen, ca, cert and key in xpud.toml (see README)"


def _reply() -> pb.ClusterReply:
    from xpu_cli.output import fail
    from xpu_cli.session import client

    with client() as c:
        reply = c.cluster()
    if not reply.enabled:
        fail(NOT_ON)
    return reply


def _slices(h: pb.ClusterHost) -> str:
    return " ".join(f"{k.removeprefix('vxpu-')}:{v}" for k, v in sorted(h.free_slices.items())) or "-"


def _where(h: pb.ClusterHost) -> str:
    return "/".join(x for x in (h.zone, h.block, h.domain) if x) or "-"


def _age(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else vocab.age(seconds)


@cluster_app.callback()
def cluster(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List the cluster's hosts as this daemon sees them (`topo` for the network tree)."""
    if ctx.invoked_subcommand:
        return
    from xpu_cli.output import handled

    handled(_list)(as_json)


def _list(as_json: bool) -> None:
    reply = _reply()
    if as_json:
        output.print_json(reply)
        return
    rows = []
    for h in reply.hosts:
        mark = "*" if h.self else ""
        if h.state != "alive":  # its last summary is not capacity anyone can use (placement skips it)
            cap = ("-", "-", "-", "-")
        elif h.summary_valid:
            cap = (f"{h.free_whole}/{h.cards}", _slices(h), h.health, h.queue)
        else:
            cap = ("?", "?", "?", "?")
        rows.append((h.name + mark, h.addr, h.state, _age(h.age_s), _where(h), *cap))
    output.table(("HOST", "ADDRESS", "STATE", "HEARD", "LOCATION", "FREE", "SLICES", "HEALTH", "QUEUE"), rows)
    alive = sum(h.state == "alive" for h in reply.hosts)
    print(f"{alive} of {len(reply.hosts)} host(s) alive; * = this host ({reply.name})")


@cluster_app.command("topo")
def topo(as_json: JsonOpt = False) -> None:
    """The zone / block / domain tree with the free capacity under each node (alive hosts only)."""
    from xpu_cli.output import handled

    handled(_topo)(as_json)


def tree(hosts) -> dict:
    """{zone: {block: {domain: [host, ...]}}} of the alive hosts with a summary."""
    out: dict = {}
    for h in hosts:
        if h.state == "alive" and h.summary_valid:
            out.setdefault(h.zone, {}).setdefault(h.block, {}).setdefault(h.domain, []).append(h)
    return out


def _sum(hosts) -> dict:
    slices: dict[str, int] = {}
    for h in hosts:
        for k, v in h.free_slices.items():
            slices[k] = slices.get(k, 0) + v
    return {
        "hosts": len(hosts),
        "cards": sum(h.cards for h in hosts),
        "free_whole": sum(h.free_whole for h in hosts),
        "free_slices": dict(sorted(slices.items())),
    }


def _topo(as_json: bool) -> None:
    reply = _reply()
    t = tree(reply.hosts)

    def flat(node) -> list:
        return node if isinstance(node, list) else [h for child in node.values() for h in flat(child)]

    if as_json:
        doc = {
            "name": reply.name,
            **_sum(flat(t)),
            "zones": [
                {
                    "zone": z,
                    **_sum(flat(blocks)),
                    "blocks": [
                        {
                            "block": b,
                            **_sum(flat(domains)),
                            "domains": [
                                {"domain": d, **_sum(hs), "hosts": [h.name for h in hs]}
                                for d, hs in sorted(domains.items())
                            ],
                        }
                        for b, domains in sorted(blocks.items())
                    ],
                }
                for z, blocks in sorted(t.items())
            ],
        }
        output.print_json(doc)
        return

    def line(indent: int, label: str, hosts) -> None:
        s = _sum(hosts)
        slices = " ".join(f"{k.removeprefix('vxpu-')}:{v}" for k, v in s["free_slices"].items()) or "-"
        print(f"{'  ' * indent}{label}  {s['free_whole']}/{s['cards']} cards free, slices {slices}")

    line(0, f"cluster ({len(flat(t))} alive host(s))", flat(t))
    for z, blocks in sorted(t.items()):
        line(1, f"zone {z or '-'}", flat(blocks))
        for b, domains in sorted(blocks.items()):
            line(2, f"block {b or '-'}", flat(domains))
            for d, hs in sorted(domains.items()):
                line(3, f"domain {d or '-'}", hs)
                for h in sorted(hs, key=lambda h: h.name):
                    line(4, h.name + ("*" if h.self else ""), [h])


def register(app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")
