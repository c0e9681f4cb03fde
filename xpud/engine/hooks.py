"""What the engine calls out through: small ``typing.Protocol`` interfaces that parts above it (the
controllers) implement and the daemon plugs in. The engine imports none of them; it knows only these.

Invariant: a hook is read on the loop, on the grant path, so it answers from what it keeps in memory:
no hardware call, no I/O, nothing that awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from xpud.model import Request


class Sizing(Protocol):
    """Right-sizing as the engine asks it (``xpud.controllers.rightsizer.Rightsizer``)."""

    def colocation(self, req: Request) -> Callable[[int], float] | None:
        """A tie-breaker for the slice placement of ``req``: a cost per card index (lower first), or None."""
        ...

    def class_of(self, lease_id: str) -> str:
        """The job class a lease is measured under ("" when it is not tracked)."""
        ...
