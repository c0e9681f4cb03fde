"""Membership between three real daemons: ``xpud --simulate`` processes on 127.0.0.2, .3 and .4, each with a
certificate from one site CA, SWIM over gRPC with mutual TLS (the daemon's own code, real clocks).

Each round: the three views converge (every daemon lists all three alive with a summary; timed from the
moment the last daemon serves); then h3 is killed (SIGKILL): the first suspicion at a peer, the death at
each peer, and how long the news took to reach the second peer after the first; then h3 restarts and
rejoins (timed until every view has it alive again). Before the rounds, each daemon's CPU share over 10 s
of steady membership (probes, gossip, summaries; no other work). Finally a SIGTERM of h3: how soon the
peers see it "left". Views are read through ``Node.GetCluster`` on each daemon's socket, every 20 ms.

    .venv/bin/python bench/federation_daemons.py --rounds 3 --out bench/federation_daemons.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import simdaemon

from xpud.api.client import Client
from xpud.errors import XpudError
from xpud.federation.certs import init_ca, issue

POLL_S = 0.02
MACHINES = ("workstation-2x", "pcie-4x-h100", "workstation-2x")


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class Host:
    def __init__(self, root: Path, i: int, seeds: list[str], dead_after: float):
        self.name, self.ip = f"h{i}", f"127.0.0.{i + 1}"
        self.machine = MACHINES[i - 1]
        self.base = root / self.name
        self.base.mkdir()
        issue(self.name, root / "ca", self.base / "certs", ips=[self.ip])
        self.addr = f"{self.ip}:{free_port(self.ip)}"
        c = self.base / "certs"
        self.config = (
            f'[cluster]\nname = "{self.name}"\nlisten = "{self.addr}"\nseeds = {json.dumps(seeds)}\n'
            f'ca = "{c / "ca.crt"}"\ncert = "{c / f"{self.name}.crt"}"\nkey = "{c / f"{self.name}.key"}"\n'
            f"dead_after_s = {dead_after}\n"
        )
        self.proc = None
        self.client: Client | None = None

    def start(self) -> float:
        self.proc = simdaemon.start(self.machine, self.base, self.config, log=self.base / "xpud.log")
        self.client = Client(self.base / "run", timeout=5.0)
        return time.monotonic()

    def states(self) -> dict[str, str]:
        try:
            reply = self.client.cluster()
        except XpudError:
            return {}
        return {h.name: h.state for h in reply.hosts if h.summary_valid or h.state != "alive"}

    def kill(self, sig: int) -> float:
        self.proc.send_signal(sig)
        t = time.monotonic()
        self.proc.wait(20)
        self.client.close()
        return t


def until(cond, limit: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if cond():
            return time.monotonic()
        time.sleep(POLL_S)
    return None


def all_alive(hosts: list[Host]) -> bool:
    names = {h.name for h in hosts}
    return all({n for n, s in h.states().items() if s == "alive"} == names for h in hosts)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(hosts: list[Host], seconds: float) -> float:
    """Mean CPU share (%) of one daemon over ``seconds`` of steady membership, nothing else asked of it."""
    before = [cpu_s(h.proc.pid) for h in hosts]
    time.sleep(seconds)
    after = [cpu_s(h.proc.pid) for h in hosts]
    return round(100 * statistics.mean(a - b for a, b in zip(after, before, strict=True)) / seconds, 2)


def one_round(hosts: list[Host], dead_after: float) -> dict:
    victim, peers = hosts[2], hosts[:2]
    killed = victim.kill(signal.SIGKILL)
    first_suspect: float | None = None
    dead: dict[str, float] = {}
    while time.monotonic() - killed < dead_after + 30 and len(dead) < len(peers):
        for p in peers:
            state = p.states().get(victim.name)
            now = time.monotonic()
            if state in ("suspect", "dead") and first_suspect is None:
                first_suspect = now
            if state == "dead" and p.name not in dead:
                dead[p.name] = now
        time.sleep(POLL_S)
    served = victim.start()
    rejoined = until(lambda: all_alive(hosts), 60)
    return {
        "first_suspicion_s": round(first_suspect - killed, 3) if first_suspect else None,
        "dead_at_first_peer_s": round(min(dead.values()) - killed, 3) if dead else None,
        "dead_at_every_peer_s": round(max(dead.values()) - killed, 3) if len(dead) == 2 else None,
        "news_spread_s": round(max(dead.values()) - min(dead.values()), 3) if len(dead) == 2 else None,
        "rejoined_s": round(rejoined - served, 3) if rejoined else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dead-after", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="xpu-fd-", dir="/tmp"))
    hosts: list[Host] = []
    try:
        init_ca(root / "ca")
        first = Host(root, 1, [], args.dead_after)
        hosts = [first] + [Host(root, i, [first.addr], args.dead_after) for i in (2, 3)]
        for h in hosts:
            last = h.start()
        converged = until(lambda: all_alive(hosts), 60)
        cpu = idle_cpu(hosts, 10.0)
        rounds = [one_round(hosts, args.dead_after) for _ in range(args.rounds)]
        left_from = hosts[2].kill(signal.SIGTERM)
        left = until(lambda: all(p.states().get("h3") == "left" for p in hosts[:2]), 10)
        load = os.getloadavg()
        result = {
            "dead_after_s": args.dead_after,
            "converged_s": round(converged - last, 3) if converged else None,
            "rounds": rounds,
            "left_seen_s": round(left - left_from, 3) if left else None,
            "steady_cpu_pct_per_daemon": cpu,
            "loadavg_1m": round(load[0], 2),
            "cpus": os.cpu_count(),
        }
        for key in ("first_suspicion_s", "dead_at_every_peer_s", "news_spread_s", "rejoined_s"):
            vals = [r[key] for r in rounds if r[key] is not None]
            if vals:
                result[f"median_{key}"] = round(statistics.median(vals), 3)
                result[f"max_{key}"] = max(vals)
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for h in hosts:
            if h.proc is not None:
                simdaemon.stop(h.proc)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
