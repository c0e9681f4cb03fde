"""Placement on one host: which whole cards form a group, which card takes a slice. Pure functions.

The engine (live daemon), the simulator and the device plugin's preferred-allocation hook all call these
with a snapshot; nothing here reads the hardware, the clock or the ledger.

``best_group`` orders candidate groups by: degraded cards avoided, modelled cost, the free groups left
(``free_quality``), health, lowest indices; exact search up to ``EXACT_SEARCH_MAX_CARDS`` free cards,
``cluster_group`` above. Each step explained: see docs/placement.md, Choosing a group of whole cards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from xpud.topology import Topology

# Exact search is used up to this many free cards: the subset tables then hold 2^16 entries.
EXACT_SEARCH_MAX_CARDS = 16
# Clustering: how many of the best candidate groups local search polishes, and the equally good swaps
# it tries per position (bounds the time on hosts with many free cards).
_POLISHED_CANDIDATES = 16
_SWAP_TIES = 8


@dataclass(frozen=True)
class CardCapacity:
    """What placement needs to know about one card right now."""

    index: int
    sliced: bool  # the card is in sliced mode
    idle: bool  # no lease holds it (whole or slice)
    usable: bool  # not drained, not unhealthy
    free_memory_fraction: float = 1.0
    free_compute_pct: int = 100
    health_score: int = 100
    mode_pinned: bool = False  # an operator fixed its mode
    avoid: bool = False  # degraded: use only when nothing else fits


# ----------------------------------------------------------------------------------------------------
# Link order: one integer rank per card pair, higher = better.


@dataclass(frozen=True, eq=False)
class _LinkOrder:
    rank: np.ndarray  # (N, N) int8; the diagonal holds `top`
    primary_gbps: np.ndarray  # modelled bandwidth per rank; index `top` = inf, index -1 = 0
    pcie_gbps: np.ndarray  # the same link's bandwidth over PCIe alone
    top: int  # rank of "no pair" (one card): better than any link


@lru_cache(maxsize=64)
def _link_order(topo: Topology) -> _LinkOrder:
    n = topo.size
    pcie_only = replace(topo, nvlinks=())
    keys = {
        (i, j): (topo.bandwidth_gbps(i, j), pcie_only.bandwidth_gbps(i, j))
        for i in range(n)
        for j in range(n)
        if i != j
    }
    distinct = sorted(set(keys.values()))
    top = len(distinct)
    if top > 126:
        raise ValueError(f"{top} kinds of link: at most 126 are supported")
    rank = np.full((n, n), top, dtype=np.int8)
    for (i, j), key in keys.items():
        rank[i, j] = distinct.index(key)
    # Two extra slots: index `top` (a single card) and index -1 (no group of that size fits).
    primary = np.array([p for p, _ in distinct] + [np.inf, 0.0])
    pcie = np.array([q for _, q in distinct] + [np.inf, 0.0])
    return _LinkOrder(rank=rank, primary_gbps=primary, pcie_gbps=pcie, top=top)


# ----------------------------------------------------------------------------------------------------
# Exact search: tables over every subset of a universe of at most 16 cards (bit i = cards[i]).


@dataclass(frozen=True, eq=False)
class _SubsetTables:
    cards: tuple[int, ...]
    bott: np.ndarray  # (2^m,) slowest-link rank of each subset (`top` for fewer than 2 cards)
    pop: np.ndarray  # (2^m,) number of cards in each subset
    lex: np.ndarray  # (2^m,) bit-reversed mask: larger = lexicographically smaller card tuple
    best: np.ndarray  # (m+1, 2^m) best slowest-link rank of any k-card subset of S; -1 if |S| < k
    arg: np.ndarray  # (m+1, 2^m) a k-card subset of S achieving it
    order: _LinkOrder
    sized: dict[int, np.ndarray] = field(default_factory=dict)  # of_size() cache

    def mask(self, cards: Collection[int]) -> int:
        pos = {c: i for i, c in enumerate(self.cards)}
        return sum(1 << pos[c] for c in cards)

    def members(self, mask: int) -> tuple[int, ...]:
        return tuple(c for i, c in enumerate(self.cards) if mask >> i & 1)

    def of_size(self, n: int) -> np.ndarray:
        """Every subset of ``n`` cards, as int32 masks."""
        if n not in self.sized:
            self.sized[n] = np.nonzero(self.pop == n)[0].astype(np.int32)
        return self.sized[n]


@lru_cache(maxsize=16)
def _tables(topo: Topology, cards: tuple[int, ...]) -> _SubsetTables:
    order = _link_order(topo)
    m = len(cards)
    size = 1 << m
    r = order.rank[np.ix_(cards, cards)]
    bott = np.full(size, order.top, dtype=np.int8)
    pop = np.zeros(size, dtype=np.int8)
    lex = np.zeros(size, dtype=np.int32)
    for h in range(m):
        lo = 1 << h
        # row[s] = the worst link between card h and the members of s (s below bit h).
        row = np.full(lo, order.top, dtype=np.int8)
        for j in range(h):
            np.minimum(row[: 1 << j], r[h, j], out=row[1 << j : 2 << j])
        np.minimum(bott[:lo], row, out=bott[lo : 2 * lo])
        pop[lo : 2 * lo] = pop[:lo] + 1
        lex[lo : 2 * lo] = lex[:lo] + (1 << (m - 1 - h))
    masks = np.arange(size, dtype=np.uint16)
    best = np.full((m + 1, size), -1, dtype=np.int8)
    arg = np.zeros((m + 1, size), dtype=np.uint16)
    for k in range(2, m + 1):
        sel = pop == k
        best[k, sel] = bott[sel]
        arg[k, sel] = masks[sel]
    # Max over subsets (sum-over-subsets transform), one bit at a time.
    for b in range(m):
        vb = best.reshape(m + 1, -1, 2, 1 << b)
        va = arg.reshape(m + 1, -1, 2, 1 << b)
        better = vb[:, :, 0, :] > vb[:, :, 1, :]
        np.copyto(vb[:, :, 1, :], vb[:, :, 0, :], where=better)
        np.copyto(va[:, :, 1, :], va[:, :, 0, :], where=better)
    return _SubsetTables(cards=cards, bott=bott, pop=pop, lex=lex, best=best, arg=arg, order=order)


def _universe(topo: Topology, free: Sequence[int]) -> _SubsetTables:
    # A host of up to 16 cards shares one cached table for every free set; a bigger host builds one
    # for the free set at hand (up to ~40 ms for 16 free cards) and does not let it evict the others.
    if topo.size <= EXACT_SEARCH_MAX_CARDS:
        return _tables(topo, tuple(range(topo.size)))
    return _tables.__wrapped__(topo, tuple(free))


def _packing_value(t: _SubsetTables, lefts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``free_quality`` of each leftover mask (all the same size): (GB/s, GB/s over PCIe alone)."""
    left = int(t.pop[lefts[0]]) if len(lefts) else 0
    total_p = np.zeros(len(lefts))
    total_q = np.zeros(len(lefts))
    if left < 2:
        return total_p, total_q
    for k in range(2, left + 1):
        cur = lefts.copy()
        jobs = left // k
        for _ in range(jobs):
            r = t.best[k, cur]
            total_p += t.order.primary_gbps[r] / jobs
            total_q += t.order.pcie_gbps[r] / jobs
            cur ^= t.arg[k, cur]
    sizes = left - 1
    return np.round(total_p / sizes, 9), np.round(total_q / sizes, 9)


