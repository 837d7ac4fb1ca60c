"""SIGTERM on a real `weightstream serve` process: the drain, its deadline, and a second SIGTERM.

A stream is held "in flight" by a client that stops reading: gRPC's flow control then stalls the
server's sends, so the stream cannot finish until the client reads again. Every wait is bounded.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.checkpoints import write_model
from tests.support.ports import LOOPBACK, free_ports
from tests.support.serve_processes import serve_process, wait_http_ready
from weightstream.client import UnavailableError, WeightStreamClient, WeightStreamError

MODEL = "drain-model"
# 64 MiB in 64 KiB chunks: far more than gRPC's flow-control windows hold, so a stream whose
# client stops reading stays in flight.
TENSORS, NUMEL = 16, 1024 * 1024
CHUNK_BYTES = 64 * 1024
WAIT_S = 15.0
POLL_S = 0.05

# Each test runs a `weightstream serve` process and signals it.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_proxy")]


@pytest.fixture(scope="module")
def state(root: Path) -> dict[str, torch.Tensor]:
    return write_model(root, MODEL, tensors=TENSORS, numel=NUMEL, seed=2)


def _args(root: Path, grpc_port: int, http_port: int, drain_seconds: float) -> list[str]:
    return [
        "--model-root",
        str(root),
        "--host",
        LOOPBACK,
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--drain-seconds",
        str(drain_seconds),
    ]


def _wait_for(what: str, check: object, output: object) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(POLL_S)
    pytest.fail(f"{what} not seen within {WAIT_S} s:\n{output()}")  # type: ignore[operator]


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service="")
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status)


def _status(http: httpx.Client, base: str) -> dict[str, object]:
    response = http.get(f"{base}/status", timeout=5.0)
    assert response.status_code == 200
    return dict(response.json())


def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(
    root: Path, state: dict[str, torch.Tensor], tmp_path: Path, http: httpx.Client
) -> None:
    grpc_port, http_port = free_ports(2)
    target, base = f"{LOOPBACK}:{grpc_port}", f"http://{LOOPBACK}:{http_port}"
    with serve_process(_args(root, grpc_port, http_port, drain_seconds=30), tmp_path) as server:
        wait_http_ready(server, http, f"{base}/readyz")
        with WeightStreamClient(target, chunk_bytes=CHUNK_BYTES, progress=False) as first:
            stream = first.iter_tensors(MODEL)
            received = dict([next(stream)])
            assert _status(http, base)["active_streams"] == 1, "the first stream should still be in flight"

            server.proc.send_signal(signal.SIGTERM)
            _wait_for("/readyz 503", lambda: http.get(f"{base}/readyz", timeout=5.0).status_code == 503, server.output)
            body = http.get(f"{base}/readyz", timeout=5.0).json()
            assert body["draining"] is True, body
            assert _health(target) == health_pb2.HealthCheckResponse.NOT_SERVING

            # A new stream is refused; the manifest it asks for first is still served.
            with WeightStreamClient(target, progress=False, timeout=10, retry=None) as second:
                assert len(second.manifest(MODEL).tensors) == TENSORS
                with pytest.raises(UnavailableError, match="shutting down"):
                    second.load_state_dict(MODEL)
            server.assert_running()

            # The stream in flight finishes, whole and correct.
            received.update(stream)
        assert set(received) == set(state)
        assert all(torch.equal(received[n], t) for n, t in state.items())
        code = server.proc.wait(timeout=WAIT_S)
    output = server.output()
    assert code == 0, output
    assert f"stream end: model='{MODEL}'" in output and "code=OK" in output, output
    assert "code=UNAVAILABLE" in output, output
    assert "cancelling" not in output, output


def test_streams_past_the_drain_deadline_are_cancelled(
    root: Path, state: dict[str, torch.Tensor], tmp_path: Path, http: httpx.Client
) -> None:
    grpc_port, http_port = free_ports(2)
    target, base = f"{LOOPBACK}:{grpc_port}", f"http://{LOOPBACK}:{http_port}"
    with serve_process(_args(root, grpc_port, http_port, drain_seconds=0.5), tmp_path) as server:
        wait_http_ready(server, http, f"{base}/readyz")
        with WeightStreamClient(target, chunk_bytes=CHUNK_BYTES, progress=False, retry=None) as client:
            stream = client.iter_tensors(MODEL)
            next(stream)
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=WAIT_S)
            took = time.monotonic() - started
            with pytest.raises(WeightStreamError):
                list(stream)  # the rest of the stream never comes
    output = server.output()
    assert code == 0, output
    assert took < 10, f"exited {took:.1f} s after SIGTERM with --drain-seconds 0.5:\n{output}"
    assert "1 streams still running after 0.5 s; cancelling them" in output, output
    assert f"stream end: model='{MODEL}' peer=ipv4:{LOOPBACK}:" in output and "code=CANCELLED" in output, output


def test_a_second_sigterm_exits_at_once(
    root: Path, state: dict[str, torch.Tensor], tmp_path: Path, http: httpx.Client
) -> None:
    grpc_port, http_port = free_ports(2)
    target, base = f"{LOOPBACK}:{grpc_port}", f"http://{LOOPBACK}:{http_port}"
    with serve_process(_args(root, grpc_port, http_port, drain_seconds=120), tmp_path) as server:
        wait_http_ready(server, http, f"{base}/readyz")
        with WeightStreamClient(target, chunk_bytes=CHUNK_BYTES, progress=False) as client:
            stream = client.iter_tensors(MODEL)
            next(stream)
            server.proc.send_signal(signal.SIGTERM)
            _wait_for("/readyz 503", lambda: http.get(f"{base}/readyz", timeout=5.0).status_code == 503, server.output)
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                code = server.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running 5 s after a second SIGTERM:\n{server.output()}")
            took = time.monotonic() - started
    output = server.output()
    assert code == 1, output
    assert took < 5
    assert "again; exiting now" in output, output
