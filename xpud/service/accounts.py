"""Accounts at the service (issue #33): which account a request is charged to, from the caller's peer
credentials (uid, gid: its user name and groups) and ``--account``.

Bridges' leases go to ``[accounts] slurm_account`` (anchored to a Slurm job) and ``kubernetes_account``
(to a pod); an operator acting for another uid may name any account; everyone else only their own.
"""

from __future__ import annotations

import pwd

from xpud.api.auth import user_and_groups
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
