"""The REST endpoint against a real uvicorn and gRPC server on port 0: health, readiness, status, metrics."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import hypothesis
import pytest
import schemathesis
import torch

import weightstream
from tests.support.checkpoints import nbytes, write_model
from tests.support.metrics import samples
from tests.support.servers import Running, eventually, running
from weightstream.client import NotFoundError, ResourceExhaustedError, WeightStreamClient
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.ops import health

MODEL = "ops-http-model"
TOKEN = "ops-http-token"


@pytest.fixture(scope="module")
def state(root: Path) -> dict[str, torch.Tensor]:
    return write_model(root, MODEL, tensors=4, numel=64 * 1024, seed=11)  # 1 MiB


@pytest.fixture(scope="module")
def served(root: Path, state: dict[str, torch.Tensor]) -> Iterator[Running]:
    with running(root) as r:
        yield r


def test_healthz(served: Running) -> None:
    response = served.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_when_ready(served: Running) -> None:
    response = served.get("/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["ready"] is True and body["grpc_serving"] is True and body["draining"] is False
    assert body["reasons"] == []
    assert [s["reachable"] for s in body["sources"]] == [True]
    # /readyz needs no token: it names the source's kind, never the server's path (/status does).
    assert body["sources"][0]["source"] == "model root"


def test_token_free_endpoints_reveal_no_server_path(served: Running, root: Path) -> None:
    for path in ("/healthz", "/readyz", "/openapi.json"):
        response = served.get(path)
        assert str(root) not in response.text, path
        assert str(root.parent) not in response.text, path


def test_no_interactive_docs_are_served(served: Running) -> None:
    """FastAPI's /docs and /redoc pages are off; the schema itself stays at /openapi.json."""
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert served.get(path).status_code == 404, path
    assert served.get("/openapi.json").status_code == 200


def test_status_fields(served: Running, state: dict[str, torch.Tensor]) -> None:
    with WeightStreamClient(served.target, progress=False) as client:
        client.load_state_dict(MODEL)
    response = served.get("/status")
    assert response.status_code == 200
    body = response.json()
    assert body["version"] == weightstream.__version__
    assert body["grpc_port"] == served.server.port
    assert body["uptime_s"] >= 0
    assert body["active_streams"] == 0
    assert body["streams_total"] >= 1
    assert body["bytes_served_total"] >= nbytes(state)
    assert body["storage_bytes_read_total"] >= nbytes(state)
    assert isinstance(body["errors_total"], dict)
    assert body["sources"] == [
        {"source": served.server.catalog.sources[0].describe(), "reachable": True, "error": None}
    ]
    assert body["models"][MODEL]["streams"] >= 1
    assert body["models"][MODEL]["bytes_served"] >= nbytes(state)
    assert body["tls"] is False and body["auth"] is False and body["draining"] is False


