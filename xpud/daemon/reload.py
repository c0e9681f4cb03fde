"""Reloading the config on SIGHUP (``systemctl reload xpud``): what changes live, and what needs a restart.

The file is read and validated whole; a bad file changes nothing (the error is logged and recorded as an
event). The live sections (``xpud.config.live``) take effect and their jobs are scheduled again; a changed
key elsewhere is named in the event as needing a restart, and the running value stays.
"""

from __future__ import annotations

import logging

from xpud import config
from xpud.config.live import merge
from xpud.errors import XpudError

log = logging.getLogger("xpud.daemon.reload")


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
