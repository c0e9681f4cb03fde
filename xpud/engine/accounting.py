"""What a request or lease counts against its account (issue #33): GPU-equivalents, a whole card 1, a slice
its memory fraction (``xpud.planning.fairshare.gpu_equivalents``). Pure: the config and the lease in."""

from __future__ import annotations

from xpud.config.accounts import DEFAULT_ACCOUNT
from xpud.config.schema import Config
from xpud.model import Lease, Mode, Request
from xpud.planning.fairshare import gpu_equivalents


def account_of(x: Lease | Request) -> str:
    return x.account or DEFAULT_ACCOUNT


def request_gpus(cfg: Config, req: Request) -> float:
    if req.mode is Mode.XPU:
        return gpu_equivalents(req.gpus)
    spec = cfg.slices.get(req.mode.value)
    return gpu_equivalents(0, [spec.memory_fraction if spec is not None else 1.0])


def lease_gpus(cfg: Config, lease: Lease) -> float:
    if lease.mode is Mode.XPU:
        return gpu_equivalents(len(lease.cards))
    spec = cfg.slices.get(lease.mode.value)
    return gpu_equivalents(0, [spec.memory_fraction if spec is not None else 1.0 for _ in lease.slices])


def allocation(cfg: Config, leases) -> dict[str, float]:
    """Account -> GPU-equivalents its ``leases`` hold."""
    out: dict[str, float] = {}
    for lease in leases:
        a = account_of(lease)
        out[a] = out.get(a, 0.0) + lease_gpus(cfg, lease)
    return out


MAX_RECORDS = 20_000  # leases one host sends for one report


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def usage_records(engine, host: str, since: float, until: float) -> tuple[list, list, bool]:
    """This host's leases that held cards in [since, until) and its fair-share reclaims then, as
    ``planning.usage_report`` records (card models from this host's cards); and whether leases were left
    out (more than ``MAX_RECORDS``). Reads the ledger (small queries, on the loop as the listings do)."""
    import json

    from xpud.ledger import accounts as ledger_accounts
    from xpud.planning.usage_report import Reclaim, Record

    db = engine.ledger.db
    rows = ledger_accounts.leases_between(db, since, until, MAX_RECORDS + 1)
    models = {i: c.info.name for i, c in engine.cards.items()}
    out = []
    for r in rows[:MAX_RECORDS]:
        cards = json.loads(r["cards"])
        mode = Mode(r["mode"])
        n = len(json.loads(r["slices"])) if mode is not Mode.XPU else len(cards)
        gpus = gpu_equivalents(n) if mode is Mode.XPU else _slice_gpus(engine.cfg, mode, n)
        out.append(
            Record(
                host,
                r["account"] or DEFAULT_ACCOUNT,
                _user(r["owner_uid"]),
                models.get(cards[0], "?") if cards else "?",
                gpus,
                float(r["created"]),
                None if r["ended"] is None else float(r["ended"]),
                float(r["queued_s"] or 0.0),
            )
        )
    reclaims = [Reclaim(*x) for x in ledger_accounts.reclaims_between(db, since, until, MAX_RECORDS)]
    return out, reclaims, len(rows) > MAX_RECORDS


def _slice_gpus(cfg: Config, mode: Mode, n: int) -> float:
    spec = cfg.slices.get(mode.value)
    return gpu_equivalents(0, [spec.memory_fraction if spec is not None else 1.0] * n)
