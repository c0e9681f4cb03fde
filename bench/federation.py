"""Membership (SWIM) at scale, in one process: the same protocol code as the daemon over the simulated
network of ``xpud.federation.simnet``, with a simulated clock.

For each (hosts, loss): hosts join through one seed until every host sees every other alive; then one host
crashes: time until a peer suspects it, time until every peer has it dead (from the crash), false deaths
of live hosts over the whole run, and messages and bytes sent per host per second in the steady state.

    .venv/bin/python bench/federation.py --hosts 100,1000 --loss 0,0.05 --out bench/federation.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xpud.federation.membership import State, SwimConfig
from xpud.federation.simnet import SimNet


def until(net: SimNet, cond, limit: float, step: float = 0.05) -> float | None:
    start = net.now
    while net.now - start < limit:
        if cond():
            return round(net.now - start, 3)
        net.run(step)
    return None


def one(hosts: int, loss: float, seed: int, dead_after: float, steady_s: float) -> dict:
    wall = time.perf_counter()
    net = SimNet(hosts, seed=seed, loss=loss, cfg=SwimConfig.for_dead_after(dead_after))
    joined = until(net, net.converged, limit=300, step=0.5)
    for h in net.hosts.values():
        h.pop_changes()
    m0, b0, t0 = net.stats.messages, net.stats.bytes, net.now
    net.run(steady_s)
    per_host_s = hosts * (net.now - t0)
    msgs, nbytes = (net.stats.messages - m0) / per_host_s, (net.stats.bytes - b0) / per_host_s
    victim = f"h{hosts // 2}"
    net.crash(victim)
    suspected = until(net, lambda: net.share(victim, (State.SUSPECT, State.DEAD)) > 0, limit=30)
    dead_all = until(net, lambda: net.share(victim, (State.DEAD,)) == 1.0, limit=60)
    changes = [c for h in net.hosts.values() for c in h.pop_changes()]
    false_dead = sum(c.state is State.DEAD and c.name != victim for c in changes)
    return {
        "hosts": hosts,
        "loss": loss,
        "seed": seed,
        "converged_s": joined,
        "suspected_s": suspected,
        "dead_everywhere_s": None
        if dead_all is None or suspected is None
        else round(suspected + dead_all, 3),
        "false_deaths": false_dead,
        "messages_per_host_s": round(msgs, 1),
        "bytes_per_host_s": round(nbytes),
        "wall_s": round(time.perf_counter() - wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="100,1000")
    ap.add_argument("--loss", default="0,0.05")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--dead-after", type=float, default=10.0)
    ap.add_argument("--steady", type=float, default=60.0, help="simulated seconds of steady state")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    for n in (int(x) for x in a.hosts.split(",")):
        for loss in (float(x) for x in a.loss.split(",")):
            for seed in (int(x) for x in a.seeds.split(",")):
                r = one(n, loss, seed, a.dead_after, a.steady)
                print(json.dumps(r), file=sys.stderr, flush=True)
                rows.append(r)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    heads = ("hosts", "loss", "join s", "suspect s", "dead s", "false", "msg/h/s", "B/h/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (6, 5, 7, 9, 7, 5, 8, 7), strict=True)))
    for r in rows:
        print(
            f"{r['hosts']:>6} {r['loss']:>5} {r['converged_s']!s:>7} {r['suspected_s']!s:>9} "
            f"{r['dead_everywhere_s']!s:>7} {r['false_deaths']:>5} {r['messages_per_host_s']:>8} "
            f"{r['bytes_per_host_s']:>7}"
        )


if __name__ == "__main__":
    main()
