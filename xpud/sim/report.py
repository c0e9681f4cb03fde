"""Presenting a :class:`~xpud.sim.runner.SimReport`: the allocation table, JSON rows, a chart.

Numbers are percentages of the cluster's GPU capacity, averaged over seeds.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from xpud.sim.runner import SimReport

TABLE_POINTS = (50, 60, 70, 80, 90, 95, 100, 110, 120, 130)


def table(report: SimReport, points: Sequence[int] = TABLE_POINTS, *, occupied: bool = False) -> str:
    """Rows: policy; columns: arrived workload %; cells: mean allocation % over seeds (useful share, or
    the share held on cards with ``occupied``)."""
    head = f"{'policy':<16}" + "".join(f"{p:>8}" for p in points)
    lines = [f"{'':<16}{'GPU allocation (%) at arrived workload (%) of capacity':>{8 * len(points)}}", head]
    for name in report.policies():
        m = report.curves(name, occupied).mean(axis=0)
        lines.append(f"{name:<16}" + "".join(f"{m[p]:>8.2f}" for p in points))
    if report.bounds:
        seeds = report.config.seeds
        cells = []
        for p in points:
            vals = [report.bounds[(s, p)].pct for s in seeds if (s, p) in report.bounds]
            cells.append(f"{np.mean(vals):>8.2f}" if vals else f"{'':>8}")
        lines.append(f"{'bound (MILP)':<16}" + "".join(cells))
        cells = []
        for p in points:
            vals = [report.offline[(s, p)] for s in seeds if (s, p) in report.offline]
            cells.append(f"{np.mean(vals):>8.2f}" if vals else f"{'':>8}")
        lines.append(f"{'offline packing':<16}" + "".join(cells))
    return "\n".join(lines)


def moves_table(report: SimReport) -> str:
    """Per policy: mean moves, distinct tasks moved (% of placed), moved GPU share (% of capacity)."""
    lines = [f"{'policy':<16}{'moves':>8}{'tasks moved':>13}{'% of placed':>13}{'GPU moved %':>13}"]
    for name in report.policies():
        rs = [r for r in report.results if r.policy == name]
        moves = np.mean([r.moves for r in rs])
        moved = np.mean([r.moved_tasks for r in rs])
        pct = np.mean([100.0 * r.moved_tasks / max(r.placed, 1) for r in rs])
        gpu = np.mean([100.0 * r.moved_gpu_milli / report.capacity_milli for r in rs])
        lines.append(f"{name:<16}{moves:>8.1f}{moved:>13.1f}{pct:>13.2f}{gpu:>13.2f}")
    return "\n".join(lines)


def cpu_only_table(report: SimReport, points: Sequence[int] = (80, 100, 130)) -> str:
    """Per policy: CPU-only tasks dropped (fit nowhere) and refused (fit, but only in GPU hosts' reserved
    CPU: ``--cpu-reserve reserve``) by each arrived point, with their cores."""
    head = "".join(f"{f'dropped@{p}':>12}{f'refused@{p}':>12}" for p in points)
    lines = [f"{'policy':<16}{head}{'cores dropped/refused @130':>29}"]
    for name in report.policies():
        rs = [r for r in report.results if r.policy == name]
        cells = "".join(
            f"{np.mean([r.cpu_only_dropped_curve[p] for r in rs]):>12.1f}"
            f"{np.mean([r.refused_curve[p] for r in rs]):>12.1f}"
            for p in points
        )
        cores = (
            f"{np.mean([r.cpu_only_dropped_cpu_curve[-1] for r in rs]) / 1000:.0f}"
            f" / {np.mean([r.refused_cpu_curve[-1] for r in rs]) / 1000:.0f}"
        )
        lines.append(f"{name:<16}{cells}{cores:>29}")
    return "\n".join(lines)


def json_rows(report: SimReport, *, extras: bool = False) -> list[dict]:
    """One row per policy, seed and integer arrived percentage (0..130)::

        {"policy": "xpud", "seed": 42, "arrived_pct": 100, "alloc_pct": 95.65}

    ``extras`` adds ``occupied_pct`` (share held on cards, rounding waste included) and, after a replay
    with moves, ``moves`` (moves so far).
    """
    rows = []
    for r in report.results:
        for x in range(len(r.alloc_pct)):
            row = {
                "policy": r.policy,
                "seed": r.seed,
                "arrived_pct": x,
                "alloc_pct": round(float(r.alloc_pct[x]), 4),
            }
            if extras:
                row["occupied_pct"] = round(float(r.occupied_pct[x]), 4)
                if r.moves_curve is not None:
                    row["moves"] = int(r.moves_curve[x])
            rows.append(row)
    return rows


def summary(report: SimReport, points: Sequence[int] = TABLE_POINTS) -> dict:
    """Everything a bench file records: configuration, mean table, per-policy facts, bounds, and rows."""
    cfg = report.config
    out: dict = {
        "cluster": str(cfg.cluster),
        "trace": str(cfg.trace),
        "seeds": list(cfg.seeds),
        "slices": cfg.slices,
        "ratio": cfg.ratio,
        "defrag": cfg.defrag,
        "move_budget_pct": cfg.move_budget_pct if cfg.defrag else None,
        "move_whole": (cfg.move_whole if cfg.move_whole is not None else cfg.move_budget_pct > 1.0)
        if cfg.defrag
        else None,
        "swaps": cfg.swaps if cfg.defrag else None,
        "cpu_reserve": cfg.cpu_reserve,
        "hosts": report.hosts,
        "tasks_in_trace": report.tasks,
        "capacity_gpus": report.capacity_milli / 1000,
        "table": {},
        "policies": {},
    }
    for name in report.policies():
        m = report.curves(name).mean(axis=0)
        occ = report.curves(name, occupied=True).mean(axis=0)
        rs = [r for r in report.results if r.policy == name]
        out["table"][name] = {str(p): round(float(m[p]), 3) for p in points}
        out["policies"][name] = {
            "occupied_pct": {str(p): round(float(occ[p]), 3) for p in points},
            "per_seed_at_100": [round(float(r.alloc_pct[100]), 3) for r in rs],
            "per_seed_at_130": [round(float(r.alloc_pct[130]), 3) for r in rs],
            "replay_wall_s_mean": round(float(np.mean([r.wall_s for r in rs])), 2),
            "tasks_mean": float(np.mean([r.tasks for r in rs])),
            "dropped_mean": float(np.mean([r.dropped for r in rs])),
            "refused_mean": float(np.mean([r.refused for r in rs])),
            "cpu_only_dropped_mean": float(np.mean([r.cpu_only_dropped for r in rs])),
            "moves_mean": float(np.mean([r.moves for r in rs])),
            "moved_tasks_pct_of_placed": round(
                float(np.mean([100.0 * r.moved_tasks / max(r.placed, 1) for r in rs])), 3
            ),
            "moved_gpu_pct_of_capacity": round(
                float(np.mean([100.0 * r.moved_gpu_milli / report.capacity_milli for r in rs])), 3
            ),
        }
    if report.bounds:
        out["bound"] = {
            str(p): {
                "milp_pct": round(float(np.mean([report.bounds[(s, p)].pct for s in cfg.seeds])), 3),
                "all_exact": all(report.bounds[(s, p)].exact for s in cfg.seeds),
                "offline_packing_pct": round(float(np.mean([report.offline[(s, p)] for s in cfg.seeds])), 3),
            }
            for p in cfg.bound_points
        }
    # Per-seed curves, arrived 50..130 % (``xpu simulate --json`` gives the same as rows).
    span = slice(50, 131)
    out["curves_from_pct"] = 50
    out["curves"] = {
        name: {
            str(r.seed): [round(float(v), 3) for v in r.alloc_pct[span]]
            for r in report.results
            if r.policy == name
        }
        for name in report.policies()
    }
    if cfg.slices != "free" or any(r.policy == "whole-only" for r in report.results):
        out["occupied_curves"] = {
            name: {
                str(r.seed): [round(float(v), 3) for v in r.occupied_pct[span]]
                for r in report.results
                if r.policy == name
            }
            for name in report.policies()
        }
    if cfg.defrag:
        out["moves_curves"] = {
            name: {
                str(r.seed): [int(v) for v in r.moves_curve[span]] for r in report.results if r.policy == name
            }
            for name in report.policies()
        }
    return out


def plot_png(report: SimReport, path: Path, title: str = "") -> None:
    """Mean allocation curves, arrived 50..130 %, as a PNG (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(50, 131)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for name in report.policies():
        ax.plot(x, report.curves(name).mean(axis=0)[50:131], label=name, lw=2.2 if name == "xpud" else 1.2)
    ax.plot(x, x, ls=":", color="grey", lw=0.8, label="arrived")
    ax.set_xlabel("arrived workload (% of GPU capacity)")
    ax.set_ylabel("GPU allocation (% of capacity)")
    ax.set_ylim(80, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title or f"{report.tasks} tasks, {report.hosts} hosts, {len(report.config.seeds)} seeds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_terminal(report: SimReport, columns: int | None = None, height: int = 12) -> str:
    """The mean curves as characters (one letter per policy, ``*`` where several meet), fitted to
    ``columns`` (default: the terminal's width): arrived 50..130 % on the full vertical range, then
    100..130 % zoomed on its own range, where the curves separate. Every point is drawn on the row of its
    value: none is pinned to an edge of a chart."""
    if columns is None:
        columns = shutil.get_terminal_size((100, 24)).columns
    width = max(21, min(81, columns - 9))  # 8 columns of y labels and the axis, 1 to spare
    names = report.policies()
    means = {n: report.curves(n).mean(axis=0)[50:131] for n in names}
    marks: dict[str, str] = {}
    for n in names:
        marks[n] = next(
            (ch for ch in n + "abcdefghijklmnopqrstuvwxyz" if ch.isalnum() and ch not in marks.values()), "*"
        )
    lines = _panel({marks[n]: m for n, m in means.items()}, 50, 130, width, height)
    lines += _panel({marks[n]: m[50:] for n, m in means.items()}, 100, 130, width, height)
    lines.append(" " * 8 + "x: arrived workload, % of capacity; y: GPU allocation %")
    legend, line = [], " "
    for item in [*(f"{marks[n]}={n}" for n in names), "*=several"]:
        if len(line) + len(item) + 2 > columns and line.strip():
            legend.append(line.rstrip())
            line = " "
        line += " " + item + " "
    legend.append(line.rstrip())
    return "\n".join(lines + legend)


def _panel(curves: dict[str, np.ndarray], first: int, last: int, width: int, height: int) -> list[str]:
    """One chart: ``curves`` (mark -> values at arrived ``first``..``last`` %) on a range that holds them."""
    every = np.concatenate(list(curves.values()))
    lo, hi = float(every.min()), float(every.max())
    pad = max((hi - lo) * 0.05, 0.05)
    lo, hi = lo - pad, hi + pad
    grid = [[" "] * width for _ in range(height)]
    span = last - first
    for mark, values in curves.items():
        for col in range(width):
            v = float(values[round(col * span / (width - 1))])
            row = round((hi - v) / (hi - lo) * (height - 1))
            grid[row][col] = mark if grid[row][col] in (" ", mark) else "*"
    digits = 2 if hi - lo < 5 else 1
    lines = [f"{hi - (hi - lo) * r / (height - 1):6.{digits}f} |" + "".join(g) for r, g in enumerate(grid)]
    lines.append(" " * 7 + "+" + "-" * width)
    mid, ends = (width - 1) // 2, (f"{first}", f"{(first + last) // 2}", f"{last}")
    axis = ends[0].ljust(mid - len(ends[1]) // 2) + ends[1]
    lines.append(" " * 8 + axis.ljust(width - len(ends[2])) + ends[2])
    return lines
