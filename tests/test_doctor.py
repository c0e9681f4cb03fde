"""`xpud doctor` over the fake: a healthy host (installed unit, admin group, running daemon) passes, and each
check fails (or warns) on its own when its part of the host is broken, with the fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pynvml as N
import pytest

from tests.conftest import xpu_env
from tests.daemons import DaemonProc
from xpud import config
from xpud.daemon import doctor
from xpud.isolation.faketools import FakeNvidiaTools

XPUD = Path(sys.executable).parent / "xpud"


def _install(root: Path) -> None:
    """The unit for an xpud at /opt/xpud/bin/xpud in ``root``, and the admin group made by sysusers."""
    (root / "opt/xpud/bin").mkdir(parents=True)
    (root / "opt/xpud/bin/xpud").symlink_to(XPUD)
    r = subprocess.run(
        [str(XPUD), "install-service", "--root", str(root), "--prefix", "/opt/xpud", "--no-start"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("XPUD_")},
    )
    assert r.returncode == 0, r.stderr
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    (root / "usr/bin/setpriv").symlink_to(shutil.which("setpriv"))
    if shutil.which("systemd-sysusers"):
        subprocess.run(["systemd-sysusers", f"--root={root}"], check=True, capture_output=True, timeout=60)
    else:
        (root / "etc/group").write_text("root:x:0:\nxpud-admin:x:999:\n")
    assert "xpud-admin:x:" in (root / "etc/group").read_text()


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory):
    """An installed root and a running simulated daemon (workstation-2x) whose sockets are checked."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="xpu-doc-", dir="/tmp"))
    root = base / "root"
    root.mkdir()
    _install(root)
    d = DaemonProc(base, "workstation-2x", "[leases]\ngrace_s = 30.0\n").start()
    d.state_dir.chmod(0o700)  # as the unit's StateDirectoryMode makes it
    cfg_file = base / "doctor.toml"
    cfg_file.write_text(
        f'[daemon]\nruntime_dir = "{d.runtime_dir}"\nstate_dir = "{d.state_dir}"\n'
        '[devices]\nbackend = "simulated"\nmachine = "workstation-2x"\n'
    )
    yield base, root, d, cfg_file
    d.kill()
    shutil.rmtree(base, ignore_errors=True)


