"""The checks of scripts/device-check.sh that read JSON or probe CUDA: one subcommand each.

Each prints one line (its detail for the summary) and exits 0 when the check passes, 1 when it fails.

    python scripts/device_check.py ls OUT          xpu ls lists the cards check-hardware saw
    python scripts/device_check.py health OUT      no card unhealthy; which signals are absent
    python scripts/device_check.py topo OUT        the topology covers every card
    python scripts/device_check.py run OUT [sim]   the whole-card child saw exactly its card
    python scripts/device_check.py cuda            (in the child) CUDA's devices: count and UUIDs
    python scripts/device_check.py cpu PID SECONDS the daemon's CPU over SECONDS
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path


def load(out: str, name: str):
    return json.loads(Path(out, name).read_text())


def check_ls(out: str) -> str:
    want = [c["uuid"] for c in load(out, "check-hardware.json")["cards"]]
    got = [c["uuid"] for c in load(out, "ls.json")]
    assert got == want, f"xpu ls lists {got}, check-hardware saw {want}"
    return f"{len(got)} card(s), the same as check-hardware"


def check_health(out: str) -> str:
    cards = load(out, "health.json")
    bad = [f"card {c['index']}: {'; '.join(c['reasons'])}" for c in cards if c["health_state"] == "unhealthy"]
    assert not bad, "unhealthy: " + " | ".join(bad)
    absent = sorted({s["name"] for c in cards for s in c["signals"] if s["status"] == "absent"})
    states = "/".join(sorted({c["health_state"] for c in cards}))
    return f"{len(cards)} card(s) {states}; signals absent: {', '.join(absent) or 'none'}"


def check_topo(out: str) -> str:
    size, cards = load(out, "topo.json")["size"], len(load(out, "check-hardware.json")["cards"])
    assert size == cards, f"topology of {size} cards, check-hardware saw {cards}"
    return f"{size}x{size} matrix"


def check_run(out: str, simulated: bool) -> str:
    lines = Path(out, "run.txt").read_text().splitlines()

    def values(key: str) -> list[str]:
        return [line.split("=", 1)[1] for line in lines if line.startswith(key + "=")]

    cvd = (values("CVD") or [""])[0]
    uuids = [c["uuid"] for c in load(out, "check-hardware.json")["cards"]]
    assert "," not in cvd and cvd in uuids, f"CUDA_VISIBLE_DEVICES={cvd!r} is not exactly one of {uuids}"
    if simulated:
        return f"child has CUDA_VISIBLE_DEVICES={cvd}: exactly one card"
    assert values("CUDA_COUNT") == ["1"], f"CUDA sees {values('CUDA_COUNT')} device(s), not 1"
    assert values("CUDA_UUID") == [cvd], f"CUDA sees {values('CUDA_UUID')}, the lease is {cvd}"
    smi = values("SMI")
    assert any(cvd in s for s in smi), f"nvidia-smi -L does not list {cvd}"
    listed = f"nvidia-smi -L: {len(smi)}, NVML ignores CUDA_VISIBLE_DEVICES"
    return f"child sees exactly {cvd} (CUDA: 1 device; {listed})"


def cuda_devices() -> str:
    """Run in the child: CUDA's view through the driver API (honours CUDA_VISIBLE_DEVICES)."""
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0, "cuInit failed"
    n = ctypes.c_int()
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == 0
    print(f"CUDA_COUNT={n.value}")
    for i in range(n.value):
        dev, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        assert cu.cuDeviceGet(ctypes.byref(dev), i) == 0 and cu.cuDeviceGetUuid(raw, dev) == 0
        h = bytes(raw).hex()
        print(f"CUDA_UUID=GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return f"{n.value} CUDA device(s)"


def daemon_cpu(pid: str, seconds: str) -> str:
    import psutil

    p, s = psutil.Process(int(pid)), float(seconds)
    c0, t0 = p.cpu_times(), time.monotonic()
    time.sleep(s)
    c1, t1 = p.cpu_times(), time.monotonic()
    pct = 100 * ((c1.user - c0.user) + (c1.system - c0.system)) / (t1 - t0)
    rss = p.memory_info().rss >> 20
    return f"daemon polling at 1 Hz: {pct:.2f} % of one core over {t1 - t0:.0f} s, RSS {rss} MiB"


COMMANDS = {
    "ls": lambda a: check_ls(a[0]),
    "health": lambda a: check_health(a[0]),
    "topo": lambda a: check_topo(a[0]),
    "run": lambda a: check_run(a[0], len(a) > 1 and a[1] == "sim"),
    "cuda": lambda a: cuda_devices(),
    "cpu": lambda a: daemon_cpu(a[0], a[1]),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: device_check.py {'|'.join(COMMANDS)} ARGS", file=sys.stderr)
        return 2
    try:
        print(COMMANDS[argv[0]](argv[1:]))
    except (AssertionError, OSError, ValueError, KeyError, IndexError) as e:
        print(f"{argv[0]}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
