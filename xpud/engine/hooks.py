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


class QueueOrder(Protocol):
    """The wait queue's order and the accounts' limits, as the engine asks them
    (``xpud.controllers.accounts.Accounts``). Without one: priority, then age; no account limits."""

    def key(self, req: Request, enqueued: float) -> tuple:
        """Sort key of a waiting request (lower first)."""
        ...

    def refusal(self, req: Request, in_flight: float) -> str:
        """Why ``req`` may not be granted now ("" when it may): its account's ``limit``, counting what it
        holds on every host and ``in_flight`` GPU-equivalents of its grants under way here."""
        ...

    def reason(self, req: Request) -> str:
        """Why ``req`` waits beyond the cards (squeue's REASON, e.g. "Fairshare: nlp over its share"),
        or "" to keep the engine's own."""
        ...
