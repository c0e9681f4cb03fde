"""The daemon's defragmenter on an in-process engine: what it proposes, what it never moves, the budget,
the value of free cards that connect well, the isolation backend's veto, and the order (waves) of moves.

The engine here is the real one (on a fake PCIe box: 2 sockets x 2 switches x 2 cards); leases are put
on chosen cards with ``Engine._grant`` so that each case starts from a known layout."""

from __future__ import annotations

import re

import pytest

from tests.syncengine import sync_engine
from tests.test_engine import Caller, Clock, cards, pcie_box, req
from xpud.config.schema import Config
from xpud.controllers.defragmenter import Books, Defragmenter, free_cards, sequence
from xpud.engine.engine import Engine
from xpud.errors import BadRequest
from xpud.isolation.base import Accounting
from xpud.ledger.ledger import Ledger
from xpud.model import CardMode, Slice


def make_engine(tmp_path, isolation=None, **defrag) -> Engine:
    cfg = Config().replace("defrag", **defrag) if defrag else Config()
    led = Ledger(tmp_path / "l.sqlite")
    return sync_engine(cards(), pcie_box(), cfg, led, isolation=isolation, clock=Clock())


@pytest.fixture
def engine(tmp_path):
    return make_engine(tmp_path)


TOKENS: dict[str, str] = {}


def put(engine, card_list, mode="vxpu-quarter", restartable=True, held=True):
    """A lease on exactly these cards (a holder connected unless ``held`` is False)."""
    lease, token = engine._grant(req(mode, len(card_list), restartable=restartable), tuple(card_list))
    TOKENS[lease.id] = token
    if held:
        engine.hold_opened(lease.id)
    return lease


def layout(engine, quarters: dict[int, int], restartable=True) -> list:
    return [put(engine, [c], restartable=restartable) for c, n in quarters.items() for _ in range(n)]


def books(engine) -> dict:
    return {i: (c.mode, c.whole_lease, dict(c.slices)) for i, c in engine.cards.items()}


def carry_out(engine, plan) -> None:
    """Make the plan's moves through Engine.move (which checks each again), wave by wave, and acknowledge
    them as `xpu run --restartable` does."""
    for wave in sorted({m.wave for m in plan.moves}):
        todo = [m for m in plan.moves if m.wave == wave]
        for m in todo:
            assert engine.move(m.lease_id, "test", to=m.dst).cards == m.dst
        for m in todo:
            engine.ack_move(m.lease_id, TOKENS[m.lease_id])


def idle(engine) -> tuple[int, ...]:
    return tuple(sorted(i for i, c in engine.cards.items() if c.idle))


def test_consolidation_frees_whole_cards_and_the_plan_itself_moves_nothing(engine):
    layout(engine, {0: 1, 1: 2, 2: 1, 3: 3})  # 7 quarters over 4 cards: 2 cards are enough
    before = books(engine)
    plan = Defragmenter(engine, engine.cfg).plan(budget_pct=100)
    assert plan.before.idle == (4, 5, 6, 7) and len(plan.after.idle) == 6
    assert plan.moves and plan.gain > plan.cost == 0.25 * len(plan.moves)
    assert books(engine) == before and not engine.moves.pending  # planning changes nothing
    carry_out(engine, plan)
    assert idle(engine) == plan.after.idle  # what the plan promised
    assert all(engine.leases[m.lease_id].restart_count == 1 for m in plan.moves)


def test_never_moves_leases_that_are_not_restartable_or_have_no_holder(engine):
    layout(engine, {0: 1, 1: 1, 2: 1, 3: 1}, restartable=False)
    d = Defragmenter(engine, engine.cfg)
    plan = d.plan(budget_pct=100)  # nothing to do is a result: an empty plan that says why
    assert not plan.moves and re.search(
        r"nothing restartable to move: 4 active lease\(s\) \(4 not restart", plan.notes[0]
    )
    put(engine, [4], held=False)  # restartable, but no holder to restart it
    assert "1 no holder connected; 4 not restartable" in d.plan(budget_pct=100).notes[0]
    mine = layout(engine, {5: 1, 6: 1})  # restartable quarters on cards of their own
    plan = d.plan(budget_pct=100)
    assert plan.moves and {m.lease_id for m in plan.moves} <= {lease.id for lease in mine}
    assert {m.dst[0] for m in plan.moves} <= {0, 1, 2, 3, 5, 6}  # beside the fixed ones


