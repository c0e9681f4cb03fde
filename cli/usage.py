"""`xpu leases --usage`: requested vs used per lease (the daemon's right-sizing measurements)."""

from __future__ import annotations

from xpu_cli import output, vocab


def _pct(v: float) -> str:
    return "-" if v < 0 else f"{v:.0f}%"


def _gib(v: int) -> str:
    return "-" if v < 0 else f"{vocab.gib(v)}G"


def show_usage(reply, as_json: bool) -> None:
    if as_json:
        return output.print_json(reply)
    rows = [
        [
            r.lease_id,
            r.mode + (" (auto)" if r.auto else ""),
            r.job_class,
            f"{r.cap_pct:.0f}%",
            _pct(r.used_pct),
            _pct(r.peak_pct),
            f"{_gib(r.mem_used_bytes)}/{_gib(r.mem_cap_bytes)}",
            output.Styled("AT CAP", "red") if r.throttled else "no",
            r.auto_moves,
            r.recommendation.split(": ", 1)[-1] if r.recommendation else "",
        ]
        for r in reply.rows
    ]
    output.table(
        ["LEASE", "MODE", "CLASS", "CAP", "USED", "PEAK", "MEMORY", "THROTTLED", "MOVES", "ADVICE"],
        rows,
        optional=["CLASS", "MOVES", "ADVICE"],
    )
    output.note(
        "USED/PEAK: compute of the card (peak: 90th percentile); '-': not measured (MIG: no per-process use)"
    )
