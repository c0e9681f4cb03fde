"""The defrag planner: consolidation on one host (what ``xpu defrag`` asks) and making room for a request."""

from __future__ import annotations

import numpy as np
import pytest

from xpud.placement.cluster import ClusterState, Demand, Host, Placement
from xpud.placement.defrag import Item, Movables, plan


def test_consolidates_slices_to_free_whole_cards_on_one_host():
    s = ClusterState([Host("h", 64_000, 256_000, 4, "X")])
    items = []
    for i in range(4):
        d, p = Demand(1_000, 1_000, 1, 250), Placement(0, (i,))
        s.place(d, p)
        items.append(Item(f"lease-{i}", d, p))
    result = plan(s, items, hosts=[0], move_cost=0.1, max_moves=8, seed=1)
    assert result.ok and len(result.moves) == 3
    after = s.copy()
    for m in result.moves:
        after.remove(Demand(1_000, 1_000, 1, 250), m.src)
    for m in result.moves:
        after.place(Demand(1_000, 1_000, 1, 250), m.dst)
    assert after.n_full[0] == 3  # three idle whole cards again
    assert result.value_after > result.value_before
    assert s.n_full[0] == 0  # the input state is untouched


def test_consolidation_respects_move_cost_and_restartable():
    s = ClusterState([Host("h", 64_000, 256_000, 2, "X")])
    items = []
    for i in range(2):
        d, p = Demand(1_000, 1_000, 1, 400), Placement(0, (i,))
        s.place(d, p)
        items.append(Item(i, d, p))
    assert not plan(s, items, hosts=[0], move_cost=10.0).moves  # freeing one card is not worth 10
    assert (
        plan(s, [Item(i.id, i.demand, i.placement, restartable=False) for i in items], hosts=[0]).moves == ()
    )


def test_makes_room_by_moving_a_cpu_task_off_a_host_with_idle_cards():
    # Host 0: idle card but its CPU is taken by a CPU-only task; host 1: CPU but no free card.
    s = ClusterState([Host("gpu", 16_000, 64_000, 1, "X"), Host("cpu", 32_000, 64_000, 1, "X")])
    cpu_task, at = Demand(12_000, 8_000), Placement(0)
    s.place(cpu_task, at)
    s.place(Demand(1_000, 1_000, 1, 1000), Placement(1, (0,)))
    request = Demand(8_000, 8_000, 1, 1000)
    assert not s.feasible(request).any()
    result = plan(s, [Item("c", cpu_task, at)], target=request, max_moves=1)
    assert result.target == Placement(0, (0,))
    assert [(m.item, m.src.host, m.dst.host) for m in result.moves] == [("c", 0, 1)]
    assert plan(s, [Item("c", cpu_task, at)], target=request, max_moves=0).target is None


def _apply(s: ClusterState, demands: dict, p) -> ClusterState:
    """The state after ``p``'s moves (stop all, then start each); fails if a start does not fit."""
    after = s.copy()
    for m in p.moves:
        after.remove(demands[m.item], m.src)
    for m in p.moves:
        assert after.fits(demands[m.item], m.dst)
        after.place(demands[m.item], m.dst)
    return after


def _swap_case():
    # Host 0 has half a card free but its CPU is held by a CPU-heavy slice ``t``; host 1 has CPU to spare but
    # no free card, and runs slices of the same size that need less CPU. Nothing fits anywhere else (host 0
    # has 1 core free), so no eviction works; trading ``t`` with the light slice of host 1 does.
    s = ClusterState([Host("a", 16_000, 64_000, 2, "X"), Host("b", 64_000, 256_000, 2, "X")])
    demands = {
        "t": Demand(12_000, 8_000, 1, 500),
        "w0": Demand(3_000, 4_000, 1, 1000),
        "light": Demand(2_000, 8_000, 1, 500),
        "mid": Demand(6_000, 8_000, 1, 500),
        "w1": Demand(2_000, 4_000, 1, 1000),
    }
    where = {
        "t": Placement(0, (0,)),
        "w0": Placement(0, (1,)),
        "light": Placement(1, (0,)),
        "mid": Placement(1, (0,)),
        "w1": Placement(1, (1,)),
    }
    for k, d in demands.items():
        s.place(d, where[k])
    items = [Item(k, demands[k], where[k]) for k in demands]
    return s, demands, items


def test_swap_trades_a_cpu_heavy_slice_for_a_light_one_of_the_same_size():
    s, demands, items = _swap_case()
    request = Demand(8_000, 4_000, 1, 500)
    assert not s.feasible(request).any()
    assert plan(s, items, target=request, move_whole=False).target is None  # evictions alone cannot
    p = plan(s, items, target=request, move_whole=False, swaps=True)
    assert p.target == Placement(0, (0,))
    assert len(p.moves) == 2 and {m.item for m in p.moves} == {"t", "light"}  # "mid" would free too little
    t_move = next(m for m in p.moves if m.item == "t")
    other = next(m for m in p.moves if m.item != "t")
    assert t_move.dst == other.src and other.dst == t_move.src  # the two trade places, cards included
    after = _apply(s, demands, p)
    assert after.fits(request, p.target)
    assert plan(s, items, target=request, move_whole=False, swaps=True, max_moves=1).target is None
    assert s.cpu_free[0] == 1_000  # the input state is untouched


