"""`xpu simulate --tenants`: accounts sharing a cluster, the trace replayed in time (issue #33). Small
synthetic traces whose right answers are worked out by hand, then the command through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner
from xpu_cli.simulate import register

from tests.test_cli_json import check
from xpud.sim import tenant_report
from xpud.sim import tenants as tn
from xpud.sim.tenants import TimedTask


def task(name, created, duration, *, cards=1, milli=1000, restartable=True):
    return TimedTask(name, cards, milli, float(created), float(duration), restartable)


def test_jain_index():
    assert tenant_report.jain([1.0, 1.0, 1.0]) == 1.0
    assert tenant_report.jain([0.5, 0.5]) == 1.0
    assert tenant_report.jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert tenant_report.jain([2.0, 0.0]) == pytest.approx(0.5)


def test_equal_service_is_fairness_one_under_every_policy():
    """Two accounts, each with two 1-card tasks at once, on 4 cards: everyone is served at once."""
    tasks = [task(f"p{i}", 0, 100) for i in range(4)]
    owners = [0, 1, 0, 1]
    for policy in tn.POLICIES:
        r = tn.replay(tasks, owners, tenants=2, gpus=4, policy=policy)
        assert r.jain_fairness == pytest.approx(1.0)
        assert r.ratios == pytest.approx([1.0, 1.0])
        assert r.alloc_pct == pytest.approx(100.0)
        assert (r.p95_wait_s, r.reclaimed_pct) == (0.0, 0.0)


# Account 0 fills 4 cards with 4 long tasks at t=0; account 1 (quota 2, like account 0) asks for 2 cards
# at t=10 for 100 s. The horizon ends at t=1000 (the last task's end in the trace).
SKEWED = [task(f"a{i}", 0, 1000) for i in range(4)] + [task(f"b{i}", 10, 100) for i in range(2)]
SKEWED_OWNERS = [0, 0, 0, 0, 1, 1]


def test_fifo_is_unfair_on_a_skewed_trace():
    """FIFO: account 1 waits for the end (never runs before it); account 0 receives 4000 GPU-s for a
    deserved 4*10 + 2*990 = 2020; account 1 receives 0 of 1980: Jain = x0^2 / (2 x0^2) = 0.5."""
    r = tn.replay(SKEWED, SKEWED_OWNERS, tenants=2, gpus=4, policy="fifo")
    assert r.ratios == pytest.approx([4000 / 2020, 0.0])
    assert r.jain_fairness == pytest.approx(0.5)
    assert r.p95_wait_s == pytest.approx(990.0)  # censored at the horizon
    assert r.reclaimed_pct == 0.0


@pytest.mark.parametrize("policy", ["fairshare", "quota"])
def test_fair_share_reclaims_and_serves_both_accounts_their_share(policy):
    """At t=10 two of account 0's tasks (restartable) are stopped; account 1 runs 10..110 and then
    account 0 has the cluster again. Account 0: 40 + 200 + 3560 = 3800 received and deserved; account 1:
    200 of 200."""
    r = tn.replay(SKEWED, SKEWED_OWNERS, tenants=2, gpus=4, policy=policy)
    assert r.ratios == pytest.approx([1.0, 1.0])
    assert r.jain_fairness == pytest.approx(1.0)
    assert r.p95_wait_s == 0.0
    assert (r.reclaims, r.reclaimed_pct) == (2, pytest.approx(100 * 2 / 6))
    assert r.alloc_pct == pytest.approx(100.0)


def test_non_restartable_work_is_never_reclaimed():
    tasks = [
        TimedTask(t.name, t.cards, t.milli, t.created, t.duration, t.name.startswith("b")) for t in SKEWED
    ]
    fair = tn.replay(tasks, SKEWED_OWNERS, tenants=2, gpus=4, policy="fairshare")
    fifo = tn.replay(tasks, SKEWED_OWNERS, tenants=2, gpus=4, policy="fifo")
    assert fair.reclaims == 0
    assert fair.ratios == pytest.approx(fifo.ratios)


def test_quota_mode_does_not_reclaim_beyond_the_quota_where_fair_share_does():
    """Three accounts of quota 2 on 6 cards; account 2 is idle, so accounts 0 and 1 deserve 3 each.
    Account 0 holds 6 cards; account 1 asks for 3 at t=10: fair share gives it 3 by reclaim, quota only
    its quota of 2 (the third card only when account 0's work ends)."""
    tasks = [task(f"a{i}", 0, 1000) for i in range(6)] + [task(f"b{i}", 10, 100) for i in range(3)]
    owners = [0] * 6 + [1] * 3
    fair = tn.replay(tasks, owners, tenants=3, gpus=6, policy="fairshare")
    quota = tn.replay(tasks, owners, tenants=3, gpus=6, policy="quota")
    assert fair.reclaims == 3 and quota.reclaims == 2
    assert fair.jain_fairness > quota.jain_fairness


def test_fractional_tasks_count_their_share_of_a_card():
    tasks = [task(f"s{i}", 0, 100, cards=0, milli=250) for i in range(4)] + [task("w", 0, 100)]
    r = tn.replay(tasks, [0, 0, 0, 0, 1], tenants=2, gpus=2, policy="fifo")
    assert r.alloc_pct == pytest.approx(100.0)  # four quarters on one card, one whole card
    assert r.p95_wait_s == 0.0


def test_accounts_are_zipf_skewed_and_seeded():
    a = tn.zipf_accounts(20000, 4, 1.0, 42)
    counts = [int((a == k).sum()) for k in range(4)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] / 20000 == pytest.approx(1 / (1 + 1 / 2 + 1 / 3 + 1 / 4), abs=0.02)
    assert (tn.zipf_accounts(100, 4, 1.0, 42) == tn.zipf_accounts(100, 4, 1.0, 42)).all()
    uniform = tn.zipf_accounts(20000, 4, 0.0, 1)
    assert all(abs((uniform == k).mean() - 0.25) < 0.02 for k in range(4))


TRACE = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
    "scheduled_time\n"
    + "".join(
        f"p{i},1000,1024,{1 if i % 5 else 0},{[1000, 500, 1000, 250, 1000][i % 5]},,"
        f"{'BE' if i % 2 else 'LS'},Running,{i * 30},{i * 30 + 600 + (i % 7) * 100},{i * 30}\n"
        for i in range(80)
    )
)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    p = tmp_path / "trace.csv"
    p.write_text(TRACE)
    return p


