"""Throwaway certificates for TLS tests: a CA, and certificates it signs, written as PEM files.

Made with ``cryptography`` in a temp folder per test session; nothing here is ever trusted
outside the tests that pass the CA file explicitly.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_LIFETIME = datetime.timedelta(days=2)


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files of one test PKI.

    Args:
        ca: the CA certificate (what clients pass as ``ca_file`` / ``ssl_ca_certs``).
        cert: server certificate for ``localhost`` and ``127.0.0.1``, signed by the CA.
        key: its private key.
        client_cert: client certificate signed by the CA (for a Redis that asks for one).
        client_key: its private key.
        wrong_host_cert: server certificate signed by the CA for ``elsewhere.invalid`` only.
        wrong_host_key: its private key.
    """

    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str
    wrong_host_cert: str
    wrong_host_key: str


def make_tls_files(folder: Path) -> TLSFiles:
    """Write a CA and three certificates it signs into ``folder``.

    Args:
        folder: an existing folder of the test's own.

    Returns:
        The file paths.
    """
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cachetier test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(folder / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))

    def leaf(name: str, names: list[x509.GeneralName], usage: x509.ObjectIdentifier) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(subject, ca_name, key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write(folder / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        _write(
            folder / f"{name}.key",
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )

    loopback = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    leaf("server", loopback, ExtendedKeyUsageOID.SERVER_AUTH)
    leaf("client", [x509.DNSName("client.invalid")], ExtendedKeyUsageOID.CLIENT_AUTH)
    leaf("elsewhere", [x509.DNSName("elsewhere.invalid")], ExtendedKeyUsageOID.SERVER_AUTH)
    return TLSFiles(
        ca=str(folder / "ca.pem"),
        cert=str(folder / "server.pem"),
        key=str(folder / "server.key"),
        client_cert=str(folder / "client.pem"),
        client_key=str(folder / "client.key"),
        wrong_host_cert=str(folder / "elsewhere.pem"),
        wrong_host_key=str(folder / "elsewhere.key"),
    )


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _LIFETIME)
    )


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)
