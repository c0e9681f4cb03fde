"""The device allow-list of a lease: what its processes' cgroup lets them open (issue #32).

Allowed: the control nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``), each of
the lease's cards by **minor number** (``/dev/nvidia<minor>``, ``nvmlDeviceGetMinorNumber``: not the NVML
index), for a MIG slice its parent card plus its GPU-instance and compute-instance capability nodes only
(never ``mig/config`` or ``mig/monitor``), an MPS slice its card's node (the client needs it; the MPS
server holds the only context: the card is EXCLUSIVE_PROCESS), and the usual pseudo-devices. Everything
else is denied (``DevicePolicy=closed``), every other card and capability included.

The entries are systemd ``DeviceAllow=`` specifications (``systemd.resource-control(5)``): a path under
``/dev`` (systemd resolves it to its major:minor when it builds the cgroup's device program) or
``char-NAME`` (every major ``/proc/devices`` lists under NAME), each with ``rw``. Node names come from
``hw/devnodes.py``, which the kubelet bridge uses too, so that a pod and a bare-metal job get the same
nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xpud.hw.devnodes import CONTROL_NODES, DevNodeError, DevTree

# What any process needs: systemd's own "closed" set (null, zero, full, random, urandom, tty, ptmx) named
# anyway, so that the list says it, and the terminals a command may run on (pseudo-terminals, consoles).
PSEUDO = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "char-pts",
)
PERMS = "rw"


@dataclass(frozen=True)
class Grant:
    """A lease's devices on this host, by minor number: whole cards and MPS slices' cards as their minors,
    MIG slices as (parent minor, GPU instance id, compute instance id)."""

    cards: tuple[int, ...] = ()
    migs: tuple[tuple[int, int, int], ...] = ()


def lease_nodes(lease, engine) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, str]]]:
    """The lease's device nodes by minor number, from the engine's cards and its MIG backends' records:
    whole cards and MPS slices' cards as (NVML index, minor), MIG slices as (parent minor, GPU instance
    id, compute instance id, MIG handle). Raises DevNodeError when a card's minor or a MIG instance is
    unknown: a node picked by NVML index could be another card's, so no guess. (Also the kubelet
    bridge's ``handout``.)"""
    by_index = {c.info.index: c.info for c in engine.cards.values()}

    def minor(i: int) -> int:
        m = by_index[i].minor_number if i in by_index else None
        if m is None:
            raise DevNodeError(f"card {i} has no minor number (nvmlDeviceGetMinorNumber): no node to name")
        return m

    migs, mig_cards = [], set()
    for s in lease.slices:
        if s.handle.startswith("MIG-"):
            ids = engine.mig_device_ids(s.card_index, s.handle)
            if ids is None:
                raise DevNodeError(f"card {s.card_index}: MIG device {s.handle} is not known to its backend")
            migs.append((minor(s.card_index), *ids, s.handle))
            mig_cards.add(s.card_index)
    return [(i, minor(i)) for i in lease.cards if i not in mig_cards], migs


def grant_of(lease, engine) -> Grant:
    """The lease's ``Grant`` (``lease_nodes``, by minor number). Raises DevNodeError as it does."""
    cards, migs = lease_nodes(lease, engine)
    return Grant(tuple(m for _, m in cards), tuple(x[:3] for x in migs))


def allow_list(grant: Grant, tree: DevTree, extra: Sequence[str] = (), create: bool = True) -> list[str]:
    """``DeviceAllow=`` entries (``"PATH rw"``) for ``grant``: pseudo-devices, control nodes, cards, MIG
    capabilities (read from the driver's capability files under ``tree.caps``; their nodes made under
    ``tree.dev`` when missing, if ``create``, as ``nvidia-modprobe -f`` does: systemd resolves a path when
    it builds the program, so a node made later would stay denied), then ``extra`` as given. Raises
    DevNodeError when a MIG instance's capability files cannot be read or its nodes made."""
    paths = [*PSEUDO, *(f"/dev/{n}" for n in CONTROL_NODES)]
    for minor in grant.cards:
        paths.append(f"/dev/{DevTree.card(minor)}")
    for parent, gi, ci in grant.migs:  # the parent's node and the two capability nodes, made if missing
        paths += [f"/dev/{n}" for n in tree.mig_nodes(parent, gi, ci, create=create)]
    out = []
    for p in paths:
        entry = f"{p} {PERMS}"
        if entry not in out:
            out.append(entry)
    return out + [e for e in extra if e not in out]
