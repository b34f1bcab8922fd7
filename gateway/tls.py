"""TLS: a self-signed CA and server certificate made into the data dir on first start; the server context."""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.clock import utcnow
from gateway.secrets import private_dir, read_secret, write_secret


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path
    ca_cert: Path | None
    ca_fingerprint: str | None  # SHA-256, colon-separated hex


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
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
    """Create ``<data_dir>/tls/{ca.pem,ca.key,server.pem,server.key}`` unless they exist.

    The directory is 0700 and the keys 0600. Each file is written whole or not at all, and
    ``server.pem`` last: a crash part-way leaves no ``server.pem``, so the next start makes a new set.

    Raises:
        UnsafeSecretPath: A key path is a symbolic link or not ours (``gateway.secrets.read_secret``).
    """
    tls_dir = private_dir(private_dir(data_dir) / "tls")
    ca_path, server_path, server_key = tls_dir / "ca.pem", tls_dir / "server.pem", tls_dir / "server.key"
    if ca_path.exists() and server_path.exists() and read_secret(server_key) is not None:
        read_secret(tls_dir / "ca.key")  # refused if a link, made 0600 if looser
        return TlsFiles(server_path, server_key, ca_path, fingerprint(ca_path))
    server_path.unlink(missing_ok=True)
    hosts = ["localhost", "127.0.0.1", "::1", *[h for h in extra_hosts if h not in ("0.0.0.0", "::")]]
    ca_key, ca = _make_ca(3650)
    key, cert = _make_server(ca_key, ca, list(dict.fromkeys(hosts)), 825)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    write_secret(tls_dir / "ca.key", _key_pem(ca_key))
    write_secret(server_key, _key_pem(key))
    write_secret(ca_path, ca_pem, mode=0o644)
    write_secret(server_path, cert.public_bytes(serialization.Encoding.PEM) + ca_pem, mode=0o644)
    return TlsFiles(server_path, server_key, ca_path, fingerprint(ca_path))


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The TLS context ``kvgate serve`` answers handshakes with (TLS 1.2 and up, OpenSSL's default ciphers).

    Handed to the edge protocol (``gateway.http_protocol``), which makes each handshake itself, under its
    deadline, once the connection is counted; uvicorn's listener is given no certificate.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context
