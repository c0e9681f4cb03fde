"""`xpu jobs` over a federated cluster with 10,000 jobs in its history (issue #31): N real daemons (the
``Daemon`` class, simulated cards) in this one process on one event loop, each with its own ledger and
its own ``Peer`` server on 127.0.0.<i+2> with mutual TLS (certificates from one site CA), all joined
through h0. The jobs' rows are written straight into each host's ledger (``save_job_op``), 10,000 in
all, spread evenly; a share of them ``running``. Then, from h0:

- ``xpu jobs`` and ``xpu jobs --all --json`` (the real CLI, a subprocess on h0's user socket): wall time;
- the same two listings as ``ListJobs`` calls on h0's servicer in this process (no CLI start-up): wall
  time of the fan-out to every alive peer over gRPC + TLS and the merge;
- each peer's own part (``PeerJobs.list`` on its ledger), summed over the peers.

Once h0 sees every host alive (SWIM probes every 5 s with a 3 s time-out here, ``[cluster] dead_after_s
= 120``: one loop serving N hosts on a loaded machine answers probes late), the membership's ticks are
stopped (``--live-membership`` keeps them): N hosts' probes and gossip share this machine's two cores,
where in a cluster each host pays its own 2 % of a core (bench/federation.md). Every peer answers on the
same loop, one after another: the wall times are an upper bound of what a cluster of N machines (each
answering in parallel) would show.

    .venv/bin/python bench/jobs_cluster.py --hosts 10,25,50,100 --out bench/jobs_cluster.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MACHINE = "workstation-2x"
BIN = Path(sys.executable).parent


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def host_config(site: Path, i: int, addr: str, seed: str) -> str:
    name = f"h{i}"
    certs = site / name
    return (
        "[leases]\ngrace_s = 30.0\n"
        "[health]\npoll_interval_s = 5.0\n"
        "[cluster]\ndead_after_s = 120.0\n"
        f'name = "{name}"\nlisten = "{addr}"\nseeds = {json.dumps([seed] if seed else [])}\n'
        f'domain = "rack-{i // 16}"\nzone = "z1"\n'
        f'ca = "{site / "ca" / "ca.crt"}"\n'
        f'cert = "{certs / f"{name}.crt"}"\nkey = "{certs / f"{name}.key"}"\n'
    )


PROBE_INTERVAL_S, PROBE_TIMEOUT_S = 5.0, 3.0  # SWIM's 0.5 s and 0.2 s: N hosts on one loop answer late
GOSSIP_S = 1.0  # SWIM's 0.2 s
PEER_CHANNELS = 8  # open channels per host but h0 (1,024): N^2 TLS connections in one process pass 20k fds
JOIN_WAIT_S = 150.0  # then the listing is measured over the hosts h0 sees alive (recorded)


def slow_probes() -> None:
    """Probe every 5 s with a 3 s time-out instead of 0.5 s and 0.2 s: N hosts share one loop here, so a
    probe's answer comes late where in a cluster each host answers at once (the listing is measured,
    not the membership: bench/federation.py measures that); gossip every 1 s instead of 0.2 s."""
    from xpud.federation.membership import SwimConfig

    orig = SwimConfig.for_dead_after

    def for_dead_after(cls, dead_after_s: float, **kw):
        kw = dict(kw, probe_interval_s=PROBE_INTERVAL_S, probe_timeout_s=PROBE_TIMEOUT_S)
        return orig(dead_after_s, gossip_interval_s=GOSSIP_S, **kw)

    SwimConfig.for_dead_after = classmethod(for_dead_after)


def make_daemons(site: Path, n: int) -> list:
    from xpud import config
    from xpud.daemon.app import Daemon, open_hardware
    from xpud.federation.certs import issue

    out, seed = [], ""
    for i in range(n):
        ip = f"127.0.0.{i + 2}"
        issue(f"h{i}", site / "ca", site / f"h{i}", ips=[ip])
        addr = f"{ip}:{free_port(ip)}"
        base = site / f"d{i}"
        base.mkdir()
        cfg = config.parse(host_config(site, i, addr, seed), str(base / "xpud.toml"))
        cfg = cfg.replace("devices", backend="simulated", machine=MACHINE)
        cfg = cfg.replace("daemon", runtime_dir=str(base / "run"), state_dir=str(base / "state"))
        hw, fake = open_hardware(cfg)
        out.append(Daemon(cfg, hw, fake))
        seed = seed or addr
    return out


def records(n_hosts: int, total: int, running_share: float, now: float):
    """``total`` job rows, host by host (``(host index, JobRecord)``), newest last."""
    from xpud.ledger import jobs as jobdb

    every = round(1 / running_share) if running_share > 0 else 0
    for k in range(total):
        i = k % n_hosts
        running = every and k % every == 0
        state = jobdb.RUNNING if running else (jobdb.COMPLETED, jobdb.FAILED, jobdb.CANCELLED)[k % 3]
        yield (
            i,
            jobdb.JobRecord(
                id=f"{k:08x}{i:04x}",
                uid=1000 + k % 50,
                gid=1000,
                state=state,
                submitted=now - total + k,
                name=f"train-{k % 200}",
                cwd="/home/user/project",
                argv=["python", "train.py", "--epochs", "10"],
                spec={"mode": "xpu", "gpus": 1, "priority": 0, "wait_s": 3600.0, "output": "/tmp/x.out"},
                hosts=[f"h{i}"],
                lease_id=f"{k:08x}",
                exit_code=None if running else (0 if k % 3 == 0 else 1),
                started=now - total + k,
                ended=None if running else now - total + k + 0.5,
            ),
        )


async def fill(daemons: list, total: int, running_share: float) -> None:
    from xpud.ledger import jobs as jobdb

    per: list[list] = [[] for _ in daemons]
    for i, r in records(len(daemons), total, running_share, time.time()):
        per[i].append(jobdb.save_job_op(r))
    for d, ops in zip(daemons, per, strict=True):
        for k in range(0, len(ops), 500):
            await d.ledger.write(*ops[k : k + 500])


def alive_at(d) -> int:
    from xpud.federation.membership import State

    return sum(m.state == State.ALIVE for m in d.federation.members())


async def cli(runtime: Path, *args: str) -> tuple[float, bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUD_", "CUDA_", "XPU_"))}
    env["XPUD_RUNTIME_DIR"] = str(runtime)
    t0 = time.perf_counter()
    p = await asyncio.create_subprocess_exec(
        str(BIN / "xpu"), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await p.communicate()
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"xpu {' '.join(args)}: exit {p.returncode}: {err.decode()[-500:]}")
    return wall, out


async def measure(daemons: list, runs: int, live: bool) -> dict:
    from inproc import _Context

    from xpud.api.auth import METADATA_KEY
    from xpud.api.v1 import xpu_pb2 as pb
    from xpud.model import Caller
    from xpud.service.jobs import NodeService

    h0 = daemons[0]
    res: dict = {}
    if not live:
        for d in daemons:
            d.federation._task.cancel()
    await asyncio.sleep(1.0)
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(3.0)
    res["idle_process_cpu_pct"] = round(100 * (time.process_time() - cpu0) / (time.perf_counter() - t0), 1)

    runtime = h0.runtime_dir
    for label, args in (("xpu_jobs", ("jobs", "--json")), ("xpu_jobs_all", ("jobs", "--all", "--json"))):
        walls, count = [], 0
        for _ in range(runs):
            w, out = await cli(runtime, *args)
            walls.append(w)
            count = len(json.loads(out)["jobs"])
        res[f"{label}_cli_s"] = {"median": round(statistics.median(walls), 3), "max": round(max(walls), 3)}
        res[f"{label}_listed"] = count
    w, _ = await cli(runtime, "jobs")  # the table, once (as a user types it)
    res["xpu_jobs_table_cli_s"] = round(w, 3)

    node = NodeService(h0.context)
    credential, _ = h0.context.issuer.issue(os.getpid(), os.getuid(), os.getgid())
    ctx = _Context(((METADATA_KEY, credential),))
    for label, req in (("list", pb.ListJobsRequest()), ("list_all", pb.ListJobsRequest(all=True))):
        walls, n = [], 0
        for _ in range(runs):
            t = time.perf_counter()
            reply = await node.ListJobs(req, ctx)
            walls.append(time.perf_counter() - t)
            n = len(reply.jobs)
        res[f"daemon_{label}_s"] = {"median": round(statistics.median(walls), 4), "max": round(max(walls), 4)}
        res[f"daemon_{label}_jobs"] = n
        res[f"daemon_{label}_omitted"] = reply.omitted
        peer_sum = 0.0
        asked = pb.PeerJobsRequest(uid=os.getuid(), list=pb.ListJobsRequest(all=req.all, here=True))
        for d in daemons[1:]:
            t = time.perf_counter()
            await d.federation.peer_jobs.list(asked)
            peer_sum += time.perf_counter() - t
        res[f"peers_{label}_sum_s"] = round(peer_sum, 4)
        res[f"peers_{label}_mean_ms"] = round(1e3 * peer_sum / max(len(daemons) - 1, 1), 2)
    _ = Caller  # (the caller is the credential's: this process's uid, root here: an operator)
    return res


async def one(n: int, total: int, running_share: float, runs: int, live: bool, direct: bool) -> dict:
    site = Path(tempfile.mkdtemp(prefix="xpu-jc-", dir="/tmp"))
    from xpud.federation.certs import init_ca

    init_ca(site / "ca")
    daemons = []
    try:
        t0 = time.perf_counter()
        daemons = make_daemons(site, n)
        if direct:  # no seeds: h0's table gets every peer as alive, the view of a converged cluster
            for d in daemons:
                d.cfg = d.cfg.replace("cluster", seeds=[])
        for i, d in enumerate(daemons):
            await d.start()
            if direct:
                d.federation._task.cancel()
            if i:
                d.federation.channels.limit = PEER_CHANNELS
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        if direct:
            from xpud.federation.membership import Member, State

            swim = daemons[0].federation.swim
            for d in daemons[1:]:
                f = d.federation
                swim.members[f.name] = Member(f.name, f.addr, f.swim.incarnation, State.ALIVE)
        while alive_at(daemons[0]) < n:  # h0, where `xpu jobs` runs, sees every host alive
            if time.perf_counter() - t1 > JOIN_WAIT_S:
                break
            await asyncio.sleep(0.5)
        joined = time.perf_counter() - t1
        await fill(daemons, total, running_share)
        res = {"hosts": n, "jobs": total, "started_s": round(started, 1)}
        res["alive_at_h0"] = alive_at(daemons[0])
        res["all_alive_at_h0_s"] = round(joined, 1) if res["alive_at_h0"] == n else None
        res.update(await measure(daemons, runs, live))
        res["alive_at_h0_after"] = alive_at(daemons[0])
        res["rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        return res
    finally:
        for d in reversed(daemons):
            try:
                await d.stop()
            except Exception as e:  # the others still stop
                print(f"stopping {d.cfg.cluster.name}: {e}", file=sys.stderr)
        shutil.rmtree(site, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="10,25,50,100", help="cluster sizes, comma-separated (1..250)")
    ap.add_argument("--jobs", type=int, default=10_000, help="jobs in the cluster's history, in all")
    ap.add_argument("--running-share", type=float, default=0.05, help="share of them running")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--live-membership", action="store_true", help="keep the membership ticking")
    ap.add_argument(
        "--direct", action="store_true", help="no membership: h0's table is given every peer as alive"
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    if not all(1 <= s <= 250 for s in sizes) or args.jobs < 0 or not 0 <= args.running_share <= 1:
        raise SystemExit("--hosts: 1..250 each; --jobs >= 0; --running-share in 0..1")
    import logging

    logging.basicConfig(level=logging.WARNING)
    slow_probes()
    results = []
    for n in sizes:
        r = asyncio.run(one(n, args.jobs, args.running_share, args.runs, args.live_membership, args.direct))
        print(json.dumps(r), flush=True)
        results.append(r)
        if args.out:
            doc = {
                "command": " ".join(["bench/jobs_cluster.py", *sys.argv[1:]]),
                "machine": MACHINE,
                "live_membership": args.live_membership,
                "direct_view": args.direct,
                "swim_probe_interval_s": PROBE_INTERVAL_S,
                "swim_probe_timeout_s": PROBE_TIMEOUT_S,
                "swim_gossip_interval_s": GOSSIP_S,
                "join_wait_s": JOIN_WAIT_S,
                "peer_channels": PEER_CHANNELS,
                "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "load_average": os.getloadavg(),
                "results": results,
            }
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
