"""Enforced device isolation (issue #32, README "Isolation"): a lease's processes can open only its own
device nodes, on a REAL systemd (tests/systemd_ns.py: systemd as pid 1 of new namespaces, cgroup v2).

The namespace's ``/dev`` is a tmpfs holding the host's pseudo-devices and NVIDIA nodes made with mknod: 8
cards under major 195 with the dgx-a100 machine's minors (not the NVML order), ``nvidiactl`` (195:255),
``nvidia-uvm``/``nvidia-uvm-tools`` and MIG capability nodes under two char majors no driver here
registered. The daemon (``xpud --simulate dgx-a100``, ``[isolation] devices = "enforced"``) and ``xpu run``
run in systemd's pid and mount namespaces; a fake ``/proc`` tree gives the daemon the ``nvidia-caps``
major and the driver's capability files (format: ``hw/devnodes.py``). The job opens every node: a node
the cgroup allows fails with ENXIO (no driver behind the major), any other with EPERM (the device program
systemd built from ``DevicePolicy=closed`` + ``DeviceAllow=``). Without the scope every open would say
ENXIO, so each case fails when the cgroup is not applied.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, DaemonProc, wait_until, xpu_env
from tests.systemd_ns import Systemd
from xpud.errors import Forbidden
from xpud.hw.devnodes import DevTree
from xpud.isolation.devices import Grant, allow_list

# CI (root, systemd and cgroup2, as these machines have) must run these, never skip them (issue #32): with
# CI=true a missing piece fails the tests instead (as tests/torch_needed.py does for torch).
IN_CI = os.environ.get("CI") == "true"
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        bool(Systemd.unavailable()) and not IN_CI, reason=f"no real systemd: {Systemd.unavailable()}"
    ),
]

MINORS = {0: 2, 1: 3, 2: 0, 3: 1, 4: 6, 5: 7, 6: 4, 7: 5}  # etc/machines/dgx-a100.toml: index -> minor
CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
GIS, CIS = range(15), range(8)  # capability files for every GPU/compute instance id the fake may give


def cap_minor(card_minor: int, gi: int, ci: int | None = None) -> int:
    """This test's capability minors: 1 and 2 are mig/config and mig/monitor, as the driver has them."""
    return 3 + card_minor * 200 + gi * 10 + (0 if ci is None else ci + 1)


def card_of_cap(minor: int) -> int:
    return (minor - 3) // 200


PROBE = r"""
import errno, glob, os
seen = []
for p in sorted(glob.glob("/dev/nvidia*") + glob.glob("/dev/nvidia-caps/*")):
    if os.path.isdir(p):
        continue
    try:
        os.close(os.open(p, os.O_RDWR))
        how = "OPENED"
    except OSError as e:
        how = errno.errorcode.get(e.errno, str(e.errno))
    seen.append(p + "=" + how)
print(os.environ.get("XPU_RESTART_COUNT", "-"), " ".join(seen), flush=True)
"""


def free_char_majors(n: int) -> list[int]:
    """Majors 234..254 ("local/experimental use", Documentation/admin-guide/devices.txt) no driver took."""
    chars = Path("/proc/devices").read_text().split("Block devices:")[0]
    used = {int(m) for m in re.findall(r"^\s*(\d+)\s+\S+$", chars, re.M)}
    return [m for m in range(254, 233, -1) if m not in used][:n]


def dev_script(uvm: int, caps: int) -> str:
    lines = [
        "set -e",
        "mkdir -p /run/hostdev && mount --bind /dev /run/hostdev",
        "mount -t tmpfs -o mode=755 tmpfs /dev",
        "for n in null zero full random urandom tty ptmx; do",
        "  touch /dev/$n; mount --bind /run/hostdev/$n /dev/$n",
        "done",
        "mkdir -p /dev/pts /dev/shm /dev/nvidia-caps && mount --bind /run/hostdev/pts /dev/pts",
        "mknod -m 666 /dev/nvidiactl c 195 255",
        f"mknod -m 666 /dev/nvidia-uvm c {uvm} 0",
        f"mknod -m 666 /dev/nvidia-uvm-tools c {uvm} 1",
        f"mknod -m 444 /dev/nvidia-caps/nvidia-cap1 c {caps} 1",
        f"mknod -m 444 /dev/nvidia-caps/nvidia-cap2 c {caps} 2",
    ]
    lines += [f"mknod -m 666 /dev/nvidia{m} c 195 {m}" for m in MINORS.values()]
    for m in MINORS.values():  # one other instance's pair on every card, there before any lease
        lines.append(
            f"mknod -m 444 /dev/nvidia-caps/nvidia-cap{cap_minor(m, 14)} c {caps} {cap_minor(m, 14)}"
        )
        lines.append(
            f"mknod -m 444 /dev/nvidia-caps/nvidia-cap{cap_minor(m, 14, 0)} c {caps} {cap_minor(m, 14, 0)}"
        )
    return "\n".join(lines)


