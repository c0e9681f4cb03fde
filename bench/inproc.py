"""xpud's own work per grant+release cycle, without gRPC: a simulated daemon started in this process, its
``Node`` servicer's ``Acquire`` and ``Release`` called directly, one cycle after another (one client).

    .venv/bin/python bench/inproc.py [--cycles 3000] [--mode vxpu-quarter|xpu] [--json]
    .venv/bin/python bench/inproc.py --profile prof.out   # cProfile of the cycles, then pstats
    .venv/bin/python bench/inproc.py --engine   # the engine alone: Engine.grant_or_queue and release
    valgrind --tool=callgrind --separate-threads=yes .venv/bin/python bench/inproc.py --cycles N  # twice
        (N and N + 1000; the difference / 1000 is instructions per cycle, per thread)

What a cycle costs here is what the daemon adds to the transport's own cost (``bench/load.py`` measures
the two together): the credential check, the request checks, placement, the lease and its ledger rows
(committed by the ledger's writer thread, as in the daemon: the loop waits for each commit), the reply
messages, and the loop's wake-ups for the writer's answers. The figures: CPU per cycle of the whole
process and of the loop's thread alone (the writer's is the difference).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WARM_CYCLES = 300


class _Context:
    """What the servicer reads of a gRPC call's context: its metadata (the caller's credential)."""

    def __init__(self, metadata: tuple) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple:
        return self._metadata

    async def abort(self, code, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


async def measure(
    daemon, mode: str, cycles: int, profile: str | None = None, engine_only: bool = False
) -> dict:
    from xpud.api.auth import METADATA_KEY
    from xpud.api.v1 import xpu_pb2 as pb
    from xpud.daemon.app import keep_out_of_collections
    from xpud.model import CommandEnd, Mode, Request
    from xpud.service.node import NodeService

    await daemon.start()
    try:
        node = NodeService(daemon.context)
        credential, _ = daemon.context.issuer.issue(os.getpid(), os.getuid(), os.getgid())
        ctx = _Context(((METADATA_KEY, credential),))

        async def cycle() -> None:
            request = pb.AcquireRequest(mode=mode, gpus=1, command="bench: inproc", wait_s=60.0)
            updates = [u async for u in node.Acquire(request, ctx)]
            g = updates[-1].granted
            await node.Release(pb.ReleaseRequest(lease_id=g.lease.id, token=g.token, exit_code=0), ctx)

        engine, caller = daemon.engine, daemon.context.caller(ctx)

        async def engine_cycle() -> None:  # the engine alone: no request message, no reply message
            req = Request(
                mode=Mode(mode), gpus=1, wait_s=60.0, owner_uid=caller.uid, holder_pid=caller.pid,
                command="bench: inproc",
            )  # fmt: skip
            lease, token = await engine.grant_or_queue(req)
            await engine.release(lease.id, caller, token, CommandEnd(exit_code=0))

        run = engine_cycle if engine_only else cycle
        for _ in range(WARM_CYCLES):
            await run()
        keep_out_of_collections()  # as the daemon does once it serves
        prof = cProfile.Profile() if profile else None
        cpu0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
        if prof:
            prof.enable()
        for _ in range(cycles):
            await run()
        if prof:
            prof.disable()
            prof.dump_stats(profile)
        cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
        wall = time.perf_counter() - wall0
        active_after = len(daemon.engine.leases)  # every cycle released what it was granted: 0
    finally:
        await daemon.stop()
    per = 1e6 / cycles
    return {
        "mode": mode,
        "engine_only": engine_only,
        "cycles": cycles,
        "cpu_us_per_cycle": round(cpu * per, 1),
        "loop_thread_cpu_us_per_cycle": round(thread * per, 1),
        "wall_us_per_cycle": round(wall * per, 1),
        "profiled": bool(profile),
        "active_leases_after": active_after,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=3000)
    ap.add_argument("--mode", default="vxpu-quarter")
    ap.add_argument("--machine", default="pcie-8x-l40s")
    ap.add_argument("--profile", metavar="FILE", help="write a cProfile of the measured cycles here")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument(
        "--engine", action="store_true", help="the engine alone (grant_or_queue, release): no servicer"
    )
    args = ap.parse_args()
    if args.cycles < 1:
        raise SystemExit("--cycles: at least 1")

    import load

    from xpud import config
    from xpud.daemon.app import Daemon, StartupError, open_hardware

    base = Path(tempfile.mkdtemp(prefix="xpu-inproc-", dir="/tmp"))
    cfg = config.parse(load.DAEMON_CONFIG, str(base / "xpud.toml"))  # as tests/daemons.py builds it
    cfg = cfg.replace("devices", backend="simulated", machine=args.machine)
    cfg = cfg.replace("daemon", runtime_dir=str(base / "run"), state_dir=str(base / "state"))
    try:
        try:
            hw, fake = open_hardware(cfg)
        except StartupError as e:
            raise SystemExit(f"--machine {args.machine}: {e}") from None
        out = asyncio.run(measure(Daemon(cfg, hw, fake), args.mode, args.cycles, args.profile, args.engine))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        what = f"{out['mode']}{' (engine alone)' if args.engine else ''}"
        print(
            f"{what}: {out['cycles']} cycles; CPU {out['cpu_us_per_cycle']} us per cycle (the loop's "
            f"thread {out['loop_thread_cpu_us_per_cycle']}), wall {out['wall_us_per_cycle']} us"
            + (" (under cProfile)" if args.profile else "")
        )


if __name__ == "__main__":
    main()
