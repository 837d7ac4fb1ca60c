"""gRPC over TLS and mutual TLS, with a CA made here; clients that do not fit are refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.certificates import Pki, make_pki
from tests.support.checkpoints import write_model
from tests.support.servers import Running, running
from weightstream.client import UnauthenticatedError, UnavailableError, WeightStreamClient
from weightstream_server import ServerSettings

MODEL = "ops-tls-model"
# Failed handshakes fail fast; the bound only keeps a broken test from hanging.
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def state(root: Path) -> dict[str, torch.Tensor]:
    return write_model(root, MODEL, tensors=3, numel=10_000, seed=7)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), "test")


@pytest.fixture(scope="module")
def rogue(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A second CA the server knows nothing of, with its own client certificate."""
    return make_pki(tmp_path_factory.mktemp("rogue-pki"), "rogue")


@pytest.fixture(scope="module")
def tls_server(root: Path, state: dict[str, torch.Tensor], pki: Pki) -> Iterator[Running]:
    with running(root, tls_cert=pki.server_cert, tls_key=pki.server_key) as r:
        yield r


@pytest.fixture(scope="module")
def mtls_server(root: Path, state: dict[str, torch.Tensor], pki: Pki) -> Iterator[Running]:
    with running(root, tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca) as r:
        yield r


def _load(target: str, **options: object) -> dict[str, torch.Tensor]:
    with WeightStreamClient(target, progress=False, timeout=TIMEOUT_S, retry=None, **options) as client:  # type: ignore[arg-type]
        return client.load_state_dict(MODEL)


def test_tls_load(tls_server: Running, state: dict[str, torch.Tensor], pki: Pki) -> None:
    got = _load(tls_server.target, tls=True, ca_file=pki.ca)
    assert all(torch.equal(got[n], t) for n, t in state.items())
    assert tls_server.get("/status").json()["tls"] is True


def test_tls_health_check(tls_server: Running, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(tls_server.target, credentials) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_refuses_plaintext_clients(tls_server: Running) -> None:
    with pytest.raises(UnavailableError):
        _load(tls_server.target)


def test_tls_client_rejects_a_server_its_ca_did_not_sign(tls_server: Running, rogue: Pki) -> None:
    with pytest.raises(UnavailableError):
        _load(tls_server.target, tls=True, ca_file=rogue.ca)


def test_mtls_load_with_a_client_certificate(mtls_server: Running, state: dict[str, torch.Tensor], pki: Pki) -> None:
    got = _load(mtls_server.target, tls=True, ca_file=pki.ca, client_cert=pki.client_cert, client_key=pki.client_key)
    assert all(torch.equal(got[n], t) for n, t in state.items())


def test_mtls_refuses_a_client_without_a_certificate(mtls_server: Running, pki: Pki) -> None:
    with pytest.raises(UnavailableError):
        _load(mtls_server.target, tls=True, ca_file=pki.ca)


def test_mtls_refuses_a_certificate_from_another_ca(mtls_server: Running, pki: Pki, rogue: Pki) -> None:
    with pytest.raises(UnavailableError):
        _load(mtls_server.target, tls=True, ca_file=pki.ca, client_cert=rogue.client_cert, client_key=rogue.client_key)


def test_tls_and_tokens_together(root: Path, state: dict[str, torch.Tensor], pki: Pki, tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("tls-token\n")
    with running(root, tls_cert=pki.server_cert, tls_key=pki.server_key, token_file=token_file) as r:
        assert len(_load(r.target, tls=True, ca_file=pki.ca, token="tls-token")) == len(state)
        with pytest.raises(UnauthenticatedError):
            _load(r.target, tls=True, ca_file=pki.ca)


def test_tls_settings_are_checked(root: Path, pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        ServerSettings(model_root=root, tls_cert=pki.server_cert)
    with pytest.raises(ValueError, match="mutual TLS"):
        ServerSettings(model_root=root, tls_client_ca=pki.ca)
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("not a certificate")
    with pytest.raises(ValueError, match="not a PEM file"):
        with running(root, tls_cert=not_pem, tls_key=pki.server_key):
            pass


def test_client_tls_options_are_checked(pki: Pki) -> None:
    with pytest.raises(ValueError, match="tls=True"):
        WeightStreamClient("127.0.0.1:1", ca_file=pki.ca)
    with pytest.raises(ValueError, match="both client_cert and client_key"):
        WeightStreamClient("127.0.0.1:1", tls=True, client_cert=pki.client_cert)
