"""A host's card-to-card topology and the communication-cost model built on it.

Levels are NVML's common-ancestor levels (``nvmlDeviceGetTopologyCommonAncestor``); NVLink counts are
the active links that connect a pair (directly, or through NVSwitch: the smaller of the two cards'
link counts). The cost of a group of cards is modelled as a ring all-reduce whose every step runs at the
speed of the group's slowest link, so groups can be compared by a number, not only by a rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

# NVML_TOPOLOGY_* values (fixed by NVML's header).
INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM = 0, 10, 20, 30, 40, 50

LEVEL_LABELS = {
    INTERNAL: "BRD",
    SINGLE: "PIX",
    MULTIPLE: "PXB",
    HOSTBRIDGE: "PHB",
    NODE: "NODE",
    SYSTEM: "SYS",
}
LEVEL_MEANING = {
    "X": "Self",
    "SYS": "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
    "NODE": "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a "
    "NUMA node",
    "PHB": "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
    "PXB": "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)",
    "PIX": "Connection traversing at most a single PCIe bridge",
    "BRD": "Connection on the same board (e.g. a dual-GPU card)",
    "NV#": "Connection traversing a bonded set of # NVLinks",
}

# Effective one-direction peer bandwidth over PCIe by common-ancestor level, as a share of the link
# speed: traffic that climbs higher crosses more shared bridges and, at SYSTEM, the socket interconnect.
_PCIE_SHARE = {INTERNAL: 1.0, SINGLE: 0.95, MULTIPLE: 0.85, HOSTBRIDGE: 0.7, NODE: 0.6, SYSTEM: 0.4}

# NVIDIA's pair-score allocator (go-gpuallocator): per NVLink link, else by PCIe level.
_PAIR_SCORE_NVLINK = 100
_PAIR_SCORE_PCIE = {INTERNAL: 60, SINGLE: 50, MULTIPLE: 40, HOSTBRIDGE: 30, NODE: 20, SYSTEM: 10}


@dataclass(frozen=True)
class Topology:
    """Card-to-card connectivity of one host. Indices are card indices 0..n-1."""

    levels: tuple[tuple[int, ...], ...]  # NVML common-ancestor level per pair (diagonal unused)
    nvlinks: tuple[tuple[int, ...], ...] = ()  # active NVLink links joining each pair; () = none at all
    numa: tuple[int | None, ...] = ()
    nvlink_gbps_per_link: float = 25.0  # GB/s, one direction
    pcie_gbps: float = 25.0  # GB/s, one direction, of one card's PCIe link (Gen4 x16 ~ 25, Gen5 ~ 50)

    @property
    def size(self) -> int:
        return len(self.levels)

    def links(self, i: int, j: int) -> int:
        return self.nvlinks[i][j] if self.nvlinks and i != j else 0

    def bandwidth_gbps(self, i: int, j: int) -> float:
        """Modelled one-direction bandwidth between two cards, GB/s."""
        if i == j:
            return float("inf")
        n = self.links(i, j)
        if n:
            return n * self.nvlink_gbps_per_link
        return self.pcie_gbps * _PCIE_SHARE.get(self.levels[i][j], _PCIE_SHARE[SYSTEM])

    def label(self, i: int, j: int) -> str:
        """The cell ``nvidia-smi topo -m`` prints for a pair: X, NV#, PIX, PXB, PHB, NODE or SYS."""
        if i == j:
            return "X"
        n = self.links(i, j)
        return f"NV{n}" if n else LEVEL_LABELS.get(self.levels[i][j], "SYS")

    def bottleneck_gbps(self, group: tuple[int, ...] | list[int]) -> float:
        """The slowest link among the group's pairs (inf for one card)."""
        return min((self.bandwidth_gbps(a, b) for a, b in combinations(group, 2)), default=float("inf"))

    def allreduce_seconds(self, group: tuple[int, ...] | list[int], nbytes: int = 1 << 30) -> float:
        """Modelled ring all-reduce time of ``nbytes`` over ``group``: 2(n-1)/n * bytes / slowest link."""
        n = len(group)
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * nbytes / (self.bottleneck_gbps(group) * 1e9)

    def busbw_gbps(self, group: tuple[int, ...] | list[int]) -> float:
        """Modelled all-reduce bus bandwidth of the group (what nccl-tests reports), GB/s."""
        return self.bottleneck_gbps(group) if len(group) > 1 else float("inf")

    def pair_score(self, group: tuple[int, ...] | list[int]) -> int:
        """NVIDIA's pair-score of a group: sum over pairs of 100 per NVLink link plus a PCIe score.

        As in go-gpuallocator, a pair's PCIe link and its NVLinks both count, so between NVLink pairs of
        equal width the PCIe path still decides (on a DGX: the same PCIe switch, then the same socket).
        """
        total = 0
        for a, b in combinations(group, 2):
            total += self.links(a, b) * _PAIR_SCORE_NVLINK + _PAIR_SCORE_PCIE.get(self.levels[a][b], 10)
        return total


def uniform(n: int, level: int = SYSTEM) -> Topology:
    """A topology where every pair sits at the same level (for tests and unknown hosts)."""
    return Topology(levels=tuple(tuple(0 if i == j else level for j in range(n)) for i in range(n)))
