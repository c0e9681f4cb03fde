"""Driver facts scripts/device-check.sh records on a lent GPU: what the real driver answers where the fake
(xpud.hw.fakenvml) had to assume. Read-only: no call here changes a card.

Each subcommand writes ``OUT/<name>.json`` and prints one line (the summary's detail); exit 0 when the
probe ran (the answer is the record, whatever it says), 1 when it could not.

    python scripts/device_probe.py mig-profiles OUT     every GPU-instance profile enum's return code
    python scripts/device_probe.py fabric OUT           nvmlDeviceGetGpuFabricInfoV per card
    python scripts/device_probe.py fields OUT           each health call's support (return code)
    python scripts/device_probe.py recovery OUT         NVML_FI_DEV_GET_GPU_RECOVERY_ACTION per card
    python scripts/device_probe.py nvlink OUT           NVLink version, state and error counters per link
    python scripts/device_probe.py load OUT SECONDS     a CUDA load (PyTorch) on card 0: power against the
                                                        limit, clock-event bits, process utilisation

``--simulate MACHINE`` before the subcommand probes the fake instead (tests).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pynvml as N

_NAMES = {getattr(N, n): n.removeprefix("NVML_ERROR_") for n in dir(N) if n.startswith("NVML_ERROR_")}
_NAMES[N.NVML_SUCCESS] = "SUCCESS"


def code(e: BaseException) -> str:
    return _NAMES.get(getattr(e, "value", None), repr(e))


def ask(fn, *args) -> tuple[str, object]:
    """(return code name, value) of one NVML call."""
    try:
        return "SUCCESS", fn(*args)
    except N.NVMLError as e:
        return code(e), None


def _handles(lib) -> list:
    return [lib.nvmlDeviceGetHandleByIndex(i) for i in range(lib.nvmlDeviceGetCount())]


def _save(out: str, name: str, doc) -> None:
    Path(out, f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")


def mig_profiles(lib, out: str) -> str:
    """Every NVML_GPU_INSTANCE_PROFILE_* enum (up to the binding's COUNT) on every card: its return code,
    and the driver's profile id and name where SUCCESS. MIG off answers NOT_SUPPORTED throughout."""
    doc, tally = [], Counter()
    for i, h in enumerate(_handles(lib)):
        rc, mode = ask(lib.nvmlDeviceGetMigMode, h)
        card = {
            "index": i,
            "mig_mode": mode if mode is None else list(mode),
            "mig_mode_rc": rc,
            "profiles": {},
        }
        for enum in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT):
            rc, info = ask(lib.nvmlDeviceGetGpuInstanceProfileInfo, h, enum)
            entry = {"rc": rc}
            if info is not None:
                name = getattr(info, "name", b"")
                entry.update(id=int(info.id), name=name.decode() if isinstance(name, bytes) else str(name))
            card["profiles"][enum] = entry
            tally[rc] += 1
        doc.append(card)
    _save(out, "mig-profiles", doc)
    return "profile enums: " + ", ".join(f"{n} {rc}" for rc, n in sorted(tally.items()))


def fabric(lib, out: str) -> str:
    doc, seen = [], Counter()
    for i, h in enumerate(_handles(lib)):
        info = N.c_nvmlGpuFabricInfoV_t()
        rc, _ = ask(lib.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info))
        entry = {"index": i, "rc": rc}
        if rc == "SUCCESS":
            entry.update(state=int(info.state), status=int(info.status), health_mask=int(info.healthMask))
            seen[f"state {int(info.state)} status {_NAMES.get(int(info.status), int(info.status))}"] += 1
        else:
            seen[rc] += 1
        doc.append(entry)
    _save(out, "fabric", doc)
    return "fabric: " + ", ".join(f"{n} x {what}" for what, n in sorted(seen.items()))


