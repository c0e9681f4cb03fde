"""Who is calling: a peer-credential handshake on a plain Unix socket.

gRPC Python cannot read SO_PEERCRED, so the daemon listens on ``cred.sock`` as well. A client connects,
the daemon reads the kernel-verified (pid, uid, gid) of the connecting process, and answers with one JSON
line holding a random short-lived credential. The client sends it as gRPC metadata
(``x-xpud-credential``) on every call; the service maps it back to the caller. Nobody can forge another
user's uid this way: the kernel fills in SO_PEERCRED.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

from xpud.errors import Unauthenticated
from xpud.model import Caller

METADATA_KEY = "x-xpud-credential"
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


@dataclass(frozen=True)
class Credential:
    caller: Caller
    expires: float


def admin_gids(group_name: str) -> set[int]:
    try:
        return {grp.getgrnam(group_name).gr_gid}
    except KeyError:
        return set()


def _groups_of(uid: int, gid: int) -> set[int]:
    import pwd

    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return {gid}
    return {gid, *(g.gr_gid for g in grp.getgrall() if name in g.gr_mem)}


def member_of(uid: int, gid: int, group_names: Iterable[str]) -> bool:
    """Whether the user is in one of these groups (by name; unknown names match nobody)."""
    gids = {g for name in group_names for g in admin_gids(name)}
    return bool(gids and gids & _groups_of(uid, gid))


class CredentialIssuer:
    """Issues and checks credentials. Operators: root, the daemon's own uid, the admin group."""

    def __init__(self, ttl_s: float = 300.0, admin_group: str = "xpud-admin", clock=time.time):
        self.ttl_s = ttl_s
        self.clock = clock
        self._admin_gids = admin_gids(admin_group)
        self._issued: dict[str, Credential] = {}

    def is_admin(self, uid: int, gid: int) -> bool:
        if uid in (0, os.getuid()):
            return True
        return bool(self._admin_gids and self._admin_gids & _groups_of(uid, gid))

    def issue(self, pid: int, uid: int, gid: int) -> tuple[str, Credential]:
        self._expire()
        token = secrets.token_urlsafe(24)
        cred = Credential(
            Caller(uid=uid, pid=pid, gid=gid, admin=self.is_admin(uid, gid)), self.clock() + self.ttl_s
        )
        self._issued[token] = cred
        return token, cred

    def check(self, token: str | None) -> Caller:
        if not token:
            raise Unauthenticated(
                "no credential: connect with the xpud client (it does the handshake on cred.sock first)"
            )
        cred = self._issued.get(token)
        if cred is None or cred.expires < self.clock():
            raise Unauthenticated("credential unknown or expired: reconnect (the client renews it)")
        return cred.caller

    def _expire(self) -> None:
        now = self.clock()
        for t in [t for t, c in self._issued.items() if c.expires < now]:
            del self._issued[t]

    async def serve(self, path: str) -> asyncio.AbstractServer:
        """Listen on ``path`` and answer each connection with a credential for its peer."""

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                sock = writer.get_extra_info("socket")
                pid, uid, gid = _UCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )
                token, cred = self.issue(pid, uid, gid)
                reply = {
                    "credential": token,
                    "uid": uid,
                    "pid": pid,
                    "admin": cred.caller.admin,
                    "expires_in": self.ttl_s,
                }
                writer.write((json.dumps(reply) + "\n").encode())
                await writer.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                writer.close()

        return await asyncio.start_unix_server(handle, path=path)


def handshake(path: str, timeout: float = 5.0) -> dict:
    """Client side: connect to ``cred.sock`` and read the credential the daemon issues us."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
