"""Presenting ``xpu simulate --tenants`` replays (``xpud.sim.tenants``): Jain's index, the p95, the JSON
rows (docs/json.md ``TenantRow``) and the table (means over seeds)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TenantResult:
    policy: str
    seed: int
    tenants: int
    skew: float
    gpus: int
    jain_fairness: float
    alloc_pct: float
    p95_wait_s: float
    reclaimed_pct: float
    tasks: int
    reclaims: int  # stops, a task reclaimed twice counted twice
    ratios: list[float] = field(default_factory=list)  # received / deserved GPU-time per account
    wall_s: float = 0.0


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one has everything."""
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return 1.0
    sq = sum(x * x for x in xs)
    return 1.0 if sq == 0 else sum(xs) ** 2 / (len(xs) * sq)


def p95(values: Sequence[float]) -> float:
    return float(np.percentile(values, 95)) if len(values) else 0.0


def json_rows(results: Sequence[TenantResult], restartable: str = "be") -> list[dict]:
    """One row per policy and seed (docs/json.md, ``xpu simulate --tenants``)."""
    return [
        {
            "policy": r.policy,
            "seed": r.seed,
            "tenants": r.tenants,
            "tenant_skew": r.skew,
            "gpus": r.gpus,
            "restartable": restartable,
            "jain_fairness": round(r.jain_fairness, 4),
            "alloc_pct": round(r.alloc_pct, 2),
            "p95_wait_s": round(r.p95_wait_s, 1),
            "reclaimed_pct": round(r.reclaimed_pct, 2),
            "tasks": r.tasks,
            "reclaims": r.reclaims,
        }
        for r in results
    ]


def table(results: Sequence[TenantResult]) -> str:
    """Per policy, the mean over seeds (min..max of Jain's index)."""
    lines = [f"{'policy':<12}{'jain_fairness':>22}{'alloc_pct':>11}{'p95_wait_s':>12}{'reclaimed_pct':>15}"]
    for policy in dict.fromkeys(r.policy for r in results):
        rs = [r for r in results if r.policy == policy]
        js = [r.jain_fairness for r in rs]
        jain_cell = f"{np.mean(js):.4f} ({min(js):.3f}..{max(js):.3f})"
        lines.append(
            f"{policy:<12}{jain_cell:>22}{np.mean([r.alloc_pct for r in rs]):>11.2f}"
            f"{np.mean([r.p95_wait_s for r in rs]):>12.0f}{np.mean([r.reclaimed_pct for r in rs]):>15.2f}"
        )
    return "\n".join(lines)
