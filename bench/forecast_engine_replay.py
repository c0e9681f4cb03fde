"""A replayed week of synthetic diurnal slice demand through the daemon's own code, with and without
forecast pre-provisioning, on a virtual clock.

    .venv/bin/python bench/forecast_engine_replay.py --out bench/forecast_engine_replay.json

What runs is the daemon's: ``xpud.engine.engine.Engine`` (queue, placement, bursts, hysteresis, capacity
windows
through ``set_window``/``keep_whole``), the MIG isolation backend (``xpud.isolation.mig``: the profile
chooser, instance creation and reuse, mode switches) over the fake NVML of a DGX H100, the SQLite ledger,
``xpud.controllers.provisioner.Provisioner`` (the forecast fitted on the ledger's four earlier weeks, cards
switched
and MIG instances pre-created, ``xpud.engine.standby``) and ``xpud.planning.windows``. Not run: gRPC, the
Hold streams,
the health monitor and the APScheduler jobs (their calls are made here at their intervals).

The clock. The asyncio loop runs on virtual time (``VirtualLoop``): whenever nothing is ready it jumps to
its next timer, so a week passes in seconds and every timeout, ``asyncio.sleep`` and engine clock reading
is virtual. Work the daemon does in threads runs inline (``asyncio.to_thread`` and the ledger's writer
are replaced by direct calls), so no thread's real duration leaks into virtual time. The fake driver is
instant; what real hardware takes is added as virtual time to the call that did it, while the card is
claimed (busy) exactly as during the real call: ``--switch-s`` per MIG mode switch (the driver's reset),
``--create-s`` per GPU instance created (with its compute instance). Both are assumptions, stated in the
output. The demand (arrivals, sizes, durations, training by the hour, the windows) is that of
bench/forecast_replay.py (the earlier one-second model), same seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import selectors
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forecast_replay as model

from xpud import config
from xpud.controllers.provisioner import Provisioner
from xpud.engine.engine import Engine
from xpud.hw.fakenvml import FakeNvml
from xpud.hw.nvml import Nvml
from xpud.isolation import backend_for
from xpud.isolation.faketools import FakeNvidiaTools
from xpud.ledger.ledger import Ledger
from xpud.model import Caller, CardMode, Lease, LeaseState, Mode, Request
from xpud.planning import windows

ROOT = Caller(uid=0, admin=True)
CREATES = ("nvmlDeviceCreateGpuInstanceWithPlacement",)
SWITCHES = ("nvmlDeviceSetMigMode",)


class VirtualSelector(selectors.DefaultSelector):
    """Never sleeps: with nothing ready it moves the loop's virtual clock to the next timer."""

    def __init__(self, loop_ref: list):
        super().__init__()
        self.loop_ref = loop_ref

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout is None or timeout <= 0:
            return ready if (ready or timeout is not None) else super().select(None)
        self.loop_ref[0].vt += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, t0: float):
        ref: list = []
        super().__init__(VirtualSelector(ref))
        ref.append(self)
        self.vt = t0
        # Epoch seconds as a float resolve ~0.2 us: timers closer than a millisecond count as due, or a
        # jump of a few nanoseconds would leave the clock where it was (and the loop spinning).
        self._clock_resolution = 1e-3

    def time(self) -> float:
        return self.vt


def window_specs(day: float, night: float) -> tuple:
    text = (
        f'[[windows]]\nname = "day"\ncron = "0 8 * * 1-5"\nwhole_share = {day}\n'
        f'[[windows]]\nname = "night"\ncron = "0 20 * * 1-5"\nwhole_share = {night}\n'
        f'[[windows]]\nname = "weekend"\ncron = "0 0 * * 6"\nwhole_share = {night}\n'
    )
    return config.parse(text).windows


def fill_history(ledger: Ledger, hist) -> None:
    ops = []
    for n, (t, size, dur) in enumerate(hist):
        lease = Lease(f"h{n:07d}", Mode(size), 1000, (0,), ("GPU-history",), created=t)
        ops += [
            ledger.insert_lease_op(lease, "t"),
            ledger.end_lease_op(lease.id, LeaseState.RELEASED, when=t + dur),
        ]
    for k in range(0, len(ops), 2000):
        ledger.write_sync(*ops[k : k + 2000])