@pytest.fixture
def app() -> typer.Typer:
    a = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @a.callback()
    def _root() -> None:
        pass

    register(a)
    return a


def invoke(app, *args: str):
    return CliRunner().invoke(app, ["simulate", *args])


def test_the_command_prints_documented_json_rows_per_policy_and_seed(app, trace):
    r = invoke(app, "--trace", str(trace), "--tenants", "3", "--gpus", "4", "--seeds", "1-2", "--json", "-q")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(x["seed"], x["policy"]) for x in rows] == [
        (s, p) for s in (1, 2) for p in ("fairshare", "quota", "fifo")
    ]
    for row in rows:
        check(row, "TenantRow")
        assert 1 / 3 - 1e-9 <= row["jain_fairness"] <= 1.0
        assert (row["tenants"], row["gpus"], row["tasks"], row["restartable"]) == (3, 4, 64, "be")
    assert all(x["reclaims"] == 0 for x in rows if x["policy"] == "fifo")


def test_the_command_prints_a_table(app, trace):
    r = invoke(
        app, "--trace", str(trace), "--tenants", "2", "--gpus", "2", "--seeds", "3", "--policy", "fifo"
    )
    assert r.exit_code == 0, r.output
    head, row = r.stdout.strip().splitlines()
    assert head.split() == ["policy", "jain_fairness", "alloc_pct", "p95_wait_s", "reclaimed_pct"]
    assert row.split()[0] == "fifo"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--tenants", "0"], "--tenants must be 1 to 1000"),
        (["--tenants", "2", "--tenant-skew", "nan"], "--tenant-skew is a Zipf exponent"),
        (["--tenants", "2", "--tenant-skew", "-1"], "--tenant-skew is a Zipf exponent"),
        (["--tenants", "2", "--gpus", "0"], "--gpus must be 1 to 100000"),
        (["--tenants", "2", "--policy", "fgd"], "unknown policy 'fgd' with --tenants"),
        (["--tenants", "2", "--restartable", "some"], "--restartable must be be, all or none"),
        (["--tenants", "2", "--reclaim-grace", "inf"], "--reclaim-grace is seconds"),
        (["--tenants", "2", "--defrag"], "--defrag does not go with --tenants"),
        (["--tenants", "2", "--seeds", "x"], "bad seed list"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(app, trace, args, words):
    r = invoke(app, "--trace", str(trace), *args)
    assert r.exit_code == 2, r.output
    assert words in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_trace_without_times_is_one_line(app, tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,1000\n")
    r = invoke(app, "--trace", str(p), "--tenants", "2")
    assert r.exit_code == 1
    assert "missing column(s) creation_time, deletion_time" in r.output
