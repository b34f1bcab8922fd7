"""Self-signed CA and server certificate, generated into the data dir on first start."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.clock import utcnow


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path
    ca_cert: Path | None
    ca_fingerprint: str | None  # SHA-256, colon-separated hex


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvgate"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    )


def _make_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = utcnow()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvgate local CA"))
        .issuer_name(_name("kvgate local CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_server(
    ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, hosts: list[str], days: int
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    now = utcnow()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def fingerprint(cert_path: Path) -> str:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def ensure_tls(data_dir: Path, extra_hosts: tuple[str, ...] = ()) -> TlsFiles:
    """Create ``<data_dir>/tls/{ca.pem,ca.key,server.pem,server.key}`` unless they exist."""
    tls_dir = data_dir / "tls"
    ca_path, server_path, server_key = tls_dir / "ca.pem", tls_dir / "server.pem", tls_dir / "server.key"
    if not (ca_path.exists() and server_path.exists() and server_key.exists()):
        tls_dir.mkdir(parents=True, exist_ok=True)
        hosts = ["localhost", "127.0.0.1", "::1", *[h for h in extra_hosts if h not in ("0.0.0.0", "::")]]
        ca_key, ca = _make_ca(3650)
        key, cert = _make_server(ca_key, ca, list(dict.fromkeys(hosts)), 825)
        _write_key(tls_dir / "ca.key", ca_key)
        _write_key(server_key, key)
        ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        server_path.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM) + ca.public_bytes(serialization.Encoding.PEM)
        )
    return TlsFiles(server_path, server_key, ca_path, fingerprint(ca_path))
