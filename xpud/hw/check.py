"""``xpud check-hardware``: run the real adapter once, read-only, and show what it sees.

The text report has the driver and CUDA versions, the inventory, the topology matrix (as
``nvidia-smi topo -m`` prints it), a health sample per card, MIG modes, profiles and instances, and an
event-registration probe. ``--json`` prints the same as a machine description (see ``machines.py``) with
the measurements under ``recording``, so a recording of a real host replays as a simulated machine:
``xpud --simulate recording.json``.

A MIG-capable card lists no profiles while MIG is off (the driver answers NOT_SUPPORTED). Its profiles are
then taken from another card of the same model that has MIG on, else from the machine descriptions that
ship with xpud (``etc/machines``), so that the report can still say which profiles xpud would use (from
``etc/mig-profiles.toml``) and the recording still replays the card as MIG-capable. Where neither knows
the model, the report says so and the recording keeps the card without MIG.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from xpud.errors import XpudError
from xpud.hw.machines import ARCHITECTURES, MachineError, format_cpulist, list_machines, load_machine
from xpud.hw.nvml import MIB, MigProfile, Nvml, NvmlError, NvmlNotSupported, NvmlUnavailable
from xpud.model import CardInfo, CardSample, SliceSpec
from xpud.topology import LEVEL_MEANING, Topology

_NVLINK_VERSIONS = {1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0", 8: "6.0"}


def check_hardware(
    lib=None,
    out: TextIO = sys.stdout,
    as_json: bool = False,
    slices: Mapping[str, SliceSpec] | None = None,
    profile_map: str | None = None,
) -> int:
    """Probe the hardware through the adapter (``lib``: pynvml by default, or a FakeNvml) and print a
    report, or with ``as_json`` a machine description. Changes nothing. Returns 0, 1 when some NVML call
    failed (each is listed), or 2 when NVML is not usable at all.

    ``slices`` (default: the default slice sizes) and ``profile_map`` (a MIG profile map file; default
    xpud's own) give the MIG mapping the report shows: the profiles xpud would use for each size."""
    nvml = Nvml(lib)
    try:
        nvml.open()
    except NvmlUnavailable as e:
        print(f"xpud check-hardware: {e}", file=sys.stderr)
        return 2
    try:
        report = _probe(nvml)
    finally:
        nvml.close()
    report["model_profiles"] = _model_profiles(report["cards"], report["mig_profiles"])
    for c in report["cards"]:
        if c.mig_capable and not report["model_profiles"][c.name][0]:
            report["notes"].append(
                f"GPU{c.index} ({c.name}): MIG is off and no machine description knows this model's "
                "profiles: the recording replays it without MIG (record again with MIG on to keep them)"
            )
    report["mig_mapping"] = _mig_mapping(report, slices, profile_map)
    problems = report["problems"] + [e for e in nvml.errors if e not in report["problems"]]
    if as_json:
        record = _description(report)
        record["recording"]["problems"] = problems
        print(json.dumps(record, indent=2), file=out)
    else:
        _print_report(report, problems, out)
    return 1 if problems else 0


def _mig_mapping(report: dict, slices, profile_map) -> dict[str, dict[str, tuple[list[str], str]]]:
    """Card model -> slice size -> (profile names xpud would use, where they come from). Pure but for
    reading the packaged machine descriptions: it uses the profiles already probed (or known by model)."""
    from xpud.config.schema import DEFAULT_SLICES
    from xpud.hw import mig_map

    try:
        table = mig_map.load(profile_map)
    except XpudError as e:
        report["problems"].append(f"MIG profile map: {e}")
        table = {}
    out = {}
    for c in report["cards"]:
        if not c.mig_capable or c.name in out:
            continue
        profiles, origin = report["model_profiles"].get(c.name, ([], ""))
        if not profiles:  # MIG off and the model unknown: the map's names, unchecked
            named = table.get(c.name, {})
            out[c.name] = {
                size: (list(named.get(size, ())), "map" if named.get(size) else "derived once MIG is on")
                for size in slices or DEFAULT_SLICES
            }
            continue
        geom = mig_map.geometry(profiles)
        ids = mig_map.profiles_for(c.name, geom, slices or DEFAULT_SLICES, table)
        note = f"; profiles from {origin}" if origin else ""
        out[c.name] = {
            size: ([geom.profile(i).name for i in chosen], mig_map.source(c.name, size, table) + note)
            for size, chosen in ids.items()
        }
    return out


def _model_profiles(cards: list[CardInfo], probed: list[list[MigProfile]]) -> dict:
    """Card model name -> (its MIG profiles, "" when a card of this host listed them, else where they come
    from): a card lists none while MIG is off, so another card of the model, or a packaged machine
    description that has the model, stands in."""
    out: dict[str, tuple[list[MigProfile], str]] = {}
    for c, profiles in zip(cards, probed, strict=True):
        if profiles and not out.get(c.name, ([], ""))[0]:
            out[c.name] = (profiles, "")
    for c in cards:
        if c.mig_capable and c.name not in out:
            out[c.name] = _packaged_profiles(c.name)
    return out


def _packaged_profiles(name: str) -> tuple[list[MigProfile], str]:
    for machine in list_machines():
        try:
            m = load_machine(machine)
        except MachineError:
            continue
        model = next((c.model for c in m.cards if c.model.name == name and c.model.mig_profiles), None)
        if model is not None:
            profiles = [
                MigProfile(
                    p.profile,
                    p.id,
                    p.name,
                    p.slices,
                    p.placement_size,
                    p.memory_mib * MIB,
                    p.instances,
                    p.multiprocessors,
                    tuple((start, p.placement_size) for start in p.placements),
                )
                for p in model.mig_profiles
            ]
            return profiles, f"etc/machines/{machine}.toml"
    return [], ""


def _probe(nvml: Nvml) -> dict:
    """Everything check-hardware shows, gathered once. A failing section is noted, not fatal."""
    problems: list[str] = []

    def section(name, fn, default):
        try:
            return fn()
        except NvmlError as e:
            problems.append(f"{name}: {e}")
            return default

    cards: list[CardInfo] = section("inventory", nvml.cards, [])
    n = len(cards)
    report = {
        "driver": nvml.driver_version(),
        "cuda": nvml.cuda_version(),
        "cards": cards,
        "topology": section("topology", nvml.topology, None),
        "nvlinks": [section(f"card {i} nvlinks", lambda i=i: nvml.nvlinks(i), []) for i in range(n)],
        "pcie": [section(f"card {i} pcie", lambda i=i: nvml.pcie_link(i), (None, None)) for i in range(n)],
        "samples": [nvml.sample(i) for i in range(n)],
        "mig_mode": [section(f"card {i} MIG mode", lambda i=i: nvml.mig_mode(i), None) for i in range(n)],
        "mig_profiles": [
            section(f"card {i} MIG profiles", lambda i=i: nvml.mig_profiles(i), []) for i in range(n)
        ],
        "mig_instances": [
            section(f"card {i} MIG instances", lambda i=i: nvml.mig_instances(i), []) for i in range(n)
        ],
        "events": {},
        "problems": problems,
        "notes": [],
    }
    problems.extend(f"card {i}: lost (fallen off the bus)" for i, s in enumerate(report["samples"]) if s.lost)
    try:
        waiter = nvml.event_waiter()
    except NvmlError as e:
        problems.append(f"events: {e}")
    else:
        report["events"] = {i: (", ".join(kinds), None) for i, kinds in waiter.registered.items()}
        for i, err in waiter.unregistered.items():
            report["events"][i] = ("", str(err))
            if not isinstance(err, NvmlNotSupported):
                problems.append(f"events on card {i}: {err}")
        waiter.close()
    return report


# ------------------------------------------------------------------------------------------ text


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 30):.1f} GiB"


