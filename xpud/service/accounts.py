"""Accounts at the service (issue #33): which account a request is charged to, from the caller's peer
credentials (uid, gid: its user name and groups) and ``--account``.

Bridges' leases go to ``[accounts] slurm_account`` (anchored to a Slurm job) and ``kubernetes_account``
(to a pod); an operator acting for another uid may name any account; everyone else only their own.
"""

from __future__ import annotations

import pwd
from typing import Any

from xpud.api.auth import user_and_groups
from xpud.api.v1 import xpu_pb2 as pb
from xpud.config import accounts as accounts_config
from xpud.config.schema import Config
from xpud.errors import BadRequest
from xpud.model import Caller


def charge(cfg: Config, caller: Caller, asked: str, owner_uid: int, anchor: str = "") -> str:
    """The account a request of ``caller`` for ``owner_uid`` is charged to. Raises BadRequest (one line)
    for an unknown account or one the user is not a member of."""
    if anchor.startswith("slurm:") and not asked:
        return cfg.accounts.slurm_account
    if anchor.startswith("pod:") and not asked:
        return cfg.accounts.kubernetes_account
    if not cfg.named_accounts:  # nobody is a member of anything: no user database to read
        try:
            return accounts_config.resolve({}, asked, "", ())
        except ValueError as e:
            raise BadRequest(str(e)) from None
    gid = caller.gid
    if owner_uid != caller.uid:
        try:
            gid = pwd.getpwuid(owner_uid).pw_gid
        except KeyError:
            gid = -1
    user, groups = user_and_groups(owner_uid, gid)
    on_behalf = caller.admin and owner_uid != caller.uid
    try:
        return accounts_config.resolve(cfg.named_accounts, asked, user, groups, operator=on_behalf)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def accounts_reply(cfg: Config, controller: Any) -> pb.AccountsReply:
    """``ListAccounts``: every account as the controller (``xpud.controllers.accounts.Accounts``) sees it
    across the cluster; ``enabled`` false without [accounts.NAME] (no controller)."""
    if controller is None:
        return pb.AccountsReply(enabled=False, reclaim=cfg.accounts.reclaim)
    controller.accrue()  # as things stand now, not at its last tick
    controller.refresh()
    rows = []
    for r in controller.rows():
        row = pb.AccountRow(
            name=r.name,
            quota=r.quota,
            weight=r.weight,
            parent=r.parent,
            share=round(r.share, 6),
            allocated=round(r.allocated, 6),
            usage_gpu_hours=round(r.usage_gpu_h, 6),
            waiting=round(r.waiting, 6),
            reclaimed_from=r.reclaimed_from,
            reclaimed_for=r.reclaimed_for,
            removed=r.removed,
        )
        if r.limit is not None:
            row.limit = r.limit
        rows.append(row)
    return pb.AccountsReply(
        enabled=True,
        config_hash=controller.config_hash,
        reclaim=cfg.accounts.reclaim,
        capacity=controller.capacity,
        accounts=rows,
    )


REPORT_DAYS = 30  # the window when --since is not given
PEER_TIMEOUT_S = 10.0


async def report(ctx: Any, request: pb.ReportRequest) -> pb.ReportReply:
    """``Report``: every alive host's leases and reclaims in the window (this host's from its ledger, the
    peers' over the peer channel), aggregated by ``request.by``."""
    import asyncio
    import time

    from xpud.api.convert import usage_records_pb
    from xpud.api.v1 import xpu_pb2_grpc as pbg
    from xpud.engine.accounting import usage_records
    from xpud.federation.membership import State
    from xpud.planning.usage_report import BY, Reclaim, Record, aggregate

    by = request.by or "account"
    if by not in BY:
        raise BadRequest(f"--by {by}: use one of {', '.join(BY)}")
    until = request.until or time.time()
    since = request.since or until - REPORT_DAYS * 86400
    if since >= until:
        raise BadRequest(f"--since ({since:.0f}) is not before --until ({until:.0f}): give a window")
    fed = ctx.federation
    name = fed.name if fed is not None else (ctx.info.hostname or "localhost")
    replies = [usage_records_pb(name, *usage_records(ctx.engine, name, since, until))]
    missing = []
    if fed is not None:
        peers = [m for m in fed.members() if m.name != fed.name and m.state is State.ALIVE]

        async def ask(m):
            stub = pbg.PeerStub(fed.channel(m.addr))
            return await stub.UsageRecords(
                pb.UsageRecordsRequest(since=since, until=until), timeout=PEER_TIMEOUT_S
            )

        got = await asyncio.gather(*(ask(m) for m in peers), return_exceptions=True)
        for m, g in zip(peers, got, strict=True):
            if isinstance(g, BaseException):
                details = getattr(g, "details", None)
                why = (details() if callable(details) else "") or str(g) or type(g).__name__
                missing.append(f"{m.name}: {why}"[:200])
            else:
                replies.append(g)
    records = [
        Record(
            r.host,
            x.account,
            x.user,
            x.card_model,
            x.gpus,
            x.start,
            x.end if x.HasField("end") else None,
            x.wait_s,
        )
        for r in replies
        for x in r.records
    ]
    reclaims = [Reclaim(c.at, c.victim, c.beneficiary) for r in replies for c in r.reclaims]
    out = pb.ReportReply(
        by=by,
        since=since,
        until=until,
        hosts=[r.host for r in replies],
        hosts_missing=missing,
        truncated=any(r.truncated for r in replies),
    )
    for row in aggregate(records, reclaims, by, since, until):
        m = out.rows.add(
            key=row.key,
            gpu_hours=row.gpu_hours,
            jobs=row.jobs,
            reclaims_suffered=row.reclaims_suffered,
            reclaims_caused=row.reclaims_caused,
        )
        if row.mean_wait_s is not None:
            m.mean_wait_s = round(row.mean_wait_s, 3)
            m.p95_wait_s = round(row.p95_wait_s, 3)
    return out
