"""Admission: long-lived RPCs are bounded, so that health checks, manifests and loads stay answered.

A hostile (or broken) client opens calls that hold the server's gRPC worker threads: silent
StreamTensorsShared calls that never send their first message, ReadModelFile calls it never reads,
silent reflection calls. Every such call counts against a limit and the ones beyond it end at once,
so the workers kept for short calls stay free; REST /healthz answers 503 when the gRPC server itself
no longer answers. All servers and clients are on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.checkpoints import write_model
from tests.support.reliability_report import record
from tests.support.servers import eventually, running
from weightstream.client import ResourceExhaustedError, RetryPolicy, WeightStreamClient
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

SMALL = "admission-small"
# Larger than any flow-control window: a file read nobody reads stays in flight.
BIG = "admission-big"
MAX_STREAMS = 2
FILE_READS = 20
# How long a hostile call may live at most (its gRPC deadline), and how long the answers the
# test waits for may take.
HOSTILE_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 3.0
# The server ends a StreamTensorsShared call whose first message has not come within a few seconds.
FIRST_MESSAGE_BOUND_S = 10.0
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("admission")
    write_model(folder, BIG, tensors=4, numel=1024 * 1024, seed=4)  # 16 MiB
    return folder


@pytest.fixture(scope="module")
def small(root: Path) -> dict[str, torch.Tensor]:
    return write_model(root, SMALL, tensors=4, numel=16 * 1024, seed=3)


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="weightstream-test-admission-") as name:
        yield Path(name)


def _channel(target: str) -> grpc.Channel:
    # A local subchannel pool gives this channel its own TCP connection: the hostile calls' stalled
    # flow-control windows are never shared with the test's own calls.
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def _silent(release: threading.Event) -> Iterator[pb.StreamTensorsSharedRequest]:
    """A request stream that sends nothing until release is set (or the hostile calls' deadline)."""
    release.wait(HOSTILE_TIMEOUT_S)
    yield from ()


def _code(call: Any) -> grpc.StatusCode | None:
    """The call's status code if it has ended, else None (never blocks)."""
    return call.code() if call.done() else None


def _health(channel: grpc.Channel) -> int:
    request = health_pb2.HealthCheckRequest(service="")
    return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=ANSWER_TIMEOUT_S).status)


@pytest.mark.slow
def test_hostile_calls_leave_health_manifests_and_a_load_answered(
    root: Path, small: dict[str, torch.Tensor], shm_dir: Path
) -> None:
    """2 x max-streams silent StreamTensorsShared calls, then unread ReadModelFile calls, all from one
    client: health, a manifest and /healthz answer at once, and a small load gets through."""
    release = threading.Event()
    shared: list[Any] = []
    reads: list[Any] = []
    with (
        running(root, max_streams=MAX_STREAMS, shm_dir=shm_dir) as r,
        _channel(r.target) as bad,
        grpc.insecure_channel(r.target) as good,
    ):
        stub = pb_grpc.WeightStreamServiceStub(bad)
        try:
            for _ in range(2 * MAX_STREAMS):
                shared.append(stub.StreamTensorsShared(_silent(release), timeout=HOSTILE_TIMEOUT_S))

            def shared_calls_settled() -> bool:
                # Every shared call still open is a stream on the server: each has been admitted or refused.
                # One client holds every slot but one (--max-streams-per-client's default).
                active = r.server.stats.active_streams
                return active >= MAX_STREAMS - 1 and active == sum(_code(c) is None for c in shared)

            eventually(shared_calls_settled, "the silent shared calls on the server")
            request = pb.ReadModelFileRequest(model=BIG, file="model.safetensors")
            reads = [stub.ReadModelFile(request, timeout=HOSTILE_TIMEOUT_S) for _ in range(FILE_READS)]
            time.sleep(0.5)  # the reads reach the server

            started = time.monotonic()
            assert _health(good) == SERVING
            manifest = pb_grpc.WeightStreamServiceStub(good).GetManifest(
                pb.GetManifestRequest(model=SMALL), timeout=ANSWER_TIMEOUT_S
            )
            assert len(manifest.tensors) == len(small)
            assert r.get("/healthz").status_code == 200
            answered_s = time.monotonic() - started
            held_off = sum(_code(c) is not None for c in shared + reads)

            # Every slot this client may hold is held by a silent call until its first-message deadline;
            # then a load from the same host gets one.
            retry = RetryPolicy(attempts=100, max_backoff=0.5, total_deadline=2 * FIRST_MESSAGE_BOUND_S)
            with WeightStreamClient(r.target, progress=False, retry=retry) as client:
                got = client.load_state_dict(SMALL)
            load_s = time.monotonic() - started
            assert all(torch.equal(got[name], tensor) for name, tensor in small.items())
            assert load_s < FIRST_MESSAGE_BOUND_S + 5, load_s
            eventually(lambda: all(_code(c) is not None for c in shared), "the silent shared calls ended")
            shared_codes = [_code(c) for c in shared]
            read_codes = [_code(c) for c in reads]
        finally:
            release.set()
            for call in shared + reads:
                call.cancel()
    assert read_codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * FILE_READS
    # Admitted: the slots one client may hold (all but one); the rest refused at once.
    admitted = MAX_STREAMS - 1
    assert sorted(code.name for code in shared_codes if code is not None) == sorted(
        ["DEADLINE_EXCEEDED"] * admitted + ["RESOURCE_EXHAUSTED"] * (2 * MAX_STREAMS - admitted)
    )
    record(
        "admission",
        hostile_calls=len(shared) + len(reads),
        hostile_calls_held_off_while_health_green=held_off,
        health_manifest_healthz_answered_s=round(answered_s, 3),
        load_after_hostile_calls_s=round(load_s, 3),
    )