def _opt(value, unit: str = "") -> str:
    return "-" if value is None else f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _print_report(report: dict, problems: list[str], out: TextIO) -> None:
    def p(line: str = "") -> None:
        print(line, file=out)

    cards: list[CardInfo] = report["cards"]
    p(f"NVIDIA driver {report['driver'] or '?'}, CUDA {report['cuda'] or '?'}, {len(cards)} card(s)")
    p()
    p("Cards")
    for c in cards:
        mig = "MIG on" if c.mig_enabled else "MIG off" if c.mig_capable else "no MIG"
        p(f"  GPU{c.index}  {c.name}  {_gib(c.memory_total_bytes)}  {c.pci_bus_id}  {c.uuid}")
        numa = _opt(c.numa_node)
        p(
            f"        /dev/nvidia{_opt(c.minor_number)}  arch {c.architecture or '-'}  "
            f"serial {c.serial or '-'}  NUMA {numa}  {mig}  NVLink {c.nvlink_active_links} active"
        )
    topo: Topology | None = report["topology"]
    if topo is not None:
        p()
        p("Topology")
        _print_matrix(topo, cards, p)
    p()
    p("Health")
    for c, s in zip(cards, report["samples"], strict=True):
        p(f"  GPU{c.index}  {_sample_line(s)}")
    p()
    p("MIG")
    shown: dict[str, int] = {}  # card name -> first card whose profiles were listed
    for c, mode, profiles, instances in zip(
        cards, report["mig_mode"], report["mig_profiles"], report["mig_instances"], strict=True
    ):
        if mode is None:
            p(f"  GPU{c.index}  not supported")
            continue
        state = {(0, 0): "disabled", (1, 1): "enabled"}.get(mode, f"current {mode[0]}, pending {mode[1]}")
        p(f"  GPU{c.index}  {state}")
        if c.name in shown:
            p(f"        profiles as GPU{shown[c.name]}")
        else:
            shown[c.name] = c.index
            if not profiles and mode[0] != 1:
                p("        no profiles listed while MIG is off (the driver lists them with MIG on)")
            for pr in profiles:
                starts = ",".join(str(s) for s, _ in pr.placements)
                shape = f"{pr.name:<12} id {pr.id:<3} enum {pr.profile:<3}"
                p(f"        profile {shape} x{pr.max_instances}  at {starts}")
            for size, (names, source) in report["mig_mapping"].get(c.name, {}).items():
                p(f"        xpud uses {size:<13} -> {', '.join(names) or 'none'}  ({source})")
        for m in instances:
            cis = ",".join(map(str, m.compute_instance_ids))
            where = f"{m.name} at {m.start}+{m.size}"
            p(f"        GI {m.gpu_instance_id} {where}  CI {cis}  {' '.join(m.device_uuids)}")
    p()
    p("Events")
    for i, (kinds, why) in sorted(report["events"].items()):
        p(f"  GPU{i}  " + (f"registered: {kinds}" if why is None else f"not registered: {why}"))
    p()
    for line in report["notes"]:
        p(f"Note: {line}")
    if problems:
        p(f"{len(problems)} problem(s):")
        for line in problems:
            p(f"  {line}")
    else:
        p("No problems.")


