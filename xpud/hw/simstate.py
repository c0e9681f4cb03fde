"""The simulated machine's hardware state outlives the daemon, as the real driver's does.

On a real host, MIG mode, GPU and compute instances, compute and persistence modes and MPS control
daemons (with their servers and limits) belong to the driver and to processes of their own: they survive
a restart or a crash of xpud. ``SimState`` gives the simulated machine the same property: every change of
that state in ``FakeNvml`` (its ``on_change`` hook) or ``FakeNvidiaTools`` (likewise) rewrites one JSON
file atomically (write beside it, then rename: a process killed at any moment leaves the old file or the
new one), and a new daemon reads it at start-up, before the adapter opens the fake.

Not kept: faults, counters and processes other than MPS servers (a daemon restart is not a reboot, but
the simulated cards' faults are test injections of one daemon's life). A file written for another
machine (other card UUIDs) is ignored with a warning: that is another host's hardware. A file that does
not parse or holds values the hardware could not have stops the start-up with its path and the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from xpud.errors import XpudError

log = logging.getLogger("xpud.hw.simstate")

VERSION = 1
FILE_NAME = "simulated-hardware.json"
MAX_BYTES = 4 << 20  # far above any machine's state; a bigger file is not ours
MAX_PID = 1 << 31


class SimStateError(XpudError):
    """The state file cannot be used; names the file, the value and what to do."""

    code = "FAILED_PRECONDITION"


class SimState:
    """One simulated machine's persistent hardware state (thread-safe)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = (
            threading.Lock()
        )  # innermost: taken with the fake's or the tools' lock held, never around them
        self._parts: dict[str, Any] = {}
        self._saved: dict[str, Any] | None = None  # the file as read (None: none, or another machine's)
        self._nvml = None
        self._tools = None

    # ------------------------------------------------------------------------------- reading
    def _read(self, fake) -> dict[str, Any] | None:
        try:
            if self.path.stat().st_size > MAX_BYTES:
                raise self._bad(f"larger than {MAX_BYTES} bytes")
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise self._bad(str(e)) from None
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise self._bad(f"not a version-{VERSION} simulated hardware state")
        uuids = [c.uuid for c in fake.machine.cards]
        if data.get("cards") != uuids:
            log.warning(
                "%s describes other cards than machine %r: ignored (this is fresh hardware)",
                self.path,
                fake.machine.name,
            )
            return None
        return data

    def _bad(self, why: str) -> SimStateError:
        return SimStateError(
            f"simulated hardware state {self.path}: {why}; delete the file to start from a fresh machine"
        )

    # ------------------------------------------------------------------------------ NVML part
    def attach(self, fake) -> None:
        """Load the MIG and compute-mode state into ``fake`` (a new ``FakeNvml``, not yet opened) and
        save every later change. Raises ``SimStateError`` for a bad file."""
        self._saved = self._read(fake)
        if self._saved is not None:
            try:
                _load_nvml(fake, self._saved.get("nvml", {}))
            except (KeyError, TypeError, ValueError) as e:
                raise self._bad(f"nvml: {e}") from None
        self._nvml = fake
        self._parts["cards"] = [c.uuid for c in fake.machine.cards]
        self._parts["nvml"] = _dump_nvml(fake)
        self._parts.setdefault("mps", (self._saved or {}).get("mps", {"daemons": []}))
        fake.on_change = self._nvml_changed
        fake.sim_state = self
        self._write()

    def _nvml_changed(self) -> None:
        part = _dump_nvml(self._nvml)  # called with the fake's lock held
        with self._lock:
            self._parts["nvml"] = part
            self._write()

    # ------------------------------------------------------------------------------ MPS part
    def attach_tools(self, tools) -> None:
        """Load the MPS control daemons into ``tools`` (a new ``FakeNvidiaTools`` over the attached fake)
        and save every later change."""
        mps = (self._saved or {}).get("mps", {"daemons": []})
        try:
            tools.restore(mps)
        except (KeyError, TypeError, ValueError) as e:
            raise self._bad(f"mps: {e}") from None
        self._tools = tools
        tools.on_change = self._tools_changed
        self._tools_changed()

    def _tools_changed(self) -> None:
        part = self._tools.dump()  # called with the tools' lock held
        with self._lock:
            self._parts["mps"] = part
            self._write()

    # ------------------------------------------------------------------------------- writing
    def _write(self) -> None:
        data = {"version": VERSION, **self._parts}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, sort_keys=True))
            os.replace(tmp, self.path)  # no fsync: the simulated hardware survives crashes, not power cuts
        except OSError as e:
            log.error("cannot save the simulated hardware state to %s: %s", self.path, e)
            with contextlib.suppress(OSError):
                tmp.unlink()