@pytest.mark.slow
def test_a_silent_shared_stream_ends_at_its_first_message_deadline(
    root: Path, small: dict[str, torch.Tensor], shm_dir: Path
) -> None:
    release = threading.Event()
    with running(root, max_streams=1, shm_dir=shm_dir) as r, _channel(r.target) as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        started = time.monotonic()
        call = stub.StreamTensorsShared(_silent(release), timeout=HOSTILE_TIMEOUT_S)
        try:
            eventually(lambda: call.done(), "the silent call ended by the server", timeout=FIRST_MESSAGE_BOUND_S)
            assert call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "first" in (call.details() or "")
            assert time.monotonic() - started < FIRST_MESSAGE_BOUND_S
        finally:
            release.set()
            call.cancel()
        eventually(lambda: r.server.stats.active_streams == 0, "the stream's slot free again")
        with WeightStreamClient(r.target, progress=False, retry=None) as client:
            assert client.load_state_dict(SMALL)


def test_a_malformed_first_message_is_invalid_argument(root: Path, shm_dir: Path) -> None:
    with running(root, max_streams=1, shm_dir=shm_dir) as r, _channel(r.target) as channel:
        call = channel.stream_stream(
            "/weightstream.v1.WeightStreamService/StreamTensorsShared",
            request_serializer=None,
            response_deserializer=None,
        )
        for raw in (b"\xff\xff\xff\xff", b"\x0a\x05abc"):
            with pytest.raises(grpc.RpcError) as raised:
                list(call(iter([raw]), timeout=ANSWER_TIMEOUT_S))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raw
            assert "is not a valid weightstream.v1.StreamTensorsSharedRequest" in (raised.value.details() or "")
        eventually(lambda: r.server.stats.active_streams == 0, "the refused streams ended")


def test_a_shared_stream_without_shm_dir_is_refused_before_its_first_message(root: Path) -> None:
    release = threading.Event()
    with running(root, max_streams=1) as r, _channel(r.target) as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        call = stub.StreamTensorsShared(_silent(release), timeout=ANSWER_TIMEOUT_S)
        try:
            with pytest.raises(grpc.RpcError) as raised:
                next(call)
        finally:
            release.set()
            call.cancel()
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--shm-dir" in (raised.value.details() or "")
        assert r.server.stats.active_streams == 0