def fake_proc(root: Path, caps: int) -> None:
    """``devices`` naming the caps major, and the driver's capability files (``DeviceFileMinor`` ...)."""
    root.mkdir(parents=True)
    (root / "devices").write_text(f"Character devices:\n  1 mem\n195 nvidia\n{caps} nvidia-caps\n")
    base = root / "driver/nvidia/capabilities"
    for m in MINORS.values():
        for gi in GIS:
            d = base / f"gpu{m}/mig/gi{gi}"
            d.mkdir(parents=True)
            (d / "access").write_text(
                f"DeviceFileMinor: {cap_minor(m, gi)}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
            )
            for ci in CIS:
                (d / f"ci{ci}").mkdir()
                text = f"DeviceFileMinor: {cap_minor(m, gi, ci)}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
                (d / f"ci{ci}/access").write_text(text)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """One booted systemd with the fake /dev, shared by every case here."""
    uvm, caps = free_char_majors(2)
    try:
        sd = Systemd().__enter__()
    except RuntimeError as e:
        (pytest.fail if IN_CI else pytest.skip)(f"systemd does not start in new namespaces here: {e}")
    try:
        made = sd.run(["sh", "-c", dev_script(uvm, caps)], timeout=30)
        assert made.returncode == 0, made.stderr
        base = Path(tmp_path_factory.mktemp("iso", numbered=True))
        fake_proc(base / "proc", caps)
        sd.base, sd.caps_major = base, caps
        yield sd
    finally:
        sd.__exit__()


def config(proc: Path, cards: str = "") -> str:
    return (
        f"[leases]\ngrace_s = 30.0\n[cards]\nmig_idle_keep_s = 0\n{cards}[health]\npoll_interval_s = 0.2\n"
        f'[isolation]\ndevices = "enforced"\nproc_root = "{proc}"\nextra_devices = []\n'
    )


@pytest.fixture(scope="module")
def daemons(host):
    """Two daemons in the namespace: MIG slices (the machine's own), and MPS slices."""
    made = {}
    short = Path(f"/tmp/xpu-iso-{os.getpid()}")  # short: Unix socket paths
    short.mkdir()
    try:
        for name, cards in (("mig", ""), ("mps", 'isolation = "mps"\n')):
            (short / name).mkdir()
            made[name] = DaemonProc(
                short / name, "dgx-a100", config(host.base / "proc", cards), prefix=host.prefix
            )
            made[name].start()
        yield made
    finally:
        for d in made.values():
            d.kill()
        shutil.rmtree(short, ignore_errors=True)