def test_swap_needs_a_partner_that_frees_enough_and_restartable_tasks():
    s, _, items = _swap_case()
    # 11 cores: swapping ``t`` (12 cores) for ``light`` (2) leaves host 0 with 1 + 12 - 2 = 11 cores.
    assert plan(s, items, target=Demand(11_000, 4_000, 1, 500), swaps=True, move_whole=False).ok
    # 12 cores: no partner frees enough.
    assert plan(s, items, target=Demand(12_000, 4_000, 1, 500), swaps=True, move_whole=False).target is None
    fixed = [Item(i.id, i.demand, i.placement, restartable=i.id != "t") for i in items]
    assert plan(s, fixed, target=Demand(8_000, 4_000, 1, 500), swaps=True, move_whole=False).target is None


def test_movables_index_follows_adds_moves_and_removes():
    s, demands, items = _swap_case()
    m = Movables(items)
    assert len(m) == 5 and "t" in m
    assert sorted(i.id for i in m.by_host[1]) == ["light", "mid", "w1"]
    s.remove(demands["w0"], Placement(0, (1,)))  # "w0" ends, "light" moves to host 0's idle card
    assert m.remove("w0").id == "w0" and m.remove("w0") is None and len(m) == 4
    s.remove(demands["light"], Placement(1, (0,)))
    s.place(demands["light"], Placement(0, (1,)))
    m.move("light", Placement(0, (1,)))
    assert sorted(i.id for i in m.by_host[0]) == ["light", "t"]
    assert sorted(i.id for i in m.by_host[1]) == ["mid", "w1"]
    cpu, mem, card = m.room_if_all_leave(s)
    assert cpu.tolist() == [16_000, 64_000] and mem.tolist() == [64_000, 256_000]
    assert card.tolist() == [[1000, 1000], [1000, 1000]]
    cpu, _, card = m.room_if_all_leave(s, rows=np.array([0]))  # only "t" (the first row) leaves
    assert cpu.tolist() == [14_000, 56_000] and card.tolist() == [[1000, 500], [500, 0]]
    m.add(Item("n", Demand(1_000, 1_000), Placement(1), restartable=False))
    assert "n" not in m  # only restartable tasks are indexed


def test_swap_partner_may_be_a_smaller_slice_whose_card_has_room():
    s = ClusterState([Host("a", 16_000, 64_000, 2, "X"), Host("b", 64_000, 256_000, 2, "X")])
    t, w0 = Demand(12_000, 8_000, 1, 500), Demand(3_000, 4_000, 1, 1000)
    small, other, w1 = (
        Demand(2_000, 8_000, 1, 300),
        Demand(6_000, 8_000, 1, 500),
        Demand(2_000, 4_000, 1, 1000),
    )
    where = [(t, Placement(0, (0,))), (w0, Placement(0, (1,))), (small, Placement(1, (0,)))]
    where += [(other, Placement(1, (0,))), (w1, Placement(1, (1,)))]
    for d, p in where:
        s.place(d, p)
    items = [Item(n, d, p) for n, (d, p) in enumerate(where)]
    request = Demand(8_000, 4_000, 1, 500)
    p = plan(s, items, target=request, move_whole=False, swaps=True)
    # t (500) goes to the small slice's card (200 free + its 300), the small slice to t's place.
    assert [(m.item, m.dst) for m in p.moves] == [(0, Placement(1, (0,))), (2, Placement(0, (0,)))]
    assert _apply(s, {n: d for n, (d, _) in enumerate(where)}, p).fits(request, p.target)
    # With the other slice at 600 the small one's card would have only 100 + 300 free: no swap.
    s.remove(other, Placement(1, (0,)))
    bigger = Demand(6_000, 8_000, 1, 600)
    s.place(bigger, Placement(1, (0,)))
    items[3] = Item(3, bigger, Placement(1, (0,)))
    assert plan(s, items, target=request, move_whole=False, swaps=True).target is None


def test_movables_reuse_rows_of_removed_tasks():
    m = Movables()
    for i in range(3):
        m.add(Item(i, Demand(1_000, 1_000, 1, 250), Placement(0, (i,))))
    for _ in range(50):  # a long-lived index (the daemon's) does not grow with moves
        m.move(1, Placement(0, (3,)))
        m.move(1, Placement(0, (1,)))
    assert m.rows().size == 3 and m.host.size == 64
    assert sorted(m.item(int(r)).id for r in m.rows()) == [0, 1, 2]
    with pytest.raises(ValueError):
        m.add(Item(0, Demand(1_000, 1_000), Placement(0)))
