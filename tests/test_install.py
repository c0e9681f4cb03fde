"""`xpud install-service --root DIR` and `xpud uninstall-service`: every file written, the unit verified by
systemd-analyze, a second run changes nothing, uninstall leaves nothing of ours and touches nothing else."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from xpud.daemon import install

ROOT = Path(__file__).resolve().parents[1]
XPUD = Path(sys.executable).parent / "xpud"
TEMPLATE_UNIT = (ROOT / "systemd" / "xpud.service").read_text()
TEMPLATE_CONFIG = (ROOT / "etc" / "xpud.toml").read_bytes()
UNIT = "etc/systemd/system/xpud.service"
WANTS = "etc/systemd/system/multi-user.target.wants/xpud.service"
SYSUSERS = "etc/sysusers.d/xpud.conf"
CONFIG = "etc/xpud/xpud.toml"
MANIFEST = "var/lib/xpud/install-manifest.json"


def xpud(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPUD_")}
    return subprocess.run([str(XPUD), *args], capture_output=True, text=True, timeout=60, env=env)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root: (kind, content or link target, mode, mtime_ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p), st.st_mtime_ns)
            elif p.is_dir():
                out[rel] = ("dir", None, st.st_mode & 0o7777, st.st_mtime_ns)
            else:
                out[rel] = ("file", p.read_bytes(), st.st_mode & 0o7777, st.st_mtime_ns)
    return out


@pytest.fixture
def root(tmp_path) -> Path:
    """A root with files that are not ours: they must come through install and uninstall untouched."""
    r = tmp_path / "root"
    (r / "etc/systemd/system").mkdir(parents=True)
    (r / "etc/systemd/system/other.service").write_text("[Service]\nExecStart=/bin/true\n")
    (r / "var/lib/other").mkdir(parents=True)
    (r / "var/lib/other/state").write_text("keep me\n")
    return r


def test_install_service_writes_the_unit_the_group_the_config_and_a_manifest(root):
    before = snapshot(root)
    r = xpud("install-service", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""

    unit = (root / UNIT).read_text()
    exec_lines = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert exec_lines == [
        f"ExecStart={XPUD} --config /etc/xpud/xpud.toml --runtime-dir /run/xpud --state-dir /var/lib/xpud"
    ]
    assert unit == TEMPLATE_UNIT.replace("ExecStart=/usr/local/bin/xpud", f"ExecStart={XPUD}")
    sysusers = [ln for ln in (root / SYSUSERS).read_text().splitlines() if ln and not ln.startswith("#")]
    assert sysusers == ["g xpud-admin -"]
    assert (root / CONFIG).read_bytes() == TEMPLATE_CONFIG
    assert os.readlink(root / WANTS) == "/" + UNIT
    for rel in (UNIT, SYSUSERS, CONFIG):
        assert (root / rel).stat().st_mode & 0o777 == 0o644
    assert (root / "var/lib/xpud").stat().st_mode & 0o777 == 0o700  # the unit's StateDirectoryMode

    manifest = json.loads((root / MANIFEST).read_text())
    assert manifest["exec_start"] == str(XPUD)
    assert manifest["files"] == {
        rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in (UNIT, SYSUSERS, CONFIG)
    }
    assert manifest["links"] == {WANTS: "/" + UNIT}
    # nothing else was written, and what was there is untouched
    after = snapshot(root)
    new = set(after) - set(before)
    ours = {UNIT, SYSUSERS, CONFIG, WANTS, MANIFEST}
    parents = {str(p) for rel in ours for p in Path(rel).parents if str(p) != "."}
    assert new == (ours | parents) - set(before)
    assert all(after[k][:3] == before[k][:3] for k in before if k not in parents)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_the_written_unit_verifies(root):
    assert xpud("install-service", "--root", str(root), "--no-start").returncode == 0
    # ExecStart names the xpud installed on this host (root /), where systemd-analyze looks for it
    r = subprocess.run(
        ["systemd-analyze", "verify", str(root / UNIT)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_the_sysusers_entry_makes_the_admin_group(root):
    assert xpud("install-service", "--root", str(root), "--no-start").returncode == 0
    r = subprocess.run(
        ["systemd-sysusers", f"--root={root}", "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "Creating group 'xpud-admin'" in r.stdout + r.stderr


def test_a_second_run_changes_nothing(root):
    first = xpud("install-service", "--root", str(root))
    assert first.returncode == 0 and first.stdout.strip().endswith("\nchanged")
    before = snapshot(root)
    second = xpud("install-service", "--root", str(root))
    assert second.returncode == 0, second.stderr
    assert snapshot(root) == before  # contents, modes and mtimes
    assert second.stdout.strip().endswith("nothing to change")
    assert "wrote" not in second.stdout and "updated" not in second.stdout


def test_uninstall_removes_everything_of_ours_and_nothing_else(root):
    before = snapshot(root)
    assert xpud("install-service", "--root", str(root)).returncode == 0
    r = xpud("uninstall-service", "--root", str(root))
    assert r.returncode == 0, r.stderr
    after = snapshot(root)
    assert {k: v[:3] for k, v in after.items()} == {k: v[:3] for k, v in before.items()}
    assert all(after[k] == before[k] for k in before if before[k][0] == "file")
    r = xpud("uninstall-service", "--root", str(root))
    assert r.returncode == 1 and "no install manifest" in r.stderr


def test_an_edited_config_is_never_overwritten_shows_new_keys_and_survives_uninstall(root):
    assert xpud("install-service", "--root", str(root)).returncode == 0
    edited = "[leases]\ngrace_s = 5.0\n"
    (root / CONFIG).write_text(edited)
    # as if the previous install had come from a version that did not know defrag.make_room yet
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["config_keys"].remove("defrag.make_room")
    (root / MANIFEST).write_text(json.dumps(manifest))
    r = xpud("install-service", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert (root / CONFIG).read_text() == edited
    assert "kept     /etc/xpud/xpud.toml (edited: never overwritten)" in r.stdout
    added = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("+ ")]
    assert len(added) == 1 and added[0].startswith("+ [defrag] make_room = true  # ")
    again = xpud("install-service", "--root", str(root))  # shown once
    assert "+ [" not in again.stdout and again.stdout.strip().endswith("nothing to change")

    r = xpud("uninstall-service", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert "kept     /etc/xpud/xpud.toml (edited since install-service wrote it)" in r.stdout
    assert (root / CONFIG).read_text() == edited
    left = {str(p.relative_to(root)) for p in root.rglob("*")}
    assert left == {
        "etc",
        "etc/xpud",
        CONFIG,
        "etc/systemd",
        "etc/systemd/system",
        "etc/systemd/system/other.service",
        "var",
        "var/lib",
        "var/lib/other",
        "var/lib/other/state",
    }


def test_a_config_that_was_there_before_is_kept_and_its_admin_group_used(root):
    (root / "etc/xpud").mkdir(parents=True)
    (root / CONFIG).write_text('[daemon]\nadmin_group = "gpu-ops"\n')
    r = xpud("install-service", "--root", str(root), "--no-start")
    assert r.returncode == 0, r.stderr
    assert "g gpu-ops -" in (root / SYSUSERS).read_text().splitlines()
    assert "kept     /etc/xpud/xpud.toml (not written by install-service: never overwritten)" in r.stdout
    assert "keys the file does not set" in r.stdout
    assert not (root / WANTS).exists()
    assert xpud("uninstall-service", "--root", str(root)).returncode == 0
    assert (root / CONFIG).read_text() == '[daemon]\nadmin_group = "gpu-ops"\n'
    assert (
        not (root / UNIT).exists()
        and not (root / SYSUSERS).exists()
        and not (root / "etc/sysusers.d").exists()
    )


def test_a_broken_config_or_a_hand_copied_unit_stops_install_before_it_writes_anything(root):
    (root / UNIT).write_text(TEMPLATE_UNIT)  # copied by hand, as the README used to say
    before = snapshot(root)
    r = xpud("install-service", "--root", str(root))
    assert r.returncode == 1
    assert f"{root / UNIT}: exists and is not the copy install-service wrote" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert snapshot(root) == before
    (root / UNIT).unlink()
    (root / "etc/xpud").mkdir()
    (root / CONFIG).write_text("[leases]\ngrace_s = -1\n")
    before = snapshot(root)
    r = xpud("install-service", "--root", str(root))
    assert r.returncode == 1 and "grace_s" in r.stderr and "fix the config" in r.stderr
    assert snapshot(root) == before


def test_prefix_names_the_xpud_inside_an_image(root):
    bin_dir = root / "opt/xpud/bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "xpud").write_text("#!/bin/sh\n")
    (bin_dir / "xpud").chmod(0o755)
    r = xpud("install-service", "--root", str(root), "--prefix", "/opt/xpud", "--no-start")
    assert r.returncode == 0, r.stderr
    assert "ExecStart=/opt/xpud/bin/xpud --config" in (root / UNIT).read_text()
    assert "note:" not in r.stdout
    r = xpud("install-service", "--root", str(root), "--prefix", "/opt/other")
    assert r.returncode == 1 and "--prefix /opt/other: no executable" in r.stderr
    r = xpud("install-service", "--root", str(root / "missing"))
    assert (
        r.returncode == 1
        and r.stderr
        == f"xpud: --root {root / 'missing'}: no such directory; make it (an image's root) first\n"
    )


def test_on_a_live_system_it_makes_the_group_reloads_enables_and_starts(root):
    calls = []

    def run(argv):
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0, "", "")

    install.install(root, start=True, run=run, live=True)
    assert calls == [
        ["systemd-sysusers", str(root / SYSUSERS)],
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", "xpud.service"],
    ]
    calls.clear()
    install.uninstall(root, run=run, live=True)
    assert calls == [["systemctl", "disable", "--now", "xpud.service"], ["systemctl", "daemon-reload"]]
    assert not (root / UNIT).exists()


def test_a_failing_systemctl_is_reported_in_one_line(root):
    def run(argv):
        return subprocess.CompletedProcess(argv, 1, "", "Failed to connect to bus\n")

    with pytest.raises(install.InstallError, match=r"`systemd-sysusers .*` failed \(status 1\): Failed to"):
        install.install(root, run=run, live=True)


def test_an_unedited_config_follows_the_package_on_upgrade(root):
    assert xpud("install-service", "--root", str(root)).returncode == 0
    # as if an older version had written its own default config, unedited since
    older = TEMPLATE_CONFIG.replace(b"grace_s = 10.0", b"grace_s = 20.0")
    (root / CONFIG).write_bytes(older)
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["files"][CONFIG] = hashlib.sha256(older).hexdigest()
    (root / MANIFEST).write_text(json.dumps(manifest))
    r = xpud("install-service", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert "updated  /etc/xpud/xpud.toml" in r.stdout
    assert (root / CONFIG).read_bytes() == TEMPLATE_CONFIG
    assert xpud("uninstall-service", "--root", str(root)).returncode == 0
    assert not (root / CONFIG).exists()


def _unit_lines(text: str) -> dict[str, list[str]]:
    """section -> its ``Key=value`` lines, in order (systemd.syntax(7): repeated keys add up)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif line and line[0] not in "#;" and "=" in line:
            out.setdefault(section, []).append(line)
    return out


