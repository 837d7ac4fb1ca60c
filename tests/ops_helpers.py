"""Helpers for the operations tests: a gRPC server with its REST endpoint, certificates, metrics.

Everything listens on 127.0.0.1 only, on ports the kernel picks.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from weightstream_server import ServerSettings, WeightStreamServer, create_server
from weightstream_server.http import RestServer, create_app, start_http

LOOPBACK = "127.0.0.1"
# Source reachability is cached for about a second (health.PROBE_TTL_S); waits for a change are bounded by this.
CHANGE_TIMEOUT_S = 5.0


@dataclass
class Running:
    """A started gRPC server, its REST endpoint, and an HTTP client for it."""

    server: WeightStreamServer
    rest: RestServer
    http: httpx.Client

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.server.port}"

    @property
    def base(self) -> str:
        return f"http://{LOOPBACK}:{self.rest.port}"

    def get(self, path: str, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return self.http.get(self.base + path, headers=headers, timeout=10.0)


@contextlib.contextmanager
def running(model_root: Path, **settings: object) -> Iterator[Running]:
    """create_server on port 0 plus start_http on port 0, both stopped on the way out."""
    values: dict[str, object] = {"model_root": model_root, "host": LOOPBACK, "grpc_port": 0, "http_port": 0}
    values.update(settings)
    server = create_server(ServerSettings(**values))  # type: ignore[arg-type]
    server.start()
    rest = start_http(create_app(server), LOOPBACK, 0)
    # trust_env=False: never send loopback requests through a proxy from the environment.
    http = httpx.Client(trust_env=False)
    try:
        yield Running(server, rest, http)
    finally:
        http.close()
        rest.stop(5.0)
        server.stop(grace=1.0)


def eventually(check: Callable[[], bool], what: str, timeout: float = CHANGE_TIMEOUT_S) -> None:
    """Poll check every 50 ms until it is true; fail with what after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {timeout} s")
        time.sleep(0.05)


def write_model(root: Path, name: str, tensors: int, numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A one-file float32 model of tensors tensors of numel elements each, under root/name."""
    generator = torch.Generator().manual_seed(seed)
    state = {f"layer.{i}.weight": torch.randn(numel, generator=generator) for i in range(tensors)}
    (root / name).mkdir(parents=True, exist_ok=True)
    save_file(state, str(root / name / "model.safetensors"))
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, by (name, sorted labels)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


# --- certificates --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """PEM files of a CA, a server certificate for 127.0.0.1/localhost, and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(folder: Path, name: str = "test") -> Pki:
    """A fresh CA under folder, and a server and a client certificate it signed."""
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
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(LOOPBACK))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = (
        _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inference-node")]), ca_name, client_key)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(
        folder / "ca.pem",
        folder / "server.pem",
        folder / "server.key",
        folder / "client.pem",
        folder / "client.key",
    )
    pki.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    pki.server_key.write_bytes(_key_pem(server_key))
    pki.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    pki.client_key.write_bytes(_key_pem(client_key))
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
