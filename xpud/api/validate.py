"""Checks every request on the way in, before a servicer sees it.

Each field of each request message in ``xpu.proto`` has an entry in ``LIMITS`` (a test enforces it):
strings have a length bound (and for selectors an alphabet), numbers must be finite and in range,
repeated fields have a count bound. A request that breaks one is refused with INVALID_ARGUMENT naming
the field and the limit; the offending value is never echoed beyond ``ECHO_CHARS`` characters, so an
error reply stays small whatever the caller sent. A message the protobuf runtime cannot parse arrives as
``Undecodable`` (see ``tolerant``) and is refused the same way.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from xpud.errors import BadRequest

log = logging.getLogger("xpud.service.node")

ECHO_CHARS = 80  # the most characters of a caller's input an error message repeats
MAX_TASKS_PER_NODE = 512  # --tasks-per-node: Slurm's MaxTasksPerNode default
MAX_INCARNATION = 2**63 - 1  # a Swim incarnation on the wire (int64); membership bounds it further
COMMAND_CHARS = 500  # a command is a label for listings: kept to this many characters on the way in


@dataclass(frozen=True)
class Limit:
    """What one field may hold. Strings: ``chars`` and optionally a ``pattern`` (full match); numbers:
    ``lo``..``hi`` (and finite); repeated fields: at most ``items`` entries. ``truncate``: a string over
    ``chars`` is cut (a label) instead of refused."""

    chars: int = 0
    pattern: Alphabet | None = None
    lo: float = -math.inf
    hi: float = math.inf
    items: int = 0
    truncate: bool = False


@dataclass(frozen=True)
class Alphabet:
    """The characters a selector may use (a full-match regex) and how an error describes them."""

    regex: re.Pattern
    text: str


_ID = Alphabet(re.compile(r"[0-9A-Za-z_.-]*"), "a lease id (ASCII letters, digits, '.', '_' and '-')")
_CARD = Alphabet(re.compile(r"[0-9A-Za-z-]*"), "a card index or UUID (ASCII digits, letters and '-')")
_CLASS = Alphabet(
    re.compile(r"[0-9A-Za-z._:/ -]*"),
    "a job class (ASCII letters, digits, space, '.', '_', ':', '/' and '-')",
)
_NAME = Alphabet(re.compile(r"[0-9A-Za-z._-]*"), "a name (ASCII letters, digits, '.', '_' and '-')")
_ANCHOR = Alphabet(re.compile(r"((slurm|pod):[0-9A-Za-z_.-]+)?"), "an anchor: slurm:<job id> or pod:<uid>")
_TOKEN = Alphabet(re.compile(r"[0-9A-Za-z_-]*"), "a lease token (ASCII letters, digits, '_' and '-')")

LIMITS: dict[str, Limit] = {
    "AcquireRequest.mode": Limit(chars=64, pattern=_NAME),
    "AcquireRequest.gpus": Limit(lo=0, hi=4096),
    "AcquireRequest.priority": Limit(lo=-1_000_000, hi=1_000_000),  # the config's max_priority is stricter
    "AcquireRequest.wait_s": Limit(lo=0, hi=10 * 365 * 86400.0),  # the config's max_wait_s is stricter
    "AcquireRequest.restartable": Limit(),
    "AcquireRequest.command": Limit(chars=COMMAND_CHARS, truncate=True),
    "AcquireRequest.hold": Limit(),
    "AcquireRequest.job_class": Limit(chars=64, pattern=_CLASS),
    "ResizeRequest.lease_id": Limit(chars=64, pattern=_ID),
    "ResizeRequest.token": Limit(chars=64, pattern=_TOKEN),
    "ResizeRequest.mode": Limit(chars=64, pattern=_NAME),
    "WatchLeaseRequest.lease_id": Limit(chars=64, pattern=_ID),
    "AcquireRequest.name": Limit(chars=64, pattern=_NAME),
    "AcquireRequest.wait_longest": Limit(),
    "AcquireRequest.cards": Limit(lo=0, hi=4095, items=4096),
    "AcquireRequest.anchor": Limit(chars=128, pattern=_ANCHOR),
    "AcquireRequest.owner_uid": Limit(lo=0, hi=2**31 - 2),
    "AcquireRequest.when_green": Limit(),
    "AcquireRequest.green_deadline": Limit(lo=0, hi=2**40),  # the daemon allows 31 days ahead at most
    "AcquireRequest.account": Limit(chars=64, pattern=_NAME),  # [accounts.NAME]: the service checks it
    "ReportRequest.by": Limit(chars=16, pattern=_NAME),  # the service names the choices
    "ReportRequest.since": Limit(lo=0, hi=1e11),  # seconds since the epoch
    "ReportRequest.until": Limit(lo=0, hi=1e11),
    "UsageRecordsRequest.since": Limit(lo=0, hi=1e11),
    "UsageRecordsRequest.until": Limit(lo=0, hi=1e11),
    "HoldRequest.lease_id": Limit(chars=64, pattern=_ID),
    "HoldRequest.token": Limit(chars=64, pattern=_TOKEN),
    "ReleaseRequest.lease_id": Limit(chars=64, pattern=_ID),
    "ReleaseRequest.token": Limit(chars=64, pattern=_TOKEN),
    "ReleaseRequest.exit_code": Limit(lo=0, hi=255),  # what waitpid can report
    "ReleaseRequest.exit_signal": Limit(lo=1, hi=64),  # Linux signal numbers (SIGRTMAX is 64)
    "ReleaseRequest.started": Limit(lo=0, hi=1e11),  # seconds since the epoch; the engine clamps it further
    "AckMoveRequest.lease_id": Limit(chars=64, pattern=_ID),
    "AckMoveRequest.token": Limit(chars=64, pattern=_TOKEN),
    "ConfineRequest.lease_id": Limit(chars=64, pattern=_ID),
    "ConfineRequest.token": Limit(chars=64, pattern=_TOKEN),
    "ListLeasesRequest.all": Limit(),
    "ListLeasesRequest.limit": Limit(lo=0, hi=1_000_000),  # the reply is capped at MAX_ENDED_LEASES
    "ListLeasesRequest.lease_id": Limit(chars=64, pattern=_ID),
    "EventsRequest.card": Limit(lo=0, hi=4096),
    "EventsRequest.lease_id": Limit(chars=64, pattern=_ID),
    "EventsRequest.limit": Limit(lo=0, hi=100_000),  # the reply is capped at MAX_EVENTS
    "HealthRequest.card": Limit(chars=ECHO_CHARS, pattern=_CARD),
    "HealthRequest.history": Limit(lo=0, hi=500),  # state changes per card: keeps the reply small
    "WatchRequest.min_interval_s": Limit(lo=0, hi=3600.0),
    "CardRequest.card": Limit(chars=ECHO_CHARS, pattern=_CARD),
    "DrainRequest.card": Limit(chars=ECHO_CHARS, pattern=_CARD),
    "DrainRequest.reason": Limit(chars=500),
    "SetCardModeRequest.card": Limit(chars=ECHO_CHARS, pattern=_CARD),
    "SetCardModeRequest.mode": Limit(chars=64, pattern=_NAME),
    "EvictRequest.lease_id": Limit(chars=64, pattern=_ID),
    "EvictRequest.reason": Limit(chars=500),
    "FaultRequest.card": Limit(chars=ECHO_CHARS, pattern=_CARD),
    "FaultRequest.kind": Limit(chars=64, pattern=_NAME),
    "FaultRequest.xid": Limit(lo=0, hi=1_000_000),
    "DefragRequest.apply": Limit(),
    "DefragRequest.move_budget_pct": Limit(lo=0, hi=100),
    "DefragRequest.gpus": Limit(lo=0, hi=4096),
    "DefragRequest.wait": Limit(),
    # ---- federation: the local half (Node) and the peers' (Peer). Message fields are checked field by
    # field with their own entries; a map's entries count against ``items`` and each key and value
    # against ``chars``.
    "JobInput.start": Limit(),
    "JobInput.stdin": Limit(chars=1 << 20),
    "JobInput.stdin_eof": Limit(),
    "JobInput.signal": Limit(lo=0, hi=64),
    "JobSpec.mode": Limit(chars=64, pattern=_NAME),
    "JobSpec.nodes": Limit(lo=0, hi=1024),
    "JobSpec.gpus_per_node": Limit(lo=0, hi=64),
    "JobSpec.replicas": Limit(lo=0, hi=1024),
    "JobSpec.spread": Limit(),
    "JobSpec.argv": Limit(items=4096, chars=1 << 17),
    "JobSpec.env": Limit(items=4096, chars=1 << 17),
    "JobSpec.cwd": Limit(chars=4096),
    "JobSpec.wait_s": Limit(lo=0, hi=10 * 365 * 86400.0),
    "JobSpec.kill_on_bad_exit": Limit(),
    "JobSpec.restartable": Limit(),
    "JobSpec.name": Limit(chars=64, pattern=_NAME),
    "JobSpec.tasks_per_node": Limit(lo=0, hi=MAX_TASKS_PER_NODE),
    "JobSpec.label_tasks": Limit(),
    "JobSpec.account": Limit(chars=64, pattern=_NAME),  # [accounts.NAME]: the coordinator checks it
    "SwimMessage.kind": Limit(lo=0, hi=5),
    "SwimMessage.seq": Limit(lo=0, hi=2**63),
    "SwimMessage.src": Limit(chars=253, pattern=_NAME),
    "SwimMessage.src_addr": Limit(chars=300),
    "SwimMessage.target": Limit(chars=253, pattern=_NAME),
    "SwimMessage.target_addr": Limit(chars=300),
    "SwimMessage.about": Limit(chars=253, pattern=_NAME),
    "SwimMessage.reply": Limit(),
    "SwimMessage.updates": Limit(items=10_000),
    "SwimUpdate.name": Limit(chars=253, pattern=_NAME),
    "SwimUpdate.addr": Limit(chars=300),
    "SwimUpdate.incarnation": Limit(lo=0, hi=MAX_INCARNATION),  # Swim bounds it further by its clock
    "SwimUpdate.state": Limit(lo=0, hi=3),
    "SwimUpdate.meta": Limit(chars=1024),
    "ReserveRequest.job": Limit(chars=64, pattern=_ID),
    "ReserveRequest.attempt": Limit(lo=0, hi=2**31 - 1),
    "ReserveRequest.mode": Limit(chars=64, pattern=_NAME),
    "ReserveRequest.count": Limit(lo=0, hi=4096),
    "ReserveRequest.ttl_s": Limit(lo=0, hi=600.0),  # the handler asks for 0.5 s at least
    "ReserveRequest.uid": Limit(lo=0, hi=2**32 - 1),
    "ReserveRequest.gid": Limit(lo=0, hi=2**32 - 1),
    "ReserveRequest.user": Limit(chars=64),
    "ReserveRequest.restartable": Limit(),
    "ReserveRequest.command": Limit(chars=COMMAND_CHARS, truncate=True),
    "ReserveRequest.account": Limit(chars=64, pattern=_NAME),  # each host checks the membership again
    "CommitRequest.job": Limit(chars=64, pattern=_ID),
    "CommitRequest.attempt": Limit(lo=0, hi=2**31 - 1),
    "AbortRequest.job": Limit(chars=64, pattern=_ID),
    "AbortRequest.attempt": Limit(lo=0, hi=2**31 - 1),
    "LaunchInput.start": Limit(),
    "LaunchInput.stdin": Limit(chars=1 << 20),
    "LaunchInput.stdin_eof": Limit(),
    "LaunchInput.signal": Limit(lo=0, hi=64),
    "LaunchSpec.job": Limit(chars=64, pattern=_ID),
    "LaunchSpec.rank": Limit(lo=0, hi=1023),
    "LaunchSpec.argv": Limit(items=4096, chars=1 << 17),
    "LaunchSpec.env": Limit(items=4096, chars=1 << 17),
    "LaunchSpec.cwd": Limit(chars=4096),
    "LaunchSpec.uid": Limit(lo=0, hi=2**32 - 1),
    "LaunchSpec.gid": Limit(lo=0, hi=2**32 - 1),
    "LaunchSpec.user": Limit(chars=64),
    "LaunchSpec.tasks_per_node": Limit(lo=0, hi=MAX_TASKS_PER_NODE),
    "LaunchSpec.restarts": Limit(lo=0, hi=1000),  # a --restartable job's restarts (MAX_RESTARTS is 10)
    "LaunchSpec.restartable": Limit(),
    "LaunchSpec.keep_going": Limit(),
    "LaunchSpec.label": Limit(),
    "LaunchSpec.output": Limit(chars=4096),
    "LaunchSpec.error": Limit(chars=4096),
    "LaunchSpec.time_limit_s": Limit(lo=0, hi=366 * 86400.0),
    "LaunchSpec.kill_grace_s": Limit(lo=0, hi=86400.0),
    # ---- jobs (xpud/service/jobs.py); a job is named by its id, an id prefix or its name
    "SubmitJobRequest.argv": Limit(items=4096, chars=1 << 17),
    "SubmitJobRequest.cwd": Limit(chars=4096),
    "SubmitJobRequest.env": Limit(items=4096, chars=1 << 17),
    "SubmitJobRequest.name": Limit(chars=64, pattern=_NAME),
    "SubmitJobRequest.mode": Limit(chars=64, pattern=_NAME),
    "SubmitJobRequest.gpus": Limit(lo=0, hi=4096),
    "SubmitJobRequest.priority": Limit(lo=-1_000_000, hi=1_000_000),
    "SubmitJobRequest.wait_s": Limit(lo=0, hi=10 * 365 * 86400.0),
    "SubmitJobRequest.output": Limit(chars=4096),
    "SubmitJobRequest.error": Limit(chars=4096),
    "SubmitJobRequest.time_limit_s": Limit(lo=0, hi=366 * 86400.0),
    "SubmitJobRequest.after": Limit(items=100, chars=64, pattern=_NAME),
    "SubmitJobRequest.kill_grace_s": Limit(lo=0, hi=86400.0),
    "SubmitJobRequest.restartable": Limit(),
    "SubmitJobRequest.account": Limit(chars=64, pattern=_NAME),  # [accounts.NAME]: the service checks it
    "SubmitJobRequest.nodes": Limit(lo=0, hi=1024),
    "SubmitJobRequest.gpus_per_node": Limit(lo=0, hi=64),
    "SubmitJobRequest.tasks_per_node": Limit(lo=0, hi=MAX_TASKS_PER_NODE),
    "SubmitJobRequest.replicas": Limit(lo=0, hi=1024),
    "SubmitJobRequest.spread": Limit(),
    "SubmitJobRequest.kill_on_bad_exit": Limit(),
    "ListJobsRequest.all": Limit(),
    "ListJobsRequest.uid": Limit(lo=0, hi=2**31 - 1),
    "ListJobsRequest.state": Limit(chars=32, pattern=_NAME),
    "ListJobsRequest.since": Limit(lo=0, hi=1e11),
    "ListJobsRequest.job": Limit(chars=64, pattern=_NAME),
    "ListJobsRequest.limit": Limit(lo=0, hi=1_000_000),
    "CancelJobsRequest.jobs": Limit(items=1000, chars=64, pattern=_NAME),
    "JobLogsRequest.job": Limit(chars=64, pattern=_NAME),
    "JobLogsRequest.follow": Limit(),
    "JobLogsRequest.rank": Limit(lo=0, hi=1023),
    "JobLogsRequest.error": Limit(),
    "ListJobsRequest.here": Limit(),
    "PeerJobsRequest.uid": Limit(lo=0, hi=2**31 - 1),
    "PeerJobsRequest.list": Limit(),
    "PeerJobsRequest.jobs": Limit(items=1000, chars=64, pattern=_NAME),
    "PeerJobsRequest.logs": Limit(),
    "PeerJobsRequest.cancel": Limit(),
    "PeerJobsRequest.reason": Limit(chars=500, truncate=True),
}


def clip(text: str, n: int = ECHO_CHARS) -> str:
    """``text`` cut to ``n`` characters (marked with "…") for quoting in an error message."""
    return text if len(text) <= n else text[: n - 1] + "…"


class Undecodable:
    """Stands in for a request the protobuf runtime could not parse (see ``tolerant``)."""

    def __init__(self, name: str, error: str):
        self.name, self.error = name, error


_last_log = 0.0


def tolerant(cls: Any):
    """A request deserializer for ``cls`` that turns a corrupt message into ``Undecodable`` instead of
    raising (gRPC would answer UNKNOWN and log a traceback for each one)."""
    name = cls.DESCRIPTOR.name

    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, RuntimeError, ValueError) as e:  # RecursionError is a RuntimeError
            global _last_log
            now = time.monotonic()
            if now - _last_log >= 10.0:  # one line per 10 s at most, however many arrive
                _last_log = now
                log.warning("refused an undecodable %s (%d bytes): %s", name, len(data), clip(str(e)))
            return Undecodable(name, clip(str(e)))

    return parse


def check(request: Any) -> None:
    """Raise BadRequest if ``request`` breaks a limit; cut over-long label fields in place.

    Only the fields the message carries are read (``ListFields``, in C): a field left at its default
    passes its limit, which ``_plan`` checked once per message type; the fields for which that is not so
    (no limit, or a default outside it) are read every time."""
    if isinstance(request, Undecodable):
        raise BadRequest(f"not a valid xpud.v1.{request.name} message ({request.error}): use the xpud client")
    plan = _PLANS.get(type(request))
    if plan is None:
        plan = _PLANS[type(request)] = _plan(request.DESCRIPTOR)
    always, when_set = plan
    for step in always:
        _field(request, step, getattr(request, step[0]))
    for fd, value in request.ListFields():
        found = when_set.get(fd)
        if found is not None:
            _field(request, found, value)


def _field(request: Any, step: tuple, value: Any) -> None:
    """Check one field of ``request`` (set, or one of ``_plan``'s always-read fields) holding ``value``."""
    name, where, kind, lim, scalar = step
    if lim is None:  # a field added to the proto without a limit: refuse rather than trust it
        raise BadRequest(f"{where}: this daemon has no limit for the field (a bug: report it)")
    if kind is _MAP:
        if len(value) > lim.items:
            raise BadRequest(f"{where}: {len(value)} entries; at most {lim.items}")
        for k, v in value.items():
            if len(k) > lim.chars or len(v) > lim.chars:
                raise BadRequest(f"{where} {clip(k)!r}: longer than {lim.chars} characters")
    elif kind is _MESSAGES:
        if len(value) > lim.items:
            raise BadRequest(f"{where}: {len(value)} entries; at most {lim.items}")
        for v in value:
            check(v)
    elif kind is _MESSAGE:
        check(value)
    elif kind is _SCALARS:
        if len(value) > lim.items:
            raise BadRequest(f"{where}: {len(value)} entries; at most {lim.items}")
        for v in value:
            scalar(where, lim, v)
    elif lim.truncate and len(value) > lim.chars:
        setattr(request, name, value[: lim.chars - 1] + "…")
    else:
        scalar(where, lim, value)


# message class -> (steps read every time, {field descriptor: step} read when set); a step is (field
# name, "Message.field", kind, limit, scalar check)
_PLANS: dict[type, tuple[list[tuple], dict[Any, tuple]]] = {}
_MAP, _MESSAGES, _MESSAGE, _SCALARS, _SCALAR = "map", "messages", "message", "scalars", "scalar"


def _plan(desc) -> tuple[list[tuple], dict[Any, tuple]]:
    """How ``check`` reads each field of ``desc``, decided once per message type. A field whose absence
    (its default, for a field without presence) would pass its check is read only when set; an empty
    repeated field, map or message, and an absent optional scalar, always pass."""
    always, when_set = [], {}
    for fd in desc.fields:
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            kind = _MAP
        elif fd.message_type is not None:
            kind = _MESSAGES if fd.is_repeated else _MESSAGE
        else:
            kind = _SCALARS if fd.is_repeated else _SCALAR
        where, scalar = f"{desc.name}.{fd.name}", _SCALAR_CHECKS.get(fd.type, _integer)
        step = (fd.name, where, kind, LIMITS.get(where), scalar)
        default_fails = kind is _SCALAR and not fd.has_presence and not _passes(step, fd.default_value)
        if step[3] is None or default_fails:
            always.append(step)
        else:
            when_set[fd] = step
    return always, when_set


def _passes(step: tuple, value: Any) -> bool:
    """Whether a scalar field holding ``value`` passes its check."""
    try:
        step[4](step[1], step[3], value)
    except BadRequest:
        return False
    return True


def _text(where: str, lim: Limit, value: Any) -> None:
    if len(value) > lim.chars:
        raise BadRequest(f"{where}: {len(value)} characters; at most {lim.chars}")
    if lim.pattern and isinstance(value, str) and not lim.pattern.regex.fullmatch(value):
        raise BadRequest(f"{where} {clip(value)!r}: not {lim.pattern.text}")


def _real(where: str, lim: Limit, value: Any) -> None:
    if not math.isfinite(value):
        raise BadRequest(f"{where}: {value} is not a finite number")
    if not lim.lo <= value <= lim.hi:
        raise BadRequest(f"{where}: {value:g} is outside {_range(lim)}")


def _integer(where: str, lim: Limit, value: Any) -> None:
    if isinstance(value, int) and not lim.lo <= value <= lim.hi:
        raise BadRequest(f"{where}: {value} is outside {_range(lim)}")


def _boolean(where: str, lim: Limit, value: Any) -> None:
    """Nothing to check."""


_T = FieldDescriptor
_SCALAR_CHECKS = {  # by field type; any other (integers, enums): _integer
    _T.TYPE_STRING: _text,
    _T.TYPE_BYTES: _text,
    _T.TYPE_DOUBLE: _real,
    _T.TYPE_FLOAT: _real,
    _T.TYPE_BOOL: _boolean,
}


def _range(lim: Limit) -> str:
    return "..".join(str(int(x)) if float(x).is_integer() else f"{x:g}" for x in (lim.lo, lim.hi))