def test_the_unit_starts_after_the_fabric_manager_and_loads_nvidia_uvm_first(root):
    """NVSwitch hosts: CUDA fails until nvidia-fabricmanager.service (NVIDIA's Fabric Manager package ships
    that unit) has trained the fabric, so xpud wants it and orders itself after it. ProtectKernelModules=yes
    (systemd.exec(5)) keeps the daemon from loading nvidia-uvm, so the unit loads it before, with full
    privileges ("+", systemd.service(5)), through nvidia-modprobe (NVIDIA/nvidia-modprobe: -u loads
    nvidia-uvm and makes its nodes, -c=0 makes /dev/nvidia0); "-": a host without the tool still starts."""
    assert xpud("install-service", "--root", str(root), "--no-start").returncode == 0
    unit = _unit_lines((root / UNIT).read_text())
    wants = " ".join(v.split("=", 1)[1] for v in unit["[Unit]"] if v.startswith("Wants="))
    after = " ".join(v.split("=", 1)[1] for v in unit["[Unit]"] if v.startswith("After="))
    assert "nvidia-fabricmanager.service" in wants.split()
    assert "nvidia-fabricmanager.service" in after.split()
    service = unit["[Service]"]
    assert "ProtectKernelModules=yes" in service
    pre = [v.split("=", 1)[1] for v in service if v.startswith("ExecStartPre=")]
    assert pre == ["-+/usr/bin/nvidia-modprobe -u -c=0"]