def _print_matrix(topo: Topology, cards: list[CardInfo], p) -> None:
    n = topo.size
    head = "".join(f"{f'GPU{j}':<7}" for j in range(n))
    p(f"        {head}{'CPU Affinity':<24}NUMA Affinity")
    for i in range(n):
        cells = "".join(f"{topo.label(i, j):<7}" for j in range(n))
        cpus = format_cpulist(cards[i].cpu_affinity) if i < len(cards) else ""
        numa = topo.numa[i] if i < len(topo.numa) else None
        p(f"  GPU{i:<3} {cells}{cpus or '-':<24}{_opt(numa)}")
    p(f"  NVLink {topo.nvlink_gbps_per_link:g} GB/s per link; PCIe {topo.pcie_gbps:g} GB/s per card")
    p("  Legend:")
    for label, meaning in LEVEL_MEANING.items():
        p(f"    {label:<5}= {meaning}")


def _sample_line(s: CardSample) -> str:
    if s.lost:
        return "LOST (fallen off the bus)"
    parts = [
        f"{_opt(s.temperature_c, 'C')} (slowdown {_opt(s.temperature_slowdown_c, 'C')})",
        f"{_watts(s.power_w)}/{_watts(s.power_limit_w)}",
        f"util {_opt(s.utilization_gpu_pct, '%')}",
        f"mem {_gib(s.memory_used_bytes)}/{_gib(s.memory_total_bytes)}",
        f"P{_opt(s.performance_state)}",
        f"ECC sbe/dbe {_opt(s.ecc_sbe_volatile)}/{_opt(s.ecc_dbe_volatile)}",
        f"rows remapped {_opt(s.remapped_rows_corrected)}/{_opt(s.remapped_rows_uncorrected)}",
        f"reasons {'-' if s.clock_event_reasons is None else hex(s.clock_event_reasons)}",
        f"PCIe replays {_opt(s.pcie_replay_counter)}",
        f"NVLink down {_opt(s.nvlink_links_down)}",
    ]
    return "  ".join(parts)


def _watts(w: float | None) -> str:
    return "-" if w is None else f"{w:.0f}W"


# ------------------------------------------------------------------------------- as a machine


