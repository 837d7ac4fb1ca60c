"""Bearer-token auth over gRPC and REST: no token, a wrong one, the first and the second (rotated) token."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.support.checkpoints import nbytes, write_model
from tests.support.servers import Running, running
from weightstream.client import UnauthenticatedError, WeightStreamClient
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.ops.auth import TokenFile, bearer_token

MODEL = "ops-auth-model"
FIRST = "first-token-0123456789"
SECOND = "second-token-abcdefghij"
# (token sent, accepted): none, a wrong one, each line of the token file.
MATRIX = [(None, False), ("wrong-token", False), (FIRST, True), (SECOND, True)]


@pytest.fixture(scope="module")
def state(root: Path) -> dict[str, torch.Tensor]:
    return write_model(root, MODEL, tensors=3, numel=1000, seed=3)


@pytest.fixture(scope="module")
def served(root: Path, state: dict[str, torch.Tensor]) -> Iterator[Running]:
    token_file = root.parent / "ops-auth-tokens"
    token_file.write_text(f"# rotation: {SECOND} replaces {FIRST}\n{FIRST}\n\n  {SECOND}  \n")
    with running(root, token_file=token_file) as r:
        yield r


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTSTREAM_TOKEN", raising=False)


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


@pytest.mark.parametrize(("token", "accepted"), MATRIX)
def test_grpc_rpcs_need_a_known_token(
    served: Running, state: dict[str, torch.Tensor], token: str | None, accepted: bool
) -> None:
    with WeightStreamClient(served.target, token=token, progress=False) as client:
        if accepted:
            assert len(client.manifest(MODEL).tensors) == len(state)
            got = client.load_state_dict(MODEL)
            assert all(torch.equal(got[n], t) for n, t in state.items())
        else:
            with pytest.raises(UnauthenticatedError, match="UNAUTHENTICATED") as info:
                client.manifest(MODEL)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    # The stream RPC, called directly (the client would stop at the manifest).
    with grpc.insecure_channel(served.target) as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        call = stub.StreamTensors(pb.StreamTensorsRequest(model=MODEL), metadata=_metadata(token), timeout=10)
        if accepted:
            assert sum(len(c.data) for m in call for c in m.chunks) == nbytes(state)
        else:
            with pytest.raises(grpc.RpcError) as rpc:
                list(call)
            assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(("token", "accepted"), MATRIX)
def test_reflection_needs_a_known_token(served: Running, token: str | None, accepted: bool) -> None:
    with grpc.insecure_channel(served.target) as channel:
        if token:
            channel = grpc.intercept_channel(channel, _HeaderInterceptor(token))
        database = ProtoReflectionDescriptorDatabase(channel)
        if accepted:
            assert "weightstream.v1.WeightStreamService" in database.get_services()
        else:
            with pytest.raises(grpc.RpcError) as rpc:
                database.get_services()
            assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(("token", "accepted"), MATRIX)
def test_health_is_open_to_everyone(served: Running, token: str | None, accepted: bool) -> None:
    with grpc.insecure_channel(served.target) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), metadata=_metadata(token), timeout=10
        )
    assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(("token", "accepted"), MATRIX)
def test_rest_status_and_metrics_need_the_token_probes_do_not(
    served: Running, token: str | None, accepted: bool
) -> None:
    for path in ("/status", "/metrics"):
        response = served.get(path, token)
        assert response.status_code == (200 if accepted else 401), (path, response.text)
        if not accepted:
            assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/healthz", "/readyz"):
        assert served.get(path, token).status_code == 200, path


def test_rest_refuses_other_schemes(served: Running) -> None:
    response = served.http.get(served.base + "/status", headers={"Authorization": f"Basic {FIRST}"})
    assert response.status_code == 401
    response = served.http.get(served.base + "/status", headers={"Authorization": f"bearer {FIRST}"})
    assert response.status_code == 200


def test_client_reads_the_token_from_the_environment(
    served: Running, state: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSTREAM_TOKEN", SECOND + "\n")
    with WeightStreamClient(served.target, progress=False) as client:
        assert len(client.manifest(MODEL).tensors) == len(state)
    # An explicit token wins over the environment.
    with WeightStreamClient(served.target, token="wrong-token", progress=False) as client:
        with pytest.raises(UnauthenticatedError):
            client.manifest(MODEL)


def test_refusals_are_counted(served: Running) -> None:
    before = served.get("/status", FIRST).json()["errors_total"].get("UNAUTHENTICATED", 0)
    with WeightStreamClient(served.target, token="wrong-token", progress=False) as client:
        with pytest.raises(UnauthenticatedError):
            client.manifest(MODEL)
    after = served.get("/status", FIRST).json()["errors_total"]["UNAUTHENTICATED"]
    assert after == before + 1


def test_rotating_the_file_needs_no_restart(tmp_path: Path, state: dict[str, torch.Tensor], root: Path) -> None:
    """The token file is re-read when it changes: a removed token stops working, a new one starts."""
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{FIRST}\n")
    with running(root, token_file=token_file) as r:
        with WeightStreamClient(r.target, token=FIRST, progress=False) as client:
            client.manifest(MODEL)
        replacement = tmp_path / "tokens.new"
        replacement.write_text(f"{SECOND}\n")
        os.replace(replacement, token_file)  # how secret mounts change: a new file, renamed over
        with WeightStreamClient(r.target, token=FIRST, progress=False) as client:
            with pytest.raises(UnauthenticatedError):
                client.manifest(MODEL)
        with WeightStreamClient(r.target, token=SECOND, progress=False) as client:
            client.manifest(MODEL)
        assert r.get("/status", SECOND).status_code == 200
        assert r.get("/status", FIRST).status_code == 401
        # A file emptied (or caught half-written), or not text, keeps the tokens read before.
        for broken in (b"", b"\xff\xfe not utf-8\n"):
            token_file.write_bytes(broken)
            with WeightStreamClient(r.target, token=SECOND, progress=False) as client:
                client.manifest(MODEL)


def test_without_a_token_file_every_caller_is_served(root: Path, state: dict[str, torch.Tensor]) -> None:
    with running(root) as r:
        for token in (None, "anything"):
            with WeightStreamClient(r.target, token=token, progress=False) as client:
                assert len(client.manifest(MODEL).tensors) == len(state)
            assert r.get("/status", token).status_code == 200
            assert r.get("/metrics", token).status_code == 200


def test_a_token_file_without_tokens_is_refused_at_start(tmp_path: Path) -> None:
    empty = tmp_path / "tokens"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no token"):
        TokenFile(empty)
    with pytest.raises(ValueError, match=r"token file .*missing: No such file"):
        TokenFile(tmp_path / "missing")


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token("") is None
    assert bearer_token(None) is None


class _HeaderInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Adds the bearer token to calls made by code that takes no metadata (the reflection client)."""

    def __init__(self, token: str) -> None:
        self._metadata = _metadata(token)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))  # type: ignore[attr-defined]

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request_iterator)
