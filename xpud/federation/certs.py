"""A site's certificate authority and its hosts' keys, for the peer service's mutual TLS.

``init_ca`` makes the site CA (``ca.key``, ``ca.crt``); ``issue`` a host's key and certificate, signed by
that CA, usable both as a TLS server and as a client (peers call each other). All cryptography is the
``cryptography`` package's: ECDSA P-256 keys, SHA-256 signatures, X.509 v3 with the usual extensions.
Private keys are written 0600 (created so: never readable by others, whatever the umask), certificates
0644. Nothing is overwritten unless asked.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from xpud.errors import XpudError

CA_KEY, CA_CERT = "ca.key", "ca.crt"
CA_DAYS, HOST_DAYS = 3650, 825  # 825 days: the longest validity most TLS clients accept for a leaf
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class CertError(XpudError):
    """A certificate step that cannot be done; the message says why and how to fix it."""


@dataclass(frozen=True)
class Issued:
    key: Path
    cert: Path
    ca: Path
    names: tuple[str, ...]  # the subject alternative names, as text


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write(path: Path, data: bytes, mode: int, force: bool) -> None:
    if path.exists() and not force:
        raise CertError(f"{path} exists: refusing to overwrite it (pass --force to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask narrows the mode given to open; set it exactly
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise CertError(
            f"name {name[:80]!r}: use letters, digits, '.', '_' or '-' (at most 63), e.g. the host name"
        )
    return name


def init_ca(out: Path, site: str = "xpud", force: bool = False) -> tuple[Path, Path]:
    """Make the site CA in ``out``: ``ca.key`` (0600) and ``ca.crt``. Returns their paths."""
    check_name(site)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{site} xpud site CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    out = Path(out)
    if not force and ((out / CA_KEY).exists() or (out / CA_CERT).exists()):
        raise CertError(f"{out} holds a CA already: refusing to overwrite it (pass --force to replace it)")
    _write(out / CA_KEY, _key_pem(key), 0o600, force)
    _write(out / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
    return out / CA_KEY, out / CA_CERT


def load_ca(ca_dir: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    ca_dir = Path(ca_dir)
    try:
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
    except FileNotFoundError as e:
        raise CertError(
            f"no site CA in {ca_dir} ({e.filename} missing): make one with `xpu certs init`"
        ) from e
    except (ValueError, TypeError) as e:
        raise CertError(f"the site CA in {ca_dir} cannot be read: {e}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{ca_dir / CA_KEY}: not an EC key made by `xpu certs init`")
    return key, cert


def issue(
    name: str,
    ca_dir: Path,
    out: Path,
    ips: list[str] = (),  # type: ignore[assignment]
    dns: list[str] = (),  # type: ignore[assignment]
    force: bool = False,
) -> Issued:
    """A key and certificate for host ``name`` in ``out`` (``NAME.key`` 0600, ``NAME.crt``, and a copy of
    ``ca.crt``). The certificate names ``name`` and each of ``dns`` and ``ips``."""
    check_name(name)
    try:
        addresses = [ipaddress.ip_address(ip) for ip in ips]
    except ValueError as e:
        raise CertError(f"--ip: {e}") from None
    for d in dns:
        if not re.match(r"^[A-Za-z0-9*]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$", d):
            raise CertError(f"--dns {d[:80]!r}: not a DNS name")
    ca_key, ca_cert = load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys([name, *dns])]
    sans += [x509.IPAddress(a) for a in addresses]
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=HOST_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    out = Path(out)
    _write(out / f"{name}.key", _key_pem(key), 0o600, force)
    _write(out / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
    ca_copy = out / CA_CERT
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    if not ca_copy.exists() or ca_copy.read_bytes() != ca_pem:
        _write(ca_copy, ca_pem, 0o644, True)
    names = tuple([*(n for n in dict.fromkeys([name, *dns])), *(str(a) for a in addresses)])
    return Issued(out / f"{name}.key", out / f"{name}.crt", ca_copy, names)


def peer_name(cert_pem: bytes) -> str:
    """The common name of a peer's certificate (what the peer service logs and checks)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else ""


@dataclass(frozen=True)
class HostCredentials:
    """A host's PEM files for the peer service, checked to belong together."""

    ca: bytes
    cert: bytes
    key: bytes
    name: str  # the certificate's common name


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise CertError(
            f"[cluster] {key} = {path!r}: cannot read it ({e.strerror}); "
            "make it with `xpu certs init` / `xpu certs issue` and let xpud read it"
        ) from None


def load_host(ca: str, cert: str, key: str, name: str, ip: str = "") -> HostCredentials:
    """Read and check ``[cluster] ca``, ``cert`` and ``key``: the certificate is signed by the CA, current,
    issued for ``name`` (and names ``ip``, the listen address, when given), and the key is its key.
    Raises CertError with one line saying which file and how to fix it."""
    ca_pem, cert_pem, key_pem = _read("ca", ca), _read("cert", cert), _read("key", key)
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_pem)
    except ValueError:
        raise CertError(
            f"[cluster] ca = {ca!r}: not a PEM certificate (use the ca.crt of `xpu certs init`)"
        ) from None
    try:
        host_cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise CertError(
            f"[cluster] cert = {cert!r}: not a PEM certificate (use NAME.crt of `xpu certs issue`)"
        ) from None
    try:
        private = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise CertError(f"[cluster] key = {key!r}: not an unencrypted PEM private key (NAME.key)") from None
    try:
        host_cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise CertError(
            f"[cluster] cert = {cert!r} is not signed by the CA in [cluster] ca = {ca!r}: issue it with "
            f"`xpu certs issue {name} --ca DIR` from this site's CA"
        ) from None
    if private.public_key().public_bytes(*_SPKI) != host_cert.public_key().public_bytes(*_SPKI):
        raise CertError(f"[cluster] key = {key!r} is not the key of [cluster] cert = {cert!r}")
    now = _now()
    if not host_cert.not_valid_before_utc <= now <= host_cert.not_valid_after_utc:
        raise CertError(
            f"[cluster] cert = {cert!r} is valid from {host_cert.not_valid_before_utc:%Y-%m-%d} to "
            f"{host_cert.not_valid_after_utc:%Y-%m-%d}, not now: issue a new one (`xpu certs issue`)"
        )
    cn = peer_name(cert_pem)
    if cn != name:
        raise CertError(
            f"[cluster] cert = {cert!r} is issued for host {cn!r}, but this host's name is {name!r}: set "
            f"[cluster] name = {cn!r}, or issue a certificate for {name!r}"
        )
    if ip:
        try:
            sans = host_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            ips = {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
        except x509.ExtensionNotFound:
            ips = set()
        if str(ipaddress.ip_address(ip)) not in ips:
            raise CertError(
                f"[cluster] cert = {cert!r} does not name the listen address {ip} (peers check it): "
                f"issue it with `xpu certs issue {name} --ip {ip}`"
            )
    return HostCredentials(ca_pem, cert_pem, key_pem, cn)


_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
