"""Engine.move / ack_move driven directly: reserve, tell the holder, commit on ack, time out, give up."""

from __future__ import annotations

import pytest

from tests.syncengine import sync_engine
from tests.test_engine import Clock, cards, pcie_box, req
from xpud.config.schema import Config
from xpud.errors import BadRequest, Conflict, Forbidden, NoCapacity
from xpud.ledger.ledger import Ledger
from xpud.model import Caller, HealthState


@pytest.fixture
def engine(tmp_path):
    cfg = Config().replace("health", move_ack_timeout_s=5.0)
    return sync_engine(cards(), pcie_box(), cfg, Ledger(tmp_path / "l.sqlite"), clock=Clock())


def held(engine, mode="xpu", gpus=1, restartable=True):
    lease, token = engine.try_grant(req(mode, gpus, restartable=restartable))
    q = engine.hold_opened(lease.id)
    return lease, token, q


def events(q):
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_move_reserves_tells_the_holder_and_commits_only_on_ack(engine):
    lease, token, q = held(engine)
    src = lease.cards[0]
    new = engine.move(lease.id, "card unhealthy")
    dst = new.cards[0]
    assert dst != src and new.restart_count == 1 and new.env["XPU_RESTART_COUNT"] == "1"
    assert new.env["CUDA_VISIBLE_DEVICES"] == engine.cards[dst].info.uuid
    assert new.env["XPU_LEASE_ID"] == lease.id
    [ev] = events(q)
    assert ev.kind == "move" and ev.lease == new and "card unhealthy" in ev.message
    # reserved, not committed: both cards are the lease's, the ledger still says the old one
    assert engine.cards[src].whole_lease == engine.cards[dst].whole_lease == lease.id
    assert engine.ledger.active_leases()[0].cards == (src,)
    assert engine.try_grant(req("xpu", 8)) is None  # nobody else gets the reserved card
    with pytest.raises(Conflict, match="already moving"):
        engine.move(lease.id, "again")
    with pytest.raises(Forbidden):
        engine.ack_move(lease.id, "forged")
    done = engine.ack_move(lease.id, token)
    assert done == new and engine.leases[lease.id] == new
    assert engine.cards[src].whole_lease is None and engine.cards[dst].whole_lease == lease.id
    stored = engine.ledger.active_leases()[0]
    assert stored.cards == (dst,) and stored.restart_count == 1 and stored.env == new.env
    with pytest.raises(Conflict, match="no move is pending"):
        engine.ack_move(lease.id, token)
    kinds = [e.kind for e in engine.ledger.events()]
    assert kinds.count("move") == 2  # asked, done


def test_the_daemon_acknowledges_its_own_jobs_move_by_the_anchor_not_a_token(engine):
    """A restartable detached job's lease (anchor ``job:<id>``) is held by the daemon, which keeps no token
    across a restart: ``ack_anchored_move`` commits its move by the anchor; no other anchor, and never an
    unanchored lease (a user's ``xpu run``), passes without the token."""
    lease, _token = engine.try_grant(req("xpu", 1, restartable=True, anchor="job:0123abcd"))
    engine.hold_opened(lease.id)
    new = engine.move(lease.id, "test")
    for wrong in ("job:ffffffff", "", "pod:0123abcd"):
        with pytest.raises(Forbidden):
            engine.ack_anchored_move(lease.id, wrong)
    assert engine.ack_anchored_move(lease.id, "job:0123abcd") == new
    assert engine.ledger.active_leases()[0].cards == new.cards
    plain, _, _ = held(engine)
    engine.move(plain.id, "test")
    with pytest.raises(Forbidden):
        engine.ack_anchored_move(plain.id, "")


def test_a_slice_moves_to_another_card_and_its_old_slice_is_freed(engine):
    lease, token, _ = held(engine, "vxpu-half")
    src = lease.cards[0]
    new = engine.move(lease.id, "test")
    assert new.cards != (src,) and new.slices[0].card_index == new.cards[0]
    assert new.env["XPU_MEMORY_LIMIT_BYTES"] == lease.env["XPU_MEMORY_LIMIT_BYTES"]
    engine.ack_move(lease.id, token)
    assert lease.id not in engine.cards[src].slices
    assert engine.cards[new.cards[0]].slices[lease.id] == new.slices[0]


