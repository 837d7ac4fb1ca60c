"""The stall rule: calls whose clients never read are ended after --stall-timeout, and a good client is served.

The attacker opens streaming calls and never asks for a message, so gRPC's flow control holds the
server's sends: without the rule the admitted ones keep their stream slots (--max-streams 2 here)
and worker threads for as long as the attacker likes. On the shared-memory transport the attacker
takes one tensor and then returns no ring slot; on the data port it takes one tensor and then
reads its data connection no further.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.support.checkpoints import write_model
from tests.support.ports import free_ports
from tests.support.reliability_report import record
from tests.support.servers import loopback_settings, serving
from weightstream.client import ResourceExhaustedError, RetryPolicy, WeightStreamClient, WeightStreamError
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import ServerSettings, WeightStreamServer

pytestmark = pytest.mark.slow

MODEL = "stalled"
STALL_S = 2.0
UNREAD = 10
# 4 tensors of 16 MiB: far more than gRPC's flow-control windows hold for an unread call.
TENSORS, NUMEL = 4, 4 * 1024 * 1024
POLICY = RetryPolicy(attempts=100, initial_backoff=0.1, max_backoff=0.5, total_deadline=60.0, idle_timeout=30.0)


@pytest.fixture(scope="module")
def state(root: Path) -> dict[str, torch.Tensor]:
    return write_model(root, MODEL, tensors=TENSORS, numel=NUMEL, seed=3)


# The attackers' loads wait as long as the test likes: the server, not their idle watchdog, must end them.
HOLDING = RetryPolicy(attempts=1, total_deadline=600.0, idle_timeout=600.0)


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="weightstream-test-stalls-") as name:
        yield Path(name)


@pytest.fixture(scope="module")
def root_settings(root: Path, shm_dir: Path) -> ServerSettings:
    return loopback_settings(
        model_root=root, max_streams=2, stall_timeout=STALL_S, data_port=free_ports(1)[0], shm_dir=shm_dir
    )


TRANSPORT_OF = {"StreamTensorsShared": "shm", "StreamTensorsBulk": "tcp"}


@contextlib.contextmanager
def unread_calls(stub: pb_grpc.WeightStreamServiceStub, kind: str, target: str, shm_dir: Path) -> Iterator[list]:
    """UNREAD calls of kind, started and never read (or, on shm and tcp, read for one tensor), cancelled on exit.

    Yields the loads still held on shm and tcp (every other one was refused at once: one client's share).
    """
    calls: list[grpc.Future] = []
    held: list[tuple[WeightStreamClient, Iterator[tuple[str, torch.Tensor]]]] = []
    try:
        for _ in range(UNREAD):
            if kind == "StreamTensors":
                calls.append(stub.StreamTensors(pb.StreamTensorsRequest(model=MODEL), timeout=120))
            elif kind == "ReadModelFile":
                request = pb.ReadModelFileRequest(model=MODEL, file="model.safetensors")
                calls.append(stub.ReadModelFile(request, timeout=120))
            else:
                client = WeightStreamClient(
                    target, progress=False, transport=TRANSPORT_OF[kind], shm_dir=shm_dir, retry=HOLDING
                )
                tensors = client.iter_tensors(MODEL)
                try:
                    next(tensors)
                except ResourceExhaustedError:
                    client.close()
                    continue
                held.append((client, tensors))
        yield held
    finally:
        for call in calls:
            call.cancel()
        for client, tensors in held:
            with contextlib.suppress(WeightStreamError):
                tensors.close()
            client.close()


def load(target: str, state: dict[str, torch.Tensor]) -> None:
    with WeightStreamClient(target, progress=False, transport="grpc", retry=POLICY) as client:
        got = client.load_state_dict(MODEL)
    assert all(torch.equal(got[name], tensor) for name, tensor in state.items())


def read_file(target: str, state: dict[str, torch.Tensor]) -> None:
    """A whole-file read that tries again while every stream slot is taken (read_file itself does not retry)."""
    deadline = time.monotonic() + POLICY.total_deadline
    with WeightStreamClient(target, progress=False, transport="grpc") as client:
        while True:
            try:
                data = b"".join(piece for piece, _ in client.read_file(MODEL, "model.safetensors"))
                break
            except ResourceExhaustedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    assert len(data) > TENSORS * NUMEL * 4


@pytest.mark.parametrize(
    ("kind", "good"),
    [
        ("StreamTensors", load),
        ("ReadModelFile", read_file),
        ("StreamTensorsShared", load),
        ("StreamTensorsBulk", load),
    ],
)
def test_a_good_client_is_served_while_unread_calls_are_open(
    kind: str,
    good: Callable[[str, dict[str, torch.Tensor]], None],
    root_server: WeightStreamServer,
    stub: pb_grpc.WeightStreamServiceStub,
    state: dict[str, torch.Tensor],
    shm_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    target = f"127.0.0.1:{root_server.port}"
    stalls_before = root_server.stats.snapshot().stalls_total
    with unread_calls(stub, kind, target, shm_dir) as held:
        assert len(held) == (1 if kind in TRANSPORT_OF else 0), "one client holds one of two slots"
        started = time.monotonic()
        good(target, state)
        seconds = time.monotonic() - started
    stalled = [r.getMessage() for r in caplog.records if "took nothing for" in r.getMessage()]
    assert stalled, "no stream was ended by the stall rule"
    assert root_server.stats.snapshot().stalls_total > stalls_before, "the stalls were not counted"
    assert all("127.0.0.1" in line for line in stalled), stalled
    # The good client waited for the stalled streams' slots, and not much longer.
    record("stall rule", **{f"good_{kind}_during_{UNREAD}_unread_calls_s": round(seconds, 2)})
    assert seconds < 10 * STALL_S, seconds
    # And the server serves as before.
    good(target, state)


def test_a_client_that_reads_slowly_but_steadily_is_not_ended(root: Path, state: dict[str, torch.Tensor]) -> None:
    """Each message taken restarts the clock: pauses well within STALL_S between messages end nothing.

    A send can wait for more than one of the client's reads (a message larger than gRPC's
    flow-control window), so the pauses are a fraction of the timeout.
    """
    timeout = 5.0
    request = pb.ReadModelFileRequest(model=MODEL, file="model.safetensors", max_chunk_bytes=1024 * 1024)
    with (
        serving(loopback_settings(model_root=root, stall_timeout=timeout, data_port=0)) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        responses: Iterator[pb.ReadModelFileResponse] = pb_grpc.WeightStreamServiceStub(channel).ReadModelFile(
            request, timeout=120
        )
        received = 0
        for index, response in enumerate(responses):
            received += len(response.data)
            if index < 16:
                time.sleep(timeout / 20)
    assert received > TENSORS * NUMEL * 4


def test_one_client_cannot_take_every_slot_and_another_is_served_at_once(
    root: Path, state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Two token holders: the attacker's unread calls hold at most its share (every slot but one), so
    the other's load needs no stall timeout to pass. Distinct clients on one host are told apart
    by their tokens (without tokens, by their hosts: no second host here)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("attacker-token\ngood-token\n")
    settings = loopback_settings(model_root=root, max_streams=2, stall_timeout=60.0, token_file=tokens, data_port=0)
    with (
        serving(settings) as server,
        grpc.insecure_channel(
            f"127.0.0.1:{server.port}", options=[("grpc.max_receive_message_length", 64 << 20)]
        ) as channel,
    ):
        stub = pb_grpc.WeightStreamServiceStub(channel)
        attacker = (("authorization", "Bearer attacker-token"),)
        calls = [
            stub.StreamTensors(pb.StreamTensorsRequest(model=MODEL), metadata=attacker, timeout=120)
            for _ in range(UNREAD)
        ]
        try:
            refused = 0
            for call in calls:
                try:
                    next(call)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert "--max-streams-per-client" in (exc.details() or ""), exc.details()
                    refused += 1
            assert refused == UNREAD - 1, "the attacker holds one slot of two"
            assert server.stats.snapshot().refused_total == {"share": UNREAD - 1}
            started = time.monotonic()
            with WeightStreamClient(
                f"127.0.0.1:{server.port}", token="good-token", progress=False, transport="grpc"
            ) as good:
                got = good.load_state_dict(MODEL)
            assert all(torch.equal(got[name], tensor) for name, tensor in state.items())
            seconds = time.monotonic() - started
            record("stall rule", good_load_beside_another_clients_unread_calls_s=round(seconds, 2))
            assert seconds < 20, "served without waiting for the stall timeout"
        finally:
            for call in calls:
                call.cancel()
