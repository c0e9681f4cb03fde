"""Constructed data: a plausible host and cluster, identical on every run.

Snapshot tests, the README screenshots and ``xpu top --demo`` play this through ``RecordedSource`` /
``StaticCluster``, i.e. the same path as a live daemon, so they show real widgets without the live
simulator's varying values or the wall clock. Times are offsets from ``T0``; pass ``clock=demo.now``.
"""

from __future__ import annotations

import math
import random

from xpu_tui.hostrow import HostRow
from xpu_tui.source import RecordedSource, StaticCluster

from xpud.api import capacity
from xpud.api.v1 import xpu_pb2 as pb
from xpud.config.schema import DEFAULT_SLICES
from xpud.topology import MULTIPLE, NODE, SINGLE, SYSTEM

T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
SAMPLES = 40  # recorded updates (one sample each, 5 s apart)
STEP_S = 5.0
GIB = 1 << 30
H100_MEMORY = 85_520_809_984


def now() -> float:
    """The demo's clock: just after the last recorded update."""
    return T0 + SAMPLES * STEP_S + 2.0


def _sample(index: int, step: int, load: float, memory_total: int, **extra) -> pb.Sample:
    # A slow wave per card so the sparklines have shape; deterministic in (index, step).
    wave = 0.5 + 0.5 * math.sin(step / 4.0 + index)
    util = round(min(100.0, load * (0.6 + 0.4 * wave)))
    fields = dict(
        timestamp=T0 + step * STEP_S,
        utilization_gpu_pct=util,
        utilization_memory_pct=util // 2,
        memory_used_bytes=int(memory_total * min(1.0, 0.01 + load / 100 * (0.7 + 0.2 * wave))),
        memory_total_bytes=memory_total,
        temperature_c=31 + round(util * 0.4),
        temperature_slowdown_c=87,
        temperature_shutdown_c=92,
        power_w=72.0 + util * 6.0,
        power_limit_w=700.0,
        performance_state=0 if util > 5 else 8,
    )
    fields.update(extra)
    return pb.Sample(**fields)


def _lease(lease_id, mode, cards, command, created, uid=1000, slices=(), held=True, **kw) -> pb.Lease:
    return pb.Lease(
        id=lease_id,
        mode=mode,
        owner_uid=uid,
        cards=list(cards),
        card_uuids=[dgx_uuid(c) for c in cards],
        slices=list(slices),
        holder_pid=4000 + len(lease_id) * 7 + sum(cards),
        command=command,
        created=created,
        state="active",
        held=held,
        **kw,
    )


def dgx_uuid(index: int) -> str:
    """A card UUID of the demo host, as long as a real one (GPU- and 36 characters)."""
    return f"GPU-{index:x}e1c0d2a-7a4b-4c1e-9f3a-5b6c7d8e9f0{index:x}"


def _slice(lease_id: str, size: str, handle: str = "") -> pb.SliceHeld:
    fraction, pct = {"vxpu-half": (0.5, 30), "vxpu-quarter": (0.25, 15)}[size]
    return pb.SliceHeld(
        lease_id=lease_id,
        size=size,
        memory_bytes=int(H100_MEMORY * fraction),
        compute_pct=pct,
        handle=handle,
    )


# What each card of the 8-card demo host is doing: (mode, pinned, health, score, load, drain reason).
_DGX = [
    ("sliced", False, "healthy", 100, 55, ""),
    ("whole", False, "healthy", 100, 96, ""),
    ("whole", False, "healthy", 99, 94, ""),
    ("whole", False, "healthy", 97, 0, ""),
    ("whole", False, "degraded", 71, 0, ""),
    ("whole", False, "unhealthy", 12, 0, "unhealthy: ECC double-bit error (XID 48)"),
    ("sliced", True, "healthy", 100, 40, ""),
    ("whole", True, "healthy", 100, 0, "maintenance: firmware update"),
]


