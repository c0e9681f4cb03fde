"""Telling systemd the daemon's state (``Type=notify``): READY, RELOADING, STOPPING."""

from __future__ import annotations

import contextlib
import os
import socket


def sd_notify(state: str) -> None:
    """Tell systemd our state (Type=notify). A no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(state.encode())
