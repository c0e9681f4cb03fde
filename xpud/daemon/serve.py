"""Serving: the config as the command line overrides it, then the daemon until SIGTERM. No Typer here:
``xpud.daemon.entry`` calls it straight for the plain ``xpud [--OPTION VALUE ...]`` a service runs (Typer
and its parameter checks cost ~0.4 s of CPU at every start), ``xpud.daemon.cli`` for everything else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from xpud import config
from xpud.daemon.app import StartupError, loop_factory, open_hardware, run_daemon
from xpud.errors import XpudError
from xpud.ledger.ledger import LedgerDamaged

LEDGER_DAMAGED_EXIT = 3  # systemd/xpud.service: RestartPreventExitStatus=3

Overrides = Callable[[config.Config], config.Config]


def fail(message: str, code: int = 1) -> None:
    """One line on stderr, then exit with ``code``."""
    print(f"xpud: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def setup_logging(level: str) -> None:
    fmt = (
        "%(levelname)s %(name)s: %(message)s"
        if os.environ.get("JOURNAL_STREAM")
        else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr)
    if level != "debug":  # APScheduler's INFO lines ("Added job ...") are its own chatter
        logging.getLogger("apscheduler").setLevel(logging.WARNING)


def load(
    config_path: str | None,
    simulate: str | None = None,
    runtime_dir: str | None = None,
    state_dir: str | None = None,
    seed: int | None = None,
    sim_state: str | None = None,
    log_level: str | None = None,
    kubelet: bool = False,
) -> tuple[config.Config, Overrides]:
    """The config file with the command line's values over it, and those overrides (applied again at each
    reload). A bad file or value: one line and exit 2."""

    def overrides(cfg: config.Config) -> config.Config:
        """The command line's values over the file's (at start, and again at each reload)."""
        if simulate:
            cfg = config.checked(cfg, "devices", "machine", simulate, "--simulate")
            cfg = cfg.replace("devices", backend="simulated")
        if seed is not None:
            cfg = config.checked(cfg, "devices", "seed", seed, "--seed")
        if sim_state:
            cfg = config.checked(cfg, "devices", "sim_state", str(Path(sim_state).absolute()), "--sim-state")
        if runtime_dir:
            cfg = config.checked(
                cfg, "daemon", "runtime_dir", str(Path(runtime_dir).absolute()), "--runtime-dir"
            )
        if state_dir:
            cfg = config.checked(cfg, "daemon", "state_dir", str(Path(state_dir).absolute()), "--state-dir")
        if log_level:
            cfg = config.checked(cfg, "daemon", "log_level", log_level, "--log-level")
        if kubelet:
            cfg = cfg.replace("kubelet", enabled=True)
        return cfg

    try:
        return overrides(config.load(config_path)), overrides
    except XpudError as e:
        fail(str(e), 2)
        raise  # not reached


def run(cfg: config.Config, overrides: Overrides) -> None:
    """Serve until SIGTERM/SIGINT; a start that cannot succeed is one line and a non-zero exit."""
    setup_logging(cfg.daemon.log_level)
    try:
        factory = loop_factory(cfg.daemon.event_loop)
        hw, fake = open_hardware(cfg)
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(run_daemon(cfg, hw, fake, overrides))
    except StartupError as e:
        fail(str(e))
    except LedgerDamaged as e:  # not restarted by systemd (RestartPreventExitStatus): an operator decides
        fail(str(e), LEDGER_DAMAGED_EXIT)
    except XpudError as e:
        fail(str(e))
    except PermissionError as e:
        fail(
            f"{e.filename}: permission denied; run as root, or give --runtime-dir and --state-dir "
            "directories you own"
        )
