"""Q-learning that picks, per request class, which placement rule to apply (as the system xpud is modelled
on describes), learned from replayed outcomes.

State: the request's kind (CPU-only, small / mid / large fractional share, one whole card, several cards)
x the cluster's GPU allocation (< 70 %, < 90 %, < 95 %, >= 95 %). Actions: the rules in ``RULES``; every
rule sees every arrival and placement, so any of them can decide the next task. Reward of a decision: the
fragmentation it removed (``FragAware.saved``, in cards) when the task is placed, minus the task's GPU
share (in cards) when it is dropped. Training replays the trace on seeds that the evaluation does not use
(epsilon-greedy, one-step Q-learning); the trained table then acts greedily.

Measured on the openb default trace (``bench/placement.md``): the learned table mixes rules per class and
load, and loses about 2.4 points to ``xpud`` alone (a one-step reward does not see that mixing rules breaks
the structure each rule builds), so it is not the default. ``TRAIN_SEEDS`` are disjoint from 42-51.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from xpud.placement.cluster import ClusterState, Demand, Host, Placement
from xpud.placement.fragaware import FragAware
from xpud.placement.policies import BestFit, GpuPacking, Policy

RULES: tuple[str, ...] = ("xpud", "xpud-nofill", "best-fit", "gpu-packing")
TRAIN_SEEDS: tuple[int, ...] = tuple(range(6))
LOAD_EDGES = (0.70, 0.90, 0.95)
KINDS = ("cpu", "frac-small", "frac-mid", "frac-large", "whole-1", "multi")


def kind(d: Demand) -> int:
    if d.gpus == 0:
        return 0
    if d.fractional:
        return 1 if d.gpu_milli < 300 else 2 if d.gpu_milli <= 600 else 3
    return 4 if d.gpus == 1 else 5


def state_of(state: ClusterState, d: Demand) -> int:
    load = int(np.searchsorted(LOAD_EDGES, state.allocation_ratio(), side="right"))
    return kind(d) * (len(LOAD_EDGES) + 1) + load


N_STATES = len(KINDS) * (len(LOAD_EDGES) + 1)


def make_rules() -> list[Policy]:
    rules: dict[str, Callable[[], Policy]] = {
        "xpud": FragAware,
        "xpud-nofill": lambda: FragAware(fill_weight=0.0),
        "best-fit": BestFit,
        "gpu-packing": GpuPacking,
    }
    return [rules[r]() for r in RULES]


@dataclass
class QTable:
    q: np.ndarray  # (N_STATES, len(RULES))
    visits: np.ndarray

    @classmethod
    def empty(cls) -> QTable:
        return cls(np.zeros((N_STATES, len(RULES))), np.zeros((N_STATES, len(RULES)), dtype=np.int64))

    def greedy(self, s: int) -> int:
        return int(np.argmax(self.q[s]))

    def summary(self) -> dict[str, str]:
        """Rule chosen per visited state, e.g. ``{"frac-large@>=95%": "xpud"}``."""
        loads = ["<70%", "<90%", "<95%", ">=95%"]
        out = {}
        for s in range(N_STATES):
            if self.visits[s].sum():
                out[f"{KINDS[s // len(loads)]}@{loads[s % len(loads)]}"] = RULES[self.greedy(s)]
        return out


class QRule(Policy):
    """Picks a rule per request from a Q-table; ``learn=True`` explores and updates the table."""

    name = "xpud-q"
    cacheable = False

    def __init__(
        self,
        table: QTable | None = None,
        *,
        learn: bool = False,
        epsilon: float = 0.1,
        alpha: float = 0.1,
        gamma: float = 0.95,
        seed: int = 0,
        reward: str = "frag",
    ):
        super().__init__()
        self.table = table or QTable.empty()
        self.rules = make_rules()
        self.learn = learn
        self.epsilon, self.alpha, self.gamma = epsilon, alpha, gamma
        self.rng = np.random.default_rng(seed)
        self.reward = reward
        self._last: tuple[int, int, float] | None = None  # state, action, reward of the previous decision
        self._scorer = self.rules[0]

    def observe(self, d):
        for r in self.rules:
            r.observe(d)

    def placed(self, state, d, p):
        for r in self.rules:
            r.placed(state, d, p)

    def removed(self, state, d, p):
        for r in self.rules:
            r.removed(state, d, p)

    def choose(self, state: ClusterState, d: Demand, rng) -> Placement | None:
        s = state_of(state, d)
        if self.learn and self.rng.random() < self.epsilon:
            a = int(self.rng.integers(len(self.rules)))
        else:
            a = self.table.greedy(s)
        p = self.rules[a].choose(state, d, rng)
        if self.learn:
            self._update(s)
            if p is None:
                reward = -d.gpu_total_milli / 1000.0
            elif self.reward == "alloc":
                reward = d.gpu_total_milli / 1000.0
            else:
                saved, _ = self._scorer.saved(state, d, np.array([p.host]))
                col = p.cards[0] if d.fractional else 0
                reward = float(saved[0, col]) / 1000.0
            self._last = (s, a, reward)
        self.table.visits[s, a] += 1
        return p

    def _update(self, s_next: int) -> None:
        if self._last is None:
            return
        s, a, r = self._last
        q = self.table.q
        q[s, a] += self.alpha * (r + self.gamma * q[s_next].max() - q[s, a])

    def finish(self) -> None:
        """End of an episode: the last decision has no successor."""
        if self._last is not None:
            s, a, r = self._last
            self.table.q[s, a] += self.alpha * (r - self.table.q[s, a])
            self._last = None


def train(
    hosts: Sequence[Host],
    episodes: Sequence[Sequence[Demand]],
    *,
    epsilon: float = 0.1,
    seed: int = 0,
    reward: str = "frag",
) -> QTable:
    """Learn a table by replaying each arrival sequence in ``episodes`` once (tasks that fit nowhere drop)."""
    table = QTable.empty()
    base = ClusterState(hosts)
    for n, seq in enumerate(episodes):
        state = base.copy()
        rng = np.random.default_rng([seed, n])
        state.shuffle_ties(rng)
        agent = QRule(table, learn=True, epsilon=epsilon, seed=seed * 7919 + n, reward=reward)
        for d in seq:
            agent.observe(d)
            p = agent.choose(state, d, rng)
            if p is not None:
                state.place(d, p)
                agent.placed(state, d, p)
        agent.finish()
    return table