def test_a_move_nobody_acknowledges_is_abandoned_and_the_lease_marked(engine):
    lease, token, q = held(engine, gpus=2)
    new = engine.move(lease.id, "card 1 unhealthy")
    events(q)
    engine.clock.t += 4.9
    engine.reap()
    assert lease.id in engine.moves.pending
    engine.clock.t += 0.2
    engine.reap()
    assert lease.id not in engine.moves.pending and lease.id in engine.moves.timed_out
    assert all(engine.cards[i].whole_lease is None for i in new.cards)  # the reservation is freed
    assert engine.leases[lease.id].cards == lease.cards
    [ev] = events(q)
    assert ev.kind == "mark" and "did not acknowledge" in ev.message and "stays on card" in ev.message
    engine.ledger.flush()  # a mark is a note: its write is queued, not awaited
    assert engine.ledger.active_leases()[0].mark == ev.message
    with pytest.raises(Conflict, match="abandoned"):
        engine.ack_move(lease.id, token)


def test_no_room_not_restartable_or_no_holder_reserve_nothing(engine):
    lease, _, _ = held(engine, gpus=4)
    other, _, _ = held(engine, gpus=4)
    before = {i: c.whole_lease for i, c in engine.cards.items()}
    with pytest.raises(NoCapacity, match="no healthy card is free"):
        engine.move(lease.id, "x")
    assert {i: c.whole_lease for i, c in engine.cards.items()} == before
    engine.release(other.id, Caller(1000))
    plain, _, _ = held(engine, restartable=False)
    with pytest.raises(Conflict, match="not restartable"):
        engine.move(plain.id, "x")
    unheld, _ = engine.try_grant(req("xpu", 1, restartable=True))
    with pytest.raises(Conflict, match="no holder connected"):
        engine.move(unheld.id, "x")


def test_release_during_a_move_frees_the_reservation(engine):
    lease, token, _ = held(engine)
    new = engine.move(lease.id, "x")
    engine.release(lease.id, Caller(1000), token)
    assert engine.cards[new.cards[0]].whole_lease is None and engine.moves.pending == {}


def test_explicit_targets_are_checked(engine):
    lease, _, _ = held(engine)
    other, _, _ = held(engine)
    with pytest.raises(BadRequest, match="holds it"):
        engine.move(lease.id, "x", to=lease.cards)
    with pytest.raises(NoCapacity, match="no room"):
        engine.move(lease.id, "x", to=other.cards)
    engine.set_health(7, HealthState.UNHEALTHY, 0, "test")
    with pytest.raises(Conflict, match="unhealthy"):
        engine.move(lease.id, "x", to=[7])
    free = next(i for i in range(7) if i not in lease.cards + other.cards)
    assert engine.move(lease.id, "defrag", to=[free]).cards == (free,)


def test_moves_avoid_unhealthy_and_degraded_cards_and_prefer_higher_scores(engine):
    lease, _, _ = held(engine)
    src = lease.cards[0]
    for i in range(8):
        if i != src and i not in (6, 7):
            engine.set_health(i, HealthState.UNHEALTHY, 0, "test")
    engine.set_health(6, HealthState.DEGRADED, 60, "test")
    assert engine.move(lease.id, "x").cards == (7,)


def test_placement_prefers_the_higher_score_among_equal_choices(engine):
    engine.set_health(0, HealthState.HEALTHY, 85)
    lease, _ = engine.try_grant(req("xpu", 1))
    assert lease.cards == (1,)  # cards 0 and 1 are equal choices (each orphans its switch partner)
    engine.set_health(1, HealthState.HEALTHY, 100)
    view = engine.card_views()[0]
    assert view.health_score == 85 and not view.drained


def test_an_unhealthy_card_shows_drained_with_the_reason_and_an_operator_drain_is_separate(engine):
    engine.drain("2", "fan noise")
    engine.set_health(2, HealthState.UNHEALTHY, 0, "xid 79 (GPU has fallen off the bus)")
    engine.set_health(3, HealthState.UNHEALTHY, 0, "xid 48 (double-bit ECC error)")
    v2, v3 = engine.card_views()[2:4]
    assert v2.drained and v2.drain_reason == "fan noise"
    assert v3.drained and v3.drain_reason == "unhealthy: xid 48 (double-bit ECC error)"
    assert engine.undrain("3").drained  # the operator cannot lift the monitor's drain
    engine.set_health(2, HealthState.HEALTHY, 100)
    engine.set_health(3, HealthState.HEALTHY, 100)
    v2, v3 = engine.card_views()[2:4]
    assert v2.drained and not v3.drained  # the operator's own drain stays until the operator lifts it
