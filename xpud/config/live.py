"""What a reload changes live and what needs a restart (``systemctl reload xpud``, ``xpu config set``).

Live: ``[leases]``, ``[limits]``, ``[defrag]``, ``[bursts]``, ``[forecast]``, ``[carbon]``,
``[[windows]]``, ``[accounts]`` and its ``[accounts.NAME]`` tables (issue #33: the accounts controller
takes them at the next decision). Everything else is fixed for the daemon's life (sockets, state,
hardware, isolation, slice sizes, health scoring, the metrics port): a changed key there needs a restart,
and the running value stays until then.
"""

from __future__ import annotations

import dataclasses

from xpud.config.schema import SECTIONS, Config

LIVE = ("leases", "limits", "defrag", "bursts", "forecast", "carbon", "accounts")
LIVE_OTHER = ("windows",)  # not a section: [[windows]]


def merge(running: Config, new: Config) -> tuple[Config, list[str], list[str]]:
    """The config to run with: ``new``'s live parts, ``running``'s others. Returns (config, changed live
    keys, changed keys that need a restart), keys written as ``[section] key``."""
    live, restart = [], []
    out = running
    for name in SECTIONS:
        old_s, new_s = getattr(running, name), getattr(new, name)
        changed = [
            f.name for f in dataclasses.fields(old_s) if getattr(old_s, f.name) != getattr(new_s, f.name)
        ]
        keys = [f"[{name}] {k}" for k in changed]
        if name in LIVE:
            live += keys
            out = dataclasses.replace(out, **{name: new_s})
        else:
            restart += keys
    if running.windows != new.windows:
        live.append("[[windows]]")
        out = dataclasses.replace(out, windows=new.windows)
    if running.slices != new.slices:
        restart.append("[slices]")
    if running.named_accounts != new.named_accounts or list(running.named_accounts) != list(
        new.named_accounts
    ):  # the order counts too: a user's first account is its default
        live += _accounts_changed(running, new)
        out = dataclasses.replace(out, named_accounts=new.named_accounts)
    return out, live, restart


def _accounts_changed(running: Config, new: Config) -> list[str]:
    """``[accounts.NAME]`` for each account added, changed or removed (or reordered), at most 8 named."""
    old, now = running.named_accounts, new.named_accounts
    names = [n for n in now if old.get(n) != now[n]] + [n for n in old if n not in now]
    keys = [f"[accounts.{n}]" for n in names[:8]]
    if len(names) > 8:
        keys.append(f"{len(names) - 8} more accounts")
    return keys or ["[accounts.NAME] order"]
