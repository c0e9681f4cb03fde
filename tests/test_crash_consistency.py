"""Crash consistency (issue 10): the daemon is SIGKILLed at random moments under load, 10 times on a MIG
machine (dgx-h100) and 10 times on an MPS machine (pcie-8x-l40s), and restarted over the same ledger and
the same simulated hardware. The load is real: `xpu run` wrappers whose commands run a few seconds, and
client threads that acquire and release over gRPC.

After each restart, with the load frozen (wrappers stopped, client threads parked), the invariants hold:
- every lease acknowledged to a client exists (a wrapper's lease: its command started; a client's: its
  grant arrived and no release was sent), and each wrapper holds its lease again within the grace;
- no card or slice is granted twice (whole cards disjoint and never also sliced, MIG devices unique,
  MPS memory within the card);
- the daemon's accounting (ListCards, ListLeases) equals the ledger's active leases;
- the isolation on the simulated hardware (its state file: MIG instances, MPS control daemons, compute
  modes) equals the leases.
At the end every wrapper whose command started exits with its command's status 0: no lease was lost while
its holder lived. Seeded: the same seed gives the same kill times, outages and load choices."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import BIN, alive, poll, xpu_env
from xpud.errors import NotFound, XpudError
from xpud.hw.simstate import FILE_NAME
from xpud.ledger.ledger import Ledger

KILLS = 7  # per machine: 14 random kills a run (10 each cost CI ~25 s more for the same kinds of moment)
GRACE_S = 10.0
CONFIG = f"[leases]\ngrace_s = {GRACE_S}\nrestore_grace_s = {GRACE_S}\n[cards]\nmig_idle_keep_s = 0\n"
# The command notes its lease and pid (atomically), then runs a few seconds.
SCRIPT = 'echo "$XPU_LEASE_ID $$" > {dir}/l.tmp && mv {dir}/l.tmp {dir}/lease; exec sleep {seconds:.2f}'
EXCLUSIVE_PROCESS = 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


class Load:
    """Wrappers and client threads against one daemon; ``freeze`` stops them all at a quiet point."""

    def __init__(self, d, work: Path, seed: str, wrappers: int = 4, clients: int = 2):
        self.d, self.work, self.seed = d, work, seed
        self.lock = threading.Condition()
        self.go = threading.Event()
        self.stopping = threading.Event()
        self.procs: dict[subprocess.Popen, Path] = {}
        self.results: list[tuple[int, str | None, str]] = []  # (exit status, lease id or None, stderr)
        self.acked: dict[str, object] = {}  # client lease id -> grant, until its release is sent
        self.in_flight = 0
        self.client_grants = 0
        self.threads = [
            threading.Thread(target=self._wrapper_slot, args=(n,), daemon=True) for n in range(wrappers)
        ] + [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(clients)]
        self._count = 0

    def start(self) -> None:
        self.go.set()
        for t in self.threads:
            t.start()

    # ----------------------------------------------------------------------------- wrappers
    def _wrapper_slot(self, n: int) -> None:
        rng = random.Random(f"{self.seed}-w{n}")
        env = xpu_env(self.d.runtime_dir)
        while not self.stopping.is_set():
            self.go.wait()
            mode = rng.choice(["vxpu-quarter", "vxpu-quarter", "vxpu-half", "xpu"])
            gpus = rng.choice([1, 1, 2]) if mode == "xpu" else 1
            seconds = rng.uniform(1.0, 4.0)
            with self.lock:
                if not self.go.is_set() or self.stopping.is_set():
                    continue
                self._count += 1
                work = self.work / f"w{self._count}"
                work.mkdir()
                cmd = SCRIPT.format(dir=work, seconds=seconds)
                with open(work / "stderr", "wb") as err:
                    p = subprocess.Popen(
                        [
                            str(BIN / "xpu"),
                            "run",
                            "-m",
                            mode,
                            "--gpus",
                            str(gpus),
                            "--wait",
                            "30",
                            "--",
                            "sh",
                            "-c",
                            cmd,
                        ],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                    )
                self.procs[p] = work
            p.wait()
            lease = (work / "lease").read_text().split()[0] if (work / "lease").exists() else None
            with self.lock:
                del self.procs[p]
                self.results.append((p.returncode, lease, (work / "stderr").read_text()[-400:]))
                self.lock.notify_all()
            if lease is None:
                time.sleep(0.2)  # no grant (the daemon was down): do not spin

    def wrapper_leases(self) -> dict[str, subprocess.Popen]:
        """Lease id -> wrapper, for the wrappers whose command runs (a wrapper releases its lease only
        once its command has ended)."""
        out = {}
        with self.lock:
            for p, work in self.procs.items():
                if (work / "lease").exists():
                    lease, pid = (work / "lease").read_text().split()
                    if alive(int(pid)):
                        out[lease] = p
        return out

    # ----------------------------------------------------------------------------- clients
    def _client(self, n: int) -> None:
        rng = random.Random(f"{self.seed}-c{n}")
        pending: list = []  # grants whose release is not known to have been committed
        with self.d.client() as c:
            while not self.stopping.is_set():
                self.go.wait()
                with self.lock:
                    if not self.go.is_set():
                        continue
                    self.in_flight += 1
                try:
                    for g in list(pending):  # a release cut off by a kill: send it again
                        with contextlib.suppress(NotFound):  # it was committed before the kill
                            c.release(g.lease.id, g.token)
                        pending.remove(g)
                    mode = rng.choice(["vxpu-quarter", "vxpu-half", "xpu"])
                    try:
                        g = c.acquire_lease(mode)
                    except XpudError:
                        g = None
                    if g is not None:
                        with self.lock:
                            self.acked[g.lease.id] = g
                            self.client_grants += 1
                        time.sleep(rng.uniform(0, 0.3))
                        with self.lock:
                            self.acked.pop(g.lease.id)
                        pending.append(g)
                        c.release(g.lease.id, g.token)
                        pending.remove(g)
                except XpudError:
                    time.sleep(0.1)
                finally:
                    with self.lock:
                        self.in_flight -= 1
                        self.lock.notify_all()
                time.sleep(rng.uniform(0, 0.2))
            for g in pending:
                with contextlib.suppress(XpudError):
                    c.release(g.lease.id, g.token)

    # ----------------------------------------------------------------------------- control
    def freeze(self) -> None:
        """Stop the wrappers (their Hold streams stay open) and park the client threads."""
        with self.lock:
            self.go.clear()
            assert self.lock.wait_for(lambda: self.in_flight == 0, 30), "a client call hangs"
            for p in self.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        with self.lock:
            for p in self.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
            self.go.set()

    def finish(self) -> None:
        self.stopping.set()
        self.thaw()
        for t in self.threads:
            t.join(60)


# --------------------------------------------------------------------------------- invariants


def _snapshot(d) -> tuple:
    led = Ledger(d.state_dir / "ledger.sqlite")
    try:
        ledger = {x.id: x for x in led.active_leases()}
    finally:
        led.close()
    with d.client() as c:
        cards = list(c.cards().cards)
        listed = {x.id for x in c.leases().leases}
    hw = json.loads((d.state_dir / FILE_NAME).read_text())
    return ledger, cards, listed, hw


def _mps_daemons_in_use(d) -> dict[str, int]:
    """Card UUID -> pid of its MPS control daemon, for the cards with MPS slices (the daemon stopped)."""
    led = Ledger(d.state_dir / "ledger.sqlite")
    try:
        used = {
            x.card_uuids[0] for x in led.active_leases() if any(s.handle.startswith("mps:") for s in x.slices)
        }
    finally:
        led.close()
    hw = json.loads((d.state_dir / FILE_NAME).read_text())
    return {x["devices"]: x["pid"] for x in hw["mps"]["daemons"] if x["devices"] in used}


def check_invariants(d, load: Load, kill: int, mps_before: dict[str, int]) -> list[str]:
    """What is wrong now (the load frozen). ``mps_before``: the MPS control daemons in use at the kill."""
    # Reads the ledger, the daemon and the hardware until two rounds agree (nothing moved in between).
    for _ in range(20):
        a = _snapshot(d)
        time.sleep(0.1)
        b = _snapshot(d)
        if (set(a[0]), [x.SerializeToString() for x in a[1]], a[2], a[3]) == (
            set(b[0]),
            [x.SerializeToString() for x in b[1]],
            b[2],
            b[3],
        ):
            break
    else:
        return [f"kill {kill}: the state kept changing with the load frozen"]
    ledger, cards, listed, hw = b
    bad = []
    where = f"kill {kill}"
    # every acknowledged lease exists
    with load.lock:
        acked = set(load.acked)
    acked |= set(load.wrapper_leases())
    for lid in sorted(acked - set(ledger)):
        led = Ledger(d.state_dir / "ledger.sqlite")
        try:
            ended = [x.state.value for x in led.recent_leases(500) if x.id == lid]
            events = [e.message for e in led.events(limit=500) if lid in e.message]
        finally:
            led.close()
        bad.append(f"{where}: acknowledged lease {lid} is not active: {ended} {events}")
    # the daemon's books equal the ledger
    if listed != set(ledger):
        bad.append(f"{where}: ListLeases {sorted(listed)} != ledger {sorted(ledger)}")
    uuid_of = {c.index: c.uuid for c in cards}
    for c in cards:
        whole = sorted(x.id for x in ledger.values() if x.mode.value == "xpu" and c.uuid in x.card_uuids)
        sliced = sorted(x.id for x in ledger.values() if x.mode.value != "xpu" and c.uuid in x.card_uuids)
        if len(whole) > 1 or (whole and sliced):
            bad.append(f"{where}: card {c.index} granted twice: whole {whole}, slices {sliced}")
        if (c.whole_lease or None) != (whole[0] if whole else None):
            bad.append(f"{where}: card {c.index} whole_lease {c.whole_lease!r}, ledger {whole}")
        if sorted(s.lease_id for s in c.slices) != sliced:
            bad.append(f"{where}: card {c.index} slices {[s.lease_id for s in c.slices]}, ledger {sliced}")
        held = sum(s.memory_bytes for x in ledger.values() for s in x.slices if c.uuid in x.card_uuids)
        if held > c.memory_total_bytes:
            bad.append(f"{where}: card {c.index} slices hold {held} bytes of {c.memory_total_bytes}")
    handles = Counter(s.handle for x in ledger.values() for s in x.slices)
    bad += [f"{where}: slice {h} granted {n} times" for h, n in handles.items() if n > 1]
    # the hardware equals the leases
    mig_uuids = {
        ci["uuid"]: i
        for i, card in enumerate(hw["nvml"]["cards"])
        for gi in card["gpu_instances"]
        for ci in gi["compute_instances"]
    }
    mig_leases = {s.handle: x for x in ledger.values() for s in x.slices if s.handle.startswith("MIG-")}
    if set(mig_uuids) != set(mig_leases):
        bad.append(f"{where}: MIG devices {sorted(mig_uuids)} != MIG slices {sorted(mig_leases)}")
    for h, x in mig_leases.items():
        if h in mig_uuids and uuid_of[mig_uuids[h]] not in x.card_uuids:
            bad.append(f"{where}: lease {x.id}'s MIG device {h} is on card {mig_uuids[h]}")
    mps = {x["devices"]: x for x in hw["mps"]["daemons"]}
    for c in cards:
        state = hw["nvml"]["cards"][c.index]
        mps_slices = [
            s
            for x in ledger.values()
            for s in x.slices
            if s.handle.startswith("mps:") and c.uuid in x.card_uuids
        ]
        if mps_slices and (c.uuid not in mps or state["compute_mode"] != EXCLUSIVE_PROCESS):
            bad.append(f"{where}: card {c.index} has MPS slices but no control daemon / EXCLUSIVE_PROCESS")
        if c.whole_lease and (c.uuid in mps or state["mig"] or state["compute_mode"] != 0):
            bad.append(f"{where}: card {c.index} is leased whole but has MPS or MIG on or a compute mode set")
        if c.mode == "whole" and c.uuid in mps:
            bad.append(f"{where}: card {c.index} is whole but an MPS control daemon runs for it")
    bad += [f"{where}: MPS control daemon for {u}, not a card" for u in mps if u not in uuid_of.values()]
    for u, pid in mps_before.items():  # a control daemon is a process of its own: it outlives xpud
        if u in mps and mps[u]["pid"] != pid:
            bad.append(f"{where}: card {u}'s MPS control daemon {pid} was replaced by {mps[u]['pid']}")
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("machine", ["dgx-h100", "pcie-8x-l40s"])
def test_sigkill_at_random_moments_under_load_keeps_every_invariant(daemon_factory, short_tmp, machine):
    rng = random.Random(f"crash-consistency-{machine}")
    d = daemon_factory(machine, config=CONFIG, name="c")
    work = short_tmp / "work"
    work.mkdir()
    load = Load(d, work, f"crash-{machine}")
    load.start()
    problems: list[str] = []
    try:
        for kill in range(KILLS):
            poll(
                load.wrapper_leases, 20
            )  # some wrapper's command runs (wrappers start slowly on a busy host)
            time.sleep(rng.uniform(0.0, 1.0))  # a random moment under load
            d.kill(signal.SIGKILL)
            mps_before = _mps_daemons_in_use(d)
            time.sleep(rng.uniform(0.0, 0.3))  # the outage
            load.freeze()
            d.start()
            problems += check_invariants(d, load, kill, mps_before)
            leases = load.wrapper_leases()
            load.thaw()

            def rehold(leases=leases):
                with d.client() as c:
                    held = {x.id for x in c.leases().leases if x.held}
                return not [lid for lid, p in leases.items() if lid not in held and p.poll() is None]

            if not poll(rehold, GRACE_S - 1):
                problems.append(f"kill {kill}: wrappers did not hold their leases again within the grace")
    finally:
        load.finish()
    lost = [r for r in load.results if r[1] is not None and r[0] != 0]
    granted = [r for r in load.results if r[1] is not None]
    assert not problems, "\n".join(problems)
    assert not lost, f"wrappers lost their lease while their command ran: {lost}"
    assert len(granted) >= KILLS and load.client_grants >= KILLS, (
        f"too little load: {len(granted)} wrapper(s) and {load.client_grants} client grant(s)"
    )