# ------------------------------------------------------------------------------ NVML (de)serialising


def _dump_nvml(fake) -> dict[str, Any]:
    with fake._lock:
        return {
            "serial": fake._serial,
            "cards": [
                {
                    "mig": card.mig,
                    "mig_pending": card.mig_pending,
                    "compute_mode": card.compute_mode,
                    "persistence": card.persistence,
                    "gpu_instances": [
                        {
                            "id": gi.id,
                            "profile_id": gi.spec.id,
                            "start": gi.start,
                            "compute_instances": [
                                {
                                    "id": ci.id,
                                    "profile": ci.profile,
                                    "slices": ci.slices,
                                    "start": ci.start,
                                    "mig_index": ci.mig_index,
                                    "uuid": ci.uuid,
                                }
                                for ci in sorted(gi.cis.values(), key=lambda c: c.id)
                            ],
                        }
                        for gi in sorted(card.gis.values(), key=lambda g: g.id)
                    ],
                }
                for card in fake._cards
            ],
        }


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{what} = {value!r}: expected an integer {lo}..{hi}")
    return value


def _load_nvml(fake, data: dict[str, Any]) -> None:
    """Recreate the saved MIG state in a fresh fake, refusing what the hardware could not hold."""
    import pynvml as N

    from xpud.hw import fakenvml as F

    cards = data["cards"]
    if not isinstance(cards, list) or len(cards) != len(fake._cards):
        raise ValueError(f"{len(cards) if isinstance(cards, list) else cards!r} cards saved")
    modes = (N.NVML_COMPUTEMODE_DEFAULT, N.NVML_COMPUTEMODE_PROHIBITED, N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    with fake._lock:
        fake._serial = _int(data["serial"], "serial", 0, MAX_PID)
        for card, saved in zip(fake._cards, cards, strict=True):
            where = f"card {card.index}"
            mode = _int(saved["compute_mode"], f"{where} compute_mode", 0, 3)
            if mode not in modes:
                raise ValueError(f"{where} compute_mode = {mode}: not a mode the driver sets")
            card.compute_mode = mode
            card.persistence = _int(saved["persistence"], f"{where} persistence", 0, 1)
            gis = saved["gpu_instances"]
            mig, pending = (_int(saved[k], f"{where} {k}", 0, 1) for k in ("mig", "mig_pending"))
            if (mig or pending or gis) and not card.model.mig_capable:
                raise ValueError(f"{where}: MIG state saved for a card without MIG")
            if gis and not mig:
                raise ValueError(f"{where}: GPU instances saved with MIG off")
            card.mig, card.mig_pending = mig, pending
            taken: set[int] = set()
            for g in gis:
                try:
                    spec = fake._profile(card, g["profile_id"])
                except N.NVMLError:
                    raise ValueError(f"{where}: no MIG profile id {g['profile_id']!r}") from None
                gi_id, start = _int(g["id"], f"{where} GPU instance id", 0, 15), g["start"]
                if start not in spec.placements or gi_id in card.gis:
                    raise ValueError(f"{where}: GPU instance {gi_id} ({spec.name}) at {start!r} cannot exist")
                slots = set(range(start, start + spec.placement_size))
                if slots & taken:
                    raise ValueError(f"{where}: GPU instance {gi_id} overlaps another")
                taken |= slots
                gi = F._Gi(card, gi_id, spec, start)
                gi.handle = fake._new_handle(N.c_nvmlGpuInstance_t, "gi", gi)
                card.gis[gi_id] = gi
                shapes = fake._ci_slices(gi)
                for c in g["compute_instances"]:
                    ci_id = _int(c["id"], f"{where} compute instance id", 0, 7)
                    idx = _int(c["mig_index"], f"{where} MIG device index", 0, card.model.max_mig_devices - 1)
                    profile = c["profile"]
                    if shapes.get(profile) != c["slices"] or ci_id in gi.cis or idx in card.mig_devices:
                        raise ValueError(
                            f"{where}: compute instance {ci_id} of GPU instance {gi_id} cannot exist"
                        )
                    uuid = c["uuid"]
                    if not isinstance(uuid, str) or not uuid.startswith("MIG-") or len(uuid) > 64:
                        raise ValueError(f"{where}: MIG device UUID {uuid!r}")
                    start_ci = _int(c["start"], f"{where} compute instance start", 0, 7)
                    ci = F._Ci(gi, ci_id, profile, c["slices"], start_ci, idx, uuid)
                    ci.handle = fake._new_handle(N.c_nvmlComputeInstance_t, "ci", ci)
                    ci.device = fake._new_handle(N.c_nvmlDevice_t, "mig", ci)
                    gi.cis[ci_id] = ci
                    card.mig_devices[idx] = ci