async def replay(week, hist, args, preprovision: bool, tmp: Path) -> dict:
    loop = asyncio.get_running_loop()
    fake = FakeNvml("dgx-h100")
    nvml = Nvml(fake)
    nvml.open()
    cfg = config.parse(
        f"[forecast]\nenabled = true\nlead_s = {model.LEAD_S}\ninterval_s = {model.TICK_S}\n"
        f"[bursts]\nhold_s = {model.HOLD_S}\n[leases]\nmax_wait_s = {7 * 86400.0}\n"
    ).replace("daemon", runtime_dir=str(tmp / "run"), state_dir=str(tmp / "state"))
    (tmp / "run").mkdir(exist_ok=True)
    ledger = Ledger(tmp / f"ledger-{int(preprovision)}.sqlite")
    fill_history(ledger, hist)

    async def write(*ops):  # the ledger's writer thread, inline (no real time passes on the loop)
        ledger.write_sync(*ops)

    ledger.write = write
    cost = {"created_in_a_grant": 0, "grants_on_a_ready_instance": 0, "switches": 0, "creates": 0}

    async def inline(fn, *a, **k):  # asyncio.to_thread: inline, plus the hardware's time in virtual time
        c0, s0 = sum(fake.calls[x] for x in CREATES), sum(fake.calls[x] for x in SWITCHES)
        out = fn(*a, **k)
        created = sum(fake.calls[x] for x in CREATES) - c0
        switched = sum(fake.calls[x] for x in SWITCHES) - s0
        cost["creates"] += created
        cost["switches"] += switched
        if getattr(fn, "__name__", "") == "prepare":
            cost["created_in_a_grant" if created else "grants_on_a_ready_instance"] += 1
        delay = created * args.create_s + switched * args.switch_s
        if delay:
            await asyncio.sleep(delay)
        return out

    asyncio.to_thread = inline
    iso = backend_for(cfg, nvml, FakeNvidiaTools(fake))
    engine = Engine(nvml.cards(), nvml.topology(), cfg, ledger, isolation=iso, clock=loop.time)
    await engine.restore()
    prov = Provisioner(engine, clock=loop.time)
    specs = window_specs(args.day_share, args.night_share)
    t0 = week[0][0] - week[0][0] % 3600
    t_end = t0 + args.days * 86400
    week = [w for w in week if w[0] < t_end]
    waits: list[float] = []
    training: list[str] = []  # training leases, oldest first
    pending_training = [0]
    share_day: list[float] = []
    shown = [0]

    async def slice_job(arrive: float, size: str, dur: float) -> None:
        await asyncio.sleep(max(0.0, arrive - loop.time()))
        lease, _ = await engine.acquire(Request(Mode(size), wait_s=7 * 86400.0, owner_uid=1000))
        waits.append(loop.time() - arrive)
        await asyncio.sleep(dur)
        await engine.release(lease.id, ROOT)

    async def training_job() -> None:
        pending_training[0] += 1
        try:
            lease, _ = await engine.acquire(Request(Mode.XPU, wait_s=3600.0, owner_uid=2000))
        except Exception:  # the hour's demand passed: the job gives up
            return
        finally:
            pending_training[0] -= 1
        training.append(lease.id)

    async def operator() -> None:
        """The daemon's periodic jobs: windows and training each minute, the forecast every tick."""
        next_forecast = t0
        while loop.time() < t_end:
            now = loop.time()
            engine.set_window(windows.current(specs, datetime.fromtimestamp(now).astimezone()))
            await engine.keep_whole()
            want = model.whole_wanted(now)
            while len(training) > want:
                await engine.release(training.pop(), ROOT)
            for _ in range(want - len(training) - pending_training[0]):
                engine._spawn(training_job(), "training")
            if preprovision and now >= next_forecast:
                await prov.run()
                next_forecast += model.TICK_S
            if args.verbose and int(now) // 3600 != shown[0]:
                shown[0] = int(now) // 3600
                print(
                    f"{datetime.fromtimestamp(now)} real {time.monotonic() - real0:.1f} s "
                    f"granted {len(waits)} queued {len(engine.waitlist)}",
                    file=sys.stderr,
                )
            if model.day_window(now):
                share_day.append(
                    sum(c.mode is CardMode.WHOLE for c in engine.cards.values()) / len(engine.cards)
                )
            await asyncio.sleep(60.0)

    real0 = time.monotonic()
    jobs = [asyncio.ensure_future(slice_job(*w)) for w in week]
    op = asyncio.ensure_future(operator())
    await asyncio.sleep(t_end - loop.time())
    unfinished = sum(not j.done() for j in jobs)
    for j in (op, *jobs):  # not awaited: the week is over, what they would do next is not measured
        j.cancel()
    w = np.array(waits)
    conv = {f"{m}/{why}": n for (m, why), n in sorted(engine.stats.conversions.items())}
    return {
        "requests": len(week),
        "granted": len(w),
        "still_waiting_or_running_at_the_end": unfinished,
        "waited_over_1s": int((w > 1.0).sum()),
        "waited_1_to_15s": int(((w > 1.0) & (w <= 15.0)).sum()),  # about one reconfiguration
        "mean_wait_s": round(float(w.mean()), 3),
        "p50_wait_s": round(float(np.percentile(w, 50)), 3),
        "p99_wait_s": round(float(np.percentile(w, 99)), 3),
        "max_wait_s": round(float(w.max()), 3),
        "whole_share_by_day": round(float(np.mean(share_day)), 3),
        "mig": cost,
        "conversions": conv,
        "real_seconds": round(time.monotonic() - real0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch-s", type=float, default=10.0, help="virtual seconds a MIG mode switch takes")
    ap.add_argument(
        "--create-s", type=float, default=2.0, help="virtual seconds a GPU instance creation takes"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--day-share", type=float, default=0.5)
    ap.add_argument("--night-share", type=float, default=0.0)
    ap.add_argument("--training-scale", type=float, default=1.0)
    ap.add_argument("--days", type=float, default=7.0, help="replay only this many days of the week")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    model.TRAINING_SCALE[0] = args.training_scale
    rng = np.random.default_rng(args.seed)
    hist = model.arrivals(rng, model.START, 4 * 168)
    week = model.arrivals(rng, model.START + timedelta(weeks=4), 168)
    result = {
        "switch_s": args.switch_s,
        "create_s": args.create_s,
        "seed": args.seed,
        "training_scale": args.training_scale,
        "day_share": args.day_share,
        "night_share": args.night_share,
    }
    for name, pre in (("without", False), ("with", True)):
        with tempfile.TemporaryDirectory(prefix="xpud-replay-") as tmp:
            loop = VirtualLoop(week[0][0] - week[0][0] % 3600)
            try:
                result[name] = loop.run_until_complete(replay(week, hist, args, pre, Path(tmp)))
            finally:
                loop.close()
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
