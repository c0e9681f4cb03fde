"""One error type with context. Messages say what went wrong, where, and how to fix it.

The service maps each class to one gRPC status code (``GRPC_CODES``) and the client maps the code back to
the same class, so callers on both sides of the socket handle the same exceptions.
"""

from __future__ import annotations


class XpudError(Exception):
    """Base of every error xpud reports to a user. ``str(err)`` is a one-line message."""

    code = "UNKNOWN"


class BadRequest(XpudError):
    """The request itself is wrong (bad mode, bad count, unknown card)."""

    code = "INVALID_ARGUMENT"


class NotFound(XpudError):
    code = "NOT_FOUND"


class Forbidden(XpudError):
    """Wrong token, not the owner, or an operator-only action from the user socket."""

    code = "PERMISSION_DENIED"


class Unauthenticated(XpudError):
    """No valid credential: the caller did not do the peer-credential handshake, or it expired."""

    code = "UNAUTHENTICATED"


class NoCapacity(XpudError):
    """The request does not fit now (or did not fit before its wait expired)."""

    code = "RESOURCE_EXHAUSTED"


class Conflict(XpudError):
    """The action contradicts the current state (e.g. switch the mode of a card a lease holds)."""

    code = "FAILED_PRECONDITION"


class Unavailable(XpudError):
    """The daemon cannot be reached or is shutting down."""

    code = "UNAVAILABLE"


class ConfigError(XpudError):
    """A bad configuration file or value: names the file, the key and the line."""

    code = "INVALID_ARGUMENT"


ERROR_CLASSES: dict[str, type[XpudError]] = {
    c.code: c for c in (BadRequest, NotFound, Forbidden, Unauthenticated, NoCapacity, Conflict, Unavailable)
}
