"""`xpu certs`: a site CA and host certificates that a real gRPC server with mutual TLS accepts, and
that it refuses without a certificate or with one from another CA. Keys are 0600 whatever the umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from xpud.federation.certs import CertError, issue, peer_name

XPU = [sys.executable, "-c", "from xpu_cli.main import main; main()"]


def xpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*XPU, *args], capture_output=True, text=True, timeout=60)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def site(tmp_path):
    """A CA and two hosts, made through the CLI as an operator would (with a permissive umask)."""
    old = os.umask(0o000)
    try:
        r = xpu("certs", "init", "--out", str(tmp_path / "ca"), "--site", "lab")
        assert r.returncode == 0, r.stderr
        for name, ip in (("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")):
            r = xpu("certs", "issue", name, "--ip", ip, "--dns", "localhost", "--ca", str(tmp_path / "ca"),
                    "--out", str(tmp_path / name), "--json")  # fmt: skip
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["names"] == [name, "localhost", ip]
    finally:
        os.umask(old)
    return tmp_path


def test_keys_are_0600_and_nothing_is_overwritten(site):
    assert mode(site / "ca" / "ca.key") == 0o600 and mode(site / "node-a" / "node-a.key") == 0o600
    assert mode(site / "node-a" / "node-a.crt") == 0o644
    r = xpu("certs", "init", "--out", str(site / "ca"))
    assert r.returncode == 1 and "refusing to overwrite" in r.stderr and "--force" in r.stderr
    r = xpu("certs", "issue", "node-a", "--ca", str(site / "ca"), "--out", str(site / "node-a"))
    assert r.returncode == 1 and "refusing to overwrite" in r.stderr


def test_bad_input_is_one_line(site, tmp_path):
    r = xpu(
        "certs", "issue", "node-c", "--ip", "10.0.0.300", "--ca", str(site / "ca"), "--out", str(tmp_path)
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--ip" in r.stderr
    r = xpu("certs", "issue", "bad name!", "--ca", str(site / "ca"), "--out", str(tmp_path))
    assert r.returncode == 1 and "use letters, digits" in r.stderr
    r = xpu("certs", "issue", "node-c", "--ca", str(tmp_path / "nowhere"), "--out", str(tmp_path))
    assert r.returncode == 1 and "xpu certs init" in r.stderr
    with pytest.raises(CertError):
        issue("node-c", tmp_path / "nowhere", tmp_path)


def _server(d: Path, name: str, port: int) -> grpc.Server:
    ca = (d / "ca.crt").read_bytes()
    creds = grpc.ssl_server_credentials(
        [((d / f"{name}.key").read_bytes(), (d / f"{name}.crt").read_bytes())],
        root_certificates=ca,
        require_client_auth=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    assert server.add_secure_port(f"127.0.0.2:{port}", creds) == port
    server.start()
    return server


def _check(target: str, creds: grpc.ChannelCredentials) -> None:
    with grpc.secure_channel(target, creds) as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


def test_mutual_tls_accepts_the_sites_hosts_only(site, tmp_path):
    port = _free_port()
    server = _server(site / "node-a", "node-a", port)
    try:
        b = site / "node-b"
        ca = (b / "ca.crt").read_bytes()
        good = grpc.ssl_channel_credentials(
            ca, (b / "node-b.key").read_bytes(), (b / "node-b.crt").read_bytes()
        )
        _check(f"127.0.0.2:{port}", good)  # the server's certificate names 127.0.0.2: verified as is
        with pytest.raises(grpc.RpcError) as no_cert:
            _check(f"127.0.0.2:{port}", grpc.ssl_channel_credentials(ca))
        assert no_cert.value.code() is grpc.StatusCode.UNAVAILABLE
        other = tmp_path / "other"
        assert xpu("certs", "init", "--out", str(other / "ca")).returncode == 0
        issue("node-b", other / "ca", other / "node-b")
        stranger = grpc.ssl_channel_credentials(
            ca, (other / "node-b" / "node-b.key").read_bytes(), (other / "node-b" / "node-b.crt").read_bytes()
        )
        with pytest.raises(grpc.RpcError) as foreign:
            _check(f"127.0.0.2:{port}", stranger)
        assert foreign.value.code() is grpc.StatusCode.UNAVAILABLE
        assert peer_name((b / "node-b.crt").read_bytes()) == "node-b"
    finally:
        server.stop(None)
