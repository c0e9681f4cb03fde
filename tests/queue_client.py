"""A client process holding many queued Acquire streams at once (grpc.aio, one channel), for the
waitlist's load test: ``python -m tests.queue_client RUNTIME_DIR N [COMMAND_CHARS [OBSERVERS]]``.

It opens N streams, then OBSERVERS more behind them, and prints ``queued Q other=O`` once every stream
got its first ``queued`` update (or ended: O counts each other outcome by status code). On ``cancel``
(stdin) it cancels the first N and prints ``cancelled S`` (S: seconds to cancel them); on ``exit`` it
prints ``updates U observers V W`` (U: position updates received by all streams, V: by the observers,
W: the most one observer received) and cancels the observers.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from pathlib import Path

import grpc
from grpc import aio

from xpud.api.auth import METADATA_KEY, handshake
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg


async def main(runtime: Path, n: int, command_chars: int, observers: int) -> None:
    cred = handshake(str(runtime / "cred.sock"))["credential"]
    md = ((METADATA_KEY, cred),)
    loop = asyncio.get_running_loop()
    async with aio.insecure_channel(f"unix:{runtime / 'xpud.sock'}") as ch:
        stub = pbg.NodeStub(ch)
        first: list[asyncio.Future] = [loop.create_future() for _ in range(n + observers)]
        updates = [0] * (n + observers)
        outcomes: collections.Counter = collections.Counter()

        async def one(i: int) -> None:
            request = pb.AcquireRequest(mode="xpu", gpus=1, wait_s=3600, command="x" * command_chars)
            call = stub.Acquire(request, metadata=md)
            try:
                async for u in call:
                    updates[i] += 1
                    if u.HasField("queued") and not first[i].done():
                        first[i].set_result("queued")
            except grpc.RpcError as e:
                outcomes[e.code().name] += 1
                if not first[i].done():
                    first[i].set_result(e.code().name)
            except asyncio.CancelledError:
                call.cancel()
                raise

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        results = await asyncio.gather(*first[:n])
        watching = [asyncio.ensure_future(one(n + i)) for i in range(observers)]
        results += await asyncio.gather(*first[n:])
        other = {k: v for k, v in collections.Counter(results).items() if k != "queued"}
        print(f"queued {results.count('queued')} other={other}", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # "cancel"
        t0 = time.monotonic()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        print(f"cancelled {time.monotonic() - t0:.3f}", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # "exit"
        seen = updates[n:]
        print(f"updates {sum(updates)} observers {sum(seen)} {max(seen, default=0)}", flush=True)
        for t in watching:
            t.cancel()
        await asyncio.gather(*watching, return_exceptions=True)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[2:]] + [0, 0]
    asyncio.run(main(Path(sys.argv[1]), args[0], args[1], args[2]))
