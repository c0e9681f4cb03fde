"""Membership (SWIM) at scale, in one process: the same protocol code as the daemon over the simulated
network of ``xpud.federation.simnet``, with a simulated clock.

For each (hosts, loss): hosts join through one seed until every host sees every other alive; then one host
crashes: time until a peer suspects it, time until every peer has it dead (from the crash), false deaths
of live hosts over the whole run, and messages and bytes sent per host per second in the steady state.

    .venv/bin/python bench/federation.py --hosts 100,1000 --loss 0,0.05 --out bench/federation.json

``--churn``: instead, every host starts knowing every other (``SimNet(joined=True)``: a cluster long
after its joins; each host's meta a real capacity summary, ``view.encode``), runs ``--settle`` seconds,
then ``--window`` simulated seconds of churn: each live host changes its capacity at
``--capacity-rate`` per second (a Poisson process; the daemon's ``set_meta`` + ``gossip_now``), and
``--joins``, ``--leaves`` (clean) and ``--crashes`` per minute (evenly spaced, random phase); then
``--drain`` seconds without news.
From every host's own change log: how long each piece of news took to reach every host live throughout
(capacity: the new incarnation or a later one), suspicions and deaths of live hosts, and messages and bytes
per host per second over the window.

    nice -n 10 .venv/bin/python bench/federation.py --churn --hosts 1000 --loss 0,0.05 \\
        --out bench/federation_churn.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xpud.federation import view
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


def summary(free: int, zone: int) -> str:
    """An 8-card host's meta as the daemon publishes it (HGX: NVLink groups of up to 8)."""
    groups = tuple([math.inf] + [450.0] * (free - 1)) if free else ()
    slices = {"half": 2 * free, "quarter": 4 * free} if free else {}
    s = view.HostSummary(8, free, groups, slices, 97, 0, f"z{zone}", f"b{zone * 4}", f"d{zone * 16}")
    return view.encode(s)


def _quantiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)  # noqa: E731
    return {"n": len(xs), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(xs[-1], 3)}


