"""Packaging: the package list is complete, a wheel installs and runs; the generated gRPC code is current;
the systemd unit verifies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_on_disk() -> set[str]:
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    found = set()
    for name, directory in mapping.items():
        base = ROOT / directory
        for d in [base, *[p for p in base.rglob("*") if p.is_dir()]]:
            if "__pycache__" in d.parts or not (any(d.glob("*.py")) or any(d.glob("*.toml"))):
                continue
            rel = d.relative_to(base)
            sub = name + ("." + ".".join(rel.parts) if rel.parts else "")
            if any(
                sub == other or sub.startswith(other + ".")
                for other in mapping
                if other != name and other.startswith(name + ".")
            ):
                continue  # mapped separately (xpud.etc)
            found.add(sub)
    return found


def test_package_list_is_complete():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert _packages_on_disk() == listed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("xpud-*.whl"))


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"xpud", "xpu_cli", "xpu_tui"}  # no top-level cli/ or tui/
    for needed in (
        "xpud/etc/xpud.toml",
        "xpud/etc/machines/dgx-h100.toml",
        "xpud/api/v1/xpu.proto",
        "xpud/api/v1/xpu_pb2.py",
        "xpu_cli/main.py",
        "xpud/systemd/xpud.service",
        "xpud/systemd/xpud-sysusers.conf",
        "xpud/sim/data/openb/openb_node_list_gpu_node.csv",
        "xpud/sim/data/openb/openb_pod_list_default.csv",
        "xpud/sim/data/openb/README.md",
    ):
        assert needed in names


def test_wheel_installs_and_runs(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k != "XPUD_OPENB_DIR"}
    env["PYTHONPATH"] = str(target)
    where = subprocess.run(
        [sys.executable, "-c", "import xpud, xpu_cli; print(xpud.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(target))

    def installed(command: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A command of the installed wheel, run from a folder outside the repository."""
        return subprocess.run(
            [str(target / "bin" / command), *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    r = installed("xpud", "--simulate", "workstation-2x", "check-hardware")
    assert r.returncode == 0, r.stderr
    assert "GPU0" in r.stdout
    r = installed("xpu", "--help")
    assert r.returncode == 0 and "run" in r.stdout
    # the unit and the sysusers entry ship in the wheel, and ExecStart names the xpud that ran
    root = tmp_path / "root"
    root.mkdir()
    r = installed("xpud", "install-service", "--root", str(root), "--no-start")
    assert r.returncode == 0, r.stderr
    unit = (root / "etc/systemd/system/xpud.service").read_text()
    assert f"ExecStart={target / 'bin' / 'xpud'} --config" in unit
    assert "g xpud-admin -" in (root / "etc/sysusers.d/xpud.conf").read_text()
    # the default trace ships with the package: simulate works outside the repository's layout
    r = installed("xpu", "simulate", "-q", "--seeds", "42", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["policy"] for row in rows} == {"xpud"} and max(row["alloc_pct"] for row in rows) > 50


@pytest.mark.parametrize(
    "proto",
    ["xpud/api/v1/xpu.proto", "xpud/bridges/v1beta1/api.proto", "xpud/bridges/podresources/v1/api.proto"],
)
def test_generated_grpc_code_matches_the_proto(tmp_path, proto):
    folder = Path(proto).parent
    shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--grpc_python_out=.",
            "--pyi_out=.",
            proto,
        ],
        cwd=tmp_path,
        check=True,
    )
    stem = Path(proto).stem
    for name in (f"{stem}_pb2.py", f"{stem}_pb2_grpc.py", f"{stem}_pb2.pyi"):
        fresh = (tmp_path / folder / name).read_text()
        committed = (ROOT / folder / name).read_text()
        assert fresh == committed, f"{name} is stale: regenerate it (see the header of {proto})"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path):
    unit = (ROOT / "systemd" / "xpud.service").read_text()
    assert "Type=notify" in unit and "RuntimeDirectory=xpud" in unit and "StateDirectory=xpud" in unit
    xpud = Path(sys.executable).parent / "xpud"
    (tmp_path / "xpud.service").write_text(unit.replace("/usr/local/bin/xpud", str(xpud)))
    r = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "xpud.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


def test_sd_notify_sends_ready(tmp_path, monkeypatch):
    import socket

    from xpud.daemon.systemd import sd_notify

    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        sd_notify("READY=1")
        assert s.recv(100) == b"READY=1"