def _dgx_leases() -> list[pb.Lease]:
    base = T0 - 3600
    return [
        _lease(
            "7f3a91c2",
            "vxpu-half",
            [0],
            "python serve.py --model llama-3-8b",
            base + 120,
            slices=[_slice("7f3a91c2", "vxpu-half", "MIG-0a1b2c3d-4e5f-5a6b-8c7d-9e0f1a2b3c4d")],
            name="llama-serve",
        ),
        _lease(
            "b41e0d77",
            "vxpu-quarter",
            [0],
            "python embed.py",
            base + 1800,
            uid=1001,
            slices=[_slice("b41e0d77", "vxpu-quarter", "MIG-1b2c3d4e-5f6a-5b7c-9d8e-0f1a2b3c4d5e")],
        ),
        _lease(
            "c09d5e13",
            "xpu",
            [1, 2],
            "torchrun --nproc-per-node 2 train.py --config gpt-small.yaml",
            base - 86400 * 2,
            uid=1002,
            restartable=True,
            priority=5,
            name="gpt-small",
            held=False,  # a Slurm job's lease: the job keeps it, no Hold stream
            anchor="slurm:48213",
        ),
        _lease(
            "d2aa6f40",
            "vxpu-quarter",
            [6],
            "python notebook_kernel.py",
            base + 3000,
            uid=1003,
            slices=[_slice("d2aa6f40", "vxpu-quarter", "mps:6")],
        ),
        _lease(
            "e58b3c21",
            "vxpu-quarter",
            [6],
            "python eval.py --suite mmlu",
            base + 3300,
            uid=1000,
            held=False,
            mark="holder disconnected: reclaimed in 20s unless it reconnects",
            slices=[_slice("e58b3c21", "vxpu-quarter", "mps:6")],
        ),
        _lease(
            "f6c17a08",
            "vxpu-half",
            [6],
            "python serve.py --model mistral-7b",
            base + 3500,
            uid=1001,
            slices=[_slice("f6c17a08", "vxpu-half", "mps:6")],
        ),
    ]


def _dgx_cards(step: int, leases: list[pb.Lease]) -> list[pb.Card]:
    held: dict[int, list[pb.SliceHeld]] = {}
    whole: dict[int, str] = {}
    for le in leases:
        if le.mode == "xpu":
            for c in le.cards:
                whole[c] = le.id
        else:
            held.setdefault(le.cards[0], []).extend(le.slices)
    cards = []
    for i, (mode, pinned, health, score, load, reason) in enumerate(_DGX):
        slices = held.get(i, [])
        mem_used = sum(s.memory_bytes for s in slices) / H100_MEMORY
        extra = {}
        if health == "degraded":
            extra = dict(temperature_c=84)  # near its slowdown threshold: why it is degraded
        if health == "unhealthy":
            extra = dict(ecc_dbe_volatile=1)
        cards.append(
            pb.Card(
                index=i,
                uuid=dgx_uuid(i),
                name="NVIDIA H100 80GB HBM3",
                memory_total_bytes=H100_MEMORY,
                pci_bus_id=f"00000000:{0x1B + i * 0x10:02X}:00.0",
                numa_node=i // 4,
                mig_capable=True,
                mig_enabled=i == 0,
                mode=mode,
                mode_pinned=pinned,
                drained=bool(reason),
                drain_reason=reason,
                health_state=health,
                health_score=score,
                whole_lease=whole.get(i, ""),
                slices=slices,
                free_memory_fraction=max(0.0, 1 - mem_used) if mode == "sliced" else 1.0,
                free_compute_pct=100 - sum(s.compute_pct for s in slices),
                sample=_sample(i, step, load, H100_MEMORY, **extra),
                isolation="mig" if i == 0 else ("mps" if mode == "sliced" else "none"),
                nvlink_active_links=18,
            )
        )
    return cards


def _queue() -> list[pb.QueueEntry]:
    return [
        pb.QueueEntry(
            ticket="q-51d0",
            mode="xpu",
            gpus=4,
            priority=5,
            owner_uid=1002,
            command="torchrun --nproc-per-node 4 finetune.py",
            name="finetune-4",
            position=1,
            enqueued=now() - 95,
            deadline=now() + 505,
        ),
        pb.QueueEntry(
            ticket="q-51d4",
            mode="vxpu-half",
            gpus=1,
            owner_uid=1004,
            command="python serve.py --model qwen-7b",
            position=2,
            enqueued=now() - 20,
            deadline=now() + 40,
        ),
    ]


