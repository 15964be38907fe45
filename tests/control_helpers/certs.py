"""A throwaway CA with a server certificate (localhost, 127.0.0.1) and a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path)


def _issue(
    subject: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    *,
    is_ca: bool = False,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path) -> Certs:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("kvtransfer test CA", ca_key, _name("kvtransfer test CA"), ca_key, is_ca=True)
    paths = {}
    for role, sans in (
        ("server", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        ("client", None),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"kvtransfer-{role}", ca_key, ca.subject, key, sans=sans)
        (directory / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[role] = (str(directory / f"{role}.pem"), _write_key(key, directory / f"{role}.key"))
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return Certs(
        ca=str(directory / "ca.pem"),
        server_cert=paths["server"][0],
        server_key=paths["server"][1],
        client_cert=paths["client"][0],
        client_key=paths["client"][1],
    )
