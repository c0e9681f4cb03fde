"""Model objects -> protocol messages (one place, used by the service)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from xpud.api import capacity
from xpud.api.v1 import xpu_pb2 as pb
from xpud.model import CardSample, CardView, Lease, QueuedRequest, Slice, SliceSpec

# The sample's fields the protocol carries; the others (fabric state, recovery action) reach clients as
# health signals (CardHealth), with their reasons.
_SAMPLE_FIELDS = [
    f.name for f in dataclasses.fields(CardSample) if f.name in pb.Sample.DESCRIPTOR.fields_by_name
]


def sample_pb(s: CardSample | None) -> pb.Sample | None:
    if s is None:
        return None
    return pb.Sample(**{k: v for k in _SAMPLE_FIELDS if (v := getattr(s, k)) is not None})


def slice_pb(lease_id: str, s: Slice) -> pb.SliceHeld:
    return pb.SliceHeld(
        lease_id=lease_id,
        size=s.size,
        memory_bytes=s.memory_bytes,
        compute_pct=s.compute_pct,
        handle=s.handle,
        placement=s.placement,
    )


def card_pb(v: CardView, isolation: str = "") -> pb.Card:
    i = v.info
    return pb.Card(
        index=i.index,
        uuid=i.uuid,
        name=i.name,
        memory_total_bytes=i.memory_total_bytes,
        pci_bus_id=i.pci_bus_id,
        numa_node=i.numa_node,
        mig_capable=i.mig_capable,
        mig_enabled=i.mig_enabled,
        mode=v.mode.value,
        mode_pinned=v.mode_pinned,
        drained=v.drained,
        drain_reason=v.drain_reason,
        health_state=v.health_state.value,
        health_score=v.health_score,
        whole_lease=v.whole_lease or "",
        slices=[slice_pb(lid, s) for lid, s in v.slices],
        free_memory_fraction=v.free_memory_fraction,
        free_compute_pct=v.free_compute_pct,
        sample=sample_pb(v.sample),
        isolation=isolation,
        cpu_affinity=list(i.cpu_affinity),
        nvlink_active_links=i.nvlink_active_links,
        minor_number=i.minor_number,
    )


def cards_reply(cards: Iterable[pb.Card], hostname: str, sizes: Mapping[str, SliceSpec]) -> pb.ListCardsReply:
    """The cards with the capacity they leave now (``capacity.free``): whole cards, slices per size."""
    cards = list(cards)
    return pb.ListCardsReply(cards=cards, hostname=hostname, **capacity.free(cards, sizes))


def lease_pb(lease: Lease, show_env: bool, held: bool = False) -> pb.Lease:
    return pb.Lease(
        id=lease.id,
        mode=lease.mode.value,
        owner_uid=lease.owner_uid,
        cards=list(lease.cards),
        card_uuids=list(lease.card_uuids),
        slices=[slice_pb(lease.id, s) for s in lease.slices],
        env=lease.env if show_env else {},
        priority=lease.priority,
        restartable=lease.restartable,
        holder_pid=lease.holder_pid or 0,
        command=lease.command,
        created=lease.created,
        state=lease.state.value,
        restart_count=lease.restart_count,
        mark=lease.mark,
        held=held,
        exit_code=lease.exit_code,
        exit_signal=lease.exit_signal,
        started=lease.started,
        ended=lease.ended,
        end_reason=lease.end_reason,
        name=lease.name,
        anchor=lease.anchor,
        account=lease.account or "default",
    )


# What ending a lease changes in it (the engine's ``_ended``: a copy of the active lease with these)
_END_FIELDS = ("state", "mark", "ended", "end_reason", "started", "exit_code", "exit_signal")


def end_lease_pb(msg: pb.Lease, ended: Lease) -> None:
    """Make ``msg``, ``lease_pb`` of a lease while it was active, the message of ``ended``, the copy
    ``_ended`` made of it: only the fields an end changes are set (a copy of a message and these cost a
    fifth of ``lease_pb``)."""
    for name in _END_FIELDS:
        value = getattr(ended, name)
        if value is None:
            msg.ClearField(name)
        else:
            setattr(msg, name, value.value if name == "state" else value)


def queue_pb(q: QueuedRequest) -> pb.QueueEntry:
    r = q.request
    return pb.QueueEntry(
        ticket=q.ticket,
        mode=r.mode.value,
        gpus=r.gpus,
        priority=r.priority,
        owner_uid=r.owner_uid,
        command=r.command,
        position=q.position,
        enqueued=q.enqueued,
        deadline=q.deadline,
        reason=q.reason,
        name=r.name,
        not_before=r.not_before,
        not_before_reason=r.not_before_reason,
        account=r.account or "default",
    )


def lease_load_pb(load: dict) -> pb.LeaseLoad:
    """A lease's load (``Rightsizer.load``) as a message: unknown figures as -1."""

    def known(v):
        return -1 if v is None else v

    return pb.LeaseLoad(
        lease_id=load["lease_id"],
        mode=load["mode"],
        t=load["t"],
        cap_pct=known(load["cap_pct"]),
        used_pct=known(load["used_pct"]),
        mem_used_bytes=known(load["mem_used_bytes"]),
        throttled=load["throttled"],
        waiting_for_size=load["waiting_for_size"],
        moving=load["moving"],
    )


