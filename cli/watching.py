"""`-w/--watch` on listings: draw, then draw again at every change the daemon reports (its Watch stream,
at most once a second), until Ctrl-C. On a terminal each drawing replaces the last; otherwise they follow
one another, each under a line with the time (as `kubectl get -w` and `squeue -i` do)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

CLEAR = "\033[H\033[2J"


def follow(client, draw: Callable[[object], None], interval_s: float = 1.0) -> None:
    """Call ``draw(update)`` for the Watch stream's first update and for each one after it."""
    tty = sys.stdout.isatty()
    call = client.watch(interval_s)
    try:
        for n, update in enumerate(client.iterate(call)):
            if tty:
                sys.stdout.write(CLEAR)
            elif n:
                sys.stdout.write("\n")
            sys.stdout.write(
                f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}  (redrawn at every change; Ctrl-C ends)\n"
            )
            draw(update)
            sys.stdout.flush()
    finally:
        call.cancel()
