"""``[accounts]`` and ``[accounts.NAME]`` in xpud.toml: teams, their quotas, limits and weights (issue #33).

``[accounts]`` holds the site-wide keys (``AccountsSection``, checked like every other section);
``[accounts.NAME]`` tables declare one account each (``Account``). Amounts are GPU-equivalents across the
cluster: a whole card is 1, a slice its memory fraction. The fair-share arithmetic lives in
``xpud.planning.fairshare``; this module only reads and checks.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_ACCOUNT = "default"  # where work goes whose user is in no account
MAX_ACCOUNTS = 256  # bounds /metrics' cardinality and the summary each host publishes
MAX_AMOUNT = 1_000_000.0  # GPU-equivalents: above any cluster
MAX_MEMBERS = 4096
ACCOUNT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# POSIX portable user and group names (useradd's default NAME_REGEX, with capitals allowed)
MEMBER_NAME = re.compile(r"@?[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d|w)\s*")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MIN_HALF_LIFE_S, MAX_HALF_LIFE_S = 60.0, 365 * 86400.0
RECLAIM_MODES = ("fair-share", "quota", "off")


def duration_s(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"`` -> seconds. Raises ValueError."""
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError(f'{text[:40]!r} is not a duration: a number and a unit s, m, h, d or w, e.g. "7d"')
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _check_half_life(text: str) -> str | None:
    try:
        s = duration_s(text)
    except ValueError as e:
        return str(e)
    if not MIN_HALF_LIFE_S <= s <= MAX_HALF_LIFE_S:
        return f"{text!r} is outside 1m..365d; usage decays by half over this time"
    return None


def _check_account_ref(name: str) -> str | None:
    if not ACCOUNT_NAME.fullmatch(name):
        return f"{name[:40]!r} is not an account name: lowercase letters, digits, '_' or '-', at most 32"
    return None


def _key(default: Any, doc: str, **rules: Any) -> Any:
    return field(default=default, metadata={"doc": doc, **rules})


@dataclass(frozen=True)
class AccountsSection:
    """The site-wide keys of ``[accounts]``; the accounts themselves are ``[accounts.NAME]`` tables."""

    usage_half_life: str = _key(
        "7d",
        "Half-life of each account's decayed usage (GPU-hours), as a number and a unit s, m, h, d or w.",
        check=_check_half_life,
    )
    reclaim: str = _key(
        "fair-share",
        "Whether restartable work of accounts above their share is stopped for accounts below it: "
        "fair-share = down to the victim's deserved share; quota = only for accounts below their quota, "
        "down to the victim's quota (KAI's behaviour); off = never.",
        choices=RECLAIM_MODES,
    )
    reclaim_grace_s: float = _key(
        300.0,
        "Seconds an account that just got cards back by reclaim is not reclaimed from (against thrashing).",
        min=0.0,
        max=86400.0,
    )
    slurm_account: str = _key(
        DEFAULT_ACCOUNT,
        "Account charged for the leases of Slurm jobs (xpu slurm prolog).",
        check=_check_account_ref,
    )
    kubernetes_account: str = _key(
        DEFAULT_ACCOUNT,
        "Account charged for the leases of Kubernetes pods (the kubelet bridge).",
        check=_check_account_ref,
    )

    @property
    def half_life_s(self) -> float:
        return duration_s(self.usage_half_life)


# What an [accounts.NAME] table may hold, with its documentation (etc/xpud.toml repeats it).
ACCOUNT_KEYS = {
    "members": "Users and @unix-groups whose work is charged here (a user's first account is the default).",
    "quota": "GPU-equivalents guaranteed across the cluster (a slice counts its memory fraction), 0..1e6.",
    "limit": "GPU-equivalents the account never exceeds (optional; at least quota).",
    "weight": "Share of the capacity left idle beyond the quotas, relative to the other accounts (0..1e6).",
    "parent": "Another account whose share this one is part of (optional; one level of nesting).",
}


@dataclass(frozen=True)
class Account:
    """One ``[accounts.NAME]`` table. ``limit`` None: no limit. ``parent`` "": a top-level account."""

    name: str
    members: tuple[str, ...] = ()
    quota: float = 0.0
    limit: float | None = None
    weight: float = 1.0
    parent: str = ""