def event_pb(e) -> pb.Event:
    """An event as the ledger records it (``xpud.ledger.ledger.EventRecord``) -> message."""
    return pb.Event(timestamp=e.ts, kind=e.kind, card=e.card, lease_id=e.lease_id, message=e.message, id=e.id)


def free_cards_pb(f) -> pb.FreeCards:
    """``xpud.controllers.defragmenter.FreeCards`` -> message."""
    return pb.FreeCards(
        idle=f.idle, group=f.group, group_gbps=f.group_gbps, quality_gbps=f.quality_gbps, value=f.value
    )


def defrag_pb(plan, outcomes=(), applied: bool = False, summary: str = "") -> pb.DefragReply:
    """A ``xpud.controllers.defragmenter.DefragPlan`` (and, once applied, each move's ``MoveOutcome``) ->
    DefragReply."""
    state = {id(o.move): o for o in outcomes}
    reason = f"makes room for {plan.gpus} whole card(s)" if plan.gpus else "frees whole cards"
    moves = []
    for m in plan.moves:
        o = state.get(id(m))
        moves.append(
            pb.Move(
                lease_id=m.lease_id,
                from_cards=m.src,
                to_cards=m.dst,
                cost=m.cost,
                reason=reason,
                mode=m.mode,
                wave=m.wave,
                state=o.state if o else "proposed",
                detail=o.detail if o else "",
            )
        )
    return pb.DefragReply(
        moves=moves,
        applied=applied,
        summary=summary or plan.describe(),
        before=free_cards_pb(plan.before),
        after=free_cards_pb(plan.after),
        cost=plan.cost,
        move_budget=plan.budget,
        move_budget_pct=plan.budget_pct,
        active_leases=plan.active,
        movable_leases=plan.movable,
        gpus=plan.gpus,
        target_cards=plan.target_cards,
        notes=plan.notes,
    )


def cluster_host_pb(e, is_self: bool = False) -> pb.ClusterHost:
    """A ``xpud.federation.view.HostEntry`` as the reply of ``GetCluster``."""
    s = e.summary
    host = pb.ClusterHost(
        name=e.name,
        addr=e.addr,
        state=str(e.state),
        incarnation=e.incarnation,
        age_s=round(e.age_s, 3),
        self=is_self,
        summary_valid=s is not None,
    )
    if s is not None:
        host.zone, host.block, host.domain = s.zone, s.block, s.domain
        host.cards, host.free_whole, host.health, host.queue = s.cards, s.free_whole, s.health, s.queue
        host.free_slices.update(s.free_slices)
        host.group_gbps.extend(0.0 if math.isinf(x) else x for x in s.group_gbps)
        if s.accounts is not None:
            host.accounts_hash = s.accounts.config_hash
    return host


