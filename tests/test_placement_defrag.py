"""The defrag planner: consolidation on one host (what ``xpu defrag`` asks) and making room for a request."""

from __future__ import annotations

from xpud.placement.cluster import ClusterState, Demand, Host, Placement
from xpud.placement.defrag import Item, plan


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