def test_status_is_documented_in_openapi(served: Running) -> None:
    spec = served.get("/openapi.json").json()
    assert {"/healthz", "/readyz", "/status", "/metrics"} <= set(spec["paths"])
    status_ref = spec["paths"]["/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    fields = spec["components"]["schemas"][status_ref.rsplit("/", 1)[1]]["properties"]
    wanted = {"version", "uptime_s", "grpc_port", "active_streams", "streams_total", "bytes_served_total"}
    assert wanted | {"errors_total", "sources", "models"} <= set(fields)
    assert "503" in spec["paths"]["/readyz"]["get"]["responses"]


def test_metrics_names(served: Running) -> None:
    response = served.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = {name for name, _labels in samples(response.text)}
    assert names, response.text
    assert all(name.startswith("weightstream_") for name in names), sorted(names)
    for wanted in (
        "weightstream_bytes_served_total",
        "weightstream_active_streams",
        "weightstream_stream_duration_seconds_bucket",
        "weightstream_stream_duration_seconds_count",
        "weightstream_storage_bytes_read_total",
        "weightstream_streams_total",
        "weightstream_info",
    ):
        assert wanted in names, (wanted, sorted(names))


def _metric(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_by_exactly_the_bytes_streamed(root: Path, state: dict[str, torch.Tensor]) -> None:
    """A fresh server: every counter starts at zero and moves by exactly what the test did."""
    ranges = [(100, 5000), (70_000, 200_000)]
    with (
        running(root, max_streams=1) as r,
        WeightStreamClient(r.target, progress=False, retry=None) as client,
        grpc.insecure_channel(r.target) as channel,
    ):
        before = r.get("/metrics").text
        assert _metric(before, "weightstream_bytes_served_total", model=MODEL) == 0
        client.load_state_dict(MODEL)  # every tensor, once
        stub = pb_grpc.WeightStreamServiceStub(channel)
        request = pb.StreamTensorsRequest(
            model=MODEL,
            tensors=[pb.TensorRequest(name="layer.1.weight", ranges=[pb.ByteRange(start=s, end=e) for s, e in ranges])],
        )
        assert sum(len(c.data) for m in stub.StreamTensors(request) for c in m.chunks) == 4900 + 130_000
        with pytest.raises(NotFoundError):
            client.manifest("no-such-model")
        with r.server.pool.checkout(), pytest.raises(ResourceExhaustedError):  # the only stream slot is taken
            client.load_state_dict(MODEL)
        after = r.get("/metrics").text
        status = r.get("/status").json()

    streamed = nbytes(state) + 4900 + 130_000
    assert _metric(after, "weightstream_bytes_served_total", model=MODEL) == streamed
    assert _metric(after, "weightstream_storage_bytes_read_total") == streamed
    assert _metric(after, "weightstream_streams_total", model=MODEL) == 3
    assert _metric(after, "weightstream_errors_total", code="NOT_FOUND") == 1
    assert _metric(after, "weightstream_errors_total", code="RESOURCE_EXHAUSTED") == 1
    assert _metric(after, "weightstream_stream_duration_seconds_count") == 3
    assert _metric(after, "weightstream_stream_duration_seconds_bucket", le="+Inf") == 3
    assert _metric(after, "weightstream_active_streams") == 0
    # No data port, no shared memory: every stream's bytes went over gRPC.
    assert _metric(after, "weightstream_transport_streams_total", transport="grpc") == 3
    assert _metric(after, "weightstream_transport_bytes_served_total", transport="grpc") == streamed
    assert _metric(after, "weightstream_stalls_total") == 0
    # The refusal came from the streamer pool, not the stream slots.
    assert _metric(after, "weightstream_streams_refused_total", reason="slots") == 0
    assert _metric(after, "weightstream_info", version=weightstream.__version__) == 1
    # /status reads the same counters.
    assert status["bytes_served_total"] == streamed
    assert status["storage_bytes_read_total"] == streamed
    assert status["streams_total"] == 3
    assert status["models"] == {MODEL: {"streams": 3, "bytes_served": streamed}}
    assert status["errors_total"] == {"NOT_FOUND": 1, "RESOURCE_EXHAUSTED": 1}


@contextlib.contextmanager
def _moved(path: Path) -> Iterator[None]:
    aside = path.with_name(path.name + "-aside")
    path.rename(aside)
    try:
        yield
    finally:
        aside.rename(path)


@pytest.mark.slow
def test_readyz_names_the_unreachable_source(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_model(root, "m", tensors=1, numel=16)
    with running(root) as r:
        assert r.get("/readyz").status_code == 200
        with _moved(root):
            eventually(lambda: r.get("/readyz").status_code == 503, "/readyz 503")
            response = r.get("/readyz")
            assert response.status_code == 503
            body = response.json()
            assert body["ready"] is False
            assert body["sources"][0]["reachable"] is False
            assert "model root is not reachable" in body["reasons"], body
            assert str(root) not in response.text
            assert r.get("/status").json()["sources"][0]["reachable"] is False
            assert r.get("/healthz").status_code == 200  # liveness does not depend on storage
        eventually(lambda: r.get("/readyz").status_code == 200, "/readyz 200 again")


def test_readyz_is_503_while_draining(tmp_path: Path) -> None:
    write_model(tmp_path, "m", tensors=1, numel=16)
    with running(tmp_path) as r:
        assert r.server.drain(0.0) == 0
        response = r.get("/readyz")
        assert response.status_code == 503
        assert response.json()["draining"] is True
        assert any("draining" in reason for reason in response.json()["reasons"])
        assert r.get("/status").json()["draining"] is True


# --- schemathesis against the served OpenAPI schema, with tokens configured -----------------------


@pytest.fixture(scope="module")
def served_with_token(root: Path, state: dict[str, torch.Tensor]) -> Iterator[Running]:
    token_file = root.parent / "ops-http-tokens"
    token_file.write_text(TOKEN + "\n")
    with running(root, token_file=token_file) as r:
        yield r


@pytest.mark.slow
def test_rest_api_conforms_to_its_openapi_schema(served_with_token: Running) -> None:
    """schemathesis, on the schema the server serves: every operation, with the token, a wrong one and none,
    answers as its schema says (documented status, content type, body shape) and never with a 5xx.

    The strategies are driven here rather than through schemathesis' pytest plugin, whose lazy
    (fixture-based) loader does not run under this pytest version.
    """
    api = schemathesis.openapi.from_url(served_with_token.base + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/healthz", "/readyz", "/status", "/metrics"}
    for operation in operations:

        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(
            max_examples=5, deadline=None, database=None, suppress_health_check=list(hypothesis.HealthCheck)
        )
        def check(case: schemathesis.Case) -> None:
            for authorization in (f"Bearer {TOKEN}", "Bearer not-the-token", None):
                headers = {"Authorization": authorization} if authorization else {}
                case.call_and_validate(headers=headers)

        check()


class _HangingSource:
    """A fake source whose reachability check fails, and blocks first while hanging is set: a real
    store that hangs on demand cannot be arranged here."""

    def __init__(self) -> None:
        self.hanging = False
        self.release = threading.Event()
        self.calls = 0

    def describe(self) -> str:
        return "s3://hanging"

    def public_name(self) -> str:
        return "s3://hanging"

    def reachable(self) -> bool:
        self.calls += 1
        if self.hanging:
            self.release.wait(10)
        raise ConnectionError("endpoint timed out")


def test_a_hanging_source_holds_one_probe_and_others_get_the_last_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "PROBE_TTL_S", 0.0)
    source = _HangingSource()
    readiness = health.Readiness([source])  # type: ignore[list-item]
    readiness.mark_serving()
    first = readiness.report()
    assert first.sources[0].reachable is False
    assert first.sources[0].error == "ConnectionError: endpoint timed out"
    assert "s3://hanging is not reachable (ConnectionError: endpoint timed out)" in first.reasons
    probes = source.calls
    source.hanging = True
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        hung = pool.submit(readiness.report)
        eventually(lambda: source.calls == probes + 1, "the hanging probe")
        started = time.monotonic()
        for _ in range(5):
            assert readiness.report().ready is False  # answered from the last probe, not blocked
        assert time.monotonic() - started < 1.0
        assert source.calls == probes + 1
        source.release.set()
        assert hung.result(timeout=10).ready is False