def test_leases_on_drained_cards_moving_already_or_that_ignored_a_move_stay(engine):
    _, b, c = layout(engine, {0: 1, 1: 1, 2: 1})
    engine.drain("0", "maintenance")
    engine.move(b.id, "health", to=(5,))
    engine.moves.timed_out.add(c.id)
    plan = Defragmenter(engine, engine.cfg).plan(budget_pct=100)
    assert not plan.moves and "nothing restartable" in plan.notes[0]
    for why in ("1 on a drained or unhealthy card", "1 already moving", "1 its holder did not follow"):
        assert why in plan.notes[0]


def test_the_move_budget_is_a_share_of_active_leases_rounded_down(engine):
    layout(engine, {0: 1, 2: 1, 4: 1, 6: 1})  # one quarter per switch: freeing 3 cards takes 3 moves
    d = Defragmenter(engine, engine.cfg)
    assert len(d.plan(budget_pct=100).moves) == 3
    one = d.plan(budget_pct=25)  # 25 % of 4 leases: 1 move
    assert len(one.moves) == 1 and one.budget == 1 and len(one.after.idle) == 5
    assert len(d.plan(budget_pct=74).moves) <= 2  # 2.96 rounds down
    with pytest.raises(BadRequest, match="0 % allows no move"):
        d.plan(budget_pct=0)
    short = d.plan(budget_pct=20)
    assert not short.moves and re.search(r"allows no move .*give --move-budget 25 or more", short.notes[0])
    assert d.plan().budget_pct == engine.cfg.defrag.move_budget_pct == 25.0


def test_nothing_is_proposed_when_no_move_pays_for_itself(tmp_path):
    engine = make_engine(tmp_path, move_cost=2.0)
    layout(engine, {0: 1, 1: 1})
    plan = Defragmenter(engine, engine.cfg).plan(budget_pct=100)
    assert plan.moves == () and plan.after == plan.before and "pays" in plan.notes[-1]
    again = Defragmenter(engine, engine.cfg.replace("defrag", move_cost=0.25)).plan(budget_pct=100)
    assert len(again.moves) == 1


def test_free_cards_that_share_a_pcie_switch_are_worth_more_than_scattered_ones(engine):
    pair, apart = free_cards(engine.topology, (2, 3)), free_cards(engine.topology, (0, 3))
    assert pair.group == (2, 3) and pair.group_gbps > apart.group_gbps > 0
    assert pair.value > apart.value > 2 and pair.quality_gbps > apart.quality_gbps
    # Cards 1 and 4-7 held whole; one quarter on card 0, one on card 2, card 3 idle. Either quarter can
    # join the other and free one card, but only emptying card 2 frees a pair on one switch (2 and 3).
    for c in (1, 4, 5, 6, 7):
        put(engine, [c], mode="xpu", restartable=False)
    _, q2 = layout(engine, {0: 1, 2: 1})
    for seed in range(5):
        plan = Defragmenter(engine, engine.cfg).plan(budget_pct=100, seed=seed)
        assert [(m.lease_id, m.dst) for m in plan.moves] == [(q2.id, (0,))]
        assert plan.after.idle == (2, 3) and plan.after.group == (2, 3)


def test_making_room_for_a_whole_card_request(engine):
    layout(engine, {0: 2, 1: 1, 2: 1, 3: 2})
    d = Defragmenter(engine, engine.cfg)
    assert "free already" in d.plan(budget_pct=100, gpus=4).notes[0]
    none = d.plan(budget_pct=100, gpus=8)
    assert none.moves == () and "frees 8 whole card(s)" in none.notes[-1]
    plan = d.plan(budget_pct=100, gpus=6)
    assert plan.moves and len(plan.target_cards) == 6 and set(plan.target_cards) <= set(plan.after.idle)
    carry_out(engine, plan)
    assert len(idle(engine)) >= 6
    assert engine.try_grant(req("xpu", 6)) is not None