def _keep_best(cands: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """The candidates that maximise ``keys`` lexicographically (all of them, when tied)."""
    for i in range(len(keys)):
        keep = keys[i] == keys[i].max()
        cands = cands[keep]
        keys = tuple(k[keep] for k in keys)
    return cands


def _exact(
    topo: Topology, free: Sequence[int], n: int, scores: Mapping[int, int], avoid: Collection[int]
) -> tuple[int, ...]:
    t = _universe(topo, free)
    fmask = t.mask(free)
    cands = t.of_size(n)
    cands = cands[(cands & ~fmask) == 0]
    amask = t.mask([c for c in avoid if c in set(free)])
    cands = _keep_best(cands, -t.pop[cands & amask], t.bott[cands])
    if len(cands) > 1:
        cands = _keep_best(cands, *_packing_value(t, fmask ^ cands))
    if len(cands) > 1 and len({scores.get(c, 100) for c in free}) > 1:
        weakest = np.full(len(cands), 1 << 20)
        total = np.zeros(len(cands), dtype=np.int64)
        for i, c in enumerate(t.cards):
            has = (cands >> i) & 1 == 1
            weakest = np.where(has, np.minimum(weakest, scores.get(c, 100)), weakest)
            total += has * scores.get(c, 100)
        cands = _keep_best(cands, weakest, total)
    return t.members(int(_keep_best(cands, t.lex[cands])[0]))


def free_quality(topo: Topology, free: Sequence[int]) -> float:
    """How good the groups are that the ``free`` cards can still form, in GB/s (higher is better).

    For each job size k from 2 to ``len(free)``, the free cards are handed out greedily to k-card jobs
    (each takes the best-connected k cards left) and the modelled bus bandwidths of those groups are
    averaged; the result is the mean over k. 0.0 for fewer than two cards. Defined for at most
    ``EXACT_SEARCH_MAX_CARDS`` free cards (ValueError beyond).
    """
    free = sorted(set(free))
    if len(free) > EXACT_SEARCH_MAX_CARDS:
        raise ValueError(f"free_quality is defined for at most {EXACT_SEARCH_MAX_CARDS} free cards")
    if len(free) < 2:
        return 0.0
    t = _universe(topo, free)
    return float(_packing_value(t, np.array([t.mask(free)], dtype=np.int32))[0][0])


# ----------------------------------------------------------------------------------------------------
# Clustering, for free sets too large for exact search.


@dataclass(frozen=True)
class _Cluster:
    members: tuple[int, ...]
    rank: int  # slowest link inside (complete linkage); `top` for one card
    children: tuple[_Cluster, ...] = ()


def _dendrogram(order: _LinkOrder, free: Sequence[int]) -> list[_Cluster]:
    """Complete-linkage clustering of ``free`` by link rank; every node, root last.

    Complete linkage merges the two clusters whose *worst* cross link is best, so each node's rank is
    exactly the bottleneck of its members: the same quantity the ring cost model charges.
    """
    m = len(free)
    sim = order.rank[np.ix_(free, free)].astype(np.int32)
    np.fill_diagonal(sim, -1)
    slots: list[_Cluster | None] = [_Cluster((c,), order.top) for c in free]
    nodes: list[_Cluster] = [c for c in slots if c is not None]
    size = np.ones(m, dtype=np.int32)
    for _ in range(m - 1):
        best = sim.max()
        ii, jj = np.nonzero(np.triu(sim == best, 1))
        # Among equally good merges the smallest result first: keeps the tree balanced on uniform hosts.
        k = np.lexsort((jj, ii, size[ii] + size[jj]))[0]
        i, j = int(ii[k]), int(jj[k])
        a, b = slots[i], slots[j]
        assert a is not None and b is not None  # a merged slot is never picked again (its row is -1)
        merged = _Cluster(tuple(sorted(a.members + b.members)), int(best), (a, b))
        nodes.append(merged)
        slots[i], slots[j] = merged, None
        size[i] += size[j]
        sim[i, :] = np.minimum(sim[i, :], sim[j, :])
        sim[:, i] = sim[i, :]
        sim[i, i] = -1
        sim[j, :] = -1
        sim[:, j] = -1
    return nodes


def _fills(node: _Cluster, n: int, limit: int = 8) -> list[tuple[int, ...]]:
    """Ways to take ``n`` cards from ``node`` using whole sub-clusters where they fit."""
    if n == len(node.members):
        return [node.members]
    if not node.children or n > len(node.members):
        return []
    out: list[tuple[int, ...]] = []
    a, b = node.children
    for first, second in ((a, b), (b, a)):
        if len(first.members) >= n:
            out += _fills(first, n, limit)
        else:
            out += [first.members + rest for rest in _fills(second, n - len(first.members), limit)]
    return list(dict.fromkeys(tuple(sorted(g)) for g in out))[:limit]


def _link_stats(order: _LinkOrder, group: Sequence[int]) -> tuple[int, int]:
    """(slowest-link rank, minus the number of pairs at that rank): larger is better."""
    if len(group) < 2:
        return order.top, 0
    g = np.asarray(group)
    sub = order.rank[g[:, None], g]
    low = int(sub.min())
    return low, -int((sub == low).sum())


def _improve(order: _LinkOrder, group: tuple[int, ...], pool: Sequence[int]) -> tuple[int, ...]:
    """Swap one card at a time while it raises the slowest link (or thins the pairs that hold it)."""
    current = list(group)
    stats = _link_stats(order, current)
    for _ in range(2 * len(group) if len(group) > 1 else 0):
        outside = np.array([c for c in pool if c not in current], dtype=np.int64)
        best = None
        for pos in range(len(current) if len(outside) else 0):
            rest = current[:pos] + current[pos + 1 :]
            # The swapped-in card's worst link to the others bounds the new slowest link.
            worst_to_rest = order.rank[outside[:, None], np.asarray(rest)].min(axis=1)
            new_low = np.minimum(worst_to_rest, _link_stats(order, rest)[0])
            if new_low.max() < stats[0]:
                continue
            for c in outside[new_low == new_low.max()][:_SWAP_TIES]:
                s = _link_stats(order, [*rest, int(c)])
                if s > stats and (best is None or s > best[0]):
                    best = (s, [*rest, int(c)])
        if best is None:
            break
        stats, current = best
    return tuple(sorted(current))


@dataclass(frozen=True, eq=False)
class _Tree:
    """The dendrogram as arrays: node i holds the cards of ``masks[i]`` (bit c = card c)."""

    masks: tuple[int, ...]
    rank: np.ndarray  # (N,) slowest link inside each node
    children: np.ndarray  # (N, 2) child node indices, -1 for a card


def _tree(nodes: Sequence[_Cluster]) -> _Tree:
    at = {id(node): i for i, node in enumerate(nodes)}
    return _Tree(
        masks=tuple(sum(1 << c for c in node.members) for node in nodes),
        rank=np.array([node.rank for node in nodes]),
        children=np.array([[at[id(ch)] for ch in node.children] or [-1, -1] for node in nodes]),
    )


def _tree_quality(order: _LinkOrder, tree: _Tree, left: int) -> tuple[float, float]:
    """``free_quality`` of the cards in mask ``left``, read off the dendrogram: (GB/s, GB/s over PCIe).

    Handing out k-card groups greedily, a node with c free cards hosts c // k of them, of which those
    its children cannot host themselves run at the node's slowest link. Exact on tree-shaped hosts; a
    lower bound elsewhere.
    """
    count = np.array([(mask & left).bit_count() for mask in tree.masks])
    cards = left.bit_count()
    if cards < 2:
        return 0.0, 0.0
    ks = np.arange(2, cards + 1)
    jobs = count[:, None] // ks
    inner = tree.children[:, 0] >= 0
    at_node = jobs[inner] - jobs[tree.children[inner, 0]] - jobs[tree.children[inner, 1]]
    share = at_node / (cards // ks)
    ranks = tree.rank[inner]
    p = float((order.primary_gbps[ranks][:, None] * share).sum() / len(ks))
    q = float((order.pcie_gbps[ranks][:, None] * share).sum() / len(ks))
    return round(p, 9), round(q, 9)


def cluster_group(
    topo: Topology,
    free: Sequence[int],
    n: int,
    scores: Mapping[int, int] | None = None,
    *,
    avoid: Collection[int] = (),
) -> tuple[int, ...] | None:
    """``best_group`` by clustering instead of exact search, for hosts with many free cards.

    Candidates are built from the complete-linkage dendrogram of the free cards (whole sub-clusters
    first), improved by single-card swaps, and ranked like ``best_group``: degraded cards used, slowest
    link, the leftover's quality read off the dendrogram (``_tree_quality``), health, indices.
    """
    scores = scores or {}
    free = sorted(set(free))
    if n <= 0 or len(free) < n:
        return None
    bad = set(avoid) & set(free)
    if bad and len(free) - len(bad) >= n:
        # Enough healthy cards: search among them alone, so no degraded card is used.
        return cluster_group(topo, [c for c in free if c not in bad], n, scores)
    order = _link_order(topo)
    nodes = _dendrogram(order, free)
    tree = _tree(nodes)
    fmask = sum(1 << c for c in free)
    found = {g for node in nodes if len(node.members) >= n for g in _fills(node, n)}
    ranked = sorted(found, key=lambda g: _link_stats(order, g), reverse=True)
    cands = found | {_improve(order, g, free) for g in ranked[:_POLISHED_CANDIDATES]}

    def key(g: tuple[int, ...]) -> tuple:
        health = [scores.get(c, 100) for c in g]
        return (
            -sum(1 for c in g if c in bad),
            _link_stats(order, g)[0],
            *_tree_quality(order, tree, fmask & ~sum(1 << c for c in g)),
            min(health),
            sum(health),
            [-c for c in g],
        )

    return max(cands, key=key)


# ----------------------------------------------------------------------------------------------------
# The API the engine calls.


def best_group(
    topo: Topology,
    free: Sequence[int],
    n: int,
    scores: Mapping[int, int] | None = None,
    *,
    avoid: Collection[int] = (),
) -> tuple[int, ...] | None:
    """The best group of ``n`` cards among ``free`` (sorted card indices), or ``None`` if fewer are free.

    Precedence (module docstring): fewest ``avoid`` (degraded) cards, then the ring all-reduce cost
    model, then the least harm to the free groups that remain (``free_quality``), then ``scores``
    (health 0-100 per card index, 100 when missing), then lowest indices. Exact search for up to
    ``EXACT_SEARCH_MAX_CARDS`` free cards, ``cluster_group`` beyond.
    """
    scores = scores or {}
    free = sorted(set(free))
    if n <= 0 or len(free) < n:
        return None
    if len(free) > EXACT_SEARCH_MAX_CARDS:
        return cluster_group(topo, free, n, scores, avoid=avoid)
    # Everything _exact reads, as a key: the same free set asks the same question at every grant.
    avoid = set(avoid)
    return _exact_cached(
        topo,
        tuple(free),
        n,
        tuple(scores.get(c, 100) for c in free),
        tuple(c in avoid for c in free),
    )


@lru_cache(maxsize=4096)
def _exact_cached(
    topo: Topology, free: tuple[int, ...], n: int, scores: tuple[int, ...], avoid: tuple[bool, ...]
) -> tuple[int, ...]:
    avoided = {c for c, a in zip(free, avoid, strict=True) if a}
    return _exact(topo, free, n, dict(zip(free, scores, strict=True)), avoided)


def choose_slice_card(
    cards: Sequence[CardCapacity],
    memory_fraction: float,
    compute_pct: int,
    topo: Topology | None = None,
    *,
    free_whole: Collection[int] | None = None,
    tie_break: Callable[[int], float] | None = None,
    displaces: Collection[int] = (),
) -> int | None:
    """The card a new slice goes to, or ``None`` when no card can take it.

    ``memory_fraction`` is the share of a card's memory (0-1], ``compute_pct`` its share of compute
    (0-100]. Already-sliced cards come first, best fit (least memory, then compute, left over), so whole
    cards stay whole; otherwise an idle whole card that no operator pinned is converted: the one whose
    loss leaves the free whole cards the best groups (``free_quality``). Degraded cards (``avoid``) are
    used only when nothing else fits; health scores, then lowest indices, break ties.

    ``free_whole``: the cards whole-card groups could use now, when the caller knows better than
    ``cards`` (e.g. it marks pinned whole cards unusable for slices); default: the usable, idle, whole
    cards in ``cards``.

    ``tie_break``: a cost per card index (lower first) among already-sliced cards that tie on every term
    above, before the lowest index (the daemon's co-location on MPS cards, ``placement.colocate``); it is
    called only for such ties.

    ``displaces``: sliced cards where the slice would displace what is kept there for another user (an
    MPS server kept idle for another uid: the slice's prepare shuts it down first, and starts its own);
    they come after every other sliced card that fits, whatever their fit.
    """
    eps = 1e-9
    for avoid in (False, True):
        sliced = [
            c
            for c in cards
            if c.usable
            and c.sliced
            and c.avoid == avoid
            and c.free_memory_fraction + eps >= memory_fraction
            and c.free_compute_pct >= compute_pct
        ]
        if sliced:
            keyed = [
                (
                    (
                        c.index in displaces,
                        round(c.free_memory_fraction - memory_fraction, 9),
                        c.free_compute_pct - compute_pct,
                        -c.health_score,
                    ),
                    c.index,
                )
                for c in sliced
            ]
            best, index = min(keyed)
            if tie_break is None:
                return index
            ties = [i for k, i in keyed if k == best]
            return index if len(ties) == 1 else min(ties, key=lambda i: (tie_break(i), i))
        if memory_fraction > 1 + eps or compute_pct > 100:
            continue
        convertible = [
            c
            for c in cards
            if c.usable and not c.sliced and c.idle and not c.mode_pinned and c.avoid == avoid
        ]
        if convertible:
            if free_whole is None:
                free_whole = [c.index for c in cards if c.usable and not c.sliced and c.idle]
            return _least_harmful(sorted(set(free_whole)), convertible, topo).index
    return None


def _least_harmful(
    free_whole: Sequence[int], convertible: Sequence[CardCapacity], topo: Topology | None
) -> CardCapacity:
    """The convertible card whose loss hurts the free whole-card groups (``free_whole``) least."""
    free_whole = sorted(set(free_whole) | {c.index for c in convertible})
    fallback = {c.index: (0.0, 0.0) for c in convertible}
    if topo is None or len(free_whole) < 3 or max(free_whole) >= topo.size:
        harm = fallback
    elif len(free_whole) <= EXACT_SEARCH_MAX_CARDS:
        harm = _exact_harm(topo, tuple(free_whole), tuple(c.index for c in convertible))
    else:
        order = _link_order(topo)
        tree = _tree(_dendrogram(order, free_whole))
        fmask = sum(1 << c for c in free_whole)
        harm = {}
        for c in convertible:
            p, q = _tree_quality(order, tree, fmask & ~(1 << c.index))
            harm[c.index] = (-p, -q)
    return min(convertible, key=lambda c: (*harm[c.index], -c.health_score, c.index))


@lru_cache(maxsize=4096)
def _exact_harm(
    topo: Topology, free_whole: tuple[int, ...], convertible: tuple[int, ...]
) -> dict[int, tuple[float, float]]:
    """What losing each ``convertible`` card does to the groups of ``free_whole`` (exact search); cached:
    it depends on nothing else, and a slice grant asks it again for the same free cards. (Read only.)"""
    t = _universe(topo, free_whole)
    fmask = t.mask(free_whole)
    lefts = np.array([fmask ^ t.mask([c]) for c in convertible], dtype=np.int32)
    p, q = _packing_value(t, lefts)
    return {c: (-p[i], -q[i]) for i, c in enumerate(convertible)}
