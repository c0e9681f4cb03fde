"""`xpu simulate`: replay an openb-format trace through the placement policies and print the allocation table.

The CLI's main module adds the command with ``register(app)``. Everything here is parsing and printing;
the replay lives in ``xpud.sim``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

# Only light modules here (no NumPy): the CLI imports this one for every command. The replay, the
# policies and the report are imported inside the command.
from xpud.placement.names import (
    CPU_RESERVE_MODES,
    DEFAULT_CPU_RESERVE,
    DEFAULT_POLICY,
    DESCRIPTIONS,
    POLICY_NAMES,
    PROFILE_SETS,
    canonical_policy,
)
from xpud.sim.defaults import (
    DEFAULT_CLUSTER,
    DEFAULT_RATIO,
    DEFAULT_TRACE,
    OPENB_ENV,
    TraceError,
    default_path,
    parse_seeds,
)

SLICE_MODES = tuple(m for m in PROFILE_SETS if m != "whole")
TENANT_POLICIES = ("fairshare", "quota", "fifo")  # xpud.sim.tenants.POLICIES (NumPy is not imported here)
MAX_TENANTS = 1000
BOUND_POINTS = (100, 130)

HELP = f"""Replay a trace (openb CSV format) through placement policies; print GPU allocation (% of capacity)
as the arrived workload grows from 50 % to 130 % of capacity, averaged over seeds.

