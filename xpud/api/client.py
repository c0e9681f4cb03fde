"""The client used by the CLI, the dashboard and scripts: one object per daemon socket.

It does the peer-credential handshake on ``cred.sock`` (renewing it when it expires), attaches the
credential to every call, and turns gRPC status codes back into the ``xpud.errors`` classes.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from xpud.api.auth import METADATA_KEY, handshake
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import ERROR_CLASSES, BadRequest, Forbidden, Unauthenticated, Unavailable, XpudError

DEFAULT_RUNTIME_DIR = "/run/xpud"
# gRPC's default reconnect backoff (1 s, x1.6, up to 120 s) leaves a holder cut off by a long daemon outage
# waiting seconds after the daemon is back, past the leases' grace: retry the socket at least every second.
# Not grpc.min_reconnect_backoff_ms: gRPC core takes it as the connect timeout (default 20 s), and a short
# one fails every connection to a busy daemon.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def runtime_dir(explicit: str | os.PathLike | None = None) -> Path:
    return Path(explicit or os.environ.get("XPUD_RUNTIME_DIR") or DEFAULT_RUNTIME_DIR)


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What tells one socket file from the next one at the same path (None: no file)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _request(cls, **fields):
    """``cls(**fields)``, or one line naming the field a request cannot hold (an integer beyond its type,
    text that is not UTF-8: a command-line argument may be neither) instead of protobuf's exception."""
    try:
        return cls(**fields)
    except (ValueError, TypeError) as whole:  # UnicodeEncodeError is a ValueError
        err, where = whole, cls.DESCRIPTOR.name
    for name, value in fields.items():
        try:
            cls(**{name: value})
        except (ValueError, TypeError) as one:
            err, where = one, f"{where}.{name}"
            break
    if isinstance(err, UnicodeEncodeError):
        raise BadRequest(f"{where}: not UTF-8 text") from None
    raise BadRequest(f"{where}: {str(err)[:200]}") from None


def to_error(e: grpc.RpcError, where: str) -> XpudError:
    code = e.code() if hasattr(e, "code") else None
    detail = (e.details() if hasattr(e, "details") else "") or ""
    # The daemon's own UNAVAILABLE (ledger busy or full, a full disk under a backend): retry, not unreachable.
    daemon_said = detail.startswith(("ledger ", "disk full:"))
    if code in (grpc.StatusCode.UNAVAILABLE, None) and "Socket closed" not in detail and not daemon_said:
        return Unavailable(
            f"cannot reach xpud at {where}: is the daemon running? (systemctl status xpud; "
            "or point --runtime-dir / XPUD_RUNTIME_DIR at its sockets)"
        )
    cls = ERROR_CLASSES.get(code.name, XpudError) if code else XpudError
    return cls(detail or str(code))


