"""Who is calling: a peer-credential handshake on a plain Unix socket.

gRPC Python cannot read SO_PEERCRED, so the daemon listens on ``cred.sock`` as well. A client connects,
the daemon reads the kernel-verified (pid, uid, gid) of the connecting process, and answers with one JSON
line holding a random short-lived credential. The client sends it as gRPC metadata
(``x-xpud-credential``) on every call; the service maps it back to the caller. Nobody can forge another
user's uid this way: the kernel fills in SO_PEERCRED.
"""

from __future__ import annotations

import asyncio
import errno
import grp
import json
import logging
import os
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xpud.errors import Unauthenticated

if TYPE_CHECKING:  # the client (`xpu run`) imports this module for handshake(): keep it light
    from xpud.model import Caller

log = logging.getLogger("xpud.api.auth")

METADATA_KEY = "x-xpud-credential"
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}

# A flood of handshakes must cost the daemon little and other users nothing: each uid holds at most
# MAX_PER_UID live credentials (a new one retires that uid's oldest: its client renews once), at most
# MAX_HANDSHAKES are answered at once, and a peer that does not take its reply in HANDSHAKE_TIMEOUT_S is
# dropped. The listen backlog absorbs bursts; clients retry a connect the kernel refuses as busy.
MAX_PER_UID = 256
MAX_HANDSHAKES = 64
HANDSHAKE_TIMEOUT_S = 1.0
BACKLOG = 1024
GROUPS_TTL_S = 30.0  # how long an operator check (the group database) is cached per (uid, gid)


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


def user_and_groups(uid: int, gid: int) -> tuple[str, list[str]]:
    """The user name of ``uid`` (its number when it has none) and the names of its groups (``gid`` and
    those that list it as a member), for accounts' members (``alice``, ``@vision``)."""
    import pwd

    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    out = []
    for g in _groups_of(uid, gid):
        try:
            out.append(grp.getgrgid(g).gr_name)
        except KeyError:
            continue
    return name, out


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
        self._issued: OrderedDict[str, Credential] = OrderedDict()  # oldest first = soonest to expire
        self._by_uid: dict[int, OrderedDict[str, None]] = {}
        self._admin_cache: dict[tuple[int, int], tuple[bool, float]] = {}

    def __len__(self) -> int:
        return len(self._issued)

    def is_admin(self, uid: int, gid: int) -> bool:
        if uid in (0, os.getuid()):
            return True
        if not self._admin_gids:
            return False
        now = time.monotonic()
        hit = self._admin_cache.get((uid, gid))
        if hit is None or now - hit[1] > GROUPS_TTL_S:  # the group database can be slow (NSS, LDAP)
            if len(self._admin_cache) > 4096:
                self._admin_cache.clear()
            hit = (bool(self._admin_gids & _groups_of(uid, gid)), now)
            self._admin_cache[(uid, gid)] = hit
        return hit[0]

    def issue(self, pid: int, uid: int, gid: int) -> tuple[str, Credential]:
        import secrets

        from xpud.model import Caller

        self._expire()
        token = secrets.token_urlsafe(24)
        cred = Credential(
            Caller(uid=uid, pid=pid, gid=gid, admin=self.is_admin(uid, gid)), self.clock() + self.ttl_s
        )
        mine = self._by_uid.setdefault(uid, OrderedDict())
        if len(mine) >= MAX_PER_UID:  # retire this uid's oldest credential
            old, _ = mine.popitem(last=False)
            self._issued.pop(old, None)
        mine[token] = None
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
        """Drop expired credentials: O(1) per credential, oldest first (all share one lifetime)."""
        now = self.clock()
        while self._issued:
            token, cred = next(iter(self._issued.items()))
            if cred.expires >= now:
                break
            del self._issued[token]
            mine = self._by_uid.get(cred.caller.uid)
            if mine is not None:
                mine.pop(token, None)
                if not mine:
                    del self._by_uid[cred.caller.uid]

    async def serve(self, path: str) -> asyncio.AbstractServer:
        """Listen on ``path`` and answer each connection with a credential for its peer."""
        busy = asyncio.Semaphore(MAX_HANDSHAKES)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                async with busy:
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
                    await asyncio.wait_for(writer.drain(), HANDSHAKE_TIMEOUT_S)
            except (OSError, ConnectionError, TimeoutError):
                pass
            except Exception:  # never let one connection's trouble reach the loop's log as a traceback
                log.exception("credential handshake failed")
            finally:
                if writer.transport.get_write_buffer_size():
                    writer.transport.abort()  # the peer did not take its reply: drop it now
                else:
                    writer.close()

        return await asyncio.start_unix_server(handle, path=path, backlog=BACKLOG)


def handshake(path: str, timeout: float = 5.0) -> dict:
    """Client side: connect to ``cred.sock`` and read the credential the daemon issues us."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        while True:
            try:
                s.connect(path)
                break
            except BlockingIOError as e:  # the listen queue is full (a burst): the kernel says EAGAIN
                if e.errno != errno.EAGAIN or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