def xpu_run(host, d: DaemonProc, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [*host.prefix, str(BIN / "xpu"), "run", *args, "--", sys.executable, "-c", PROBE]
    return subprocess.run(argv, env=xpu_env(d.runtime_dir), capture_output=True, text=True, timeout=timeout)


def opened(line: str) -> tuple[str, dict[str, str]]:
    count, _, rest = line.strip().partition(" ")
    return count, dict(item.rsplit("=", 1) for item in rest.split())


def lease_named(d: DaemonProc, name: str):
    with d.client(admin=True) as c:
        (lease,) = [le for le in c.leases(all=True).leases if le.name == name]
    return lease


def check(seen: dict[str, str], cards: set[int], caps: set[int] = frozenset()) -> None:
    """``cards`` (minors) and ``caps`` (capability minors) and the control nodes allowed, all else not."""
    allowed = {
        *CONTROL,
        *(f"/dev/nvidia{m}" for m in cards),
        *(f"/dev/nvidia-caps/nvidia-cap{c}" for c in caps),
    }
    assert len(seen) >= 8 + 3 + 2 + 16, seen  # every node was tried
    wrong = {p: how for p, how in seen.items() if how != ("ENXIO" if p in allowed else "EPERM")}
    assert not wrong, f"allowed {sorted(allowed)}; wrong: {wrong}"


def test_a_whole_card_lease_opens_its_card_by_minor_and_no_other(host, daemons):
    r = xpu_run(host, daemons["mig"], "-m", "xpu", "--name", "one")
    assert r.returncode == 0, r.stderr
    lease = lease_named(daemons["mig"], "one")
    check(opened(r.stdout)[1], {MINORS[i] for i in lease.cards})
    assert "isolation" not in r.stderr  # enforced: nothing to say


def test_a_two_card_lease_opens_both_of_its_cards(host, daemons):
    r = xpu_run(host, daemons["mig"], "-m", "xpu", "-g", "2", "--name", "two")
    assert r.returncode == 0, r.stderr
    lease = lease_named(daemons["mig"], "two")
    assert len(lease.cards) == 2
    check(opened(r.stdout)[1], {MINORS[i] for i in lease.cards})


def test_a_mig_slice_opens_its_parent_and_its_two_capabilities_only(host, daemons):
    r = xpu_run(host, daemons["mig"], "-m", "vxpu-half", "--name", "mig")
    assert r.returncode == 0, r.stderr
    lease = lease_named(daemons["mig"], "mig")
    (parent,) = lease.cards
    seen = opened(r.stdout)[1]
    own = {int(p.rsplit("cap", 1)[1]) for p, how in seen.items() if "nvidia-caps" in p and how == "ENXIO"}
    assert len(own) == 2 and {card_of_cap(c) for c in own} == {MINORS[parent]}, own
    assert not own & {1, 2, cap_minor(MINORS[parent], 14), cap_minor(MINORS[parent], 14, 0)}
    check(seen, {MINORS[parent]}, own)


def test_an_mps_slice_opens_its_card_and_nothing_else(host, daemons):
    r = xpu_run(host, daemons["mps"], "-m", "vxpu-half", "--name", "mps")
    assert r.returncode == 0, r.stderr
    lease = lease_named(daemons["mps"], "mps")
    assert lease.slices and not lease.slices[0].handle.startswith("MIG-")
    check(opened(r.stdout)[1], {MINORS[i] for i in lease.cards})


def test_a_moved_lease_opens_its_new_card_and_no_longer_its_old_one(host, daemons):
    d = daemons["mig"]
    script = f'{sys.executable} -c "$0" && [ "$XPU_RESTART_COUNT" = 1 ] && exit 0; exec sleep 60'
    argv = [*host.prefix, str(BIN / "xpu"), "run", "-m", "xpu", "--restartable", "--name", "moved", "--"]
    env = xpu_env(d.runtime_dir)
    p = subprocess.Popen([*argv, "sh", "-c", script, PROBE], env=env, stdout=-1, stderr=-1, text=True)
    try:
        first, before = opened(p.stdout.readline())
        assert first == "0", before
        (old,) = lease_named(d, "moved").cards
        check(before, {MINORS[old]})
        with d.client(admin=True) as c:
            c.inject_fault(str(old), "xid", 79)  # unhealthy: the health monitor moves the restartable job
        second, after = opened(p.stdout.readline())
        assert p.wait(60) == 0, p.stderr.read()
    finally:
        p.kill()
        with d.client(admin=True) as c:
            c.clear_fault(str(old))
    (new,) = lease_named(d, "moved").cards
    assert second == "1" and new != old
    check(after, {MINORS[new]})


def test_what_escapes_the_commands_process_group_ends_with_the_lease(host, daemons):
    d = daemons["mig"]
    argv = [
        *host.prefix,
        str(BIN / "xpu"),
        "run",
        "-m",
        "xpu",
        "--",
        "sh",
        "-c",
        "setsid sleep 300 </dev/null >/dev/null 2>&1 & sleep 0.5; echo $!",  # in a session of its own
    ]
    r = subprocess.run(argv, env=xpu_env(d.runtime_dir), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pid = r.stdout.strip()
    assert host.run(["kill", "-0", pid]).returncode == 0  # the wrapper killed its group; this left it
    deadline = time.monotonic() + 15
    while host.run(["kill", "-0", pid]).returncode == 0:
        assert time.monotonic() < deadline, "a process of an ended lease still runs in its scope"
        time.sleep(0.2)


def test_a_caller_the_daemon_cannot_see_is_told_advisory_not_refused(daemons):
    """This test process is outside the daemon's PID namespace: SO_PEERCRED gives it pid 0."""
    with daemons["mig"].client() as c:
        g = c.acquire_lease("xpu")
        try:
            r = c.confine(g.lease.id, g.token)
        finally:
            c.release(g.lease.id, g.token)
    assert not r.enforced and r.warn and r.isolation == "advisory (the caller is in another PID namespace)"


def test_a_rank_unit_gets_the_same_fence(host, tmp_path):
    """A multi-host job's rank on this host: its systemd-run service carries the lease's device list
    (``rankproc.Rank(devices=...)``, from ``hostjobs.rank_devices``)."""
    from tests.test_federation_rankproc import Inputs, spec
    from xpud.federation import rankproc, sysunit

    wrapper = tmp_path / "systemd-run"
    wrapper.write_text(f'#!/bin/sh\nexec {" ".join(host.prefix)} systemd-run "$@"\n')
    wrapper.chmod(0o755)

    async def runner(argv):
        return await sysunit.run([*host.prefix, *argv])

    units = sysunit.Units(tmp_path / "env", runner=runner, systemd_run=str(wrapper))
    tree = DevTree(Path("/dev"), host.base / "proc/driver/nvidia/capabilities", host.base / "proc/devices")
    devices = allow_list(Grant(cards=(MINORS[5],)), tree)

    async def go():
        s = spec([sys.executable, "-c", PROBE])
        inputs = Inputs()
        inputs.end()
        rank = rankproc.Rank(s, inputs, units=units, devices=devices)
        events = [ev async for ev in rank.events()]
        return b"".join(e.output.data for e in events if e.HasField("output") and e.output.fd == 1).decode()

    out = asyncio.run(go())
    check(opened(out.strip().splitlines()[-1])[1], {MINORS[5]})


def test_without_systemd_xpu_run_works_and_says_once_that_isolation_is_advisory(short_tmp):
    """A host without systemd as PID 1 (hidden from the daemon here): `xpu run` runs the command and says
    once, at its start, that isolation is advisory; `xpu info --json` says why."""
    hide = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /run/systemd 2>/dev/null; exec "$@"', "sh")
    text = '[leases]\ngrace_s = 30.0\n[isolation]\ndevices = "enforced"\n'
    d = DaemonProc(short_tmp, "dgx-a100", text, prefix=hide).start()
    try:
        runs = [d.xpu("run", "-m", "xpu", "--", "sh", "-c", "exit 7") for _ in range(2)]
        assert [r.returncode for r in runs] == [7, 7]
        said = [line for line in runs[0].stderr.splitlines() if "isolation" in line]
        assert len(said) == 1 and "advisory (systemd is not PID 1" in said[0], runs[0].stderr
        assert "isolation" not in runs[1].stderr  # once (per host and day)
        info = d.xpu("info", "--json")
        assert '"device_isolation": "advisory (systemd is not PID 1' in info.stdout, info.stdout
        with d.client() as c:  # Confine checks the token before it says anything
            g = c.acquire_lease("xpu")
            assert not c.confine(g.lease.id, g.token).enforced
            with pytest.raises(Forbidden, match="wrong token"):
                c.confine(g.lease.id, "x" * 32)
            c.release(g.lease.id, g.token)
    finally:
        d.kill()


def test_allow_list_names_nodes_by_minor_and_only_the_slices_capabilities(tmp_path):
    caps = 240
    proc = tmp_path / "proc"
    fake_proc(proc, caps)
    (tmp_path / "dev").mkdir()
    tree = DevTree(tmp_path / "dev", proc / "driver/nvidia/capabilities", proc / "devices")
    entries = allow_list(Grant(cards=(2, 3)), tree, ["char-infiniband_verbs rw"])
    assert "/dev/nvidia2 rw" in entries and "/dev/nvidia3 rw" in entries and "/dev/nvidia0 rw" not in entries
    assert entries[-1] == "char-infiniband_verbs rw" and not any("nvidia-caps" in e for e in entries)
    if os.geteuid() == 0:  # the capability nodes are made when missing (mknod)
        mig = allow_list(Grant(migs=((6, 3, 0),)), tree)
        assert [e for e in mig if "nvidia-caps" in e] == [
            f"/dev/nvidia-caps/nvidia-cap{cap_minor(6, 3)} rw",
            f"/dev/nvidia-caps/nvidia-cap{cap_minor(6, 3, 0)} rw",
        ]
        assert "/dev/nvidia6 rw" in mig


# ------------------------------------------------------------------------------------ xpud doctor
def _doctor_root(tmp_path: Path, systemd: bool, world_writable: bool) -> Path:
    root = tmp_path / "root"
    (root / "dev/nvidia-caps").mkdir(parents=True)
    if systemd:
        (root / "run/systemd/system").mkdir(parents=True)
        (root / "sys/fs/cgroup").mkdir(parents=True)
        (root / "sys/fs/cgroup/cgroup.controllers").write_text("cpu memory pids\n")
    for name, dev in (
        ("nvidia0", (195, 0)),
        ("nvidiactl", (195, 255)),
        ("nvidia-caps/nvidia-cap1", (240, 1)),
    ):
        os.mknod(root / "dev" / name, stat.S_IFCHR | 0o600, os.makedev(*dev))
        os.chmod(root / "dev" / name, 0o666 if world_writable else 0o660)
    return root


def _doctor(tmp_path: Path, root: Path, devices: str = "auto") -> dict:
    cfg = tmp_path / "xpud.toml"
    cfg.write_text(f'[daemon]\nruntime_dir = "{tmp_path}/run"\n[isolation]\ndevices = "{devices}"\n')
    r = subprocess.run(
        [str(BIN / "xpud"), "--config", str(cfg), "doctor", "--root", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("XPUD_")},
    )
    return {c["name"]: c for c in json.loads(r.stdout)["checks"]}


@pytest.mark.skipif(os.geteuid() != 0 and not IN_CI, reason="mknod needs root")
def test_doctor_says_advisory_and_warns_of_world_writable_nodes_with_the_fix(tmp_path):
    checks = _doctor(tmp_path, _doctor_root(tmp_path, systemd=False, world_writable=True))
    iso, modes = checks["device isolation"], checks["device modes"]
    assert iso["status"] == "warn" and iso["message"].startswith(
        "device isolation: advisory (systemd is not PID 1"
    )
    assert "cgroup v2" in iso["fix"]
    assert (
        modes["status"] == "warn"
        and "/dev/nvidia0" in modes["message"]
        and "/dev/nvidiactl" in modes["message"]
    )
    assert "NVreg_DeviceFileMode" in modes["fix"] and "udev" in modes["fix"] and "enforce" in modes["fix"]


@pytest.mark.skipif(os.geteuid() != 0 and not IN_CI, reason="mknod needs root")
def test_doctor_says_enforced_under_systemd_and_cgroup2(tmp_path):
    checks = _doctor(tmp_path, _doctor_root(tmp_path, systemd=True, world_writable=True))
    assert checks["device isolation"]["status"] == "ok"
    assert checks["device isolation"]["message"].startswith("device isolation: enforced")
    assert checks["device modes"]["status"] == "ok"  # world-writable, but fenced per lease
    advisory = _doctor(tmp_path, _doctor_root(tmp_path / "a", systemd=True, world_writable=False), "advisory")
    said = advisory["device isolation"]["message"]
    assert said.startswith('device isolation: advisory ([isolation] devices = "advisory"): any process')
    assert advisory["device isolation"]["fix"] == 'set [isolation] devices = "auto"'
    assert advisory["device modes"]["status"] == "ok"  # 0660: nothing open to all


def test_doctor_checks_exclusive_process_on_cards_serving_mps(tmp_path):
    from xpud import config
    from xpud.daemon.doctor_isolation import mps_compute_mode
    from xpud.hw.fakenvml import FakeNvml
    from xpud.hw.machines import load_machine
    from xpud.hw.nvml import Nvml

    cfg = config.Config().replace("daemon", runtime_dir=str(tmp_path))
    nvml = Nvml(FakeNvml(load_machine("pcie-8x-l40s")))
    nvml.open()
    assert mps_compute_mode(cfg, nvml, [0, 1]) is None  # no card serves MPS yet
    (tmp_path / "mps/1/pipe").mkdir(parents=True)
    (tmp_path / "mps/1/pipe/control").write_text("")  # nvidia-cuda-mps-control's socket
    bad = mps_compute_mode(cfg, nvml, [0, 1])
    assert bad.status == "fail" and "GPU1 (DEFAULT)" in bad.message and "EXCLUSIVE_PROCESS" in bad.fix
    nvml.set_compute_mode(1, "EXCLUSIVE_PROCESS")
    assert mps_compute_mode(cfg, nvml, [0, 1]).status == "ok"


WARM = """
import asyncio, sys
from types import SimpleNamespace as NS
from xpud.controllers import warm
from xpud.isolation.scope import Enforcement, Scopes
# the engine's part in this: card 0's minor (the scope, busctl and systemd are the real ones)
engine = NS(cards={0: NS(info=NS(index=0, minor_number=int(sys.argv[2])))}, mig_device_ids=lambda i, h: None)
scopes = Scopes(engine, Enforcement(True))
holder = NS(id="warm-0-test", cards=(0,), slices=())
fence = (lambda pid: scopes.place(holder, pid)) if sys.argv[3] == "fenced" else None
print(asyncio.run(warm.run(sys.argv[1], "root", {}, 30.0, fence)))
"""


@pytest.mark.parametrize("fenced", ["fenced", "open"])
def test_a_warm_command_runs_in_its_slices_scope(host, tmp_path, fenced):
    """``[forecast] warm_command`` (``controllers/warm.py``): held at its gate until it is in the scope."""
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "out"
    cmd = f"{sys.executable} {tmp_path / 'probe.py'} > {out}"
    argv = [*host.prefix, sys.executable, "-c", WARM, cmd, str(MINORS[0]), fenced]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "warm_command exited 0 (as root)", r.stdout + r.stderr
    seen = opened(out.read_text())[1]
    if fenced == "fenced":
        check(seen, {MINORS[0]})
    else:  # the same command with no fence opens every node (ENXIO): what the cgroup stops
        assert set(seen.values()) == {"ENXIO"}


@pytest.mark.parametrize(
    ("setting", "simulated", "has", "said"),
    [
        ("advisory", False, {"systemd", "cgroup2"}, '[isolation] devices = "advisory"'),
        ("auto", True, {"systemd", "cgroup2"}, "a simulated machine has no device nodes to fence"),
        ("enforced", True, {"cgroup2"}, "systemd is not PID 1"),
        ("auto", False, {"systemd"}, "no cgroup v2 hierarchy"),
        ("auto", False, {"systemd", "cgroup2"}, ""),
        ("enforced", True, {"systemd", "cgroup2"}, ""),
    ],
)
def test_when_isolation_can_be_enforced(tmp_path, setting, simulated, has, said):
    from xpud.isolation.scope import detect

    if "systemd" in has:
        (tmp_path / "run/systemd/system").mkdir(parents=True)
    (tmp_path / "cgroup").mkdir()
    if "cgroup2" in has:  # a v1 (or hybrid) /sys/fs/cgroup has no cgroup.controllers at its top
        (tmp_path / "cgroup/cgroup.controllers").write_text("cpu io memory pids\n")
    how = detect(setting, simulated, tmp_path / "run/systemd/system", tmp_path / "cgroup", euid=lambda: 0)
    assert how.enforced == (not said) and said in how.why
    assert how.text == ("enforced" if not said else f"advisory ({how.why})")


RANK_CHILD = """
import asyncio, os, sys
from types import SimpleNamespace as NS
from xpud.api.v1 import xpu_pb2 as pb
from xpud.federation import rankproc
from xpud.isolation.scope import Enforcement, Scopes
engine = NS(cards={0: NS(info=NS(index=0, minor_number=int(sys.argv[2])))}, mig_device_ids=lambda i, h: None)
scopes = Scopes(engine, Enforcement(True))
lease = NS(id="rank-child-test", cards=(0,), slices=())

async def main():
    s = pb.LaunchSpec(job="j1", argv=[sys.executable, "-c", sys.argv[1]], env={"PATH": os.environ["PATH"]},
                      cwd="/", uid=os.getuid(), gid=os.getgid())
    async def inputs():
        return
        yield
    # as hostjobs' on_start does for a rank that is a child process, not a unit: into the scope at the gate
    rank = rankproc.Rank(s, inputs(), on_start=lambda pid: scopes.place(lease, pid), units=None)
    out = b""
    async for ev in rank.events():
        if ev.HasField("output") and ev.output.fd == 1:
            out += ev.output.data
    print(out.decode().strip())
asyncio.run(main())
"""


def test_a_rank_started_as_a_child_is_placed_in_the_scope_at_its_gate(host):
    """A rank outside a unit (xpud not a systemd service) waits at its gate until ``on_start`` returns:
    ``hostjobs`` places it in the lease's scope there, before the command runs."""
    argv = [*host.prefix, sys.executable, "-c", RANK_CHILD, PROBE, str(MINORS[4])]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    check(opened(r.stdout.strip().splitlines()[-1])[1], {MINORS[4]})


# one process in a session of its own (out of the command's process group), then the command goes on
ESCAPE = "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!; exec sleep 300"


def _gone(host, pids, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while any(host.run(["kill", "-0", p]).returncode == 0 for p in pids):
        assert time.monotonic() < deadline, f"a process of an ended lease still runs: {pids}"
        time.sleep(0.2)


def _scope_state(host, lease_id: str) -> str:
    return host.run(["systemctl", "is-active", f"xpu-lease-{lease_id}.scope"]).stdout.strip()


def _kill_in(host, d: DaemonProc) -> None:
    """SIGKILL the daemon itself (``d.proc`` is nsenter, which forked it into systemd's pid namespace)."""
    if d.alive():
        pid = (d.runtime_dir / "xpud.pid").read_text().strip()  # as systemd's pid namespace numbers it
        host.run(["kill", "-9", pid])
        d.proc.wait(10)


def test_an_evicted_lease_ends_with_its_scope_and_what_escaped(host, daemons):
    """Not only a release: however a lease ends (here an operator's eviction; the reaper, a health
    move-off, a multi-host job's end go the same way, ``engine.on_ended``), its scope is stopped."""
    d = daemons["mig"]
    argv = [*host.prefix, str(BIN / "xpu"), "run", "-m", "xpu", "--name", "evicted", "--", "sh", "-c", ESCAPE]
    p = subprocess.Popen(argv, env=xpu_env(d.runtime_dir), stdout=-1, stderr=-1, text=True)
    try:
        escaped = p.stdout.readline().strip()
        lease = lease_named(d, "evicted")
        assert _scope_state(host, lease.id) == "active"
        with d.client(admin=True) as c:
            c.evict(lease.id, "test")
        assert p.wait(30) != 0
        _gone(host, [escaped])
        assert _scope_state(host, lease.id) != "active"
    finally:
        p.kill()


def test_a_restarted_daemon_stops_the_scopes_of_leases_that_ended_and_keeps_the_active_ones(host):
    """A daemon SIGKILLed between a lease's end and its scope's stop: the next one stops that scope at
    start-up (``Scopes.reconcile``); the scope of a lease still active is kept (its job outlives the
    daemon)."""
    short = Path(f"/tmp/xpu-iso-r{os.getpid()}")
    short.mkdir()
    d = DaemonProc(short, "dgx-a100", config(host.base / "proc"), prefix=host.prefix).start()
    env = xpu_env(d.runtime_dir)
    kept = subprocess.Popen(
        [*host.prefix, str(BIN / "xpu"), "run", "-m", "xpu", "--name", "kept", "--", "sh", "-c", ESCAPE],
        env=env,
        stdout=-1,
        stderr=-1,
        text=True,
    )

    try:
        kept_escaped = kept.stdout.readline().strip()
        argv = [*host.prefix, str(BIN / "xpu"), "run", "-m", "xpu", "--name", "left", "--"]
        r = subprocess.run([*argv, "sh", "-c", ESCAPE.split(";")[0]], env=env, capture_output=True, text=True)
        _kill_in(host, d)  # at once: its scope's stop was due END_AFTER_S later
        left_escaped = r.stdout.strip()
        assert r.returncode == 0 and left_escaped, r.stderr
        d.start()
        left, kept_lease = lease_named(d, "left"), lease_named(d, "kept")
        _gone(host, [left_escaped])
        assert _scope_state(host, left.id) != "active"
        assert _scope_state(host, kept_lease.id) == "active"
        assert host.run(["kill", "-0", kept_escaped]).returncode == 0
        with d.client(admin=True) as c:  # and the kept one still ends with its lease
            c.evict(kept_lease.id, "test")
        _gone(host, [kept_escaped])
    finally:
        kept.kill()
        _kill_in(host, d)
        shutil.rmtree(short, ignore_errors=True)


def test_a_two_host_jobs_ranks_open_only_their_own_hosts_cards(host, short_tmp):
    """``xpu run --nodes 2`` between two federated daemons (mutual TLS on 127.0.0.2/.3), both in this
    systemd: each rank, started by its host's daemon (a child: xpud is no systemd service here), is in
    its host's lease's scope before its command runs, and opens that lease's cards only."""
    from tests.conftest import wait_until
    from tests.test_federation_daemons import DEAD_AFTER_S, Host, cluster_config, converged, free_port
    from xpud.federation.certs import init_ca, issue

    init_ca(short_tmp / "ca")
    hosts: list[Host] = []
    try:
        for i in (1, 2):
            name, ip = f"h{i}", f"127.0.0.{i + 1}"
            issue(name, short_tmp / "ca", short_tmp / name, ips=[ip])
            port, seeds = free_port(ip), [hosts[0].addr] if hosts else []
            keys = cluster_config(
                name, f"{ip}:{port}", seeds, short_tmp / name, "rack-1", allow_root_jobs=True
            )
            (short_tmp / f"d{i}").mkdir()
            d = DaemonProc(
                short_tmp / f"d{i}", "dgx-a100", config(host.base / "proc") + keys, prefix=host.prefix
            )
            hosts.append(Host(name, ip, port, short_tmp / name, d))
            d.start()
        wait_until(lambda: converged(hosts), timeout=10 * DEAD_AFTER_S, step=0.3)
        argv = [*host.prefix, str(BIN / "xpu"), "run", "--nodes", "2", "--label", "--json", "--"]
        r = subprocess.run(
            [*argv, sys.executable, "-c", PROBE],
            env=xpu_env(hosts[0].daemon.runtime_dir),
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        seen = dict(line.split(": ", 1) for line in r.stdout.splitlines() if re.match(r"\d+: ", line))
        assert set(seen) == {"0", "1"}, r.stdout
        ranks_on = json.loads(r.stdout.splitlines()[-1])["hosts"]  # rank -> host name
        for h in hosts:  # a fresh daemon: the job's lease on it is its only one
            with h.daemon.client(admin=True) as c:
                (lease,) = c.leases(all=True).leases
            check(opened(seen[str(ranks_on.index(h.name))])[1], {MINORS[i] for i in lease.cards})
    finally:
        for h in hosts:
            _kill_in(host, h.daemon)


def test_a_json_env_launchers_work_is_confined_through_xpu_confine(host, daemons):
    """`xpu run --json-env` starts nothing itself: the launcher runs its work as ``xpu confine -- COMMAND``
    under the printed env (the lease's id and token), which confines itself and execs COMMAND. The token
    is not passed on; the work ends with the lease (its scope is stopped)."""
    d = daemons["mig"]
    argv = [*host.prefix, str(BIN / "xpu"), "run", "-m", "xpu", "--json-env", "--name", "launcher"]
    holder = subprocess.Popen(argv, env=xpu_env(d.runtime_dir), stdin=-1, stdout=-1, stderr=-1, text=True)
    try:
        record = json.loads(holder.stdout.readline())
        env = {**xpu_env(d.runtime_dir), **record["env"]}
        confine = [*host.prefix, str(BIN / "xpu"), "confine", "--"]
        script = 'echo "${XPU_LEASE_TOKEN:-no token}"; exec "$0" -c "$1"'
        argv = [*confine, "sh", "-c", script, sys.executable, PROBE]
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        said, line = r.stdout.splitlines()
        assert said == "no token"
        check(opened(line)[1], {MINORS[i] for i in record["cards"]})
        work = subprocess.Popen(
            [*confine, "sh", "-c", "echo $$; exec sleep 300"], env=env, stdout=-1, text=True
        )
        pid = work.stdout.readline().strip()
        holder.stdin.close()  # the launcher is done: the lease is released, and what still runs ends
        assert holder.wait(30) == 0
        _gone(host, [pid])
        work.wait(10)
    finally:
        holder.kill()
    no_env = subprocess.run([str(BIN / "xpu"), "confine", "--", "true"], env=xpu_env(d.runtime_dir),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert no_env.returncode == 2 and "XPU_LEASE_TOKEN" in no_env.stderr


def xpu_in(host, d: DaemonProc, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``xpu ARGS`` in systemd's namespaces (the daemon sees its pid), from ``/``."""
    argv = [*host.prefix, str(BIN / "xpu"), *args]
    env = xpu_env(d.runtime_dir)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd="/")


def submitted(host, d: DaemonProc, *args: str) -> str:
    r = xpu_in(host, d, "submit", *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def job_of(d: DaemonProc, job_id: str) -> dict:
    r = d.xpu("show", job_id, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["job"]


def _unit_state(host, job_id: str) -> str:
    return host.run(["systemctl", "is-active", f"xpu-submit-{job_id}.service"]).stdout.strip()


@pytest.fixture(scope="module")
def jobd(host):
    """A daemon of its own for detached jobs (killed and restarted here), with its own copy of the fake
    ``/proc`` (a case takes the capability files away)."""
    short = Path(f"/tmp/xpu-iso-j{os.getpid()}")
    short.mkdir()
    shutil.copytree(host.base / "proc", short / "proc")
    d = DaemonProc(short, "dgx-a100", config(short / "proc"), prefix=host.prefix)
    try:
        yield d.start()
    finally:
        _kill_in(host, d)
        shutil.rmtree(short, ignore_errors=True)


def test_a_submitted_job_opens_its_leases_cards_and_no_other(host, daemons, tmp_path):
    """``xpu submit``: the job's unit (``xpu-submit-<id>.service``) carries the lease's device fence."""
    d = daemons["mig"]
    out = tmp_path / "whole.out"
    job = submitted(host, d, "-m", "xpu", "--name", "sub", "-o", str(out), "--", sys.executable, "-c", PROBE)
    assert xpu_in(host, d, "wait", job).returncode == 0
    check(opened(out.read_text())[1], {MINORS[i] for i in lease_named(d, "sub").cards})
    out = tmp_path / "mig.out"
    job = submitted(host, d, "-m", "vxpu-half", "--name", "submig", "-o", str(out), "--", sys.executable,
                    "-c", PROBE)  # fmt: skip
    assert xpu_in(host, d, "wait", job).returncode == 0
    seen = opened(out.read_text())[1]
    (parent,) = lease_named(d, "submig").cards
    own = {int(p.rsplit("cap", 1)[1]) for p, how in seen.items() if "nvidia-caps" in p and how == "ENXIO"}
    assert len(own) == 2 and {card_of_cap(c) for c in own} == {MINORS[parent]}, own
    check(seen, {MINORS[parent]}, own)


def test_a_fenced_job_outlives_a_killed_daemon_fenced_and_ends_with_its_cancel(host, jobd, tmp_path):
    """Jobs outlive their daemon by design: a SIGKILLed daemon's successor (``Scopes.reconcile`` at its
    start) leaves the running job's unit running and fenced; a cancel then stops it, lease and all."""
    d, out, go = jobd, tmp_path / "job.out", tmp_path / "go"
    script = f'"$0" -c "$1"; while [ ! -e {go} ]; do sleep 0.05; done; "$0" -c "$1"; exec sleep 300'
    job = submitted(
        host, d, "--name", "kept", "-o", str(out), "--", "sh", "-c", script, sys.executable, PROBE
    )
    wait_until(lambda: out.exists() and out.read_text().count("\n") == 1, 30)
    (card,) = lease_named(d, "kept").cards
    check(opened(out.read_text().splitlines()[0])[1], {MINORS[card]})
    _kill_in(host, d)
    d.start()
    assert job_of(d, job)["state"] == "running" and _unit_state(host, job) == "active"
    go.touch()
    wait_until(lambda: out.read_text().count("\n") == 2, 30)
    check(opened(out.read_text().splitlines()[1])[1], {MINORS[card]})
    assert xpu_in(host, d, "cancel", job).returncode == 0
    wait_until(lambda: job_of(d, job)["state"] == "cancelled", 30)
    wait_until(lambda: _unit_state(host, job) != "active", 15)
    assert lease_named(d, "kept").HasField("ended")


def test_a_restartable_job_moved_after_a_daemon_restart_opens_only_its_new_card(host, jobd, tmp_path):
    """``xpu submit --restartable``: the daemon is SIGKILLed and started again (it holds the job's lease
    again), then the job's card fails; the job is stopped and started again in a unit fenced to its NEW
    placement: the old card is EPERM now, the new one ENXIO, XPU_RESTART_COUNT=1, output appended."""
    d, out = jobd, tmp_path / "moved.out"
    script = '"$0" -c "$1"; [ "$XPU_RESTART_COUNT" = 1 ] && exit 0; exec sleep 300'
    job = submitted(host, d, "-m", "xpu", "--restartable", "--name", "hop", "--kill-grace", "3", "-o",
                    str(out), "--", "sh", "-c", script, sys.executable, PROBE)  # fmt: skip
    wait_until(lambda: out.exists() and out.read_text().count("\n") == 1, 30)
    (old,) = lease_named(d, "hop").cards
    count, before = opened(out.read_text().splitlines()[0])
    assert count == "0"
    check(before, {MINORS[old]})
    _kill_in(host, d)
    d.start()
    assert job_of(d, job)["state"] == "running"
    try:
        with d.client(admin=True) as c:
            c.inject_fault(str(old), "xid", 79)  # unhealthy: the health monitor moves the restartable job
        assert xpu_in(host, d, "wait", job, timeout=90).returncode == 0, job_of(d, job)
    finally:
        with d.client(admin=True) as c:
            c.clear_fault(str(old))
    (new,) = lease_named(d, "hop").cards
    lines = out.read_text().splitlines()
    count, after = opened(lines[-1])
    assert new != old and count == "1" and len(lines) == 2, lines
    check(after, {MINORS[new]})
    assert job_of(d, job)["restarts"] == 1


def test_a_job_whose_fence_cannot_be_computed_is_not_started(host, jobd, tmp_path):
    """Enforced, but the MIG slice's capability nodes cannot be named (the driver's files are gone): the
    job fails with one line that says why, and its command never runs."""
    d = jobd
    caps = d.base / "proc/driver/nvidia/capabilities"
    shutil.move(caps, d.base / "proc/caps-away")
    try:
        ran = tmp_path / "ran"
        job = submitted(host, d, "-m", "vxpu-half", "--name", "unfenced", "--", "touch", str(ran))
        assert xpu_in(host, d, "wait", job).returncode != 0
    finally:
        shutil.move(d.base / "proc/caps-away", caps)
    shown = job_of(d, job)
    assert shown["state"] == "failed" and not ran.exists(), shown
    assert shown["reason"].startswith("could not start: device isolation: lease "), shown["reason"]
    assert "\n" not in shown["reason"]


def test_a_restarted_daemon_stops_the_warm_scopes_it_left_and_not_another_daemons(host, daemons, jobd):
    """Warm commands' scopes (``controllers/provisioner.py``, ``Scopes.warm_id``) of a SIGKILLed daemon:
    its successor stops them at start-up (``Scopes.reconcile``); the other daemon's under the same systemd
    are left alone (the owner tag in the name)."""
    from xpud.isolation.scope import Enforcement, Scopes, owner_tag

    ours = Scopes(None, Enforcement(True), owner=owner_tag(jobd.state_dir)).warm_id(0)
    theirs = Scopes(None, Enforcement(True), owner=owner_tag(daemons["mig"].state_dir)).warm_id(0)
    procs = [
        subprocess.Popen(
            [
                *host.prefix,
                "systemd-run",
                "--scope",
                "--quiet",
                f"--unit=xpu-lease-{i}.scope",
                "sleep",
                "300",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in (ours, theirs)
    ]
    try:
        wait_until(lambda: all(_scope_state(host, i) == "active" for i in (ours, theirs)), 15)
        _kill_in(host, jobd)
        jobd.start()
        wait_until(lambda: _scope_state(host, ours) != "active", 15)
        assert _scope_state(host, theirs) == "active"
    finally:
        for i in (ours, theirs):
            host.run(["systemctl", "stop", f"xpu-lease-{i}.scope"])
        for p in procs:
            p.kill()
            p.wait(10)


WARM_ESCAPE = """
import asyncio, sys
from types import SimpleNamespace as NS
from xpud.controllers.provisioner import Provisioner
from xpud.isolation.scope import Enforcement, Scopes
# the engine's part in this: the forecast's settings, card 0's minor, the events (scope and systemd real)
said = []
cfg = NS(forecast=NS(warm_command=sys.argv[1], warm_user="root", warm_timeout_s=30.0))
engine = NS(cfg=cfg, cards={0: NS(info=NS(index=0, minor_number=int(sys.argv[2])))},
            mig_device_ids=lambda i, h: None, event=lambda kind, text, **kw: said.append(text))
p = Provisioner(engine)
p.scopes = Scopes(engine, Enforcement(True), owner="test")
async def main():
    p._warm(NS(card_index=0, size="vxpu-half", handle="GPU-0"), {}, None)
    await p.warmed()
    await asyncio.gather(*p.scopes._ending)  # the scope's stop, if one is due
asyncio.run(main())
print(said[0])
"""


def test_what_a_warm_command_left_running_ends_with_it(host, tmp_path):
    """The provisioner stops a warm command's scope once the command has ended: a process it started in
    a session of its own does not keep running on the slice's card."""
    pidfile = tmp_path / "escaped"
    cmd = f"setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}"
    argv = [*host.prefix, sys.executable, "-c", WARM_ESCAPE, cmd, str(MINORS[0])]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().endswith("warm_command exited 0 (as root)"), r.stdout + r.stderr
    _gone(host, [pidfile.read_text().strip()])
