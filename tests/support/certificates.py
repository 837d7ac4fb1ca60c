"""Certificates for the TLS tests: a fresh CA, a server certificate for 127.0.0.1/localhost, a client one."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.support.ports import LOOPBACK


@dataclass(frozen=True)
class Pki:
    """PEM files of a CA, a server certificate for 127.0.0.1/localhost, and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    # A second client of the same CA: trusted as much as the first, but not the first.
    other_client_cert: Path
    other_client_key: Path


def make_pki(folder: Path, name: str = "test", hosts: tuple[str, ...] = (), addresses: tuple[str, ...] = ()) -> Pki:
    """A fresh CA under folder, a server certificate (localhost, 127.0.0.1, the DNS names hosts, the IP
    addresses) and two client ones it signed."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"weightstream {name} CA")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key)
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
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), ca_name, server_key)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    *(x509.DNSName(host) for host in hosts),
                    x509.IPAddress(ipaddress.ip_address(LOOPBACK)),
                    *(x509.IPAddress(ipaddress.ip_address(address)) for address in addresses),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    clients = []
    for common_name in ("inference-node", "other-node"):
        client_key = ec.generate_private_key(ec.SECP256R1())
        client_cert = (
            _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), ca_name, client_key)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        clients.append((client_cert, client_key))
    pki = Pki(
        folder / "ca.pem",
        folder / "server.pem",
        folder / "server.key",
        folder / "client.pem",
        folder / "client.key",
        folder / "other-client.pem",
        folder / "other-client.key",
    )
    pki.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    pki.server_key.write_bytes(_key_pem(server_key))
    for (cert, key), (cert_path, key_path) in zip(
        clients, ((pki.client_cert, pki.client_key), (pki.other_client_cert, pki.other_client_key)), strict=True
    ):
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_key_pem(key))
    return pki


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