def card_health_pb(v) -> pb.CardHealth:
    """One card's health for GetHealth (``xpud.controllers.health.HealthView``: its report, with every
    signal and reason, and its ledger's state-change history) -> message."""
    r = v.report
    return pb.CardHealth(
        index=v.index,
        uuid=v.uuid,
        score=r.score,
        state=r.state.value,
        signals=[
            pb.Signal(
                name=s.name,
                value=s.value,
                threshold=s.threshold,
                unit=s.unit,
                status=s.status,
                reason=s.reason,
                until=s.until,
            )
            for s in r.signals
        ],
        history=[
            pb.StateChange(
                timestamp=ch.ts,
                from_state=ch.from_state,
                to_state=ch.to_state,
                reasons=list(ch.reasons),
                score=ch.score,
            )
            for ch in v.changes
        ],
        reasons=list(v.reasons),
        clear_since=r.clear_since or 0.0,
        raw_state=r.raw_state.value,
        clear_needed_s=r.clear_needed_s,
        back_at=r.back_at,
        window_ends=r.window_ends,
    )


def usage_row_pb(r) -> pb.UsageRow:
    """A ``LeaseUsage`` row (``xpud.controllers.rightsizer.UsageRow``) -> message."""
    return pb.UsageRow(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)})


def job_pb(r, full: bool) -> pb.JobRecord:
    """A job record (``xpud.ledger.jobs.JobRecord``, or any object with its fields) as a message;
    ``full``: with its command, directory and files (its owner and operators)."""
    s = r.spec
    msg = pb.JobRecord(
        id=r.id,
        name=r.name,
        kind=r.kind,
        uid=r.uid,
        gid=r.gid,
        state=r.state,
        hosts=list(r.hosts),
        submitted=r.submitted,
        reason=r.reason,
        lease_id=r.lease_id,
        mode=str(s.get("mode", "")),
        gpus=int(s.get("gpus", 0)),
        priority=int(s.get("priority", 0)),
        time_limit_s=float(s.get("time_limit_s", 0.0)),
        after=list(s.get("after", [])),
        restartable=bool(s.get("restartable", False)),
        restarts=int(s.get("restarts", 0)),
        account=str(s.get("account", "")),
    )
    for name in ("exit_code", "exit_signal", "started", "ended"):
        if (v := getattr(r, name)) is not None:
            setattr(msg, name, v)
    for x in s.get("ranks", ()):  # a submitted multi-host job's ranks (xpud.service.gangjobs)
        m = msg.ranks.add(rank=x["rank"], host=x["host"], state=x["state"], job=x.get("job", ""))
        m.reason = str(x.get("reason", "")) if full else ""
        for name in ("exit_code", "exit_signal", "ended"):
            if x.get(name) is not None:
                setattr(m, name, x[name])
    if full:
        import shlex

        msg.command = shlex.join(r.argv)[:500]
        msg.cwd = r.cwd
        msg.output = str(s.get("output", ""))
        msg.error = str(s.get("error", ""))
    return msg


def usage_records_pb(host: str, records, reclaims, truncated: bool) -> pb.UsageRecordsReply:
    """``planning.usage_report`` records and reclaims of one host -> the reply of ``Peer.UsageRecords``."""
    reply = pb.UsageRecordsReply(host=host, truncated=truncated)
    for r in records:
        m = reply.records.add(
            account=r.account,
            user=r.user,
            card_model=r.card_model,
            gpus=r.gpus,
            start=r.start,
            wait_s=r.wait_s,
        )
        if r.end is not None:
            m.end = r.end
    for c in reclaims:
        reply.reclaims.add(at=c.at, victim=c.victim, beneficiary=c.beneficiary)
    return reply
