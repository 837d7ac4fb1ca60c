"""Publishing over the data port: a trainer's bytes as frames on a TCP connection, checked as they land.

A real server with a data port on 127.0.0.1: the client publishes there by default and falls back
to gRPC where the server has none; raw connections send the hostile cases (a bad CRC32C, a chunk
beyond its tensor, END with the wrong counts, a ticket not issued, a publisher gone midway), each
of which ends the publish with the right code and leaves the current revision untouched.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.e2e.test_revisions import MODEL, assert_holds, changed, module_of, start_of, state_of
from tests.support.ports import LOOPBACK, free_ports
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import FailedPreconditionError, WeightStreamClient
from weightstream.protocol import tcp, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import WeightStreamServer


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / MODEL).mkdir()
    save_file(state_of(0), str(tmp_path / MODEL / "model.safetensors"))
    return tmp_path


@pytest.fixture
def server(root: Path) -> Iterator[WeightStreamServer]:
    (data_port,) = free_ports(1)
    with serving(loopback_settings(model_root=root, allow_publish=True, data_port=data_port, stall_timeout=3)) as s:
        yield s


def client_of(server: WeightStreamServer, transport: str = "auto") -> WeightStreamClient:
    return WeightStreamClient(f"{LOOPBACK}:{server.port}", progress=False, transport=transport)  # type: ignore[arg-type]


def test_a_publish_goes_over_the_data_port_and_lands_bit_exact(
    server: WeightStreamServer, caplog: pytest.LogCaptureFixture
) -> None:
    a = state_of(0)
    b = changed(a, ["head.weight", "layers.2.weight"], seed=3)
    b["layers.4.weight"] = b["layers.4.weight"].to(torch.float32)  # the same dtype: any bytes
    with caplog.at_level(logging.INFO, logger="weightstream.client.facade"), client_of(server, "tcp") as client:
        revision = client.publish(MODEL, b)
        module = module_of(a)
        assert client.load_into(module, MODEL).revision == revision
    assert_holds(module, b)
    assert any("over the data port" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_without_a_data_port_auto_falls_back_to_grpc_and_tcp_says_why(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    b = changed(state_of(0), ["head.weight"], seed=4)
    with serving(loopback_settings(model_root=root, allow_publish=True)) as plain:
        with caplog.at_level(logging.INFO, logger="weightstream.client.facade"), client_of(plain) as client:
            revision = client.publish(MODEL, b)
            assert client.manifest(MODEL).revision == revision
        assert any("over gRPC" in r.getMessage() for r in caplog.records)
        with client_of(plain, "tcp") as strict, pytest.raises(FailedPreconditionError, match="data port"):
            strict.publish(MODEL, changed(b, ["head.weight"], seed=5))


def announce(server: WeightStreamServer, start: pb.PublishRequest) -> tuple[grpc.Channel, object, socket.socket]:
    """A raw publish over the data port: the call (its request side held open) and the admitted connection."""
    start.start.data_port = True
    channel = grpc.insecure_channel(f"{LOOPBACK}:{server.port}")
    stub = pb_grpc.WeightStreamServiceStub(channel)

    def requests() -> Iterator[pb.PublishRequest]:
        yield start
        time.sleep(60)

    call = stub.PublishTensors(requests(), timeout=60)
    announcement = next(call)
    assert announcement.ticket and not announcement.complete
    conn = socket.create_connection((LOOPBACK, announcement.data_port), timeout=10)
    conn.sendall(tcp.hello(announcement.ticket))
    assert conn.recv(1) == tcp.ADMITTED
    return channel, call, conn


def frame(name: str, offset: int, data: bytes, crc: int | None = None) -> bytes:
    return tcp.chunk_header(name.encode(), offset, len(data), wire.crc32c(data) if crc is None else crc) + data


def small_start(a: dict[str, torch.Tensor], revision: str) -> pb.PublishRequest:
    """One tensor of the model, as a new layout (the hostile frames need no more)."""
    request = start_of({"head.weight": a["head.weight"]}, revision=revision)
    request.start.new_layout = True
    return request


def refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        next(call)  # type: ignore[call-overload]
    return caught.value


@pytest.mark.slow
def test_hostile_frames_end_the_publish_with_their_code_and_leave_nothing(server: WeightStreamServer) -> None:
    a = state_of(0)
    with client_of(server, "grpc") as client:
        current = client.manifest(MODEL).revision
        cases = [
            ([frame("head.weight", 0, b"\1" * 64, crc=1)], grpc.StatusCode.DATA_LOSS, "CRC32C"),
            ([frame("head.weight", 4 * 1024 * 1024 - 8, b"\0" * 64)], grpc.StatusCode.INVALID_ARGUMENT, "expected 0"),
            ([frame("embed.weight", 0, b"\0" * 64)], grpc.StatusCode.INVALID_ARGUMENT, "not announced"),
            ([frame("head.weight", 0, b"\0" * 64), tcp.end_frame(2, 64)], grpc.StatusCode.INVALID_ARGUMENT, "END"),
            (
                [frame("head.weight", 0, b"\0" * 64), tcp.end_frame(1, 64)],
                grpc.StatusCode.INVALID_ARGUMENT,
                "of 4194304",
            ),
            ([struct.pack("<BHQQI", 9, 0, 0, 0, 0)], grpc.StatusCode.INVALID_ARGUMENT, "bad frame"),
        ]
        for frames, code, words in cases:
            channel, call, conn = announce(server, small_start(a, "bad"))
            with channel, conn:
                conn.sendall(b"".join(frames))
                error = refused(call)
            assert error.code() == code, (words, error)
            assert words in (error.details() or ""), (words, error.details())
        # A chunk beyond its tensor: refused before its payload is taken.
        channel, call, conn = announce(server, small_start(a, "over"))
        with channel, conn:
            conn.sendall(tcp.chunk_header(b"head.weight", 0, 8 * 1024 * 1024, 0))
            error = refused(call)
        assert error.code() == grpc.StatusCode.OUT_OF_RANGE and "head.weight" in (error.details() or "")
        # A publisher that goes silent on its data connection is ended by the stall rule.
        channel, call, conn = announce(server, small_start(a, "silent"))
        with channel, conn:
            conn.sendall(frame("head.weight", 0, b"\0" * 64))
            error = refused(call)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "--stall-timeout" in (error.details() or "")
        # One gone midway: its connection closed after a chunk.
        channel, call, conn = announce(server, small_start(a, "gone"))
        with channel:
            conn.sendall(frame("head.weight", 0, b"\0" * 64))
            conn.close()
            error = refused(call)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        publisher = server.publisher
        assert publisher is not None
        eventually(lambda: publisher.pending_bytes() == 0, "every refused publish let go of its memory")
        assert client.manifest(MODEL).revision == current
    b = changed(a, ["head.weight"], seed=9)
    with client_of(server) as client:  # and the next publish works, over the data port
        revision = client.publish(MODEL, b)
        module = module_of(a)
        client.load_into(module, MODEL)
    assert_holds(module, b)
    assert revision != current


def test_a_ticket_is_good_for_its_own_publish_only(server: WeightStreamServer) -> None:
    assert server.data_port is not None
    with socket.create_connection((LOOPBACK, server.data_port.port), timeout=10) as stranger:
        stranger.sendall(tcp.hello(b"\0" * tcp.TICKET_BYTES))
        assert stranger.recv(1) in (tcp.REFUSED, b"")
    with client_of(server, "grpc") as client:
        assert client.manifest(MODEL).revision  # still serving
