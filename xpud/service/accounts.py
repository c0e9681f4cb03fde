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