def _events() -> list[pb.Event]:
    e = [
        (-3480, "grant", 0, "7f3a91c2", "lease 7f3a91c2 granted: vxpu-half on card 0 (uid 1000)"),
        (-3480, "mode", 0, "", "card 0 switched to sliced for lease 7f3a91c2"),
        (-1800, "grant", 0, "b41e0d77", "lease b41e0d77 granted: vxpu-quarter on card 0 (uid 1001)"),
        (-1500, "drain", 7, "", "card 7 drained: maintenance: firmware update"),
        (-1200, "mode", 6, "", "card 6 set to sliced by an operator"),
        (-600, "grant", 6, "d2aa6f40", "lease d2aa6f40 granted: vxpu-quarter on card 6 (uid 1003)"),
        (-420, "fault", 5, "", "fault injected on card 5: ecc-dbe"),
        (-418, "health", 5, "", "card 5 healthy -> unhealthy: ECC double-bit error (XID 48)"),
        (-418, "drain", 5, "", "card 5 drained: unhealthy: ECC double-bit error (XID 48)"),
        (-400, "move", 5, "c09d5e13", "lease c09d5e13 moved from cards 4,5 to 1,2: card 5 unhealthy"),
        (-300, "grant", 6, "e58b3c21", "lease e58b3c21 granted: vxpu-quarter on card 6 (uid 1000)"),
        (-240, "release", 3, "a0b1c2d3", "lease a0b1c2d3 released by its holder"),
        (-200, "grant", 6, "f6c17a08", "lease f6c17a08 granted: vxpu-half on card 6 (uid 1001)"),
        (-150, "health", 4, "", "card 4 healthy -> degraded: temperature 84 C within 5 C of slowdown (87 C)"),
        (-95, "evict", 3, "9e8d7c6b", "lease 9e8d7c6b evicted: by an operator: runaway job"),
        (-20, "reclaim", 2, "5a4b3c2d", "lease 5a4b3c2d reclaimed: holder gone for 30 s"),
    ]
    return [pb.Event(timestamp=now() + dt, kind=k, card=c, lease_id=lid, message=m) for dt, k, c, lid, m in e]


