"""How faithful the fake is to a real host: ``xpud check-hardware --json`` of the driver against the fake's.

Two comparisons, both over the same adapter and the same record format (``xpud.hw.check``):

- **replay**: the record, loaded as a machine description, run through ``FakeNvml`` and recorded again.
  Everything the driver returned must come back: inventory, topology, MIG geometry and mapping, event
  registration, and for every health signal the same presence (a signal the driver cannot report must be
  absent in the fake too) and, for values fixed by the board, the same value.
- **model**: a shipped description (``etc/machines``) with a card model of the same name, if any: its
  model table must say what the recording says, and its cards' signals must be present where the driver's
  are.

Values that move (utilisation, temperature, power, clocks) are compared by presence only, and counters the
fake starts at zero (ECC, replays, NVLink errors) by presence, with their values listed as notes. Run as
``python -m xpud.hw.fidelity RECORD.json``: one line per difference, exit status 1 if there is any.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

MOVING = {  # values that change from one read to the next: presence only
    "utilization_gpu_pct",
    "utilization_memory_pct",
    "memory_used_bytes",
    "temperature_c",
    "power_w",
    "performance_state",
    "fan_pct",
    "clock_event_reasons",
}
COUNTERS = {  # the fake starts them at zero: presence, values as notes
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "ecc_sbe_aggregate",
    "ecc_dbe_aggregate",
    "retired_pages_sbe",
    "retired_pages_dbe",
    "remapped_rows_corrected",
    "remapped_rows_uncorrected",
    "pcie_replay_counter",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
    "nvlink_crc_flit_errors",
    "nvlink_crc_data_errors",
}
# Model keys derived from moving values when a record becomes a description.
DERIVED_MODEL_KEYS = {"power_idle_w", "temp_idle_c", "temp_load_c"}
IGNORED_TOP = {"name", "description"}


@dataclass
class Diff:
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def record_of(machine, seed: int = 0) -> dict:
    """``check-hardware --json`` of a simulated machine (a name, a path or a ``Machine``)."""
    from xpud.hw.check import check_hardware
    from xpud.hw.fakenvml import FakeNvml
    from xpud.hw.machines import load_machine

    m = machine if hasattr(machine, "cards") else load_machine(machine)
    out = io.StringIO()
    check_hardware(FakeNvml(m, seed=seed), out=out, as_json=True)
    return json.loads(out.getvalue())


def replay(record: dict) -> dict:
    """The record as a machine description, run through the fake and recorded again."""
    from xpud.hw.machines import parse_machine

    return record_of(parse_machine(record, source="<recording>"))


def compare_samples(where: str, real: dict, fake: dict, diff: Diff, values: bool = True) -> None:
    """One card's samples: every signal present in both or absent in both; fixed values equal."""
    for key in sorted(set(real) | set(fake)):
        if key == "timestamp":
            continue
        r, f = real.get(key), fake.get(key)
        if (r is None) != (f is None):
            said = ["absent" if v is None else repr(v) for v in (r, f)]
            diff.mismatches.append(f"{where} {key}: driver {said[0]}, fake {said[1]}")
        elif key in COUNTERS and r != f:
            diff.notes.append(f"{where} {key}: driver {r}, fake {f} (a counter the fake starts at zero)")
        elif values and key not in MOVING and key not in COUNTERS and r != f:
            diff.mismatches.append(f"{where} {key}: driver {r!r}, fake {f!r}")


def compare_replay(real: dict, fake: dict) -> Diff:
    """The driver's record against the fake's replay of it."""
    diff = Diff()
    for key in sorted((set(real) | set(fake)) - IGNORED_TOP - {"recording", "models"}):
        if real.get(key) != fake.get(key):
            diff.mismatches.append(f"replay {key}: driver {real.get(key)!r}, fake {fake.get(key)!r}")
    for model in sorted(set(real.get("models", {})) | set(fake.get("models", {}))):
        r, f = real["models"].get(model, {}), fake["models"].get(model, {})
        for key in sorted((set(r) | set(f)) - DERIVED_MODEL_KEYS):
            if r.get(key) != f.get(key):
                diff.mismatches.append(
                    f"replay model {model} {key}: driver {r.get(key)!r}, fake {f.get(key)!r}"
                )
    rr, fr = real.get("recording", {}), fake.get("recording", {})
    for key in ("mig_instances", "mig_mapping", "events", "problems"):
        if rr.get(key) != fr.get(key):
            diff.mismatches.append(f"replay {key}: driver {rr.get(key)!r}, fake {fr.get(key)!r}")
    rs, fs = rr.get("samples", []), fr.get("samples", [])
    if len(rs) != len(fs):
        diff.mismatches.append(f"replay: driver sampled {len(rs)} cards, fake {len(fs)}")
    for i, (r, f) in enumerate(zip(rs, fs, strict=False)):
        compare_samples(f"replay card {i}", r, f, diff)
    return diff


def shipped_machines(name: str) -> list[str]:
    """Shipped descriptions with a card model called ``name``."""
    from xpud.hw.machines import list_machines, load_machine

    return [m for m in list_machines() if any(c.model.name == name for c in load_machine(m).cards)]


def compare_models(real: dict) -> Diff:
    """The driver's record against each shipped description of the same card model."""
    diff = Diff()
    samples = real.get("recording", {}).get("samples", [])
    for key, model in real.get("models", {}).items():
        machines = shipped_machines(model["name"])
        if not machines:
            diff.notes.append(f"no shipped machine has a {model['name']}: only the replay is compared")
        first = next(i for i, c in enumerate(real["cards"]) if c["model"] == key)
        for machine in machines:
            ours = record_of(machine)
            mine = next(k for k, m in ours["models"].items() if m["name"] == model["name"])
            theirs = ours["models"][mine]
            where = f"model {model['name']} in {machine}"
            for k in sorted((set(model) | set(theirs)) - DERIVED_MODEL_KEYS):
                if model.get(k) != theirs.get(k):
                    diff.mismatches.append(
                        f"{where} {k}: driver {model.get(k)!r}, {machine} {theirs.get(k)!r}"
                    )
            j = next(i for i, c in enumerate(ours["cards"]) if c["model"] == mine)
            if first < len(samples):
                compare_samples(where, samples[first], ours["recording"]["samples"][j], diff, values=False)
    return diff


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m xpud.hw.fidelity RECORD.json  (from xpud check-hardware --json)",
            file=sys.stderr,
        )
        return 2
    try:
        real = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as e:
        print(f"fidelity: {args[0]}: cannot read a check-hardware record: {e}", file=sys.stderr)
        return 2
    total = Diff()
    for part in (compare_replay(real, replay(real)), compare_models(real)):
        total.mismatches += part.mismatches
        total.notes += part.notes
    for line in total.mismatches:
        print(f"MISMATCH {line}")
    for line in total.notes:
        print(f"note     {line}")
    print(f"fidelity: {len(total.mismatches)} mismatch(es), {len(total.notes)} note(s)")
    return 0 if total.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