def test_waves_put_a_move_after_the_one_that_frees_its_room(engine):
    full = layout(engine, {0: 4})
    lone = put(engine, [1])
    # `lone` may go to card 0 only once a quarter has left it: a move holds its old place until acked.
    waves, refused = sequence(engine, [(lone.id, (0,)), (full[0].id, (2,))])
    assert waves == [[1], [0]] and refused == {}
    # Two whole-card leases trading places can never start: each needs the other's card first.
    w1, w2 = put(engine, [4], mode="xpu"), put(engine, [5], mode="xpu")
    waves, refused = sequence(engine, [(w1.id, (5,)), (w2.id, (4,))])
    assert waves == [] and set(refused) == {0, 1} and "not idle" in refused[0]


class GeometryBackend(Accounting):
    """A MIG-like backend: at most two slices per card whatever their size, judged from its own books
    (``fits`` ignores the ``held`` list it is given), as the MIG backend does."""

    name = "mig"

    def __init__(self):
        super().__init__()
        self.count: dict[int, int] = {}

    def fits(self, card, held, spec, owner_uid=-1):
        return self.count.get(card.index, 0) < 2 and super().fits(card, held, spec)

    def prepare(self, card, held, spec, lease_id, owner_uid):
        self.count[card.index] = self.count.get(card.index, 0) + 1
        return super().prepare(card, held, spec, lease_id, owner_uid)

    def teardown(self, card, s: Slice) -> None:
        self.count[card.index] -= 1


def test_moves_the_isolation_backend_would_refuse_are_never_proposed(tmp_path):
    backend = GeometryBackend()
    engine = make_engine(tmp_path, isolation=lambda card: backend)
    layout(engine, {0: 1, 1: 1, 2: 1, 3: 1})
    # By shares all four quarters fit on one card; this backend takes two per card. Its books reflect
    # the card as it is, so a card that gains or loses a slice takes no second move in the same run.
    for seed in range(4):
        plan = Defragmenter(engine, engine.cfg).plan(budget_pct=100, seed=seed)
        assert plan.moves and {m.wave for m in plan.moves} == {1}
        dst = [m.dst[0] for m in plan.moves]
        assert len(dst) == len(set(dst)) and not set(dst) & {m.src[0] for m in plan.moves}
    carry_out(engine, plan)  # the engine takes every move as proposed
    assert idle(engine) == plan.after.idle and max(backend.count.values()) == 2


class StuckBackend(Accounting):
    """A backend that refuses to take some idle cards out of sliced mode (as MIG does while a process
    still runs on the card)."""

    name = "mig"

    def __init__(self, stuck: set[int]):
        super().__init__()
        self.stuck = stuck

    def switch_blocker(self, card, sliced: bool) -> str:
        return "a process still runs on it" if not sliced and card.index in self.stuck else ""


def test_no_whole_card_move_or_switch_onto_a_sliced_card_the_backend_cannot_switch(tmp_path):
    backend = StuckBackend({0})
    engine = make_engine(tmp_path, isolation=lambda card: backend)
    for i in (0, 1):  # cards 0 and 1 left sliced and idle
        engine.release(put(engine, [i]).id, Caller(1000))
    assert engine.cards[0].mode is engine.cards[1].mode is CardMode.SLICED
    whole = put(engine, [7], mode="xpu")
    assert "cannot switch to whole now: a process still runs on it" in Books(engine).why_not(whole, (0,))
    assert Books(engine).why_not(whole, (1,)) == ""
    assert not engine.to_whole(0, "test") and engine.cards[0].mode is CardMode.SLICED
    assert engine.to_whole(1, "test") and engine.cards[1].mode is CardMode.WHOLE
    backend.stuck.clear()  # the process went away: the next run switches it
    assert Books(engine).why_not(whole, (0,)) == "" and engine.to_whole(0, "test")
