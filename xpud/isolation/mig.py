"""MIG slices: a GPU instance (with one compute instance over all of it) per slice, at a chosen place.

Sizes map to profiles through the profile map (``mig_map``); where an instance goes is the pure choice of
``xpud.placement.mig.choose``; this module reads the card, applies the choice and keeps the books.

Invariants: a MIG card is sliced exactly when MIG is on; the mode never switches while a process runs on
the card or an instance is in use (``switch_blocker``), and a switch that did not take is cancelled, so no
later reset flips the card behind xpud's back; an instance in which processes still run after its release
is never reused; instances xpud did not make (``mig_book``) are never destroyed, under any ``mig_switch``.

Mode switches, idle instances and start-up reconciliation: see docs/isolation.md, MIG.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from xpud.errors import Conflict, NoCapacity
from xpud.hw.mig_map import ProfileMap, geometry, profiles_for
from xpud.hw.types import MigInstance, NvmlError, NvmlInsufficientResources, NvmlInUse, NvmlNotFound
from xpud.isolation.base import STANDBY, Reconciled
from xpud.isolation.mig_book import MemoryBook, MigBook, ours
from xpud.isolation.runner import Runner
from xpud.model import CardInfo, CardMode, Slice, SliceSpec
from xpud.placement.mig import Geometry, Instance, choose

log = logging.getLogger("xpud.isolation.mig")

RECHECK_S = 5.0  # how often tidy looks again at instances blocked by processes
SWITCH_RETRY_S = 60.0  # after a switch the driver refused (card held), how long before trying again
HELD_BY = (
    "another NVML client holds the card (a monitoring agent such as DCGM or dcgm-exporter, nvidia-smi "
    "polling, a profiler; nvidia-persistenced does not count): stop it, or set [cards] mig_switch = "
    '"never" and set MIG modes with mig-parted'
)


@dataclass
class _Gi:
    """Our record of one GPU instance on the card."""

    info: MigInstance
    lease: str | None = None  # the lease holding it
    idle_since: float | None = None  # kept idle for reuse since (clock seconds)
    blocked: str = ""  # why it is neither held nor free: processes run in it
    standby: str = ""  # the slice size it was pre-created for (xpud.engine.standby), held by no lease yet
    warming: bool = False  # a pre-created instance whose warm_command runs: not handed out meanwhile
    foreign: bool = False  # made by another tool (not in the book): never destroyed by xpud

    @property
    def busy(self) -> bool:
        return self.lease is not None or bool(self.blocked) or self.warming


class MigIsolation:
    """MIG for one card."""

    name = "mig"
    reserved_bytes = 0  # instances' sizes already exclude the driver's reservation

    def __init__(
        self,
        card: CardInfo,
        hw,
        runner: Runner,
        table: ProfileMap,
        slices: Mapping[str, SliceSpec],
        switch: str = "idle",
        idle_keep_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        book: MigBook | None = None,
    ):
        self.card = card
        self.book: MigBook = MemoryBook() if book is None else book  # the instances this xpud made
        self.index = card.index
        self.hw = hw
        self.runner = runner
        self.table = table
        self.slices = dict(slices)
        self.switch = switch
        self.idle_keep_s = idle_keep_s
        self.clock = clock
        self._gis: dict[int, _Gi] = {}  # GPU instance id -> record
        self._geom: Geometry | None = None
        self._map: dict[str, tuple[int, ...]] = {}
        self._next_recheck = 0.0
        self._refused: tuple[float, str] | None = None  # (clock, why) of the last refused switch

    # ------------------------------------------------------------------------------ reading
    def mapping(self) -> tuple[Geometry | None, dict[str, tuple[int, ...]]]:
        """The card's geometry and slice size -> profile ids (None, {} when the card lists no profiles)."""
        if self._geom is None:
            profiles = self.hw.mig_profiles(self.index)
            if profiles:
                self._geom = geometry(profiles)
                self._map = profiles_for(self.card.name, self._geom, self.slices, self.table)
        return self._geom, self._map

    def mig_on(self) -> bool:
        mode = self.hw.mig_mode(self.index)
        return mode is not None and mode[0] == 1

    def _layout(self, keep_standby: bool = False) -> list[Instance]:
        """The instances for ``choose``; with ``keep_standby`` pre-created ones count as busy (kept)."""
        return [
            Instance(g.info.profile_id, g.info.start, g.busy or (keep_standby and bool(g.standby)), gi)
            for gi, g in self._gis.items()
        ]

    def _sizes(self) -> list[tuple[int, ...]]:
        return [ids for ids in self._map.values() if ids]

    def _processes(self, gi: int) -> list[int] | None:
        """PIDs running in a GPU instance; None when they cannot be read."""
        try:
            return self.hw.mig_processes(self.index).get(gi, [])
        except NvmlError as e:
            log.warning("card %d: cannot read the processes of GPU instance %d: %s", self.index, gi, e)
            return None

    def instances(self) -> dict[int, tuple[str | None, str]]:
        """GPU instance id -> (holding lease or None, state: "held", "idle" or "blocked: ...")."""
        return {
            gi: (g.lease, "held" if g.lease else f"blocked: {g.blocked}" if g.blocked else "idle")
            for gi, g in self._gis.items()
        }

    def device_ids(self, uuid: str) -> tuple[int, int] | None:
        """(GPU instance id, compute instance id) of MIG device ``uuid`` on this card, or None."""
        for gi, g in list(self._gis.items()):
            if uuid in g.info.device_uuids:
                return gi, g.info.compute_instance_ids[g.info.device_uuids.index(uuid)]
        return None

    # ------------------------------------------------------------------------------- fitting
    def fits(self, card: CardInfo, held: Sequence[Slice], spec: SliceSpec, owner_uid: int = -1) -> bool:
        return not self.why_not(card, held, spec, owner_uid, room=True)

    def serves_other_user(self, owner_uid: int) -> bool:
        return False  # MIG instances are hard partitions: any users may share a card

    def why_not(self, card, held, spec, owner_uid=-1, room: bool = False) -> str:
        """The reason ``spec`` does not fit ("" when it does). Lack of room is a reason only with ``room``."""
        mode = self.hw.mig_mode(self.index)
        if mode is None:
            return f"card {self.index} ({self.card.name}) has no MIG"
        geom, mapping = self.mapping()
        if geom is not None and not mapping.get(spec.name):
            return f"card {self.index} ({self.card.name}): no MIG profile serves {spec.name}"
        if mode[0] != 1:
            return self.switch_blocker(card, True)
        if geom is None:
            return f"card {self.index}: MIG is on but the card lists no profiles"
        if choose(geom, self._layout(), mapping[spec.name], self._sizes()) is None:
            return f"card {self.index}: no room for {spec.name} beside {self._summary()}" if room else ""
        return ""

    def _summary(self) -> str:
        geom = self._geom
        parts = [
            f"{geom.profile(g.info.profile_id).name}@{g.info.start}"
            f"({'held' if g.lease else 'blocked' if g.blocked else 'idle'})"
            for g in sorted(self._gis.values(), key=lambda g: g.info.start)
        ]
        return ", ".join(parts) or "nothing"

    # ------------------------------------------------------------------------- slices
    def prepare(self, card, held, spec, lease_id, owner_uid):
        ready = self._ready(spec.name)  # pre-created for this size: handed over, nothing created
        inst = self._gis[ready].info if ready is not None else self._make(card, spec)
        g = self._gis[inst.gpu_instance_id]
        g.lease, g.idle_since, g.standby = lease_id, None, ""
        return self._slice(inst, spec.name)

    def _ready(self, size: str) -> int | None:
        """A pre-created instance of ``size`` free to hand out (the oldest GPU instance id first)."""
        return next(
            (gi for gi, g in sorted(self._gis.items()) if g.standby == size and not g.busy and g.info.uuid),
            None,
        )

    def _make(self, card: CardInfo, spec: SliceSpec, keep_standby: bool = False) -> MigInstance:
        """An instance for ``spec``: an idle one reused or a new one created (MIG switched on first)."""
        if not self.mig_on():
            self.enter_sliced(card)
        geom, mapping = self.mapping()
        wanted = mapping.get(spec.name) if geom else None
        if not wanted:
            raise NoCapacity(f"card {self.index} ({card.name}): no MIG profile serves {spec.name}")
        inst = None
        for _attempt in range(3):
            plan = choose(geom, self._layout(keep_standby), wanted, self._sizes())
            if plan is None:
                raise NoCapacity(f"card {self.index}: no room for {spec.name} beside {self._summary()}")
            try:
                inst = self._apply(plan)
                break
            except (NvmlInUse, NvmlInsufficientResources, NvmlNotFound) as e:
                # The card differs from our books (an instance in use, or made by someone else): re-read.
                log.warning("card %d: %s; reading the card again", self.index, e)
                self._sync()
            except NvmlError as e:
                raise Conflict(f"card {self.index}: cannot create a MIG instance: {e}") from None
        if inst is None or inst.uuid is None:
            raise NoCapacity(f"card {self.index}: MIG instances could not be created for {spec.name}")
        return inst

    def _slice(self, inst: MigInstance, size: str) -> tuple[Slice, dict[str, str]]:
        """The ``size`` slice an instance is, and the child's environment on it."""
        geom = self._geom
        prof = geom.profile(inst.profile_id)
        mem = inst.memory_bytes or prof.memory_bytes
        pct = round(100 * prof.compute / geom.compute_slices)
        s = Slice(self.index, size, mem, pct, handle=inst.uuid, placement=inst.start)
        env = {
            "CUDA_VISIBLE_DEVICES": inst.uuid,
            "XPU_MEMORY_LIMIT_BYTES": str(mem),
            "XPU_COMPUTE_PCT": str(pct),
            "XPU_MIG_PROFILE": prof.name,
        }
        return s, env

    def _apply(self, plan) -> MigInstance:
        for d in plan.destroy:
            self._destroy(d.key)
        if plan.reuse is not None:
            return self._gis[plan.reuse.key].info
        uuid = self.card.uuid
        self.book.record(uuid, plan.start, plan.profile)  # durable first: a crash leaves it ours
        try:
            inst = self.hw.create_mig_instance(self.index, plan.profile, plan.start)
        except BaseException:
            self.book.forget(uuid, plan.start)
            raise
        self.book.name(uuid, inst.start, inst.uuid or "")
        self._gis[inst.gpu_instance_id] = _Gi(inst)
        log.info("card %d: created MIG %s at %d (%s)", self.index, inst.name, inst.start, inst.uuid)
        return inst

    def _destroy(self, gi: int) -> None:
        g = self._gis.get(gi)
        if g is not None and g.foreign:
            raise Conflict(f"card {self.index}: GPU instance {gi} was not made by xpud: left alone")
        try:
            self.hw.destroy_mig_instance(self.index, gi)
        except NvmlNotFound:
            pass  # already gone
        except NvmlInUse:
            self._gis[gi].blocked = "processes still run in it"
            self._gis[gi].idle_since = None
            raise
        self._gis.pop(gi, None)
        if g is not None:
            self.book.forget(self.card.uuid, g.info.start)

    def _by_uuid(self, uuid: str) -> int | None:
        return next((gi for gi, g in self._gis.items() if uuid in g.info.device_uuids), None)

    def teardown(self, card, s) -> None:
        gi = self._by_uuid(s.handle)
        if gi is None:
            log.warning("card %d: MIG device %s was already gone at release", self.index, s.handle)
            return
        g = self._gis[gi]
        g.lease = None
        pids = self._processes(gi)
        if pids:
            g.blocked = f"released with processes {', '.join(map(str, pids))} still in it"
            log.warning("card %d: GPU instance %d %s; destroyed once they exit", self.index, gi, g.blocked)
            return
        if pids == [] and self.idle_keep_s > 0:
            g.idle_since = self.clock()  # kept for reuse
            return
        try:
            self._destroy(gi)
        except NvmlInUse:
            log.warning("card %d: GPU instance %d in use at release; destroyed once free", self.index, gi)
        except NvmlError as e:
            g.blocked = f"could not be destroyed: {e}"
            raise Conflict(f"card {self.index}: releasing GPU instance {gi} failed: {e}") from None

    # ------------------------------------------------------------- pre-created slices (xpud.engine.standby)
    def precreate(self, card: CardInfo, spec: SliceSpec) -> tuple[Slice, dict[str, str]]:
        """Create (or take an idle instance as) a ``spec`` slice held by no lease, for the first request
        of its size; the same choice and creation as ``prepare``, never undoing other pre-created ones.
        The card must be sliced (MIG on) already. Raises NoCapacity when there is no room."""
        if not self.mig_on():
            raise Conflict(f"card {self.index}: MIG is off; pre-created slices need a sliced card")
        inst = self._make(card, spec, keep_standby=True)
        g = self._gis[inst.gpu_instance_id]
        g.standby, g.idle_since = spec.name, None
        return self._slice(inst, spec.name)

    def standby(self) -> dict[str, str]:
        """MIG device UUID -> size of each pre-created instance no lease holds yet."""
        return {g.info.uuid: g.standby for g in self._gis.values() if g.standby and g.info.uuid}

    def set_warming(self, handle: str, on: bool) -> None:
        """While its warm_command runs, a pre-created instance is not handed out (nor destroyed)."""
        gi = self._by_uuid(handle)
        if gi is not None:
            self._gis[gi].warming = on

    def drop_standby(self, handle: str) -> None:
        """Destroy a pre-created instance no lease took (its record is gone from the ledger already).
        One that cannot be destroyed now is left idle for ``tidy``."""
        gi = self._by_uuid(handle)
        if gi is None or not self._gis[gi].standby:
            return
        g = self._gis[gi]
        g.standby, g.warming, g.idle_since = "", False, self.clock() - self.idle_keep_s
        try:
            self._destroy(gi)
        except NvmlError as e:
            log.warning("card %d: pre-created GPU instance %d not destroyed yet: %s", self.index, gi, e)

    def tidy(self, now: float | None = None) -> list[str]:
        """Destroy idle instances kept longer than ``mig_idle_keep_s`` and blocked ones whose processes
        are gone (checked every RECHECK_S). Returns one line per destroyed instance."""
        now = self.clock() if now is None else now
        done = []
        recheck = now >= self._next_recheck
        if recheck:
            self._next_recheck = now + RECHECK_S
        for gi, g in list(self._gis.items()):
            if g.lease is not None or g.foreign:
                continue
            expired = g.idle_since is not None and now - g.idle_since >= self.idle_keep_s
            freed = bool(g.blocked) and recheck and self._processes(gi) == []
            if expired or freed:
                try:
                    self._destroy(gi)
                    done.append(
                        f"card {self.index}: destroyed {'idle' if expired else 'freed'} instance {gi}"
                    )
                except NvmlError as e:
                    log.warning("card %d: destroying GPU instance %d failed: %s", self.index, gi, e)
        return done

    # -------------------------------------------------------------------------------- modes
    def switch_blocker(self, card, sliced: bool) -> str:
        on = self.mig_on()
        if sliced == on:
            return ""
        if self.switch == "never":
            return (
                f'card {self.index}: MIG is {"on" if on else "off"} and [cards] mig_switch = "never" '
                "(the operator sets MIG modes)"
            )
        if self._refused is not None and self.clock() - self._refused[0] < SWITCH_RETRY_S:
            return f"{self._refused[1]} (tried {self.clock() - self._refused[0]:.0f} s ago)"
        foreign = [gi for gi, g in self._gis.items() if g.foreign]
        if foreign:
            return (
                f"card {self.index}: MIG instances {', '.join(map(str, foreign))} were made by another tool "
                "(mig-parted, the GPU Operator, an operator): xpud leaves them and MIG alone"
            )
        busy = [gi for gi, g in self._gis.items() if g.busy]
        if busy:
            return f"card {self.index}: MIG instances {', '.join(map(str, busy))} are in use"
        procs = self.hw.processes(self.index)
        if procs:
            pids = ", ".join(str(p) for p, _ in procs[:5])
            return (
                f"card {self.index}: {len(procs)} process(es) run on it (pid {pids}); "
                "MIG switches only on an idle card"
            )
        return ""

    def enter_sliced(self, card) -> CardInfo | None:
        if self.mig_on():
            return None
        blocker = self.switch_blocker(card, True)
        if blocker:
            raise Conflict(blocker)
        self._set_mig(True)
        return self.hw.card_info(self.index)  # the driver may renumber the card's minor on a MIG change

    def leave_sliced(self, card) -> CardInfo | None:
        if not self.mig_on():
            return None
        blocker = self.switch_blocker(card, False)
        if blocker:
            raise Conflict(blocker)
        for gi in list(self._gis):
            try:
                self._destroy(gi)
            except NvmlError as e:
                raise Conflict(f"card {self.index}: cannot destroy GPU instance {gi}: {e}") from None
        self._sync()
        if self._gis:
            raise Conflict(f"card {self.index}: MIG instances remain ({self._summary()}); MIG stays on")
        self._set_mig(False)
        return self.hw.card_info(self.index)

    def _set_mig(self, enabled: bool) -> None:
        """Switch MIG on or off, or leave the card as it was (nothing pending) and raise Conflict."""
        word = "on" if enabled else "off"
        with self.hw.card_released(self.index):
            try:
                outcome = self.hw.set_mig_mode(self.index, enabled)
            except NvmlError as e:
                self._cancel_pending(word)
                raise Conflict(f"card {self.index}: cannot switch MIG {word}: {e}") from None
            why = ""
            if outcome == "reset":  # the driver cannot reset the card itself here
                bus = self.card.pci_bus_id
                done = self.runner.run(["nvidia-smi", "--gpu-reset", "-i", bus], timeout_s=120)
                if not done.ok:
                    said = (done.stderr or done.stdout).strip().splitlines()
                    why = f"nvidia-smi --gpu-reset refused ({said[0] if said else done.returncode})"
            mode = self.hw.mig_mode(self.index)
            if mode is None or mode[0] != int(enabled):
                self._cancel_pending(word)
                why = why or self._held_by()
                msg = f"card {self.index}: the driver did not switch MIG {word}: {why}; MIG stays "
                msg += "on" if not enabled else "off"
                self._refused = (self.clock(), msg)
                raise Conflict(msg)
        self._refused = None
        self._gis.clear()
        self._sync()
        log.info("card %d: MIG switched %s", self.index, word)

    def _cancel_pending(self, word: str) -> None:
        try:
            if self.hw.cancel_pending_mig_mode(self.index):
                log.info("card %d: the pending MIG %s is cancelled", self.index, word)
        except NvmlError as e:
            log.error(
                "card %d: MIG %s stays pending (%s): the next GPU reset would switch it; cancel it with "
                "`nvidia-smi -i %s -mig %d`",
                self.index,
                word,
                e,
                self.card.pci_bus_id,
                0 if word == "on" else 1,
            )

    def _held_by(self) -> str:
        """What holds the card, as far as NVML can tell (it lists processes, not other NVML clients)."""
        try:
            procs = self.hw.processes(self.index)
        except NvmlError:
            procs = []
        if procs:
            pids = ", ".join(str(p) for p, _ in procs[:5])
            return f"the card is in use by {len(procs)} process(es) (pid {pids})"
        return HELD_BY

    def _sync(self) -> None:
        """Bring our books in line with the card: add instances we did not know of, drop vanished ones."""
        found = {m.gpu_instance_id: m for m in self.hw.mig_instances(self.index)}
        for gi in list(self._gis):
            if gi not in found:
                if self._gis[gi].lease:
                    log.error(
                        "card %d: GPU instance %d of lease %s vanished", self.index, gi, self._gis[gi].lease
                    )
                del self._gis[gi]
        for gi, m in found.items():
            if gi in self._gis:
                self._gis[gi].info = m
            elif ours(self.book, self.card.uuid, m):
                self._gis[gi] = _Gi(m, idle_since=self.clock())
            else:
                self._gis[gi] = _Gi(m, blocked="found on the card, not made by this xpud", foreign=True)

    # ----------------------------------------------------------------------------- start-up
    def reconcile(self, card, mode: CardMode, held) -> Reconciled:
        self._gis.clear()
        notes: list[str] = []
        uuid = self.card.uuid
        if not self.mig_on():
            for start, _, _ in self.book.made(uuid):
                self.book.forget(uuid, start)  # MIG off: no instance is left
            lost = [h.lease_id for h in held]
            notes += [f"card {self.index}: MIG is off; the MIG slice of lease {lid} is gone" for lid in lost]
            return Reconciled(CardMode.WHOLE, lost, notes)
        self.mapping()
        try:
            procs = self.hw.mig_processes(self.index)
        except NvmlError as e:
            procs = None
            notes.append(f"card {self.index}: cannot read processes per MIG instance ({e}); touching none")
        held_by_uuid = {h.slice.handle: h for h in held}
        seen = set()
        found = self.hw.mig_instances(self.index)
        starts = {m.start for m in found}
        for start, _, _ in self.book.made(uuid):
            if start not in starts:
                self.book.forget(uuid, start)  # gone while xpud was down
        for m in found:
            h = next((held_by_uuid[u] for u in m.device_uuids if u in held_by_uuid), None)
            if h is not None and h.lease_id.startswith(STANDBY):
                self._gis[m.gpu_instance_id] = _Gi(m, standby=h.slice.size)
                seen.add(h.lease_id)
                notes.append(
                    f"card {self.index}: adopted pre-created MIG {m.name}@{m.start} ({h.slice.size})"
                )
            elif h is not None:
                self._gis[m.gpu_instance_id] = _Gi(m, lease=h.lease_id)
                seen.add(h.lease_id)
                notes.append(f"card {self.index}: adopted MIG {m.name}@{m.start} of lease {h.lease_id}")
            elif not ours(self.book, uuid, m):
                self._gis[m.gpu_instance_id] = _Gi(
                    m, blocked="made by another tool, not by this xpud", foreign=True
                )
                notes.append(
                    f"card {self.index}: MIG {m.name}@{m.start} was not made by this xpud (mig-parted, the "
                    "GPU Operator, an operator?): left alone, its space blocked; destroy it yourself "
                    f"(nvidia-smi mig -i {self.index} -dci -gi {m.gpu_instance_id}; "
                    f"nvidia-smi mig -i {self.index} -dgi -gi {m.gpu_instance_id}) if nothing needs it"
                )
            elif procs is None or procs.get(m.gpu_instance_id):
                pids = ", ".join(map(str, (procs or {}).get(m.gpu_instance_id, []))) or "unknown"
                self._gis[m.gpu_instance_id] = _Gi(m, blocked=f"found at start-up with processes ({pids})")
                notes.append(
                    f"card {self.index}: MIG {m.name}@{m.start} has processes ({pids}) and no lease; "
                    "left alone, its space blocked until they exit"
                )
            else:
                try:
                    self.hw.destroy_mig_instance(self.index, m.gpu_instance_id)
                    self.book.forget(uuid, m.start)
                    notes.append(f"card {self.index}: destroyed orphaned MIG {m.name}@{m.start}")
                except NvmlError as e:
                    self._gis[m.gpu_instance_id] = _Gi(m, blocked=f"orphan that could not be destroyed: {e}")
                    notes.append(f"card {self.index}: orphaned MIG {m.name}@{m.start} not destroyed: {e}")
        lost = [h.lease_id for h in held if h.lease_id not in seen]
        notes += [
            f"card {self.index}: the MIG instance of lease {lid} is gone"
            for lid in lost
            if not lid.startswith(STANDBY)
        ]
        if seen or any(g.blocked for g in self._gis.values()):
            return Reconciled(CardMode.SLICED, lost, notes)
        if mode is CardMode.WHOLE and not self.switch_blocker(card, False):
            try:
                self._set_mig(False)  # MIG on with nothing in it, on a card the ledger has whole
            except Conflict as e:  # e.g. a monitoring agent holds the card: it stays sliced
                notes.append(f"{e}; the card stays sliced")
                return Reconciled(CardMode.SLICED, lost, notes)
            notes.append(f"card {self.index}: MIG was on with nothing in it; switched off (card whole)")
            return Reconciled(CardMode.WHOLE, lost, notes)
        return Reconciled(CardMode.SLICED, lost, notes)
