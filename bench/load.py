"""Load: grant throughput and latency beside the bare-gRPC ceiling, `xpu run` start-up against
`python -c "import grpc"`, a 5,000-waiter queue and its cancellation, and the daemon's idle CPU and RSS.

    .venv/bin/python bench/load.py --out bench/load.json        # the full run, ~10 minutes
    .venv/bin/python bench/load.py --quick                      # a smoke test, ~20 s

Everything runs against a real simulated daemon (``xpud --simulate pcie-8x-l40s``) on temp sockets.

- **Grants.** Clients in several processes (1 client: one process; else 4 processes, clients/4 threads
  each, one channel per thread) do Acquire (a server stream, answered up to the grant) then Release (a
  unary call) as fast as they can for ``--seconds``. Slices (vxpu-quarter, 32 of them: every client's
  slice fits) and whole cards (8 cards: 1 and 8 clients) are measured separately.
- **The ceiling.** A bare grpc-python aio server, in its own process on a Unix socket, with one
  server-stream and one unary method that do no work; the same clients, the same processes, the same
  cycle. ``ratio`` = grants per second / bare cycles per second at the same number of clients: the figure
  that travels between machines (absolute rates move with the machine and its load). With
  ``--bare-durable``, also the same bare server committing one SQLite row (a writer thread, WAL,
  ``synchronous=NORMAL``, group commit) before each answer: the floor of any ledger-first server here.
- **xpu run.** Median wall time of ``xpu run -m vxpu-quarter -- true`` against ``python -c "import grpc"``
  (the same interpreter), alternated, ``--runs`` each; and the same run through Typer (``xpu_cli.main``,
  the path before ``xpu_cli.entry``) for comparison. Bytecode is cached (in the temp directory) for
  both, as in an installed copy.
- **Waiters.** Every card held, then ``--waiters`` Acquire streams (one process, asyncio) queue for a
  whole card; once all are queued they are cancelled at once. Meanwhile another client calls ``Info``
  every 20 ms: its latency (max, p99) while they queue and while they leave, the time until the daemon's
  queue is empty, and the daemon's RSS before and after. Then the floor (``waiters_bare``): as many
  streams against the bare server (one message each, then they wait), cancelled at once, with its
  ``Info`` probed the same way: what grpc.aio alone costs for that burst, in the same run.
- **Idle.** The daemon's CPU (% of one core) and RSS over ``--idle-seconds`` with no client, after start
  and after all the load.

Progress goes to stderr, a summary to stdout, everything to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HERE = Path(__file__).resolve()
BARE_ACQUIRE = "/bench.Bare/Acquire"
BARE_RELEASE = "/bench.Bare/Release"
BARE_WAIT = "/bench.Bare/Wait"  # a server stream that sends one message, then waits until cancelled
BARE_INFO = "/bench.Bare/Info"
DAEMON_CONFIG = "[leases]\ngrace_s = 30.0\n"
XPU_RUN_ARGS = ["run", "-m", "vxpu-quarter", "--", "true"]


def say(msg: str) -> None:
    sys.stderr.write(f"load: {msg}\n")
    sys.stderr.flush()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


# ---------------------------------------------------------------------------------------------- bare server
def bare_server(path: str, loop: str = "asyncio", durable: str | None = None) -> None:
    """A grpc-python aio server with one server-stream and one unary method that do nothing (the grant
    cycle's ceiling), and a stream that waits forever after one message beside a unary ``Info`` (the
    waiters' floor: what grpc.aio alone costs when thousands of streams are cancelled at once).

    With ``durable`` (an SQLite file), each Acquire and Release first commits one row there and answers
    once it is committed, as a ledger-first server must: a writer thread, group commit, WAL with
    ``synchronous=NORMAL``, the answer handed back to the loop (xpud's ledger does the same, with real
    rows). The floor of any server that changes durable state before it answers, on this transport."""
    import asyncio

    import grpc
    from grpc import aio

    commit = _durable_commit(durable) if durable else None

    async def acquire(request, context):
        if commit:
            await commit("acquire")
        yield b"granted"

    async def release(request, context):
        if commit:
            await commit("release")
        return b""

    async def wait(request, context):
        yield b"queued"
        await asyncio.get_running_loop().create_future()  # until the caller cancels

    async def info(request, context):
        return b"info"

    async def serve() -> None:
        from xpud.daemon.app import SERVER_OPTIONS  # as xpud's (pending-request limits: see there)

        server = aio.server(options=SERVER_OPTIONS)
        handler = grpc.method_handlers_generic_handler(
            "bench.Bare",
            {
                "Acquire": grpc.unary_stream_rpc_method_handler(acquire),
                "Release": grpc.unary_unary_rpc_method_handler(release),
                "Wait": grpc.unary_stream_rpc_method_handler(wait),
                "Info": grpc.unary_unary_rpc_method_handler(info),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    factory = None
    if loop == "uvloop":  # the same server on uvloop's loop (the daemon's with [daemon] event_loop)
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve())


def _durable_commit(db_path: str):
    """An ``async commit(text)`` that returns once a row holding ``text`` is committed to ``db_path`` by
    a writer thread (a batch of whatever is waiting per transaction), answered on the caller's loop."""
    import asyncio
    import queue
    import sqlite3

    todo: queue.SimpleQueue = queue.SimpleQueue()

    def answer(futures: list) -> None:
        for f in futures:
            if not f.done():
                f.set_result(None)

    def writer() -> None:
        db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE IF NOT EXISTS rows (id INTEGER PRIMARY KEY, what TEXT, at REAL)")
        while True:
            batch = [todo.get()]
            while not todo.empty():
                batch.append(todo.get_nowait())
            db.execute("BEGIN IMMEDIATE")
            for what, _, _ in batch:
                db.execute("INSERT INTO rows (what, at) VALUES (?, ?)", (what, time.time()))
            db.execute("COMMIT")
            by_loop: dict = {}
            for _, fut, loop in batch:
                by_loop.setdefault(loop, []).append(fut)
            for loop, futures in by_loop.items():
                loop.call_soon_threadsafe(answer, futures)

    threading.Thread(target=writer, daemon=True).start()

    async def commit(what: str) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        todo.put((what, fut, loop))
        await fut

    return commit


def bare_sync_server(path: str) -> None:
    """The same two methods on grpc-python's synchronous server (a thread pool): the experiment of
    ``--bare-sync``, to compare the two servers' ceilings for this pair of calls."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    def acquire(request, context):
        yield b"granted"

    def release(request, context):
        return b""

    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    handler = grpc.method_handlers_generic_handler(
        "bench.Bare",
        {
            "Acquire": grpc.unary_stream_rpc_method_handler(acquire),
            "Release": grpc.unary_unary_rpc_method_handler(release),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{path}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


# ---------------------------------------------------------------------------------------------- cycle workers
def _cycle_fn(spec: dict):
    """A function doing one Acquire+Release cycle, returning the acquire latency (s)."""
    if spec["target"] == "bare":
        import grpc

        channel = grpc.insecure_channel(f"unix:{spec['socket']}")
        acquire = channel.unary_stream(BARE_ACQUIRE)
        release = channel.unary_unary(BARE_RELEASE)

        def cycle() -> float:
            t0 = time.perf_counter()
            for _ in acquire(b"acquire", timeout=30):
                break
            t1 = time.perf_counter()
            release(b"release", timeout=30)
            return t1 - t0

        return cycle, channel.close

    from xpud.api.client import Client

    client = Client(spec["runtime"])

    def cycle() -> float:
        t0 = time.perf_counter()
        g = client.acquire_lease(spec["mode"], gpus=spec["gpus"], wait_s=spec["wait_s"], command="bench")
        t1 = time.perf_counter()
        client.release(g.lease.id, g.token)
        return t1 - t0

    return cycle, client.close


def cycle_worker(spec: dict) -> None:
    """``spec["threads"]`` threads, each with its own channel; warm up, say "ready", read the window
    (monotonic start, stop) from stdin, cycle in it, print the results as JSON."""
    n = spec["threads"]
    ready = threading.Barrier(n + 1)
    window: dict = {}
    go = threading.Event()
    results: list[dict] = [{} for _ in range(n)]

    def thread(i: int) -> None:
        cycle, close = _cycle_fn(spec)
        cycle()  # connect, handshake, one grant: not counted
        ready.wait()
        go.wait()
        start, stop = window["start"], window["stop"]
        while time.monotonic() < start:
            time.sleep(0.001)
        lat, cycles, errors = [], 0, 0
        while True:
            t0 = time.monotonic()
            if t0 >= stop:
                break
            try:
                acq = cycle()
            except Exception as e:  # counted and shown: the bench goes on
                errors += 1
                results[i]["error"] = f"{type(e).__name__}: {e}"[:300]
                time.sleep(0.01)
                continue
            if time.monotonic() <= stop:
                cycles += 1
                lat.append(acq)
        results[i].update(cycles=cycles, errors=errors, acquire_s=lat)
        close()

    threads = [threading.Thread(target=thread, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    print("ready", flush=True)
    window.update(json.loads(sys.stdin.readline()))
    cpu0 = time.process_time()
    go.set()
    for t in threads:
        t.join()
    out = {
        "cpu_s": time.process_time()
        - cpu0,  # every thread of this process, for the window (and a little after)
        "cycles": sum(r.get("cycles", 0) for r in results),
        "errors": sum(r.get("errors", 0) for r in results),
        "error": next((r["error"] for r in results if "error" in r), None),
        "acquire_s": [x for r in results for x in r.get("acquire_s", [])],
    }
    print(json.dumps(out), flush=True)


def thread_cpu(pid: int) -> dict[int, tuple[str, float, float]]:
    """Each thread of ``pid``: thread id -> (its name, user and system CPU seconds so far), from /proc."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[int(tid)] = (name, int(fields[11]) / tick, int(fields[12]) / tick)  # utime, stime
    return out


def measure_cycles(spec: dict, clients: int, seconds: float, daemon_pid: int | None = None) -> dict:
    """Run ``clients`` clients (in up to 4 processes) for ``seconds``; cycles/s and acquire p50/p99."""
    import psutil

    procs = 1 if clients == 1 else min(4, clients)
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    workers = [
        subprocess.Popen(
            [sys.executable, str(HERE), "--worker", json.dumps({**spec, "threads": k})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in per
    ]
    try:
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise SystemExit(f"a {spec['target']} worker did not start (exit {w.wait()})")
        start = time.monotonic() + 0.2
        window = json.dumps({"start": start, "stop": start + seconds})
        daemon = psutil.Process(daemon_pid) if daemon_pid else None
        cpu0 = sum(daemon.cpu_times()[:2]) if daemon else 0.0
        threads0 = thread_cpu(daemon_pid) if daemon_pid else {}
        for w in workers:
            w.stdin.write(window + "\n")
            w.stdin.flush()
        time.sleep(max(0.0, start + seconds - time.monotonic()))
        cpu1 = sum(daemon.cpu_times()[:2]) if daemon else 0.0
        threads1 = thread_cpu(daemon_pid) if daemon_pid else {}
        outs = [json.loads(w.stdout.readline()) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.wait(30)
    lat = [x for o in outs for x in o["acquire_s"]]
    cycles = sum(o["cycles"] for o in outs)
    client_cpu = sum(o["cpu_s"] for o in outs)
    res = {
        "clients": clients,
        "processes": procs,
        "cycles_per_s": round(cycles / seconds, 1),
        "acquire_p50_ms": ms(pct(lat, 0.5)),
        "acquire_p99_ms": ms(pct(lat, 0.99)),
        "errors": sum(o["errors"] for o in outs),
    }
    # CPU per cycle (ms): less sensitive to other load on the machine than the rates
    res["clients_cpu_ms_per_cycle"] = round(1e3 * client_cpu / max(cycles, 1), 3)
    if daemon:
        res["daemon_cpu_pct"] = round(100 * (cpu1 - cpu0) / seconds, 1)
        res["daemon_cpu_ms_per_cycle"] = round(1e3 * (cpu1 - cpu0) / max(cycles, 1), 3)
        # by thread: the event loop (the main thread), the others of Python (the ledger's writer, the
        # hardware executor) and gRPC's own (event_engine, ...): % of one core over the window
        # and each group's user and system CPU per cycle (ms)
        groups: dict[str, list[float]] = {}
        for tid, (name, user, system) in threads1.items():
            group = "loop" if tid == daemon_pid else "python" if name == threads1[daemon_pid][0] else "grpc"
            _, user0, system0 = threads0.get(tid, (name, 0.0, 0.0))
            g = groups.setdefault(group, [0.0, 0.0])
            g[0] += user - user0
            g[1] += system - system0
        res["daemon_threads_pct"] = {g: round(100 * sum(v) / seconds, 1) for g, v in sorted(groups.items())}
        res["daemon_threads_ms_per_cycle"] = {
            g: {
                "user": round(1e3 * v[0] / max(cycles, 1), 3),
                "system": round(1e3 * v[1] / max(cycles, 1), 3),
            }
            for g, v in sorted(groups.items())
        }
    if res["errors"]:
        res["first_error"] = next(o["error"] for o in outs if o["error"])
    return res


def grants(
    runtime: Path,
    bare_sock: Path,
    bare_pid: int,
    daemon_pid: int,
    clients: list[int],
    seconds: float,
    rounds: int = 1,
    extra_bare: tuple[tuple[str, Path, int], ...] = (),
) -> list[dict]:
    """At each client count: the bare ceiling, then slices, then whole cards (at most 8: the cards),
    back to back so that the ratios compare runs under the same background load. With ``rounds`` > 1
    the whole sequence is repeated and each figure is the median over the rounds (the ratio: the median
    of the per-round ratios), with every round's rows kept under ``rounds``."""
    kinds = [
        ("bare", {"target": "bare", "socket": str(bare_sock)}, bare_pid, 10**6),
        *((name, {"target": "bare", "socket": str(sock)}, pid, 10**6) for name, sock, pid in extra_bare),
        ("slice", {"target": "xpud", "mode": "vxpu-quarter", "gpus": 1}, daemon_pid, 32),
        ("whole", {"target": "xpud", "mode": "xpu", "gpus": 1}, daemon_pid, 8),
    ]
    every: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        for n in clients:
            bare_rate = None
            for name, spec, pid, most in kinds:
                if n > most:
                    continue
                say(
                    f"{name}: {n} client(s), {seconds:g} s"
                    + (f" (round {r + 1}/{rounds})" if rounds > 1 else "")
                )
                row = {
                    "kind": name,
                    **measure_cycles({**spec, "runtime": str(runtime), "wait_s": 30.0}, n, seconds, pid),
                }
                if name == "bare":
                    bare_rate = row["cycles_per_s"]
                elif bare_rate:  # the other bare servers too: their rates against the plain one's
                    row["ratio_to_bare"] = round(row["cycles_per_s"] / bare_rate, 3)
                say(
                    f"  {row['cycles_per_s']}/s, acquire p99 {row['acquire_p99_ms']} ms, CPU ms/cycle: "
                    f"clients {row['clients_cpu_ms_per_cycle']}, server {row.get('daemon_cpu_ms_per_cycle')} "
                    f"(threads, % of a core: {row.get('daemon_threads_pct')})"
                )
                every.setdefault((name, n), []).append(row)
    if rounds == 1:
        return [rows[0] for rows in every.values()]
    out = []
    for (name, n), rows in every.items():
        med = {"kind": name, "clients": n, "processes": rows[0]["processes"], "rounds": rows}
        keys = ("cycles_per_s", "acquire_p50_ms", "acquire_p99_ms", "daemon_cpu_pct", "ratio_to_bare")
        for key in (*keys, "daemon_cpu_ms_per_cycle", "clients_cpu_ms_per_cycle"):
            values = [x[key] for x in rows if x.get(key) is not None]
            if values:
                med[key] = round(statistics.median(values), 3 if key == "ratio_to_bare" else 2)
        med["errors"] = sum(x["errors"] for x in rows)
        out.append(med)
    return out


# ---------------------------------------------------------------------------------------------- xpu run
def xpu_run_overhead(runtime: Path, runs: int) -> dict:
    """Median wall times of `xpu run -- true` and `python -c "import grpc"`, alternated."""
    import simdaemon

    # Bytecode cached, as in an installed copy (pip compiles it): a PYTHONDONTWRITEBYTECODE in the
    # environment would have every run compile xpud's modules again, but not grpc's (pip compiled those).
    env = {**simdaemon.clean_env(runtime), "PYTHONPYCACHEPREFIX": str(runtime.parent / "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmds = {
        "xpu_run": [str(simdaemon.BIN / "xpu"), *XPU_RUN_ARGS],
        "import_grpc": [sys.executable, "-c", "import grpc"],
        # the same run through Typer (the path every `xpu run` took before xpu_cli.entry)
        "typer_run": [sys.executable, "-c", "from xpu_cli.main import main; main()", *XPU_RUN_ARGS],
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for cmd in cmds.values():  # warm the page cache and the bytecode
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    for _ in range(runs):
        for name, cmd in cmds.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t0)
    xpu, grpc_ = statistics.median(times["xpu_run"]), statistics.median(times["import_grpc"])
    typer_ = statistics.median(times["typer_run"])
    return {
        "runs": runs,
        "xpu_run_ms": ms(xpu),
        "import_grpc_ms": ms(grpc_),
        "ratio": round(xpu / grpc_, 2),
        "through_typer_ms": ms(typer_),
        "through_typer_ratio": round(typer_ / grpc_, 2),
        "xpu_run_min_ms": ms(min(times["xpu_run"])),
        "import_grpc_min_ms": ms(min(times["import_grpc"])),
    }


# ---------------------------------------------------------------------------------------------- waiters
def waiters_worker(spec: dict) -> None:
    """Open ``spec["n"]`` Acquire streams for a whole card (asyncio, 100 per channel); say "queued S" once
    each has its first queue position (or "timeout" with the count); on "cancel" cancel them all."""
    import asyncio

    from grpc import aio

    from xpud.api.auth import METADATA_KEY, handshake
    from xpud.api.v1 import xpu_pb2 as pb
    from xpud.api.v1 import xpu_pb2_grpc as pbg

    async def main() -> None:
        bare = spec.get("bare")
        runtime = Path(spec["runtime"])
        md = () if bare else ((METADATA_KEY, handshake(str(runtime / "cred.sock"))["credential"]),)
        n = spec["n"]
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection each, not one shared by all
        channels = [
            aio.insecure_channel(f"unix:{bare or runtime / 'xpud.sock'}", options=options)
            for _ in range((n + 99) // 100)
        ]
        if bare:
            stubs = [c.unary_stream(BARE_WAIT) for c in channels]
        else:
            stubs = [pbg.NodeStub(c).Acquire for c in channels]
        queued = asyncio.Event()
        count = [0, 0]  # queued, failed
        failures: list[str] = []

        async def one(i: int) -> None:
            req = pb.AcquireRequest(mode="xpu", gpus=1, wait_s=spec["wait_s"], command=f"waiter {i}")
            call = stubs[i % len(stubs)](b"wait" if bare else req, metadata=md)
            first = True
            try:
                async for _ in call:
                    if first:
                        first = False
                        count[0] += 1
                        if count[0] + count[1] == n:
                            queued.set()
            except (aio.AioRpcError, asyncio.CancelledError) as e:
                if first:
                    count[1] += 1
                    if isinstance(e, aio.AioRpcError) and len(failures) < 3:
                        failures.append(f"{e.code().name}: {e.details()}"[:200])
                    if count[0] + count[1] == n:
                        queued.set()

        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        try:
            await asyncio.wait_for(queued.wait(), spec["timeout_s"])
            status = "queued"
        except TimeoutError:
            status = "timeout"
        took = time.monotonic() - t0
        print(
            json.dumps(
                {
                    "status": status,
                    "seconds": took,
                    "queued": count[0],
                    "failed": count[1],
                    "failures": failures,
                }
            ),
            flush=True,
        )
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        t0 = time.monotonic()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in channels:
            await c.close()
        print(json.dumps({"cancel_s": time.monotonic() - t0}), flush=True)

    asyncio.run(main())


class Prober(threading.Thread):
    """Calls Info every 20 ms and records (when, latency)."""

    def __init__(self, runtime: Path | None = None, bare_sock: Path | None = None):
        super().__init__(daemon=True)
        if bare_sock is not None:  # the bare server's Info (no credential, no work)
            import grpc

            channel = grpc.insecure_channel(f"unix:{bare_sock}")
            call = channel.unary_unary(BARE_INFO)
            info = {"info": lambda _: call(b"info", timeout=600), "close": channel.close}
            self.client = type("Bare", (), info)()
        else:
            from xpud.api.client import Client

            self.client = Client(runtime, timeout=600)
        self.client.info()
        self.samples: list[tuple[float, float]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            t0 = time.monotonic()
            with contextlib.suppress(Exception):  # a failed call counts with its latency too
                self.client.info()
            self.samples.append((t0, time.monotonic() - t0))
            self.stopping.wait(0.02)

    def between(self, a: float, b: float) -> dict:
        lat = [d for t, d in self.samples if a <= t <= b or a <= t + d <= b]
        return {"calls": len(lat), "max_ms": ms(max(lat, default=None)), "p99_ms": ms(pct(lat, 0.99))}

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.client.close()


def start_waiters(spec: dict) -> subprocess.Popen:
    """The ``--waiters-worker`` process for ``spec``; it prints one JSON line per phase."""
    return subprocess.Popen(
        [sys.executable, str(HERE), "--waiters-worker", json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def waiters(runtime: Path, n: int, daemon_pid: int, timeout_s: float, signal_daemon=None) -> dict:
    """The waiters part (see the module's docstring); a failure midway keeps what was measured.
    ``signal_daemon(sig)``: called with SIGUSR1 as the cancellation starts, SIGUSR2 once the queue is
    empty (bench/profile_daemon.py profiles that stretch alone)."""
    import signal

    import psutil

    from xpud.api.client import Client

    daemon = psutil.Process(daemon_pid)
    out: dict = {"waiters": n, "rss_before_mib": round(daemon.memory_info().rss / 2**20, 1)}
    blocker = Client(runtime, timeout=timeout_s)
    held = blocker.acquire("xpu", gpus=8, command="bench: every card", hold=True)  # held while we wait
    hold = next(u.granted for u in held if u.HasField("granted"))
    prober = Prober(runtime)
    prober.start()
    w = start_waiters({"runtime": str(runtime), "n": n, "wait_s": 3600, "timeout_s": timeout_s})
    try:
        t0 = time.monotonic()
        q = json.loads(w.stdout.readline())
        t1 = time.monotonic()
        out["queue"] = {
            "status": q["status"],
            "seconds": round(q["seconds"], 2),
            "queued": q["queued"],
            "refused": q["failed"],
            "refusals": q["failures"],
            "info_latency": prober.between(t0, t1),
        }
        out["queue_length_seen"] = len(blocker.leases().queue)
        out["rss_queued_mib"] = round(daemon.memory_info().rss / 2**20, 1)
        say(f"  {q['queued']} queued in {q['seconds']:.1f} s ({q['failed']} refused); cancelling them")
        if signal_daemon:
            signal_daemon(signal.SIGUSR1)
        t2, cpu2 = time.monotonic(), sum(daemon.cpu_times()[:2])
        w.stdin.write("cancel\n")
        w.stdin.flush()
        c = json.loads(w.stdout.readline())
        out["cancel"] = {"client_side_s": round(c["cancel_s"], 2), "queue_empty_after_s": None}
        while time.monotonic() - t2 < timeout_s:
            if not blocker.leases().queue:
                out["cancel"]["queue_empty_after_s"] = round(time.monotonic() - t2, 2)
                break
            time.sleep(0.05)
        t3 = time.monotonic()
        if signal_daemon:
            signal_daemon(signal.SIGUSR2)
        # the daemon's CPU for the whole burst (ms per cancelled waiter): steadier than the stall
        out["cancel"]["daemon_cpu_ms_per_waiter"] = round(1e3 * (sum(daemon.cpu_times()[:2]) - cpu2) / n, 3)
        time.sleep(0.5)  # the probe goes on a little after the queue is empty
        out["cancel"]["info_latency"] = prober.between(t2, t3 + 0.5)
        say(f"  queue empty after {out['cancel']['queue_empty_after_s']} s")
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        say(f"  waiters: {out['error']}")
    finally:
        if w.poll() is None:
            w.kill()
        w.wait()
        prober.stop()
        with contextlib.suppress(Exception):
            blocker.release(hold.lease.id, hold.token)
        held.cancel()
        blocker.close()
    out["rss_after_mib"] = round(daemon.memory_info().rss / 2**20, 1)
    return out


def waiters_bare(bare_sock: Path, bare_pid: int, n: int, timeout_s: float) -> dict:
    """The floor for the waiters' cancellation: the same ``n`` streams against the bare server (one
    message, then they wait), cancelled at once, while another client calls its ``Info`` every 20 ms."""
    import psutil

    server = psutil.Process(bare_pid)
    prober = Prober(bare_sock=bare_sock)
    prober.start()
    w = start_waiters({"runtime": "", "bare": str(bare_sock), "n": n, "wait_s": 3600, "timeout_s": timeout_s})
    try:
        t0 = time.monotonic()
        q = json.loads(w.stdout.readline())
        t1 = time.monotonic()
        out = {"waiters": n, "queued": q["queued"], "refused": q["failed"], "refusals": q["failures"]}
        out["seconds"] = round(q["seconds"], 2)
        out["info_latency_queueing"] = prober.between(t0, t1)
        t2, cpu2 = time.monotonic(), sum(server.cpu_times()[:2])
        w.stdin.write("cancel\n")
        w.stdin.flush()
        c = json.loads(w.stdout.readline())
        t3 = time.monotonic()
        time.sleep(0.3)  # the server's last cancellations (it has no queue to watch)
        cpu = round(1e3 * (sum(server.cpu_times()[:2]) - cpu2) / n, 3)
        time.sleep(0.2)
        latency = prober.between(t2, t3 + 0.5)
        out["cancel"] = {
            "client_side_s": round(c["cancel_s"], 2),
            "server_cpu_ms_per_waiter": cpu,
            "info_latency": latency,
        }
        say(f"  bare: Info max {out['cancel']['info_latency']['max_ms']} ms during the cancellation")
        return out
    finally:
        if w.poll() is None:
            w.kill()
        w.wait()
        prober.stop()


# ---------------------------------------------------------------------------------------------- idle
def idle(daemon_pid: int, seconds: float) -> dict:
    import psutil

    p = psutil.Process(daemon_pid)
    c0, t0 = sum(p.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    c1, t1 = sum(p.cpu_times()[:2]), time.monotonic()
    return {
        "seconds": seconds,
        "cpu_pct": round(100 * (c1 - c0) / (t1 - t0), 2),
        "rss_mib": round(p.memory_info().rss / 2**20, 1),
    }


def start_bare(flag: str, sock: Path, *extra: str) -> subprocess.Popen:
    """A bare server (``--bare-server`` or ``--bare-sync-server``) on ``sock``, once it is ready."""
    cmd = [sys.executable, str(HERE), flag, str(sock), *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        raise SystemExit(f"the bare gRPC server ({flag}) did not start")
    return p


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results here (JSON)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: short and small (~20 s)")
    ap.add_argument("--machine", default="pcie-8x-l40s")
    ap.add_argument("--seconds", type=float, default=5.0, help="each throughput measurement")
    ap.add_argument("--clients", default="1,8,16,32", help="client counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="grant measurements repeated (medians)")
    ap.add_argument("--runs", type=int, default=30, help="xpu run / import grpc repetitions")
    ap.add_argument("--waiters", type=int, default=5000)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--skip", default="", help="parts to skip: grants,xpu_run,waiters,idle")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--waiters-worker", help=argparse.SUPPRESS)
    ap.add_argument("--bare-server", help=argparse.SUPPRESS)
    ap.add_argument("--bare-sync-server", help=argparse.SUPPRESS)
    ap.add_argument(
        "--bare-sync", action="store_true", help="also measure the bare methods on grpc's sync server"
    )
    ap.add_argument(
        "--bare-durable",
        action="store_true",
        help="also measure the bare methods with one SQLite commit each before answering (a writer thread)",
    )
    ap.add_argument("--durable", help=argparse.SUPPRESS)
    ap.add_argument(
        "--event-loop",
        choices=("auto", "asyncio", "uvloop"),
        help="the daemon's [daemon] event_loop (default: not set, the daemon's default)",
    )
    ap.add_argument(
        "--bare-loop", choices=("asyncio", "uvloop"), default="asyncio", help="the bare server's loop"
    )
    args = ap.parse_args()
    if args.worker:
        return cycle_worker(json.loads(args.worker))
    if args.waiters_worker:
        return waiters_worker(json.loads(args.waiters_worker))
    if args.bare_server:
        return bare_server(args.bare_server, args.bare_loop, args.durable)
    if args.bare_sync_server:
        return bare_sync_server(args.bare_sync_server)
    if args.quick:
        args.seconds, args.clients, args.runs, args.rounds = 0.5, "1,4", 3, 1
        args.waiters, args.idle_seconds = 100, 0.5
    clients = [int(c) for c in args.clients.split(",")]
    skip = set(filter(None, args.skip.split(",")))

    import simdaemon

    base = Path(tempfile.mkdtemp(prefix="xpu-load-", dir="/tmp"))
    runtime = base / "run"
    out: dict = {
        "machine": args.machine,
        "cpus": os.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "seconds": args.seconds,
        "quick": args.quick,
        "event_loop": args.event_loop,
        "bare_loop": args.bare_loop,
    }
    say(f"starting xpud --simulate {args.machine} in {base}")
    config = DAEMON_CONFIG + (f'[daemon]\nevent_loop = "{args.event_loop}"\n' if args.event_loop else "")
    daemon = simdaemon.start(args.machine, base, config, log=base / "xpud.log")
    bare = None

    def part(name: str, fn, *a, **kw) -> None:
        """Run one part; a failure is recorded (and the rest goes on); the results so far are written."""
        try:
            out[name] = fn(*a, **kw)
        except Exception as e:
            say(f"{name} failed: {type(e).__name__}: {e}")
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2) + "\n")

    try:
        if "idle" not in skip:
            say(f"daemon idle after start ({args.idle_seconds:g} s)")
            part("idle_after_start", idle, daemon.pid, args.idle_seconds)
        if "grants" not in skip or "waiters" not in skip:
            (base / "bare").mkdir()
            bare_sock = base / "bare" / "bare.sock"
            bare = start_bare("--bare-server", bare_sock, "--bare-loop", args.bare_loop)
        if "grants" not in skip:
            extra: list[tuple[str, Path, subprocess.Popen]] = []
            try:
                if args.bare_sync:
                    sock = base / "bare" / "sync.sock"
                    extra.append(("bare_sync", sock, start_bare("--bare-sync-server", sock)))
                if args.bare_durable:
                    sock, db = base / "bare" / "durable.sock", base / "bare" / "durable.sqlite"
                    server = start_bare(
                        "--bare-server", sock, "--bare-loop", args.bare_loop, "--durable", str(db)
                    )
                    extra.append(("bare_durable", sock, server))
                part(
                    "grants",
                    grants,
                    *(runtime, bare_sock, bare.pid, daemon.pid, clients, args.seconds, args.rounds),
                    extra_bare=tuple((name, sock, p.pid) for name, sock, p in extra),
                )
            finally:
                for _, _, p in extra:
                    p.terminate()
                    p.wait()
            if args.bare_durable:  # what its answers waited for was really written
                import sqlite3

                with contextlib.closing(sqlite3.connect(base / "bare" / "durable.sqlite")) as db:
                    out["bare_durable_rows"] = db.execute("SELECT count(*) FROM rows").fetchone()[0]
        if "xpu_run" not in skip:
            say(f"xpu run -- true against python -c 'import grpc', {args.runs} runs each")
            part("xpu_run", xpu_run_overhead, runtime, args.runs)
        if "waiters" not in skip:
            say(f"{args.waiters} waiters: queue, then cancel")
            part("waiters", waiters, runtime, args.waiters, daemon.pid, timeout_s=60 if args.quick else 300)
            say(f"the same {args.waiters} streams against the bare server")
            wait_s = 60 if args.quick else 300
            part("waiters_bare", waiters_bare, bare_sock, bare.pid, args.waiters, timeout_s=wait_s)
        if "idle" not in skip:
            say(f"daemon idle after the load ({args.idle_seconds:g} s)")
            part("idle_after_load", idle, daemon.pid, args.idle_seconds)
    finally:
        if bare is not None:
            bare.terminate()
            bare.wait()
        simdaemon.stop(daemon)
        shutil.rmtree(base, ignore_errors=True)
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