def _field_ids():
    ids = {
        "recovery_action": N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
        "nvlink_link_count": N.NVML_FI_DEV_NVLINK_LINK_COUNT,
    }
    for name in (
        "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    ):
        ids[name.removeprefix("NVML_FI_DEV_").lower()] = getattr(N, name)
    return ids


def _field_values(lib, h, ids: dict[str, int]) -> dict[str, tuple[str, object]]:
    rc, values = ask(lib.nvmlDeviceGetFieldValues, h, list(ids.values()))
    if values is None:
        return {k: (rc, None) for k in ids}
    out = {}
    for k, v in zip(ids, values, strict=True):
        ret = _NAMES.get(v.nvmlReturn, str(v.nvmlReturn)) if v.nvmlReturn else "SUCCESS"
        out[k] = (ret, int(v.value.ullVal) if not v.nvmlReturn else None)
    return out


def fields(lib, out: str) -> str:
    """Each call behind a health signal, per card: SUCCESS or why not (NOT_SUPPORTED, ...)."""
    calls = {
        "utilization": (lib.nvmlDeviceGetUtilizationRates,),
        "memory": (lib.nvmlDeviceGetMemoryInfo,),
        "temperature": (lib.nvmlDeviceGetTemperature, N.NVML_TEMPERATURE_GPU),
        "temp_slowdown": (lib.nvmlDeviceGetTemperatureThreshold, N.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
        "power": (lib.nvmlDeviceGetPowerUsage,),
        "power_limit": (lib.nvmlDeviceGetEnforcedPowerLimit,),
        "performance_state": (lib.nvmlDeviceGetPerformanceState,),
        "fan": (lib.nvmlDeviceGetFanSpeed,),
        "ecc_dbe_volatile": (
            lib.nvmlDeviceGetTotalEccErrors,
            N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            N.NVML_VOLATILE_ECC,
        ),
        "retired_pages": (
            lib.nvmlDeviceGetRetiredPages,
            N.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        ),
        "remapped_rows": (lib.nvmlDeviceGetRemappedRows,),
        "clock_event_reasons": (lib.nvmlDeviceGetCurrentClocksEventReasons,),
        "pcie_replays": (lib.nvmlDeviceGetPcieReplayCounter,),
        "inforom": (lib.nvmlDeviceValidateInforom,),
        "process_utilization": (lib.nvmlDeviceGetProcessUtilization, 0),
    }
    doc, unsupported = [], Counter()
    for i, h in enumerate(_handles(lib)):
        card = {k: ask(c[0], h, *c[1:])[0] for k, c in calls.items()}
        card.update({f"field {k}": rc for k, (rc, _) in _field_values(lib, h, _field_ids()).items()})
        for k, rc in card.items():
            if rc != "SUCCESS":
                unsupported[f"{k} {rc}"] += 1
        doc.append({"index": i, **card})
    _save(out, "fields", doc)
    return "not SUCCESS: " + (", ".join(f"{k} (x{n})" for k, n in sorted(unsupported.items())) or "none")


def recovery(lib, out: str) -> str:
    doc = []
    for i, h in enumerate(_handles(lib)):
        rc, value = _field_values(lib, h, {"recovery_action": N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION})[
            "recovery_action"
        ]
        doc.append({"index": i, "rc": rc, "action": value})
    _save(out, "recovery", doc)
    answers = Counter(
        f"{d['rc']}" + (f" action {d['action']}" if d["action"] is not None else "") for d in doc
    )
    return "recovery action: " + ", ".join(f"{n} x {a}" for a, n in sorted(answers.items()))


def nvlink(lib, out: str) -> str:
    doc, versions, up = [], Counter(), 0
    for i, h in enumerate(_handles(lib)):
        count = _field_values(lib, h, {"n": N.NVML_FI_DEV_NVLINK_LINK_COUNT})["n"][1] or 0
        links = []
        for k in range(int(count)):
            rc_s, state = ask(lib.nvmlDeviceGetNvLinkState, h, k)
            rc_v, version = ask(lib.nvmlDeviceGetNvLinkVersion, h, k)
            errors = {
                c: ask(
                    lib.nvmlDeviceGetNvLinkErrorCounter, h, k, getattr(N, f"NVML_NVLINK_ERROR_DL_{c.upper()}")
                )
                for c in ("replay", "recovery", "crc_flit", "crc_data")
            }
            links.append(
                {
                    "link": k,
                    "state": state,
                    "state_rc": rc_s,
                    "version": version,
                    "version_rc": rc_v,
                    "errors": {c: (rc, v) for c, (rc, v) in errors.items()},
                }
            )
            up += state == N.NVML_FEATURE_ENABLED
            versions[version] += 1
        doc.append({"index": i, "link_count": count, "links": links})
    _save(out, "nvlink", doc)
    return f"{sum(len(c['links']) for c in doc)} link(s), {up} active; versions {dict(versions)}"


_LOAD = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda"); b = torch.randn(8192, 8192, device="cuda")
end = time.time() + float(sys.argv[1])
while time.time() < end:
    (a @ b).sum().item()
"""


def load(lib, out: str, seconds: str) -> str:
    """A matmul loop (PyTorch) on card 0 for SECONDS, sampled each second: power against the enforced limit,
    clock-event reason bits, and the per-process utilisation samples of the loop's pid."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise OSError("SKIP: no PyTorch here (pip install torch), no CUDA load run") from None
    h = lib.nvmlDeviceGetHandleByIndex(0)
    child = subprocess.Popen(
        [sys.executable, "-c", _LOAD, seconds], env={"CUDA_VISIBLE_DEVICES": "0", **_env()}
    )
    rows, bits, seen_pid, last = [], 0, 0, 0
    limit = lib.nvmlDeviceGetEnforcedPowerLimit(h)
    try:
        while child.poll() is None:
            time.sleep(1.0)
            power = ask(lib.nvmlDeviceGetPowerUsage, h)[1]
            reasons = ask(lib.nvmlDeviceGetCurrentClocksEventReasons, h)[1] or 0
            rc, samples = ask(lib.nvmlDeviceGetProcessUtilization, h, last)
            mine = [s for s in samples or () if s.pid == child.pid]
            seen_pid += bool(mine)
            last = max([last, *(int(s.timeStamp) for s in samples or ())])
            bits |= reasons
            rows.append(
                {
                    "power_mw": power,
                    "limit_mw": limit,
                    "reasons": reasons,
                    "proc_rc": rc,
                    "proc": [(s.smUtil, s.memUtil) for s in mine],
                }
            )
    finally:
        child.wait()
    _save(out, "load", rows)
    ratios = [r["power_mw"] / limit for r in rows if r["power_mw"]]
    at_cap = sum(x >= 0.98 for x in ratios)
    top = max(ratios, default=0.0)
    return (
        f"{len(rows)} s: power max {top:.3f} x limit, {at_cap} sample(s) >= 0.98; clock-event bits "
        f"0x{bits:x}; process utilisation for the load's pid in {seen_pid} sample(s); exit {child.returncode}"
    )


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}


COMMANDS = {
    "mig-profiles": lambda lib, a: mig_profiles(lib, a[0]),
    "fabric": lambda lib, a: fabric(lib, a[0]),
    "fields": lambda lib, a: fields(lib, a[0]),
    "recovery": lambda lib, a: recovery(lib, a[0]),
    "nvlink": lambda lib, a: nvlink(lib, a[0]),
    "load": lambda lib, a: load(lib, a[0], a[1]),
}


def main(argv: list[str]) -> int:
    lib = N
    if argv[:1] == ["--simulate"]:
        from xpud.hw.fakenvml import FakeNvml

        lib, argv = FakeNvml(argv[1]), argv[2:]
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: device_probe.py [--simulate MACHINE] {'|'.join(COMMANDS)} OUT ...", file=sys.stderr)
        return 2
    try:
        lib.nvmlInit()
    except N.NVMLError as e:
        print(f"{argv[0]}: NVML did not start ({code(e)})")
        return 1
    try:
        print(COMMANDS[argv[0]](lib, argv[1:]))
    except (OSError, ValueError, IndexError, N.NVMLError) as e:
        print(f"{argv[0]}: {e}")
        return 3 if str(e).startswith("SKIP") else 1
    finally:
        lib.nvmlShutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
