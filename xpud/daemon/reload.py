"""Reloading the config on SIGHUP (``systemctl reload xpud``): what changes live, and what needs a restart.

The file is read and validated whole; a bad file changes nothing (the error is logged and recorded as an
event). The live sections (``xpud.config.live``) take effect and their jobs are scheduled again; a changed
key elsewhere is named in the event as needing a restart, and the running value stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from xpud import config
from xpud.config.live import merge
from xpud.errors import XpudError

if TYPE_CHECKING:
    from xpud.controllers.defragmenter import Defragmenter
    from xpud.daemon.periodic import Jobs
    from xpud.engine.engine import Engine

log = logging.getLogger("xpud.daemon.reload")


def reload(
    running: config.Config,
    overrides: Callable[[config.Config], config.Config],
    engine: Engine,
    defrag: Defragmenter | None = None,
    jobs: Jobs | None = None,
    accounts: Callable[[config.Config, config.Config], None] | None = None,
) -> tuple[config.Config, str]:
    """Re-read ``running``'s config file (``overrides``: re-applies the daemon's flags and environment)
    and apply what can change live to ``engine``, ``defrag`` and ``jobs``; ``accounts(old, new)`` hands
    ``[accounts]`` to the accounts controller (before the queue is looked at again). Returns the config
    to run with (``running`` when nothing could be applied) and the event's message. Runs on the
    daemon's loop."""
    path = running.path
    if not path:
        msg = "reload: the daemon runs on defaults (no config file): nothing to reload"
        engine.event("reload", msg)
        return running, msg
    try:
        new = overrides(config.load(path))
    except XpudError as e:
        msg = f"reload refused, the running config stays: {e}"
        log.error("%s", msg)
        engine.event("reload", msg)
        return running, msg
    merged, live, restart = merge(running, new)
    engine.cfg = merged
    if defrag is not None:
        defrag.cfg = merged.defrag
    if jobs is not None:
        jobs.reschedule()
    if accounts is not None:
        accounts(running, merged)
    parts = [f"config reloaded from {path}: " + (f"changed {', '.join(live)}" if live else "no live change")]
    if restart:
        parts.append(f"needs a restart to apply: {', '.join(restart)} (the running values stay)")
    msg = "; ".join(parts)
    engine.event("reload", msg)
    engine.pump()
    return merged, msg