def churn(a, hosts: int, loss: float, seed: int) -> dict:
    wall = time.perf_counter()
    rng = random.Random(seed + 7)
    net = SimNet(hosts, seed=seed, loss=loss, cfg=SwimConfig.for_dead_after(a.dead_after), joined=True,
                 meta=lambda name: summary(rng.randrange(9), rng.randrange(8)))  # fmt: skip
    net.run(a.settle / 2)  # probes, gossip and push-pull under way; the first rounds' timers spread
    s0, sm, sb = net.now, net.stats.messages, net.stats.bytes
    net.run(a.settle / 2)  # the same cluster without news: the baseline of the traffic figures
    quiet = (
        (net.stats.messages - sm) / (hosts * (net.now - s0)),
        (net.stats.bytes - sb) / (hosts * (net.now - s0)),
    )
    for h in net.hosts.values():
        h.pop_changes()
    t0, m0, b0 = net.now, net.stats.messages, net.stats.bytes
    events = []  # (time, kind): capacity changes as a Poisson process, joins/leaves/crashes evenly spaced
    t = t0 + rng.expovariate(a.capacity_rate * hosts) if a.capacity_rate > 0 else math.inf
    while t < t0 + a.window:
        events.append((t, "capacity"))
        t += rng.expovariate(a.capacity_rate * hosts)
    for kind, per_min in (("join", a.joins), ("leave", a.leaves), ("crash", a.crashes)):
        gap, phase = (60.0 / per_min, rng.random()) if per_min > 0 else (math.inf, 0.0)
        events += [
            (t0 + (k + phase) * gap, kind)
            for k in range(int(a.window / gap + 1))
            if (k + phase) * gap < a.window
        ]
    events.sort()
    live_since = {n: 0.0 for n in net.live()}  # host -> when it joined (0: before the window)
    gone_at: dict[str, float] = {}  # host -> when it left or crashed
    news = []  # (kind, host, incarnation or 0, time)
    host_s, last, fresh = 0.0, t0, hosts
    for at, kind in events:
        host_s += len(live_since) * (at - last)
        net.run(at - net.now)
        last = at
        live = sorted(live_since)
        if kind == "capacity":
            name = rng.choice(live)
            meta = net.hosts[name].meta
            while meta == net.hosts[name].meta:  # news: its free capacity is not what it was
                meta = summary(rng.randrange(9), rng.randrange(8))
            news.append(("capacity", name, net.set_meta(name, meta), at))
        elif kind == "join":
            name, fresh = f"h{fresh}", fresh + 1
            net.add(name, seeds=[net.hosts[rng.choice(live)].addr])
            live_since[name] = at
            news.append(("join", name, 0, at))
        else:
            name = rng.choice(live[1:])  # h0 stays: it is the seed of the first joins
            net.leave(name) if kind == "leave" else net.crash(name)
            del live_since[name]
            gone_at[name] = at
            news.append((kind, name, 0, at))
    host_s += len(live_since) * (t0 + a.window - last)
    net.run(t0 + a.window - net.now)
    msgs, nbytes = (net.stats.messages - m0) / host_s, (net.stats.bytes - b0) / host_s
    net.run(a.drain)
    logs: dict[str, dict[str, list]] = {}  # observer -> member -> [(at, state, incarnation)]
    false_dead, suspicions = set(), set()  # (host, incarnation): one per incident, however many heard it
    for o in live_since:
        for c in net.hosts[o].pop_changes():
            logs.setdefault(o, {}).setdefault(c.name, []).append((c.at, c.state, c.incarnation))
            live_then = c.name in net.hosts and (c.name not in gone_at or c.at < gone_at[c.name])
            if live_then and c.name != o and c.state in (State.SUSPECT, State.DEAD):
                (false_dead if c.state is State.DEAD else suspicions).add((c.name, c.incarnation))
    reach: dict[str, list[float]] = {"capacity": [], "join": [], "leave": [], "crash": []}
    missed = dict.fromkeys(reach, 0)
    for kind, name, inc, at in news:
        if kind in ("capacity", "join") and name in gone_at:
            continue  # gone again before the end: whether all heard it is moot
        want = {"capacity": None, "join": State.ALIVE, "leave": State.LEFT, "crash": State.DEAD}[kind]
        worst = 0.0
        for o, since in live_since.items():
            if o == name or since > at:
                continue  # only hosts there when it happened and still there at the end
            heard = [
                t for t, st, i in logs.get(o, {}).get(name, ())
                if t >= at and (i >= inc if kind == "capacity" else st is want)
            ]  # fmt: skip
            if not heard:
                worst = None
                break
            worst = max(worst, heard[0] - at)
        if worst is None:
            missed[kind] += 1
        else:
            reach[kind].append(worst)
    return {
        "hosts": hosts,
        "loss": loss,
        "seed": seed,
        "window_s": a.window,
        "news": {k: sum(n[0] == k for n in news) for k in reach},
        "reach_all_s": {k: _quantiles(v) for k, v in reach.items()},
        "reach_all_mean_s": {k: round(statistics.fmean(v), 3) for k, v in reach.items() if v},
        "never_reached_all": missed,
        "false_deaths": len(false_dead),
        "suspicions_of_live_hosts": len(suspicions),
        "messages_per_host_s": round(msgs, 1),
        "bytes_per_host_s": round(nbytes),
        "without_news": {"messages_per_host_s": round(quiet[0], 1), "bytes_per_host_s": round(quiet[1])},
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
    ap.add_argument("--churn", action="store_true", help="measure gossip under churn (see above)")
    ap.add_argument("--settle", type=float, default=20.0, help="simulated seconds before the churn")
    ap.add_argument("--window", type=float, default=60.0, help="simulated seconds of churn")
    ap.add_argument("--drain", type=float, default=15.0, help="simulated seconds after it, no news")
    ap.add_argument("--capacity-rate", type=float, default=0.01, help="capacity changes per host per second")
    ap.add_argument("--joins", type=float, default=3.0, help="hosts joining per minute")
    ap.add_argument("--leaves", type=float, default=3.0, help="hosts leaving cleanly per minute")
    ap.add_argument("--crashes", type=float, default=1.0, help="hosts crashing per minute")
    a = ap.parse_args()
    if a.churn:
        rows = []
        for n in (int(x) for x in a.hosts.split(",")):
            for loss in (float(x) for x in a.loss.split(",")):
                for seed in (int(x) for x in a.seeds.split(",")):
                    rows.append(churn(a, n, loss, seed))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if a.out:
            a.out.write_text(json.dumps(rows, indent=1) + "\n")
        return
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