class Client:
    """A connection to one daemon. ``admin=True`` uses admin.sock (operators only)."""

    def __init__(self, runtime: str | os.PathLike | None = None, admin: bool = False, timeout: float = 15.0):
        self.runtime_dir = runtime_dir(runtime)
        self.socket = self.runtime_dir / ("admin.sock" if admin else "xpud.sock")
        self.cred_socket = self.runtime_dir / "cred.sock"
        self.timeout = timeout
        if admin and self.socket.exists() and not os.access(self.socket, os.R_OK | os.W_OK):
            raise Forbidden(f"{self.socket}: permission denied: operators only (root or the admin group)")
        self._admin_stub = admin
        self._old_channels: list[grpc.Channel] = []
        self._connect()
        self._credential: str | None = None
        self._lock = threading.Lock()

    def _connect(self) -> None:
        self._socket_id = _identity(self.socket)
        self.channel = grpc.insecure_channel(f"unix:{self.socket}", options=CHANNEL_OPTIONS)
        self.node = pbg.NodeStub(self.channel)
        self.admin = pbg.AdminStub(self.channel) if self._admin_stub else None

    def reconnect_if_restarted(self) -> bool:
        """If the socket file is a new one (the daemon restarted), connect to it now, with a new
        credential, instead of waiting out the old channel's backoff. Returns whether it did."""
        now = _identity(self.socket)
        if now is None or now == self._socket_id:
            return False
        self._old_channels.append(self.channel)  # closed with the client: another thread may be using it
        self._connect()
        with self._lock:
            self._credential = None
        return True

    def close(self) -> None:
        for channel in (*self._old_channels, self.channel):
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _metadata(self, renew: bool = False) -> tuple[tuple[str, str], ...]:
        with self._lock:
            if renew or self._credential is None:
                try:
                    self._credential = handshake(str(self.cred_socket))["credential"]
                except (OSError, ValueError, KeyError) as e:
                    raise Unavailable(
                        f"cannot reach xpud at {self.cred_socket}: {getattr(e, 'strerror', e)}; "
                        "is the daemon running? (or set --runtime-dir / XPUD_RUNTIME_DIR)"
                    ) from None
            return ((METADATA_KEY, self._credential),)

    def _unary(self, method, request, timeout: float | None = None):
        for attempt in (0, 1):
            try:
                return method(
                    request, metadata=self._metadata(renew=attempt > 0), timeout=timeout or self.timeout
                )
            except grpc.RpcError as e:
                err = to_error(e, str(self.socket))
                if isinstance(err, Unauthenticated) and attempt == 0:
                    continue  # credential expired: renew once
                raise err from None
        raise AssertionError("unreachable")

    def _stream(self, method, request, timeout: float | None = None):
        """Open a server stream (renewing an expired credential once). Returns the call object."""
        return method(request, metadata=self._metadata(), timeout=timeout)

    def iterate(self, call) -> Iterator:
        """Iterate a stream call, mapping errors."""
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            raise to_error(e, str(self.socket)) from None

    # ------------------------------------------------------------------ Node
    def info(self) -> pb.InfoReply:
        return self._unary(self.node.Info, pb.InfoRequest())

    def acquire(
        self,
        mode: str,
        gpus: int = 1,
        priority: int = 0,
        wait_s: float | None = 0.0,
        restartable: bool = False,
        command: str = "",
        hold: bool = False,
        job_class: str = "",
        name: str = "",
        cards: tuple[int, ...] = (),
        anchor: str = "",
        owner_uid: int | None = None,
        when_green: bool = False,
        green_deadline: float = 0.0,
        account: str = "",
    ):
        """The Acquire stream call: iterate it (``iterate``) for ``queued`` updates, then ``granted``. With
        ``hold`` the same stream goes on as the lease's Hold stream (``event`` updates). ``wait_s``: None
        for the daemon's default ([leases] default_wait_s), ``math.inf`` for the longest it allows."""
        request = _request(
            pb.AcquireRequest,
            mode=mode,
            gpus=gpus,
            priority=priority,
            restartable=restartable,
            command=command,
            hold=hold,
            job_class=job_class,
            name=name,
            cards=cards,
            anchor=anchor,
            owner_uid=owner_uid,
            when_green=when_green,
            green_deadline=green_deadline,
            account=account,
        )
        if wait_s == math.inf:
            request.wait_longest = True
        elif wait_s is not None:
            request.wait_s = wait_s
        return self._stream(self.node.Acquire, request)

    def acquire_lease(self, mode: str, **kw) -> pb.Granted:
        """Acquire and return the grant (blocking through the queue)."""
        for attempt in (0, 1):
            try:
                for update in self.iterate(self.acquire(mode, **kw)):
                    if update.HasField("granted"):
                        return update.granted
            except Unauthenticated:
                if attempt:
                    raise
                self._metadata(renew=True)  # a restarted daemon does not know our credential
                continue
            break
        raise Unavailable("the daemon closed the Acquire stream without a grant")

    def hold(self, lease_id: str, token: str):
        return self._stream(self.node.Hold, _request(pb.HoldRequest, lease_id=lease_id, token=token))

    def release(
        self,
        lease_id: str,
        token: str = "",
        exit_code: int | None = None,
        exit_signal: int | None = None,
        started: float = 0.0,
    ) -> pb.Lease:
        """Release a lease; its wrapper says how the command ended (an exit code or a signal) and when
        it started."""
        request = _request(
            pb.ReleaseRequest,
            lease_id=lease_id,
            token=token,
            exit_code=exit_code,
            exit_signal=exit_signal,
            started=started,
        )
        return self._unary(self.node.Release, request).lease

    def ack_move(self, lease_id: str, token: str) -> pb.Lease:
        return self._unary(
            self.node.AckMove, _request(pb.AckMoveRequest, lease_id=lease_id, token=token)
        ).lease

    def confine(self, lease_id: str, token: str) -> pb.ConfineReply:
        """Put this process in the lease's device scope (before it starts the lease's command)."""
        return self._unary(self.node.Confine, _request(pb.ConfineRequest, lease_id=lease_id, token=token))

    def cards(self) -> pb.ListCardsReply:
        return self._unary(self.node.ListCards, pb.ListCardsRequest())

    def leases(self, all: bool = False, limit: int = 0, lease_id: str = "") -> pb.ListLeasesReply:
        request = _request(pb.ListLeasesRequest, all=all, limit=limit, lease_id=lease_id)
        return self._unary(self.node.ListLeases, request)

    def lease(self, lease_id: str) -> pb.Lease:
        """One lease, active or ended, by its id or a unique prefix."""
        return self.leases(lease_id=lease_id).leases[0]

    # ------------------------------------------------------------------ jobs
    def submit_job(self, **fields) -> pb.JobRecord:
        """Queue a detached job (``pb.SubmitJobRequest``'s fields); its record, with its id."""
        return self._unary(self.node.SubmitJob, _request(pb.SubmitJobRequest, **fields)).job

    def jobs(self, **fields) -> pb.ListJobsReply:
        return self._unary(self.node.ListJobs, _request(pb.ListJobsRequest, **fields))

    def job(self, selector: str) -> pb.JobRecord:
        """One job (the caller's, or any for an operator) by id, id prefix or name."""
        return self.jobs(job=selector).jobs[0]

    def cancel_jobs(self, selectors: list[str]) -> list[pb.JobRecord]:
        return list(self._unary(self.node.CancelJobs, _request(pb.CancelJobsRequest, jobs=selectors)).jobs)

    def job_logs(self, selector: str, follow: bool = False, rank: int = 0, error: bool = False):
        """The job's output as it comes (bytes chunks)."""
        request = _request(pb.JobLogsRequest, job=selector, follow=follow, rank=rank, error=error)
        for chunk in self.iterate(self._stream(self.node.JobLogs, request)):
            yield chunk.data

    def report(self, by: str = "account", since: float = 0.0, until: float = 0.0) -> pb.ReportReply:
        """Usage from every host's ledger (``xpu report``)."""
        return self._unary(self.node.Report, pb.ReportRequest(by=by, since=since, until=until))

    def accounts(self) -> pb.AccountsReply:
        """The accounts and how they stand across the cluster (``xpu accounts``)."""
        return self._unary(self.node.ListAccounts, pb.AccountsRequest())

    def events(self, card: int | None = None, lease_id: str = "", limit: int = 0) -> list[pb.Event]:
        """The daemon's latest events (oldest first), about ``card`` and/or ``lease_id`` when given."""
        request = _request(pb.EventsRequest, card=card, lease_id=lease_id, limit=limit)
        return list(self._unary(self.node.ListEvents, request).events)

    def resize(self, lease_id: str, mode: str, token: str = "") -> pb.ResizeReply:
        return self._unary(
            self.node.Resize, _request(pb.ResizeRequest, lease_id=lease_id, mode=mode, token=token)
        )

    def lease_usage(self) -> pb.LeaseUsageReply:
        return self._unary(self.node.LeaseUsage, pb.LeaseUsageRequest())

    def topology(self) -> pb.TopologyReply:
        return self._unary(self.node.GetTopology, pb.TopologyRequest())

    def health(self, card: str = "", history: int = 0) -> pb.HealthReply:
        return self._unary(self.node.GetHealth, _request(pb.HealthRequest, card=card, history=history))

    def watch_lease(self, lease_id: str):
        """A lease's live load: one ``LeaseLoad`` now, then one per right-sizing round until it ends."""
        return self._stream(self.node.WatchLease, _request(pb.WatchLeaseRequest, lease_id=lease_id))

    def watch(self, min_interval_s: float = 1.0):
        return self._stream(self.node.Watch, _request(pb.WatchRequest, min_interval_s=min_interval_s))

    # ------------------------------------------------------------------ Admin
    def cluster(self) -> pb.ClusterReply:
        """The cluster as this daemon sees it through federation (``enabled`` false without [cluster])."""
        return self._unary(self.node.GetCluster, pb.ClusterRequest())

    def _admin(self):
        if self.admin is None:
            raise Forbidden("this action needs the admin socket: connect with admin=True (operators only)")
        return self.admin

    def drain(self, card: str, reason: str = "") -> pb.Card:
        return self._unary(self._admin().Drain, _request(pb.DrainRequest, card=card, reason=reason)).card

    def undrain(self, card: str) -> pb.Card:
        return self._unary(self._admin().Undrain, _request(pb.CardRequest, card=card)).card

    def set_mode(self, card: str, mode: str) -> pb.Card:
        return self._unary(
            self._admin().SetCardMode, _request(pb.SetCardModeRequest, card=card, mode=mode)
        ).card

    def evict(self, lease_id: str, reason: str = "") -> pb.Lease:
        return self._unary(
            self._admin().Evict, _request(pb.EvictRequest, lease_id=lease_id, reason=reason)
        ).lease

    def inject_fault(self, card: str, kind: str, xid: int = 0) -> str:
        return self._unary(
            self._admin().InjectFault, _request(pb.FaultRequest, card=card, kind=kind, xid=xid)
        ).message

    def clear_fault(self, card: str) -> str:
        return self._unary(self._admin().ClearFault, _request(pb.CardRequest, card=card)).message

    def defrag(
        self, apply: bool = False, move_budget_pct: float | None = None, gpus: int = 0, wait: bool = True
    ) -> pb.DefragReply:
        """Plan (and with ``apply`` perform) a defragmentation. ``move_budget_pct`` None: the daemon's
        default; ``gpus``: make room for that many whole cards instead of consolidating."""
        request = _request(
            pb.DefragRequest, apply=apply, move_budget_pct=move_budget_pct, gpus=gpus, wait=wait
        )
        return self._unary(self._admin().Defrag, request, timeout=300)
