"""Reloading the config on SIGHUP (``systemctl reload xpud``): what changes live, and what needs a restart.

The file is read and validated whole; a bad file changes nothing (the error is logged and recorded as an
event). Live: ``[leases]``, ``[limits]``, ``[defrag]``, ``[bursts]``, ``[forecast]``, ``[carbon]`` and
``[[windows]]`` (their jobs are scheduled again). Everything else is fixed for the daemon's life (sockets,
state, hardware, isolation, slice sizes, health scoring, the metrics port): a changed key there is named in
the event as needing a restart, and the running value stays.
"""

from __future__ import annotations

import dataclasses
import logging

from xpud.config import schema as config
from xpud.errors import XpudError

log = logging.getLogger("xpud.daemon.reload")

LIVE = ("leases", "limits", "defrag", "bursts", "forecast", "carbon")
LIVE_OTHER = ("windows",)  # not a section: [[windows]]


def merge(running: config.Config, new: config.Config) -> tuple[config.Config, list[str], list[str]]:
    """The config to run with: ``new``'s live parts, ``running``'s others. Returns (config, changed live
    keys, changed keys that need a restart), keys written as ``[section] key``."""
    live, restart = [], []
    out = running
    for name in config.SECTIONS:
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
    if running.named_accounts != new.named_accounts:  # the accounts controller is built at start (#33)
        restart.append("[accounts.NAME]")
    return out, live, restart


def reload(daemon, overrides) -> str:
    """Re-read the daemon's config file (``overrides``: re-applies its flags and environment) and apply
    what can change live. Returns the event's message. Runs on the daemon's loop."""
    engine = daemon.engine
    path = daemon.cfg.path
    if not path:
        msg = "reload: the daemon runs on defaults (no config file): nothing to reload"
        engine.event("reload", msg)
        return msg
    try:
        new = overrides(config.load(path))
    except XpudError as e:
        msg = f"reload refused, the running config stays: {e}"
        log.error("%s", msg)
        engine.event("reload", msg)
        return msg
    merged, live, restart = merge(daemon.cfg, new)
    daemon.cfg = merged
    engine.cfg = merged
    if daemon.defrag is not None:
        daemon.defrag.cfg = merged.defrag
    if daemon.jobs is not None:
        daemon.jobs.reschedule()
    parts = [f"config reloaded from {path}: " + (f"changed {', '.join(live)}" if live else "no live change")]
    if restart:
        parts.append(f"needs a restart to apply: {', '.join(restart)} (the running values stay)")
    msg = "; ".join(parts)
    engine.event("reload", msg)
    engine.pump()
    return msg