def _description(report: dict) -> dict:
    """The report as a machine description (``machines.py`` format) plus a ``recording`` table."""
    cards: list[CardInfo] = report["cards"]
    models: dict[str, dict] = {}
    card_tables = []
    profile_sources: dict[str, str] = {}
    switch_buses: set[str] = set()
    for c, sample, links, pcie, profiles, mode in zip(
        cards,
        report["samples"],
        report["nvlinks"],
        report["pcie"],
        report["mig_profiles"],
        report["mig_mode"],
        strict=True,
    ):
        key = re.sub(r"[^a-z0-9]+", "-", c.name.lower()).strip("-") or f"card{c.index}"
        if key not in models:
            profiles, origin = report["model_profiles"].get(c.name, (profiles, ""))
            models[key] = _model(c, sample, links, pcie, profiles)
            if origin:
                profile_sources[key] = f"{origin} (MIG was off: the cards listed no profiles)"
        table = {"model": key, "bus_id": c.pci_bus_id, "uuid": c.uuid}
        if c.numa_node is not None:
            table["numa"] = c.numa_node
        if c.serial:
            table["serial"] = c.serial
        if c.minor_number is not None:
            table["minor"] = c.minor_number
        if mode is not None and mode[0]:
            table["mig_enabled"] = True
        switch = [lk for lk in links if lk.remote == "switch" and lk.active]
        switch_buses.update(lk.remote_bus_id for lk in switch if lk.remote_bus_id)
        if switch:
            table["nvlink_switch_links"] = len(switch)
        peers = [
            lk.remote_index
            for lk in links
            if lk.remote == "gpu" and lk.active and lk.remote_index is not None
        ]
        if peers:
            table["nvlink_peers"] = peers
        card_tables.append(table)
    numa_nodes = [c.numa_node for c in cards if c.numa_node is not None]
    numa_cpus = [
        format_cpulist(sorted({cpu for c in cards if c.numa_node == node for cpu in c.cpu_affinity}))
        for node in range(max(numa_nodes, default=0) + 1)
    ]
    topo: Topology | None = report["topology"]
    record = {
        "name": "recorded",
        "description": f"recorded by xpud check-hardware on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        "driver_version": report["driver"] or "unknown",
        "cuda_version": report["cuda"] or "0.0",
        "numa_cpus": numa_cpus,
        "nvswitch_count": max(len(switch_buses), 1),
        "models": models,
        "cards": card_tables,
        "recording": {
            "time": time.time(),
            "samples": [dataclasses.asdict(s) for s in report["samples"]],
            "mig_instances": [[dataclasses.asdict(m) for m in ms] for ms in report["mig_instances"]],
            "mig_mapping": {
                model: {size: names for size, (names, _) in sizes.items()}
                for model, sizes in report["mig_mapping"].items()
            },
            "events": {str(i): {"registered": k, "error": e} for i, (k, e) in report["events"].items()},
            "mig_profiles_from": profile_sources,
            "notes": report["notes"],
        },
    }
    if topo is not None:
        record["topology"] = {"levels": [list(row) for row in topo.levels]}
    return record


def _model(c: CardInfo, s: CardSample, links: list, pcie: tuple, profiles: list[MigProfile]) -> dict:
    model: dict = {
        "name": c.name,
        "memory_mib": c.memory_total_bytes // MIB,
        "architecture": c.architecture if c.architecture in ARCHITECTURES else "unknown",
        "ecc": s.ecc_sbe_volatile is not None,
        "fan": s.fan_pct is not None,
        # Under MIG the card hides its remapped rows; Ampere and later remap rows either way.
        "memory_errors": "remap"
        if s.remapped_rows_corrected is not None or (c.mig_capable and c.architecture in ("ampere", "hopper"))
        else "retire"
        if s.retired_pages_sbe is not None
        else "none",
    }
    if s.power_limit_w is not None:
        model["power_limit_w"] = s.power_limit_w
    if s.power_w is not None and not s.lost:
        model["power_idle_w"] = round(s.power_w, 1)
    if s.temperature_c is not None:
        model["temp_idle_c"] = s.temperature_c
    for key, value in (
        ("temp_slowdown_c", s.temperature_slowdown_c),
        ("temp_shutdown_c", s.temperature_shutdown_c),
    ):
        if value is not None:
            model[key] = value
    if s.temperature_c is not None:
        ceiling = (s.temperature_slowdown_c or 90) - 12
        model["temp_load_c"] = max(min(s.temperature_c + 35, ceiling), s.temperature_c)
    if pcie[0]:
        model["pcie_gen"] = pcie[0]
    if pcie[1]:
        model["pcie_width"] = pcie[1]
    version = next((lk.version for lk in links if lk.version), None)
    if version in _NVLINK_VERSIONS:
        model["nvlink_version"] = _NVLINK_VERSIONS[version]
    elif links:
        model["nvlink_version"] = "4.0"  # the card has links but cannot say which kind
    if links:
        model["nvlink_links"] = len(links)  # all the board's links; only the active ones are wired above
    if profiles:
        model["mig_profiles"] = [
            {
                "profile": pr.profile,
                "id": pr.id,
                "name": pr.name,
                "slices": pr.slice_count,
                "memory_mib": pr.memory_bytes // MIB,
                "instances": pr.max_instances,
                "placements": [start for start, _ in pr.placements],
                "placement_size": pr.memory_slices,
                "multiprocessors": pr.multiprocessors,
            }
            for pr in profiles
            if pr.placements
        ]
    return model