Protocol (ATC'23 FGD paper): the trace is shuffled per seed, then tasks resampled from it are appended until
the GPU request reaches {DEFAULT_RATIO}x capacity; tasks only arrive; a task that fits nowhere is dropped.

Defaults: the openb cluster and default trace from ${OPENB_ENV}, or ./shared/data/openb or
../shared/data/openb (the repository layout), else the copy shipped with xpud (Alibaba's openb node list
and default trace, Apache-2.0).

Policies: {", ".join(f"{n} ({d})" for n, (d, _) in DESCRIPTIONS.items())}. The FGD paper's names are
accepted too: bestfit, dotprod, packing, clustering."""


MAX_WORKERS = 256


def _writable(path: Path) -> bool:
    """Whether ``path`` can be written: an existing file we may write, or a new one in a directory we
    may write."""
    if path.exists():
        return path.is_file() and os.access(path, os.W_OK)
    parent = path.parent if str(path.parent) else Path(".")
    return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)


def _fail(message: str, code: int = 1):
    typer.echo(f"xpu: {message}", err=True)
    raise typer.Exit(code)


def _policies(values: list[str] | None) -> tuple[str, ...]:
    names: list[str] = []
    for v in values or [DEFAULT_POLICY]:
        for part in v.split(","):
            part = part.strip()
            if part.lower() == "all":
                names.extend(POLICY_NAMES)
            elif canonical_policy(part):
                names.append(canonical_policy(part))
            elif part:
                raise typer.BadParameter(
                    f"unknown policy {part!r}: choose from {', '.join(POLICY_NAMES)} or all "
                    "(the FGD paper's names work too: bestfit, dotprod, packing, clustering)"
                )
    return tuple(dict.fromkeys(names))


def simulate(
    cluster: Annotated[
        Path | None,
        typer.Option(
            help=f"Node list CSV (sn, cpu_milli, memory_mib, gpu, model). Default: {DEFAULT_CLUSTER}."
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            help=f"Pod list CSV (name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec]). "
            f"Default: {DEFAULT_TRACE}."
        ),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option("--policy", help=f"Policy; repeat or comma-separate; 'all'. Default: {DEFAULT_POLICY}."),
    ] = None,
    seeds: Annotated[str, typer.Option(help="Seeds: 42-51, or 42,43,...")] = "42-51",
    slices: Annotated[
        str,
        typer.Option(
            help=f"Slice sizes: {', '.join(SLICE_MODES)} (free = any size, as MPS; others round "
            "fractional requests up, as fixed MIG-like profiles)."
        ),
    ] = "free",
    defrag: Annotated[
        bool, typer.Option("--defrag", help="Let restartable tasks move when a task fits nowhere.")
    ] = False,
    move_budget: Annotated[
        float,
        typer.Option("--move-budget", metavar="PCT", help="With --defrag: moves allowed, % of tasks placed."),
    ] = 1.0,
    move_whole: Annotated[
        bool | None,
        typer.Option(
            "--move-whole/--no-move-whole",
            help="With --defrag: whole-card tasks may move too and "
            "small groups of hosts may be repacked (default: when --move-budget > 1).",
        ),
    ] = None,
    swaps: Annotated[
        bool,
        typer.Option(
            "--swaps/--no-swaps",
            help="With --defrag: when no eviction makes room, a task may trade places with one of the same "
            "GPU shape that needs less CPU/memory (two moves).",
        ),
    ] = True,
    cpu_reserve: Annotated[
        str,
        typer.Option(
            "--cpu-reserve",
            metavar="MODE",
            help="xpud and CPU-only tasks: "
            + "; ".join(f"{k} = {v}" for k, v in CPU_RESERVE_MODES.items())
            + ". A host's reserve is the CPU its free GPUs need at the CPU-per-GPU ratio of the GPU tasks "
            f"seen so far. Default: {DEFAULT_CPU_RESERVE}.",
        ),
    ] = DEFAULT_CPU_RESERVE,
    plot: Annotated[
        str | None,
        typer.Option(
            metavar="FILE.png|term", help="Write the curves as a PNG, or 'term' for a terminal chart."
        ),
    ] = None,
    bound: Annotated[
        bool,
        typer.Option(
            "--bound",
            help="Also compute the packing upper bound (MILP) and an offline packing "
            "(at 100 and 130 % arrived).",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON rows instead of the table.")] = False,
    save: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE.json", help="Also write the configuration, table, per-policy facts and rows."
        ),
    ] = None,
    extras: Annotated[
        bool,
        typer.Option("--extras", help="With --json: add occupied_pct (and moves with --defrag) to each row."),
    ] = False,
    ratio: Annotated[
        float, typer.Option(help="Grow the workload to this multiple of GPU capacity.")
    ] = DEFAULT_RATIO,
    workers: Annotated[int, typer.Option(help="Worker processes (0 = one per CPU).")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
    tenants: Annotated[
        int | None,
        typer.Option(
            help="Accounts sharing the cluster: replay the trace in time (creation and deletion times) "
            f"with policies {', '.join(TENANT_POLICIES)} instead (docs: bench/fairshare.md).",
        ),
    ] = None,
    tenant_skew: Annotated[
        float, typer.Option(help="With --tenants: Zipf exponent of the tasks' accounts (0 = uniform).")
    ] = 1.0,
    gpus: Annotated[
        int, typer.Option(help="With --tenants: cards in the cluster (a pool; hosts not modelled).")
    ] = 32,
    restartable: Annotated[
        str,
        typer.Option(help="With --tenants: which tasks may be reclaimed: be (QoS BE), all, none."),
    ] = "be",
    reclaim_grace: Annotated[
        float,
        typer.Option(
            metavar="SECONDS", help="With --tenants: an account that got cards back is spared this long."
        ),
    ] = 300.0,
) -> None:
    if tenants is not None:
        return _tenants(
            trace,
            policy,
            seeds,
            tenants,
            tenant_skew,
            gpus,
            restartable,
            reclaim_grace,
            json_out,
            quiet,
            refused={
                "--defrag": defrag,
                "--bound": bound,
                "--plot": plot,
                "--save": save,
                "--extras": extras,
            },
        )
    from xpud.sim import report as rep
    from xpud.sim.runner import SimConfig, run

    try:
        names = _policies(policy)
        seed_list = parse_seeds(seeds)
    except ValueError as e:
        _fail(str(e), 2)
    except typer.BadParameter as e:
        _fail(str(e), 2)
    if cpu_reserve not in CPU_RESERVE_MODES:
        _fail(f"unknown --cpu-reserve {cpu_reserve!r}: choose one of {', '.join(CPU_RESERVE_MODES)}", 2)
    if slices not in SLICE_MODES:
        _fail(f"unknown --slices {slices!r}: choose one of {', '.join(SLICE_MODES)}", 2)
    if not 0 < ratio <= 10:
        _fail(f"--ratio must be in (0, 10], got {ratio}", 2)
    if not 0 <= move_budget <= 100:  # nan too
        _fail(f"--move-budget is a percentage of the tasks, 0 to 100; got {move_budget}", 2)
    if not 0 <= workers <= MAX_WORKERS:
        _fail(f"--workers must be 0 (one per core) to {MAX_WORKERS}, got {workers}", 2)
    if plot and plot != "term" and not plot.lower().endswith(".png"):
        _fail(f"--plot takes a .png file name or 'term', got {plot!r}", 2)
    for flag, out in (("--save", save), ("--plot", Path(plot) if plot and plot != "term" else None)):
        if out is not None and not _writable(out):  # said now, not after a replay of many minutes
            _fail(f"{flag} {out}: cannot write there (no such directory, or no permission)", 2)
    cfg = SimConfig(
        cluster=cluster or default_path(DEFAULT_CLUSTER),
        trace=trace or default_path(DEFAULT_TRACE),
        policies=names,
        seeds=seed_list,
        slices=slices,
        ratio=ratio,
        defrag=defrag,
        move_budget_pct=move_budget,
        move_whole=move_whole,
        swaps=swaps,
        cpu_reserve=cpu_reserve,
        bound_points=BOUND_POINTS if bound else (),
        workers=workers,
    )
    started = time.perf_counter()
    say = (lambda _m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"replaying {len(names)} polic{'y' if len(names) == 1 else 'ies'} x {len(seed_list)} seeds ...")
    try:
        report = run(cfg, progress=say)
    except TraceError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    say(f"done in {time.perf_counter() - started:.1f} s")
    if json_out:
        typer.echo(json.dumps(rep.json_rows(report, extras=extras)))
    else:
        typer.echo(rep.table(report))
        if slices != "free" or "whole-only" in names:
            typer.echo("\nshare held on cards, rounding waste included (%):")
            typer.echo("\n".join(rep.table(report, occupied=True).splitlines()[1:]))
        if defrag:
            typer.echo("\nmoves (mean per replay):")
            typer.echo(rep.moves_table(report))
        typer.echo("\nCPU-only tasks not placed (mean per replay):")
        typer.echo(rep.cpu_only_table(report))
    if save is not None:
        try:
            save.write_text(json.dumps(rep.summary(report), indent=1) + "\n")
        except OSError as e:
            _fail(f"cannot write {save}: {e.strerror}")
        say(f"wrote {save}")
    if plot == "term":
        print(rep.plot_terminal(report), file=sys.stderr if json_out else sys.stdout)
    elif plot:
        try:
            rep.plot_png(report, Path(plot))
        except OSError as e:
            _fail(f"cannot write {plot}: {e.strerror}")
        say(f"wrote {plot}")


def _tenants(trace, policy, seeds, tenants, skew, gpus, restartable, grace, json_out, quiet, refused) -> None:
    """``xpu simulate --tenants N``: accounts sharing ``gpus`` cards, the trace replayed in time."""
    for flag, value in refused.items():
        if value:
            _fail(f"{flag} does not go with --tenants (the in-time replay of accounts)", 2)
    names: list[str] = []
    for v in policy or [",".join(TENANT_POLICIES)]:
        for part in (p.strip() for p in v.split(",")):
            if part not in TENANT_POLICIES:
                _fail(f"unknown policy {part!r} with --tenants: choose from {', '.join(TENANT_POLICIES)}", 2)
            names.append(part)
    try:
        seed_list = parse_seeds(seeds)
    except ValueError as e:
        _fail(str(e), 2)
    if not 1 <= tenants <= MAX_TENANTS:
        _fail(f"--tenants must be 1 to {MAX_TENANTS}, got {tenants}", 2)
    if not 0 <= skew <= 10:  # nan too
        _fail(f"--tenant-skew is a Zipf exponent from 0 (uniform) to 10, got {skew}", 2)
    if not 1 <= gpus <= 100_000:
        _fail(f"--gpus must be 1 to 100000, got {gpus}", 2)
    if restartable not in ("be", "all", "none"):
        _fail(f"--restartable must be be, all or none, got {restartable!r}", 2)
    if not 0 <= grace <= 86400:
        _fail(f"--reclaim-grace is seconds from 0 to 86400, got {grace}", 2)
    from xpud.sim import tenant_report
    from xpud.sim import tenants as tn

    say = (lambda _m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        tasks = tn.with_restartable(tn.load_timed(trace or default_path(DEFAULT_TRACE)), restartable)
    except TraceError as e:
        _fail(str(e))
    say(f"replaying {len(tasks)} GPU tasks in time: {len(names)} policies x {len(seed_list)} seeds ...")
    try:
        results = tn.run(
            tasks,
            tenants=tenants,
            skew=skew,
            gpus=gpus,
            policies=tuple(dict.fromkeys(names)),
            seeds=seed_list,
            grace_s=grace,
            progress=say,
        )
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if json_out:
        typer.echo(json.dumps(tenant_report.json_rows(results, restartable)))
    else:
        typer.echo(tenant_report.table(results))


def register(app: typer.Typer) -> None:
    """Add the ``simulate`` command to the ``xpu`` application."""
    app.command("simulate", help=HELP, no_args_is_help=False)(simulate)
