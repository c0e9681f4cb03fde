"""A/B of daemon settings under grant load, on a noisy machine: two or more simulated daemons (one per
setting, all started first), measured in turn, in alternating order, for ``--rounds`` rounds; medians.

    .venv/bin/python bench/load_ab.py --clients 8 --rounds 10 \\
        --setting '' --setting '[daemon]
    event_loop = "asyncio"'

Each ``--setting`` is TOML added to ``bench/load.py``'s daemon config ('' = as it is). A measurement is
``bench/load.py``'s: clients in 4 processes doing Acquire+Release of a ``--mode`` lease for ``--seconds``.
On a shared machine the rate moves 2x within minutes; alternating the daemons round by round puts each
setting under the same drift, so the medians (and each round's pair) compare where one run per setting
cannot. Prints one JSON object per setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", action="append", required=True, help="TOML added to the daemon's config")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--mode", default="vxpu-quarter")
    ap.add_argument("--machine", default="pcie-8x-l40s")
    ap.add_argument("--out", help="also write the results here (JSON)")
    args = ap.parse_args()
    if len(args.setting) < 2:
        raise SystemExit("give at least two --setting (one may be '': the config as it is)")

    import load
    import simdaemon

    daemons = []
    try:
        for i, setting in enumerate(args.setting):
            base = Path(tempfile.mkdtemp(prefix=f"xpu-ab{i}-", dir="/tmp"))
            proc = simdaemon.start(args.machine, base, load.DAEMON_CONFIG + setting, log=base / "xpud.log")
            spec = {
                "target": "xpud",
                "mode": args.mode,
                "gpus": 1,
                "runtime": str(base / "run"),
                "wait_s": 60.0,
            }
            daemons.append((setting, spec, proc))
        for _, spec, _ in daemons:  # warm: connections, credentials, first grants
            load.measure_cycles(spec, args.clients, 2.0)
        rows: dict[str, list[dict]] = {s: [] for s in args.setting}
        for r in range(args.rounds):
            for setting, spec, proc in daemons if r % 2 == 0 else daemons[::-1]:
                rows[setting].append(load.measure_cycles(spec, args.clients, args.seconds, proc.pid))
                load.say(f"round {r + 1}/{args.rounds} {setting!r}: {rows[setting][-1]['cycles_per_s']}/s")
    finally:
        for _, _, proc in daemons:
            proc.terminate()
            proc.wait(60)
    out = []
    for setting in args.setting:
        rs = rows[setting]

        def med(key: str, rs=rs) -> float:
            return round(statistics.median(x[key] for x in rs if x.get(key) is not None), 3)

        out.append(
            {
                "setting": setting,
                "clients": args.clients,
                "mode": args.mode,
                "cycles_per_s_median": med("cycles_per_s"),
                "acquire_p50_ms_median": med("acquire_p50_ms"),
                "acquire_p99_ms_median": med("acquire_p99_ms"),
                "daemon_cpu_ms_per_cycle_median": med("daemon_cpu_ms_per_cycle"),
                "clients_cpu_ms_per_cycle_median": med("clients_cpu_ms_per_cycle"),
                "daemon_threads_pct_median": {
                    g: round(statistics.median(x["daemon_threads_pct"].get(g, 0.0) for x in rs), 1)
                    for g in rs[0]["daemon_threads_pct"]
                },
                "cycles_per_s": [x["cycles_per_s"] for x in rs],
                "errors": sum(x["errors"] for x in rs),
            }
        )
        print(json.dumps(out[-1]))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
