"""The gRPC operations surface: standard health, reflection, request limits, draining, the per-stream log line."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.support.checkpoints import nbytes, write_model
from tests.support.servers import Running, eventually, running
from weightstream.client import UnavailableError, WeightStreamClient
from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.serving.read_plan import MAX_REQUESTED_TENSORS

MODEL = "ops-grpc-model"
SERVICE = "weightstream.v1.WeightStreamService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def state(root: Path) -> dict[str, torch.Tensor]:
    return write_model(root, MODEL, tensors=3, numel=4096, seed=5)


@pytest.fixture(scope="module")
def served(root: Path, state: dict[str, torch.Tensor]) -> Iterator[Running]:
    with running(root) as r:
        yield r


@pytest.fixture
def channel(served: Running) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(served.target) as channel:
        yield channel


def _health(channel: grpc.Channel, service: str = "") -> int:
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


@pytest.mark.parametrize("service", ["", SERVICE])
def test_health_is_serving(channel: grpc.Channel, service: str) -> None:
    assert _health(channel, service) == SERVING


def test_health_of_an_unknown_service_is_not_found(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _health(channel, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_describes_the_services(channel: grpc.Channel) -> None:
    database = ProtoReflectionDescriptorDatabase(channel)
    services = set(database.get_services())
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    described = database.FindFileContainingSymbol(SERVICE)
    assert described.package == "weightstream.v1"
    methods = {m.name for m in described.service[0].method}
    assert methods == {
        "GetManifest",
        "StreamTensors",
        "ListModelFiles",
        "ReadModelFile",
        "OpenSharedMemory",
        "StreamTensorsShared",
        "StreamTensorsBulk",
        "PublishTensors",
        "GetChanges",
        "WatchModel",
        # Described always; served only with --fanout or --peers (UNIMPLEMENTED otherwise).
        "GetBlockHashes",
        "StreamRevisionBlocks",
    }


def _stream_error(channel: grpc.Channel, request: pb.StreamTensorsRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.WeightStreamServiceStub(channel).StreamTensors(request, timeout=60))
    return info.value


@pytest.mark.parametrize("chunk", [wire.MIN_CHUNK_BYTES - 1, wire.MAX_CHUNK_BYTES + 1, 2**32 - 1])
def test_chunk_size_out_of_bounds_is_invalid(channel: grpc.Channel, state: dict[str, torch.Tensor], chunk: int) -> None:
    error = _stream_error(channel, pb.StreamTensorsRequest(model=MODEL, max_chunk_bytes=chunk))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_chunk_bytes" in (error.details() or "")


@pytest.mark.parametrize("chunk", [wire.MIN_CHUNK_BYTES, wire.MAX_CHUNK_BYTES])
def test_chunk_size_bounds_are_allowed(channel: grpc.Channel, state: dict[str, torch.Tensor], chunk: int) -> None:
    stream = pb_grpc.WeightStreamServiceStub(channel).StreamTensors(
        pb.StreamTensorsRequest(model=MODEL, max_chunk_bytes=chunk), timeout=60
    )
    assert sum(len(c.data) for m in stream for c in m.chunks) == nbytes(state)


def test_too_many_names_is_invalid(channel: grpc.Channel, state: dict[str, torch.Tensor]) -> None:
    names = [pb.TensorRequest(name="x")] * (MAX_REQUESTED_TENSORS + 1)
    error = _stream_error(channel, pb.StreamTensorsRequest(model=MODEL, tensors=names))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensors" in (error.details() or "")


def test_one_log_line_per_stream(
    served: Running, state: dict[str, torch.Tensor], channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="weightstream_server.serving.stream_session")
    with WeightStreamClient(served.target, progress=False) as client:
        client.load_state_dict(MODEL)
    _stream_error(channel, pb.StreamTensorsRequest(model="no-such-model"))
    ended = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stream end:")]
    assert len(ended) == 2, ended
    pattern = (
        r"stream end: model='(?P<model>[^']+)' peer=ipv4:127\.0\.0\.1:\d+ tensors=(?P<tensors>\d+) "
        r"bytes=(?P<bytes>\d+) seconds=\d+\.\d{3} gbps=\d+\.\d{2} code=(?P<code>[A-Z_]+)"
    )
    ok, missing = (re.fullmatch(pattern, line) for line in ended)
    assert ok is not None and missing is not None, ended
    assert ok["model"] == MODEL and int(ok["tensors"]) == len(state) and int(ok["bytes"]) == nbytes(state)
    assert ok["code"] == "OK"
    assert missing["model"] == "no-such-model" and missing["code"] == "NOT_FOUND" and missing["bytes"] == "0"


@pytest.mark.slow
def test_draining_refuses_new_streams_but_serves_manifests(root: Path, state: dict[str, torch.Tensor]) -> None:
    with running(root) as r, grpc.insecure_channel(r.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == SERVING
        assert r.server.drain(0.0) == 0
        assert next(watch).status == NOT_SERVING  # watchers hear of the drain without asking
        watch.cancel()
        assert _health(channel) == NOT_SERVING
        assert _health(channel, SERVICE) == NOT_SERVING
        # Draining is not dying: a liveness probe must not get the server restarted mid-drain.
        assert _health(channel, "liveness") == SERVING
        with WeightStreamClient(r.target, progress=False, retry=None) as client:
            assert len(client.manifest(MODEL).tensors) == len(state)
            with pytest.raises(UnavailableError, match="shutting down"):
                client.load_state_dict(MODEL)


@pytest.mark.slow
def test_health_follows_source_reachability(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_model(root, "m", tensors=1, numel=16)
    with running(root) as r, grpc.insecure_channel(r.target) as channel:
        assert _health(channel) == SERVING
        root.rename(tmp_path / "aside")
        try:
            eventually(lambda: _health(channel) == NOT_SERVING, "NOT_SERVING")
            assert _health(channel, "liveness") == SERVING
        finally:
            (tmp_path / "aside").rename(root)
        eventually(lambda: _health(channel) == SERVING, "SERVING again")
