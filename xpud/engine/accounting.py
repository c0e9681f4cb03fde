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
