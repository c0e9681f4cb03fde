"""What every `xpu` command shares: the runtime directory the command line gave (``--runtime-dir`` or
``XPUD_RUNTIME_DIR``, set by ``xpu_cli.main``'s callback) and a client on it.

Its own module, below ``xpu_cli.main`` and the commands that live in their own modules, so that these
reach the daemon without importing ``main`` back (tests/test_layers.py: no import circle)."""

from __future__ import annotations

from xpud.api.client import Client


class State:
    runtime_dir: str | None = None


state = State()


def client(admin: bool = False) -> Client:
    return Client(state.runtime_dir, admin=admin)
