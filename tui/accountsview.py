"""The accounts (issue #33) under the leases: each account's quota, limit, deserved share, what it holds and
waits for across the cluster, and the reclaims this host made from and for it. What ``ListAccounts``
returns (``xpu accounts``), asked every few seconds; hidden when the daemon has no ``[accounts.NAME]``.
"""

from __future__ import annotations

from textual.widgets import DataTable
from xpu_tui.tablesync import sync_rows

from xpud.api.v1 import xpu_pb2 as pb

ACCOUNT_COLUMNS = ("ACCOUNT", "QUOTA", "LIMIT", "SHARE", "ALLOC", "WAITING", "RECLAIMED FROM/FOR")


def amount(x: float) -> str:
    """GPU-equivalents as ``xpu accounts`` prints them: at most two decimals, no trailing zeros."""
    return f"{x:.2f}".rstrip("0").rstrip(".") or "0"


def account_row(a: pb.AccountRow) -> list:
    name = a.name if not a.parent else f"{a.parent}/{a.name}"
    return [
        name + (" (removed)" if a.removed else ""),
        amount(a.quota),
        amount(a.limit) if a.HasField("limit") else "-",
        amount(a.share),
        amount(a.allocated),
        amount(a.waiting),
        f"{a.reclaimed_from}/{a.reclaimed_for}",
    ]


class AccountsTable(DataTable):
    """One row per account; not shown while the daemon has no accounts (or has not answered yet)."""

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", show_cursor=False, **kw)
        self.can_focus = False  # read-only: the focus belongs to the lease table
        self.border_title = "accounts"
        self.display = False
        self.reply: pb.AccountsReply | None = None

    def on_mount(self) -> None:
        self.add_columns(*ACCOUNT_COLUMNS)
        if self.reply is not None:
            self.show(self.reply)

    def show(self, reply: pb.AccountsReply) -> None:
        self.reply = reply
        if not self.is_mounted:
            return  # on_mount shows it
        self.display = reply.enabled
        if not reply.enabled:
            return
        sync_rows(self, [(a.name, account_row(a)) for a in reply.accounts])
        self.border_title = (
            f"accounts ({amount(reply.capacity)} GPU-equivalents in the cluster; reclaim {reply.reclaim})"
        )