def dgx_topology(cards: list[pb.Card]) -> pb.TopologyReply:
    """Eight cards on NVSwitch (NV18 between every pair), 0-3 on NUMA node 0 and 4-7 on node 1."""
    n = len(cards)
    cells = [(i, j) for i in range(n) for j in range(n)]
    return pb.TopologyReply(
        size=n,
        labels=["X" if i == j else "NV18" for i, j in cells],
        levels=[0 if i == j else (NODE if i // 4 == j // 4 else SYSTEM) for i, j in cells],
        nvlinks=[0 if i == j else 18 for i, j in cells],
        bandwidth_gbps=[0.0 if i == j else 450.0 for i, j in cells],
        cards=cards,
    )


def info(hostname: str, backend: str, cards: int, admin: bool) -> pb.InfoReply:
    return pb.InfoReply(
        version="0.1.0",
        hostname=hostname,
        backend=backend,
        driver_version="550.90.07",
        started=T0 - 86400 * 3,
        cards=cards,
        caller_uid=0 if admin else 1000,
        caller_is_admin=admin,
    )


def card_health(card: pb.Card) -> pb.CardHealth:
    """A card's health report as the daemon would give it, derived from the card as recorded: the main
    signals with their thresholds, and the reason for its state."""
    s = card.sample
    lost = s.lost
    signals = [
        pb.Signal(name="lost", value=float(lost), unit="", status="fail" if lost else "ok",
                  reason="fallen off the bus (XID 79)" if lost else ""),
    ]  # fmt: skip

    def reading(name: str, field: str, threshold: float, unit: str, warn_below: float = 0.0) -> None:
        if lost or not s.HasField(field):
            signals.append(pb.Signal(name=name, threshold=threshold, unit=unit, status="absent"))
            return
        v = float(getattr(s, field))
        status = "fail" if v > threshold else ("warn" if warn_below and v >= threshold - warn_below else "ok")
        why = f"{v:g} {unit} within {threshold - v:g} {unit} of {threshold:g}" if status == "warn" else ""
        signals.append(
            pb.Signal(name=name, value=v, threshold=threshold, unit=unit, status=status, reason=why)
        )

    reading("temperature", "temperature_c", float(s.temperature_slowdown_c or 87), "C", warn_below=5)
    reading("power", "power_w", s.power_limit_w or 700.0, "W")
    reading("ecc_dbe_volatile", "ecc_dbe_volatile", 0.0, "errors")
    reading("pcie_replays", "pcie_replay_counter", 100.0, "")
    reasons = [card.drain_reason.removeprefix("unhealthy: ")] if card.health_state == "unhealthy" else []
    reasons += [sig.reason for sig in signals if sig.status == "warn"]
    return pb.CardHealth(
        index=card.index,
        uuid=card.uuid,
        score=card.health_score,
        state=card.health_state,
        signals=signals,
        reasons=reasons,
        raw_state=card.health_state,
        clear_needed_s=60.0,
    )


def _cards_reply(cards: list[pb.Card], hostname: str) -> pb.ListCardsReply:
    """The cards as a daemon with the default slice sizes sends them, with the capacity it counts."""
    return pb.ListCardsReply(cards=cards, hostname=hostname, **capacity.free(cards, DEFAULT_SLICES))


def dgx_source(admin: bool = False, samples: int = SAMPLES) -> RecordedSource:
    """The 8-card demo host as a recorded Watch stream of ``samples`` updates."""
    leases = _dgx_leases()
    updates = []
    for step in range(1, samples + 1):
        last = step == samples
        updates.append(
            pb.WatchUpdate(
                cards=_cards_reply(_dgx_cards(step, leases), "dgx-a07"),
                leases=pb.ListLeasesReply(leases=leases, queue=_queue() if last else []),
                events=_events() if step == 1 else [],
            )
        )
    cards = list(updates[-1].cards.cards)
    return RecordedSource(
        info("dgx-a07", "simulated:dgx-h100", len(cards), admin),
        dgx_topology(cards),
        updates,
        admin=admin,
        health_of=card_health,
    )


def health_source(admin: bool = False) -> RecordedSource:
    """A 3-card PCIe workstation with one card in each health state (healthy, degraded, unhealthy)."""
    memory = 48_305_799_168
    specs = [
        ("healthy", 100, 62, {}, ""),
        ("degraded", 68, 35, dict(temperature_c=86, pcie_replay_counter=412), ""),
        ("unhealthy", 8, 0, dict(lost=True), "unhealthy: fallen off the bus (XID 79)"),
    ]
    updates = []
    for step in range(1, SAMPLES + 1):
        cards = []
        for i, (health, score, load, extra, reason) in enumerate(specs):
            sample = _sample(i, step, load, memory, power_limit_w=350.0, **extra)
            if extra.get("lost"):
                sample = pb.Sample(timestamp=T0 + step * STEP_S, lost=True)
            cards.append(
                pb.Card(
                    index=i,
                    uuid=f"GPU-ws-{i}",
                    name="NVIDIA L40S",
                    memory_total_bytes=memory,
                    numa_node=0,
                    mode="whole",
                    drained=bool(reason),
                    drain_reason=reason,
                    health_state=health,
                    health_score=score,
                    whole_lease="0c1d2e3f" if i == 0 else "",
                    free_memory_fraction=1.0,
                    free_compute_pct=100,
                    sample=sample,
                    isolation="none",
                )
            )
        lease = _lease("0c1d2e3f", "xpu", [0], "python train.py", T0 - 600)
        events = []
        if step == 1:
            events = [
                pb.Event(
                    timestamp=now() - 60,
                    kind="health",
                    card=1,
                    message="card 1 healthy -> degraded: temperature 86 C within 1 C of slowdown; "
                    "PCIe replays rising",
                ),
                pb.Event(
                    timestamp=now() - 30,
                    kind="health",
                    card=2,
                    message="card 2 healthy -> unhealthy: fallen off the bus (XID 79)",
                ),
            ]
        updates.append(
            pb.WatchUpdate(
                cards=_cards_reply(cards, "ws-03"),
                leases=pb.ListLeasesReply(leases=[lease]),
                events=events,
            )
        )
    cards = list(updates[-1].cards.cards)
    n = len(cards)
    cells = [(i, j) for i in range(n) for j in range(n)]
    topology = pb.TopologyReply(
        size=n,
        levels=[0 if i == j else (SINGLE if {i, j} == {0, 1} else MULTIPLE + 10) for i, j in cells],
        cards=cards,
    )
    ws = info("ws-03", "simulated:workstation", n, admin)
    return RecordedSource(ws, topology, updates, admin=admin, health_of=card_health)


def cluster(hosts: int = 1000, seed: int = 7) -> StaticCluster:
    """``hosts`` generated summaries spread over racks of ~32, a few degraded, unhealthy or stale."""
    rng = random.Random(seed)
    out = []
    for k in range(hosts):
        rack = k // 32 + 1
        cards = 8
        unhealthy = 1 if rng.random() < 0.03 else 0
        degraded = 1 if rng.random() < 0.08 else 0
        drained = unhealthy + (1 if rng.random() < 0.02 else 0)
        busy = rng.randint(0, cards - unhealthy - drained)
        sliced = rng.randint(0, 2)
        stale = rng.random() < 0.02
        error = "cannot reach xpud: connection refused" if rng.random() < 0.005 else ""
        out.append(
            HostRow(
                name=f"gpu-r{rack:02d}-n{k % 32 + 1:02d}",
                domain=f"dc1/rack-{rack:02d}",
                cards=cards,
                whole_free=max(0, cards - busy - drained - sliced),
                slices_free={
                    "vxpu-half": sliced * rng.randint(0, 2),
                    "vxpu-quarter": sliced * rng.randint(0, 4),
                },
                healthy=cards - degraded - unhealthy,
                degraded=degraded,
                unhealthy=unhealthy,
                drained=drained,
                leases=busy + sliced * 2,
                queued=rng.choice([0, 0, 0, 0, 1, 3]),
                seen=now() - (rng.randint(40, 900) if stale else rng.random()),
                error=error,
            )
        )
    return StaticCluster(out)
