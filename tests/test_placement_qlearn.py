"""Q-learning over placement rules: it learns from replays and then acts greedily."""

from __future__ import annotations

import numpy as np

from xpud.placement.cluster import ClusterState, Demand, Host
from xpud.placement.qlearn import N_STATES, RULES, QRule, QTable, kind, state_of, train

HOSTS = [Host(f"h{i}", 32_000, 128_000, 4, "X") for i in range(4)]


def test_request_kinds_and_load_states():
    assert [
        kind(d) for d in (Demand(1, 1), Demand(1, 1, 1, 200), Demand(1, 1, 1, 500), Demand(1, 1, 1, 810))
    ] == [
        0,
        1,
        2,
        3,
    ]
    assert kind(Demand(1, 1, 1, 1000)) == 4 and kind(Demand(1, 1, 4, 1000)) == 5
    s = ClusterState(HOSTS)
    assert state_of(s, Demand(1, 1, 1, 1000)) == 4 * 4 + 0
    assert 0 <= state_of(s, Demand(1, 1, 4, 1000)) < N_STATES


def test_training_updates_the_table_and_greedy_follows_it():
    rng = np.random.default_rng(0)
    shapes = [Demand(4_000, 8_000, 1, 500), Demand(8_000, 8_000, 1, 1000), Demand(2_000, 4_000)]
    episodes = [[shapes[i] for i in rng.integers(0, 3, 40)] for _ in range(3)]
    table = train(HOSTS, episodes)
    assert table.visits.sum() == 120 and np.abs(table.q).sum() > 0
    assert set(table.summary().values()) <= set(RULES)
    forced = QTable.empty()
    forced.q[:, RULES.index("best-fit")] = 1.0
    agent = QRule(forced)
    s = ClusterState(HOSTS)
    assert agent.choose(s, shapes[1], rng) is not None
    assert forced.visits[:, RULES.index("best-fit")].sum() == 1