def test_a_healthy_host_passes_every_check(host_dir):
    _, root, d, cfg_file = host_dir
    r = subprocess.run(
        [str(XPUD), "--config", str(cfg_file), "doctor", "--root", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=xpu_env(d.runtime_dir),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert report["ok"] is True
    assert statuses == {
        "driver": "ok",
        "mig GPU0": "ok",
        "mig GPU1": "ok",
        "persistence": "ok",
        "fabric": "skip",
        "mps": "ok",
        "uvm": "ok",
        "device isolation": "skip",  # a simulated machine (tests/test_device_isolation.py: the others)
        "device modes": "skip",
        "admin group": "ok",
        "user switch": "ok",
        "sockets": "ok",
        "state dir": "ok",
        "unit": "ok",
        "unit devices": "ok",
        "clock skew": "skip",
    }
    skew = next(c for c in report["checks"] if c["name"] == "clock skew")
    assert skew["message"].startswith("no [cluster] configured")
    text = subprocess.run(
        [str(XPUD), "--config", str(cfg_file), "doctor", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        env=xpu_env(d.runtime_dir),
    )
    assert text.returncode == 0
    assert text.stdout.splitlines()[0].startswith("ok    driver: NVIDIA driver 550.90.07")
    assert text.stdout.strip().endswith("0 failed, 0 warning(s), 16 check(s)")


def _cfg(cfg_file: Path, **changes) -> config.Config:
    cfg = config.load(cfg_file, environ={})
    for section, values in changes.items():
        cfg = cfg.replace(section, **values)
    return cfg


def _by_name(checks):
    return {c.name: c for c in checks}


def _differences(cfg, host, break_it) -> tuple[dict[str, doctor.Check], list[doctor.Check]]:
    """The checks that differ once ``break_it(host)`` ran (the others stay as on the healthy host), and all
    the checks of the broken host."""
    before = _by_name(doctor.run_checks(cfg, host))
    assert not [c for c in before.values() if c.status in ("warn", "fail")], before
    restore = break_it(host)
    try:
        after = doctor.run_checks(cfg, host)
    finally:
        if restore:
            restore()
    return {c.name: c for c in after if c.name not in before or c.status != before[c.name].status}, after


def _handle(host, index):
    return host.lib.nvmlDeviceGetHandleByIndex(index)


def _chmod(path: Path, mode: int):
    old = path.stat().st_mode & 0o7777
    path.chmod(mode)
    return lambda: path.chmod(old)


def _break_nvml(host):
    host.lib.fail("nvmlInit", N.NVML_ERROR_DRIVER_NOT_LOADED)


def _persistence_off(host):
    lib = host.lib
    lib.nvmlInit()
    lib.nvmlDeviceSetPersistenceMode(_handle(host, 1), N.NVML_FEATURE_DISABLED)
    lib.nvmlShutdown()


def _no_mps_control(host):
    host.tools = FakeNvidiaTools(host.lib, missing=["nvidia-cuda-mps-control"])


def _mig_pending(host):
    lib = host.lib
    lib.nvmlInit()
    lib.add_client(0, "dcgm")  # a monitoring agent holds the card: the driver leaves the mode pending
    lib.nvmlDeviceSetMigMode(_handle(host, 0), N.NVML_DEVICE_MIG_ENABLE)
    lib.nvmlShutdown()


def _unit_gone(host):
    unit = host.root / "etc/systemd/system/xpud.service"
    saved = unit.read_bytes()
    unit.unlink()
    return lambda: unit.write_bytes(saved)


def _setpriv_gone(host):
    tool = host.root / "usr/bin/setpriv"
    target = tool.readlink()
    tool.unlink()
    return lambda: tool.symlink_to(target)


def _exec_gone(host):
    exe = host.root / "opt/xpud/bin/xpud"
    exe.unlink()
    return lambda: exe.symlink_to(XPUD)


def _drop_in(text: str):
    def apply(host):
        d = host.root / "etc/systemd/system/xpud.service.d"
        d.mkdir()
        (d / "devices.conf").write_text(text)
        return lambda: shutil.rmtree(d)

    return apply


def _lose_card(host):
    host.lib.lose(1)


def _no_uvm(host):
    real = host.devices

    def devices():
        nodes, groups = real()
        return [n for n in nodes if not n.path.startswith("/dev/nvidia-uvm")], groups

    host.devices = devices
    return lambda: setattr(host, "devices", real)


def _fabric_training(host):
    host.lib.set_fabric(3, N.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
    return lambda: host.lib.set_fabric(3, N.NVML_GPU_FABRIC_STATE_COMPLETED)


CASES = {
    "card off the bus": (
        "workstation-2x",
        {},
        _lose_card,
        {"card GPU1": ("fail", "nvidia-smi -r -i 1")},
    ),
    "no driver": (
        "workstation-2x",
        {},
        _break_nvml,
        {
            "driver": ("fail", "install or load the NVIDIA driver"),
            "mig": ("skip", ""),
            "mps": ("skip", ""),
            "persistence": ("skip", ""),
        },
    ),
    "persistence off": (
        "workstation-2x",
        {},
        _persistence_off,
        {"persistence": ("warn", "nvidia-persistenced")},
    ),
    "no mps control": (
        "workstation-2x",
        {},
        _no_mps_control,
        {"mps": ("fail", "install the NVIDIA driver's utilities")},
    ),
    "mig wanted, not there": (
        "workstation-2x",
        {"cards": {"isolation": "mig"}},
        None,
        {
            "mig GPU0": ("fail", 'isolation = "auto"'),
            "mig GPU1": ("fail", 'isolation = "auto"'),
            "mps": ("skip", ""),
        },
    ),
    "mig mode pending": (
        "dgx-h100",
        {},
        _mig_pending,
        {"mig GPU0": ("warn", "nvidia-smi -i 0 --gpu-reset")},
    ),
    "nvidia-uvm not loaded": (
        "workstation-2x",
        {},
        _no_uvm,
        {"uvm": ("fail", "nvidia-modprobe -u -c=0")},
    ),
    "nvswitch fabric not trained": (
        "dgx-h100",
        {},
        _fabric_training,
        {"fabric": ("fail", "systemctl enable --now nvidia-fabricmanager")},
    ),
    "no admin group": (
        "workstation-2x",
        {"daemon": {"admin_group": "xpud-no-such-group"}},
        None,
        {"admin group": ("fail", "groupadd --system xpud-no-such-group")},
    ),
    "no setpriv": (
        "workstation-2x",
        {},
        _setpriv_gone,
        {"user switch": ("warn", "install util-linux")},
    ),
    "no unit": (
        "workstation-2x",
        {},
        _unit_gone,
        {"unit": ("warn", "xpud install-service"), "unit devices": ("skip", "")},
    ),
    "unit runs a missing xpud": (
        "workstation-2x",
        {},
        _exec_gone,
        {"unit": ("fail", "xpud install-service")},
    ),
    "unit denies nvidia-uvm": (
        "workstation-2x",
        {},
        _drop_in(
            "[Service]\nDeviceAllow=\nDeviceAllow=char-nvidia-frontend rw\nDeviceAllow=char-nvidia-caps rw\n"
        ),
        {"unit devices": ("fail", "DeviceAllow=char-<group> rw")},
    ),
    "unit allows MIG caps read-only": (
        "dgx-h100",
        {},
        _drop_in(
            "[Service]\nDeviceAllow=\nDeviceAllow=char-nvidia-frontend rw\nDeviceAllow=char-nvidia-uvm rw\n"
            "DeviceAllow=char-nvidia-caps r\n"
        ),
        {"unit devices": ("fail", "DeviceAllow=char-<group> rw")},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_check_fails_alone_with_its_fix(host_dir, case):
    _, root, _d, cfg_file = host_dir
    machine, changes, break_it, expected = CASES[case]
    healthy = _cfg(cfg_file, devices={"machine": machine})
    host = doctor.host_for(healthy, root)
    cfg = _cfg(cfg_file, devices={"machine": machine}, **changes)
    if changes:  # a config change breaks it: compare with the healthy config
        before = _by_name(doctor.run_checks(healthy, host))
        after = list(doctor.run_checks(cfg, host))
        diff = {c.name: c for c in after if c.status != before[c.name].status}
    else:
        diff, after = _differences(cfg, host, break_it)
    assert {n: c.status for n, c in diff.items() if n in expected} == {n: s for n, (s, _) in expected.items()}
    assert set(diff) == set(expected), diff
    for name, (status, fix) in expected.items():
        if status in ("warn", "fail"):
            assert fix in diff[name].fix, diff[name]
    failing = any(s == "fail" for s, _ in expected.values())
    assert doctor.exit_code(after) == (1 if failing else 0)


SOCKET_CASES = {
    "admin.sock open to all": ("admin.sock", 0o666, "fail", "anyone can use the operators' socket"),
    "xpud.sock closed to users": ("xpud.sock", 0o600, "fail", "users cannot connect"),
}


@pytest.mark.parametrize("case", list(SOCKET_CASES))
def test_socket_permissions(host_dir, case):
    _, root, d, cfg_file = host_dir
    name, mode, status, said = SOCKET_CASES[case]
    cfg = _cfg(cfg_file)
    diff, _ = _differences(cfg, doctor.host_for(cfg, root), lambda h: _chmod(d.runtime_dir / name, mode))
    assert {n: c.status for n, c in diff.items()} == {"sockets": status}
    assert said in diff["sockets"].message and "systemctl restart xpud" in diff["sockets"].fix


@pytest.mark.parametrize(("mode", "status"), [(0o755, "warn"), (0o777, "fail")])
def test_state_dir_permissions(host_dir, mode, status):
    _, root, d, cfg_file = host_dir
    cfg = _cfg(cfg_file)
    diff, _ = _differences(cfg, doctor.host_for(cfg, root), lambda h: _chmod(d.state_dir, mode))
    assert {n: c.status for n, c in diff.items()} == {"state dir": status}
    assert diff["state dir"].fix == f"chmod 700 {d.state_dir}"


def test_a_stopped_daemon_is_a_warning_not_a_failure(host_dir, tmp_path):
    _, root, _d, cfg_file = host_dir
    cfg = _cfg(cfg_file, daemon={"runtime_dir": str(tmp_path / "run")})
    checks = _by_name(doctor.run_checks(cfg, doctor.host_for(cfg, root)))
    assert checks["sockets"].status == "warn" and "xpud is not running" in checks["sockets"].message
    assert doctor.exit_code(list(checks.values())) == 0


def test_real_device_nodes_and_groups_are_read_from_dev_and_proc(tmp_path):
    proc = tmp_path / "devices"
    proc.write_text(
        "Character devices:\n  1 mem\n195 nvidia-frontend\n236 nvidia-caps\n509 nvidia-uvm\n\n"
        "Block devices:\n  8 sd\n"
    )
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").write_text("")  # not a character device: not a node
    nodes, groups = doctor.real_devices(tmp_path / "dev", proc)
    assert nodes == [] and groups == {
        1: ("mem",),
        195: ("nvidia-frontend",),
        236: ("nvidia-caps",),
        509: ("nvidia-uvm",),
    }
    node = doctor.DeviceNode("/dev/nvidia-uvm", 509, 0)
    assert doctor.device_access({"DeviceAllow": ["char-nvidia-*", "/dev/null rw"]}, [node], groups) == (
        [],
        [],
    )
    assert doctor.device_access({"DevicePolicy": ["closed"]}, [node], groups) == ([node], [])
    assert doctor.device_access({}, [node], groups) == ([], [])  # no restriction at all
    assert doctor.device_access({"DeviceAllow": ["/dev/nvidia-uvm r"]}, [node], groups) == ([], [node])


def test_doctor_takes_simulate_and_says_what_it_checked(tmp_path):
    r = subprocess.run(
        [str(XPUD), "doctor", "--simulate", "dgx-h100", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("XPUD_")},
    )
    assert r.returncode == 1  # no admin group under an empty root
    assert "(simulated): NVML reachable, 8 card(s)" in r.stdout
    assert "fail  admin group" in r.stdout and "      fix: xpud install-service" in r.stdout
    assert "warn  unit: no xpud.service under" in r.stdout


def test_persistence_mode_through_the_adapter_and_the_fake():
    from xpud.hw.fakenvml import FakeNvml
    from xpud.hw.nvml import Nvml

    fake = FakeNvml("workstation-2x", root=False)
    with Nvml(fake) as nvml:
        assert [nvml.persistence_mode(i) for i in range(2)] == [True, True]
        h = fake.nvmlDeviceGetHandleByIndex(1)
        with pytest.raises(N.NVMLError_NoPermission):  # as the driver: only root changes it
            fake.nvmlDeviceSetPersistenceMode(h, N.NVML_FEATURE_DISABLED)
        fake.root = True
        fake.nvmlDeviceSetPersistenceMode(h, N.NVML_FEATURE_DISABLED)
        assert [nvml.persistence_mode(i) for i in range(2)] == [True, False]
        fake.fail("nvmlDeviceGetPersistenceMode", N.NVML_ERROR_NOT_SUPPORTED)
        assert nvml.persistence_mode(0) is None


def test_a_unit_naming_only_nvidia_frontend_blocks_the_cards_of_a_545_driver(tmp_path):
    """From driver 545 on major 195 is "nvidia"/"nvidiactl" in /proc/devices (no "nvidia-frontend")."""
    proc = tmp_path / "devices"
    proc.write_text(
        "Character devices:\n  1 mem\n195 nvidia\n195 nvidiactl\n195 nvidia-modeset\n"
        "236 nvidia-caps\n509 nvidia-uvm\n\nBlock devices:\n  8 sd\n"
    )
    _, groups = doctor.real_devices(tmp_path, proc)
    assert groups[195] == ("nvidia", "nvidiactl", "nvidia-modeset")
    nodes = [doctor.DeviceNode("/dev/nvidia0", 195, 0), doctor.DeviceNode("/dev/nvidiactl", 195, 255)]
    old = {"DevicePolicy": ["closed"], "DeviceAllow": ["char-nvidia-frontend rw", "char-nvidia-uvm rw"]}
    assert doctor.device_access(old, nodes, groups) == (nodes, [])
    unit = tmp_path / "root" / "etc" / "systemd" / "system" / "xpud.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(
        "[Service]\nExecStart=/bin/true\nDevicePolicy=closed\nDeviceAllow=char-nvidia-frontend rw\n"
    )
    host = doctor.Host(root=tmp_path / "root", devices=lambda: (nodes, groups))
    check = _by_name(doctor._unit(host))["unit devices"]
    assert check.status == "fail" and "/dev/nvidia0 (nvidia/nvidiactl/nvidia-modeset)" in check.message
    shipped = Path(__file__).parent.parent / "systemd" / "xpud.service"
    unit.write_text(shipped.read_text().replace("/usr/local/bin/xpud", "/bin/true"))
    assert _by_name(doctor._unit(host))["unit devices"].status == "ok"