def _number(src: Any, table: str, key: str, value: Any, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise src.error(table, key, f"expected a finite number {low:g}..{MAX_AMOUNT:g}, got {value!r}")
    if not low <= value <= MAX_AMOUNT:
        raise src.error(table, key, f"{value!r} is outside {low:g}..{MAX_AMOUNT:g}")
    return float(value)


def _one(src: Any, name: str, data: Any) -> tuple[Account, bool]:
    """The account of ``[accounts.NAME]`` and whether it gave a quota."""
    table = f"accounts.{name}"
    if not ACCOUNT_NAME.fullmatch(name):
        raise src.error(
            table,
            None,
            "an account name is lowercase letters, digits, '_' or '-' (at most 32), from a letter",
        )
    for key in data:
        if key not in ACCOUNT_KEYS:
            close = [k for k in ACCOUNT_KEYS if k[:3] == key[:3]]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise src.error(table, key, f"unknown key{hint}; an account has {', '.join(ACCOUNT_KEYS)}")
    members = data.get("members", [])
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise src.error(
            table, "members", 'expected a list of user names and @groups, e.g. ["alice", "@vision"]'
        )
    if len(members) > MAX_MEMBERS:
        raise src.error(table, "members", f"{len(members)} members; at most {MAX_MEMBERS} (name a @group)")
    for m in members:
        if not MEMBER_NAME.fullmatch(m):
            raise src.error(table, "members", f"{m[:40]!r} is not a user name or @group name")
    quota = _number(src, table, "quota", data.get("quota", 0.0), 0.0)
    limit = None
    if "limit" in data:
        limit = _number(src, table, "limit", data["limit"], 0.0)
        if limit < quota:
            raise src.error(
                table, "limit", f"{limit:g} is below quota ({quota:g}); raise limit or lower quota"
            )
    weight = _number(src, table, "weight", data.get("weight", 1.0), 0.0)
    parent = data.get("parent", "")
    if not isinstance(parent, str):
        raise src.error(table, "parent", f"expected an account name, got {parent!r}")
    if parent == name:
        raise src.error(table, "parent", "an account cannot be its own parent")
    account = Account(name, tuple(members), quota, limit, weight, parent)
    return account, "quota" in data


def accounts(src: Any, data: Mapping[str, Any]) -> dict[str, Account]:
    """The ``[accounts.NAME]`` tables of ``[accounts]``'s data (its sub-tables), checked: names, numbers
    (finite, in range, limit >= quota), members, parents one level deep, children's quotas within their
    parent's. A parent without a quota gets the sum of its children's. ``src.error(table, key, reason)``
    makes the one-line ConfigError."""
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    if len(tables) > MAX_ACCOUNTS:
        raise src.error("accounts", None, f"{len(tables)} accounts; at most {MAX_ACCOUNTS}")
    out: dict[str, Account] = {}
    gave_quota: dict[str, bool] = {}
    for name, spec in tables.items():
        if name in _SECTION_KEYS:
            raise src.error(
                f"accounts.{name}", None, f"{name} is a key of [accounts], not an account: give it a value"
            )
        out[name], gave_quota[name] = _one(src, name, spec)
    for a in out.values():
        if not a.parent:
            continue
        table = f"accounts.{a.name}"
        if a.parent not in out:
            known = ", ".join(sorted(out)) or "none"
            raise src.error(table, "parent", f"{a.parent!r} is not an account (accounts: {known})")
        if out[a.parent].parent:
            raise src.error(
                table,
                "parent",
                f"{a.parent!r} has a parent itself ({out[a.parent].parent!r}); accounts nest one level deep",
            )
    for p in {a.parent for a in out.values() if a.parent}:
        kids = [a for a in out.values() if a.parent == p]
        if out[p].members:
            raise src.error(
                f"accounts.{p}",
                "members",
                f"{p} is a parent: its work runs in its children ({', '.join(a.name for a in kids)}); "
                "move its members to one of them",
            )
        total = sum(a.quota for a in kids)
        if not gave_quota[p]:
            limit = out[p].limit
            if limit is not None and limit < total:
                raise src.error(
                    f"accounts.{p}", "limit", f"{limit:g} is below its children's quotas ({total:g})"
                )
            out[p] = Account(p, (), total, limit, out[p].weight, "")
        elif total > out[p].quota + 1e-9:
            raise src.error(
                f"accounts.{p}",
                "quota",
                f"{out[p].quota:g} is below its children's quotas ({total:g}); raise it or lower theirs",
            )
    return out


_SECTION_KEYS = {f for f in AccountsSection.__dataclass_fields__}


def section_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """``[accounts]``'s own keys (not its sub-tables), for the schema's checks."""
    return {k: v for k, v in data.items() if not isinstance(v, dict)}


def check_refs(src: Any, section: AccountsSection, named: Mapping[str, Account]) -> None:
    """The accounts that ``[accounts]`` names for Slurm and Kubernetes exist, and hold work (no parent)."""
    for key in ("slurm_account", "kubernetes_account"):
        name = getattr(section, key)
        if name == DEFAULT_ACCOUNT and name not in named:
            continue
        if name not in named:
            known = ", ".join([DEFAULT_ACCOUNT, *sorted(named)])
            raise src.error("accounts", key, f"{name!r} is not an account; use one of {known}")
        if any(a.parent == name for a in named.values()):
            raise src.error("accounts", key, f"{name!r} is a parent account; name one of its children")


def quota_warning(named: Mapping[str, Account], capacity: float) -> str | None:
    """A one-line warning where the top-level quotas sum above the cluster's ``capacity``
    (GPU-equivalents), else None. Not an error: oversubscribed quotas are a site's choice."""
    total = sum(a.quota for a in named.values() if not a.parent)
    if total <= capacity + 1e-9:
        return None
    return (
        f"[accounts] quotas sum to {total:g} GPU-equivalents, above the cluster's {capacity:g}: not every "
        "account can have its quota at once; lower the quotas or add cards"
    )


def to_dict(named: Mapping[str, Account]) -> dict[str, dict[str, Any]]:
    """The accounts as xpud.toml's ``[accounts.NAME]`` tables."""
    out = {}
    for a in named.values():
        t: dict[str, Any] = {"members": list(a.members), "quota": a.quota, "weight": a.weight}
        if a.limit is not None:
            t["limit"] = a.limit
        if a.parent:
            t["parent"] = a.parent
        out[a.name] = t
    return out


def config_hash(section: AccountsSection, named: Mapping[str, Account]) -> str:
    """A stable hash of the accounts' configuration (16 hex digits): the same on every host whose
    ``[accounts]`` means the same, whatever the order of keys and members and the spelling of numbers
    (``xpud doctor`` compares it). The order of the accounts counts: a user's first account is its default."""
    tables = to_dict(named)
    for t in tables.values():
        t["members"] = sorted(t["members"])
    data = {
        "section": {k: getattr(section, k) for k in sorted(_SECTION_KEYS)},
        "accounts": [[n, t] for n, t in tables.items()],
    }
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def accounts_of(named: Mapping[str, Account], user: str, groups: Iterable[str]) -> list[str]:
    """The accounts whose members name ``user`` or one of its ``groups`` (as "@group"), in the order of
    xpud.toml (the first is the user's default). Parents hold no members."""
    mine = {user, *(f"@{g}" for g in groups)}
    return [a.name for a in named.values() if mine.intersection(a.members)]


def resolve(
    named: Mapping[str, Account], asked: str, user: str, groups: Iterable[str], operator: bool = False
) -> str:
    """The account a request of ``user`` (in ``groups``) is charged to: ``asked`` when given (it must exist
    and hold work, and the user must be a member; an operator may name any), else the user's first
    account, else ``default``. Raises ValueError with the one-line reason."""
    mine = accounts_of(named, user, groups)
    if not asked:
        return mine[0] if mine else DEFAULT_ACCOUNT
    if asked == DEFAULT_ACCOUNT and asked not in named:
        return asked
    if asked not in named:
        known = ", ".join([DEFAULT_ACCOUNT, *named]) if len(named) < 20 else f"{len(named) + 1} accounts"
        raise ValueError(f"--account {asked[:40]!r}: no such account (xpud.toml [accounts]: {known})")
    if any(a.parent == asked for a in named.values()):
        kids = ", ".join(a.name for a in named.values() if a.parent == asked)
        raise ValueError(f"--account {asked}: a parent account holds no work; name one of {kids}")
    if not operator and asked not in mine:
        yours = ", ".join(mine) or f"none (work goes to {DEFAULT_ACCOUNT})"
        raise ValueError(f"--account {asked}: {user} is not a member (your accounts: {yours})")
    return asked
