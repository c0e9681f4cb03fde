"""Group a host's cards the way they talk to each other, for the host view's tiles.

Cards joined by NVLink, or sitting under the same PCIe switch (common ancestor at most "multiple PCIe
bridges", i.e. without crossing the host bridge), form one island; each island is then split by NUMA
node, since CPU affinity is what an operator places processes by. Works on the plain matrices of
``Node.GetTopology`` so it can be tested without a daemon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xpud.topology import INTERNAL, MULTIPLE, SINGLE


@dataclass(frozen=True)
class CardGroup:
    label: str  # e.g. "NVLink NV18 · NUMA 0 · cards 0-3"
    cards: tuple[int, ...]  # card indices, ascending


def card_list(indices: Sequence[int]) -> str:
    """``0-3,6`` for [0, 1, 2, 3, 6]."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def group_cards(
    levels: Sequence[Sequence[int]],
    nvlinks: Sequence[Sequence[int]],
    numa: Sequence[int | None],
    indices: Sequence[int] | None = None,
) -> list[CardGroup]:
    """Islands of cards (NVLink or one PCIe switch), split by NUMA node.

    The matrices are indexed by position 0..n-1; ``indices`` names the card at each position
    (default: the position itself).
    """
    n = len(levels)
    names = list(indices) if indices is not None else list(range(n))
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def links(i: int, j: int) -> int:
        return nvlinks[i][j] if nvlinks else 0

    for i in range(n):
        for j in range(i + 1, n):
            if links(i, j) or levels[i][j] <= MULTIPLE:
                parent[find(i)] = find(j)
    islands: dict[int, list[int]] = {}
    for i in range(n):
        islands.setdefault(find(i), []).append(i)
    groups = []
    for members in islands.values():
        kind = _island_kind(members, levels, links)
        by_numa: dict[int | None, list[int]] = {}
        for i in members:
            by_numa.setdefault(numa[i] if i < len(numa) else None, []).append(i)
        for node, positions in by_numa.items():
            cards = [names[i] for i in positions]
            parts = [kind] + ([f"NUMA {node}"] if node is not None else []) + [f"cards {card_list(cards)}"]
            groups.append(CardGroup(" · ".join(parts), tuple(cards)))
    return sorted(groups, key=lambda g: g.cards[0])


def _island_kind(members: list[int], levels, links) -> str:
    if len(members) == 1:
        return "PCIe"
    pairs = [(i, j) for i in members for j in members if i < j]
    most = max(links(i, j) for i, j in pairs)
    if most:
        return f"NVLink NV{most}"
    tightest = min(levels[i][j] for i, j in pairs)
    if tightest == INTERNAL:
        return "same board"
    return "PCIe switch" if tightest <= SINGLE else "PCIe switches"


def groups_from_topology(topology) -> list[CardGroup]:
    """``group_cards`` over a ``TopologyReply`` (row-major matrices)."""
    n = topology.size
    if n == 0:
        return []
    levels = [list(topology.levels[i * n : (i + 1) * n]) for i in range(n)]
    nvlinks = [list(topology.nvlinks[i * n : (i + 1) * n]) for i in range(n)] if topology.nvlinks else []
    numa = [c.numa_node if c.HasField("numa_node") else None for c in topology.cards]
    indices = [c.index for c in topology.cards] if len(topology.cards) == n else list(range(n))
    return group_cards(levels, nvlinks, (numa + [None] * n)[:n], indices)


def single_group(indices: Sequence[int]) -> list[CardGroup]:
    """The fallback when the topology is unknown: one group of every card."""
    return [CardGroup(f"cards {card_list(indices)}", tuple(sorted(indices)))] if indices else []