def test_file_reads_and_tensor_streams_share_the_stream_limit(root: Path, small: dict[str, torch.Tensor]) -> None:
    with running(root, max_streams=1) as r, _channel(r.target) as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        read = stub.ReadModelFile(
            pb.ReadModelFileRequest(model=BIG, file="model.safetensors", max_chunk_bytes=64 * 1024),
            timeout=HOSTILE_TIMEOUT_S,
        )
        try:
            next(read)  # the file read holds the only stream slot, as long as it is not read further
            with WeightStreamClient(r.target, progress=False, retry=None) as client:
                with pytest.raises(ResourceExhaustedError, match="1 streams are already running"):
                    client.load_state_dict(SMALL)
            second = stub.ReadModelFile(pb.ReadModelFileRequest(model=SMALL, file="model.safetensors"), timeout=10)
            with pytest.raises(grpc.RpcError) as raised:
                list(second)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            read.cancel()
        eventually(lambda: r.server.stats.active_streams == 0, "the file read's slot free again")
        with WeightStreamClient(r.target, progress=False, retry=None, chunk_bytes=16 * 1024) as client:
            stream = client.iter_tensors(BIG)
            next(stream)  # now a tensor stream holds the slot
            with pytest.raises(grpc.RpcError) as raised:
                list(stub.ReadModelFile(pb.ReadModelFileRequest(model=SMALL, file="model.safetensors"), timeout=10))
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(dict(stream)) == 3


def _silent_reflection(release: threading.Event) -> Iterator[reflection_pb2.ServerReflectionRequest]:
    release.wait(HOSTILE_TIMEOUT_S)
    yield from ()


def test_silent_calls_of_other_services_are_bounded(root: Path) -> None:
    """Reflection waits on its client like StreamTensorsShared; silent reflection calls beyond their
    share are refused at once. (Health Watch needs no limit: gRPC serves it without holding a worker.)"""
    release = threading.Event()
    with running(root, max_streams=1) as r, _channel(r.target) as bad, grpc.insecure_channel(r.target) as good:
        stub = reflection_pb2_grpc.ServerReflectionStub(bad)
        calls = [stub.ServerReflectionInfo(_silent_reflection(release), timeout=HOSTILE_TIMEOUT_S) for _ in range(40)]
        try:
            time.sleep(0.5)  # the calls reach the server
            assert _health(good) == SERVING
            watch = health_pb2_grpc.HealthStub(good).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert next(watch).status == SERVING
            watch.cancel()
            eventually(lambda: any(_code(c) is not None for c in calls), "silent calls beyond the limit refused")
            refused = [c for c in calls if _code(c) is not None]
            assert {c.code() for c in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert len(refused) < len(calls)
        finally:
            release.set()
            for call in calls:
                call.cancel()
        # Ended calls give their places back: reflection answers again.
        eventually(lambda: _reflection_answers(good), "reflection answering again")
    record("admission", silent_reflection_calls_refused=len(refused))


def _reflection_answers(channel: grpc.Channel) -> bool:
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        answers = list(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=5)
        )
    except grpc.RpcError:
        return False
    return any(s.name == "grpc.health.v1.Health" for m in answers for s in m.list_services_response.service)


@pytest.mark.slow
def test_healthz_is_503_while_every_grpc_worker_is_busy(
    root: Path, small: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that hangs is faked by a manifest lookup that blocks: a real hung store cannot be arranged here."""
    release = threading.Event()
    with running(root, max_streams=1) as r, _channel(r.target) as channel:
        real_manifest = r.server.catalog.manifest

        def hanging_manifest(model: str, revision: str = "") -> Any:
            release.wait(HOSTILE_TIMEOUT_S)
            return real_manifest(model, revision)

        monkeypatch.setattr(r.server.catalog, "manifest", hanging_manifest)
        stub = pb_grpc.WeightStreamServiceStub(channel)
        calls = [
            stub.GetManifest.future(pb.GetManifestRequest(model=SMALL), timeout=HOSTILE_TIMEOUT_S) for _ in range(64)
        ]
        try:
            eventually(lambda: r.get("/healthz").status_code == 503, "/healthz 503 with every worker busy")
            body = r.get("/healthz").json()
            assert body["status"] != "ok"
        finally:
            release.set()
        for call in calls:
            assert len(call.result(timeout=HOSTILE_TIMEOUT_S).tensors) == 4
        eventually(lambda: r.get("/healthz").status_code == 200, "/healthz 200 again")


def test_healthz_is_503_once_grpc_has_stopped(root: Path) -> None:
    with running(root) as r:
        assert r.get("/healthz").status_code == 200
        r.server.stop(grace=0)
        response = r.get("/healthz")  # REST still runs
        assert response.status_code == 503
        assert response.json()["status"] != "ok"
