"""Hostile input: checkpoints and requests built to crash, hang or balloon the server.

Each case must end with its status code (INVALID_ARGUMENT, OUT_OF_RANGE, NOT_FOUND or DATA_LOSS, as
fits) and a message naming the model, file or tensor, and the server must go on serving a good model
afterwards. Memory is measured on a `weightstream serve` subprocess (VmRSS and VmHWM from /proc).
Tensor slices are not covered here.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeAlias

import grpc
import pytest
import torch
from safetensors.torch import save_file

from benchmarks.harness import peak_rss, reset_peak_rss, rss
from tests.support.ports import LOOPBACK, free_ports
from tests.support.reliability_report import record
from tests.support.serve_processes import serve_process, wait_grpc_ready
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.serving.read_plan import MAX_RANGES_PER_REQUEST, MAX_RANGES_PER_TENSOR, MAX_REQUESTED_TENSORS
from weightstream_server.storage.header import MAX_HEADER_BYTES, MAX_HEADER_ITEMS

GOOD = "hostile-good"
MANY = "hostile-many"
MANY_TENSORS = 5000
CALL_TIMEOUT_S = 30.0
SERVICE = "/weightstream.v1.WeightStreamService/"
MIB = 1024 * 1024
# A 100 MB header is read whole (it is within MAX_HEADER_BYTES); the server may hold it and its
# decoded text while parsing, but nothing once the request has ended.
HEADER_PEAK_FACTOR = 2.5
RETAINED_BYTES = 48 * MIB

Code: TypeAlias = grpc.StatusCode


# The raw stub (conftest.stub) talks to the session's server, next to the other tests' models.
STUB_ON_SESSION_SERVER = True


@pytest.fixture(scope="module")
def good(model_root: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    state = {
        "w": torch.randn(64, 32, generator=generator),
        "b": torch.randn(100, generator=generator).half(),
        "empty": torch.zeros(0),
    }
    (model_root / GOOD).mkdir()
    save_file(state, str(model_root / GOOD / "model.safetensors"))
    return state


@pytest.fixture(scope="module")
def many(model_root: Path) -> dict[str, torch.Tensor]:
    state = {f"t.{i}": torch.full((4,), float(i)) for i in range(MANY_TENSORS)}
    (model_root / MANY).mkdir()
    save_file(state, str(model_root / MANY / "model.safetensors"))
    return state


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def stream(stub: pb_grpc.WeightStreamServiceStub, request: pb.StreamTensorsRequest) -> dict[str, bytearray]:
    """Every tensor's bytes from one StreamTensors call, placed by chunk offset."""
    received: dict[str, bytearray] = {}
    for response in stub.StreamTensors(request, timeout=CALL_TIMEOUT_S):
        for chunk in response.chunks:
            buffer = received.setdefault(chunk.tensor, bytearray())
            end = chunk.offset + len(chunk.data)
            if len(buffer) < end:
                buffer.extend(bytes(end - len(buffer)))
            buffer[chunk.offset : end] = chunk.data
    return received


def assert_good_load(stub: pb_grpc.WeightStreamServiceStub, good: dict[str, torch.Tensor]) -> None:
    received = stream(stub, pb.StreamTensorsRequest(model=GOOD))
    for name, tensor in good.items():
        assert bytes(received.get(name, b"")) == tensor_bytes(tensor), name


@pytest.fixture
def still_serving(good: dict[str, torch.Tensor], stub: pb_grpc.WeightStreamServiceStub) -> Iterator[None]:
    """After the test body, the same server must still load a good model bit-identically."""
    yield
    assert_good_load(stub, good)


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    """The RpcError that call ends with, its response stream (if it returns one) read to the end."""
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if isinstance(result, Iterator):
            for _ in result:
                pass
    return info.value


def manifest_error(stub: pb_grpc.WeightStreamServiceStub, model: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S)
    return info.value


def stream_error(stub: pb_grpc.WeightStreamServiceStub, request: pb.StreamTensorsRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stream(stub, request)
    return info.value


def header_file(body: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(body)) + body + data


# --- hostile checkpoints -------------------------------------------------------------------------

_ENTRY = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
_HUGE_DIM = int("9" * 4000)
# (case name, header body, data section, status code, what the message must say)
HOSTILE_HEADERS: list[tuple[str, bytes, bytes, Code, str]] = [
    (
        "huge-shape",
        json.dumps({"x": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}).encode(),
        bytes(4),
        Code.DATA_LOSS,
        "tensor 'x'.*needs 4835703278458516698824704$",
    ),
    (
        "huge-shape-huge-offsets",
        json.dumps({"x": {"dtype": "F32", "shape": [2**30, 2**30], "data_offsets": [0, 2**62]}}).encode(),
        bytes(4),
        Code.DATA_LOSS,
        "tensor 'x' ends at byte 4611686018427387904",
    ),
    (
        "huge-digits-shape",
        json.dumps({"x": {"dtype": "F32", "shape": [_HUGE_DIM] * 16, "data_offsets": [0, 4]}}).encode(),
        bytes(4),
        Code.DATA_LOSS,
        r"tensor 'x'.*shape \[9999.*\.\.\.",
    ),
    (
        "int-too-long",
        b'{"x": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
        bytes(4),
        Code.DATA_LOSS,
        "not valid JSON",
    ),
    (
        "too-many-dims",
        json.dumps({"x": {"dtype": "F32", "shape": [1] * 17, "data_offsets": [0, 4]}}).encode(),
        bytes(4),
        Code.DATA_LOSS,
        "tensor 'x'.*invalid shape",
    ),
    (
        "negative-offsets",
        json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}).encode(),
        bytes(4),
        Code.DATA_LOSS,
        "tensor 'x'.*invalid data_offsets",
    ),
    (
        "offsets-past-end",
        json.dumps({"x": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode(),
        bytes(40),
        Code.DATA_LOSS,
        "tensor 'x' ends at byte 4000 of the data section, which holds 40 bytes",
    ),
    (
        "overlapping",
        json.dumps(
            {
                "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "y": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]},
            }
        ).encode(),
        bytes(28),
        Code.DATA_LOSS,
        "tensors 'x' and 'y' overlap",
    ),
    (
        "same-offsets",
        json.dumps({"x": _ENTRY, "y": _ENTRY}).encode(),
        bytes(4),
        Code.DATA_LOSS,
        "overlap",
    ),
    (
        "unknown-dtype",
        json.dumps({"x": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 4]}}).encode(),
        bytes(4),
        Code.DATA_LOSS,
        "tensor 'x': unknown dtype 'Q99'",
    ),
    ("nul-name", json.dumps({"a\x00b": _ENTRY}).encode(), bytes(4), Code.DATA_LOSS, "invalid tensor name"),
    ("surrogate-name", b'{"a\\ud800": ' + json.dumps(_ENTRY).encode() + b"}", bytes(4), Code.DATA_LOSS, "invalid"),
    ("long-name", json.dumps({"n" * 5000: _ENTRY}).encode(), bytes(4), Code.DATA_LOSS, "invalid tensor name"),
    ("deep-nesting", b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", Code.DATA_LOSS, "deeply"),
    ("not-an-object", b"[1, 2, 3]", b"", Code.DATA_LOSS, "not a JSON object"),
    ("not-utf8", b'{"\xff\xfe": 1}', b"", Code.DATA_LOSS, "not UTF-8"),
    ("not-json", b"{" * 10, b"", Code.DATA_LOSS, "not valid JSON"),
    (
        "too-many-items",
        b'{"__metadata__": [' + b"[]," * (MAX_HEADER_ITEMS // 2 + 1) + b"[]]}",
        b"",
        Code.DATA_LOSS,
        "JSON items",
    ),
]


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(
    ("case", "body", "data", "code", "message"), HOSTILE_HEADERS, ids=[c[0] for c in HOSTILE_HEADERS]
)
def test_hostile_header_is_refused_with_a_message(
    model_root: Path,
    stub: pb_grpc.WeightStreamServiceStub,
    case: str,
    body: bytes,
    data: bytes,
    code: Code,
    message: str,
) -> None:
    model = f"hostile-{case}"
    path = model_root / model / "m.safetensors"
    path.parent.mkdir()
    path.write_bytes(header_file(body, data))
    for error in (manifest_error(stub, model), stream_error(stub, pb.StreamTensorsRequest(model=model))):
        assert error.code() == code, error.details()
        details = error.details()
        assert f"model {model!r}, file 'm.safetensors'" in details
        assert re.search(message, details), details
        # Messages travel in trailers: they must stay far below gRPC's 8 KiB metadata limit.
        assert len(details) < 1024


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "too short"),
        (b"\x01\x00", "too short"),
        (struct.pack("<Q", 2**63), "header length"),
        (struct.pack("<Q", 1000) + b"{}", "truncated"),
    ],
    ids=["empty", "short", "length-2-63", "length-past-end"],
)
def test_truncated_or_absurd_length_prefix_is_data_loss(
    model_root: Path, stub: pb_grpc.WeightStreamServiceStub, content: bytes, message: str
) -> None:
    model = f"hostile-prefix-{len(content)}-{content[:8].hex()}"
    (model_root / model).mkdir()
    (model_root / model / "p.safetensors").write_bytes(content)
    error = manifest_error(stub, model)
    assert error.code() == Code.DATA_LOSS
    assert "p.safetensors" in error.details() and message in error.details()


@pytest.mark.usefixtures("still_serving")
def test_tensor_names_with_path_characters_are_only_names(
    model_root: Path, stub: pb_grpc.WeightStreamServiceStub, tmp_path: Path
) -> None:
    """A tensor name is a key, never a path: the server serves such names verbatim and opens nothing."""
    state = {
        "../../outside": torch.arange(4, dtype=torch.float32),
        "/etc/passwd": torch.arange(3, dtype=torch.int32),
        "a\\b:c": torch.arange(2, dtype=torch.int64),
        "\u00fcml\u00e4ut \u2603": torch.ones(5, dtype=torch.uint8),
    }
    (model_root / "hostile-path-names").mkdir()
    save_file(state, str(model_root / "hostile-path-names" / "model.safetensors"))
    listed = {t.name for t in stub.GetManifest(pb.GetManifestRequest(model="hostile-path-names"), timeout=10).tensors}
    assert listed == set(state)
    received = stream(stub, pb.StreamTensorsRequest(model="hostile-path-names"))
    assert {n: bytes(b) for n, b in received.items()} == {n: tensor_bytes(t) for n, t in state.items()}
    assert not (model_root.parent / "outside").exists()


# --- hostile model ids ---------------------------------------------------------------------------

HOSTILE_IDS = [
    "..",
    "../hostile-good",
    "hostile-good/../hostile-good",
    "/etc/passwd",
    "/",
    "a\x00b",
    "hostile-good\x00",
    "a//b",
    "a/",
    "./hostile-good",
    ".",
    "C:\\x",
    "a\\..\\b",
    "~root",
    "x" * 600,
    "hostile good",
    "a\nb",
]


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("model", HOSTILE_IDS, ids=[repr(m)[:30] for m in HOSTILE_IDS])
def test_hostile_model_id_is_invalid_argument_on_every_rpc(stub: pb_grpc.WeightStreamServiceStub, model: str) -> None:
    errors = [
        manifest_error(stub, model),
        stream_error(stub, pb.StreamTensorsRequest(model=model)),
        rpc_error(lambda: stub.ListModelFiles(pb.ListModelFilesRequest(model=model), timeout=CALL_TIMEOUT_S)),
        rpc_error(
            lambda: stub.ReadModelFile(
                pb.ReadModelFileRequest(model=model, file="model.safetensors"), timeout=CALL_TIMEOUT_S
            )
        ),
    ]
    for error in errors:
        assert error.code() == Code.INVALID_ARGUMENT, error.details()
        assert "model id" in error.details()


def test_unknown_model_is_not_found_naming_it(stub: pb_grpc.WeightStreamServiceStub) -> None:
    error = manifest_error(stub, "no/such-model")
    assert error.code() == Code.NOT_FOUND and "'no/such-model'" in error.details()


# --- hostile requests ----------------------------------------------------------------------------


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("max_chunk_bytes", [1, 4095, 16 * MIB + 1, 2**31, 2**32 - 1])
def test_absurd_chunk_sizes_are_invalid_argument(stub: pb_grpc.WeightStreamServiceStub, max_chunk_bytes: int) -> None:
    error = stream_error(stub, pb.StreamTensorsRequest(model=GOOD, max_chunk_bytes=max_chunk_bytes))
    assert error.code() == Code.INVALID_ARGUMENT
    assert f"max_chunk_bytes {max_chunk_bytes}" in error.details()


def test_thousands_of_names_are_all_served(
    many: dict[str, torch.Tensor], stub: pb_grpc.WeightStreamServiceStub
) -> None:
    names = list(many)
    request = pb.StreamTensorsRequest(model=MANY, tensors=[pb.TensorRequest(name=n) for n in reversed(names)])
    received = stream(stub, request)
    assert len(received) == MANY_TENSORS
    assert all(bytes(received[n]) == tensor_bytes(many[n]) for n in names)


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(
    ("names", "code", "message"),
    [
        ([f"t.{i}" for i in range(MANY_TENSORS)] + ["t.5000"], Code.NOT_FOUND, "no tensor 't.5000'"),
        ([f"nope.{i}" for i in range(MANY_TENSORS)], Code.NOT_FOUND, "no tensor 'nope.0'"),
        (["t.1", "t.2", "t.1"], Code.INVALID_ARGUMENT, "'t.1' is requested more than once"),
        (["t.1\x00"], Code.NOT_FOUND, r"no tensor 't.1\\x00'"),
        (["../t.1"], Code.NOT_FOUND, "no tensor '../t.1'"),
        ([""], Code.NOT_FOUND, "no tensor ''"),
        (["x" * 100_000], Code.NOT_FOUND, "no tensor 'xxxx"),
    ],
    ids=["one-unknown-of-5001", "5000-unknown", "duplicate", "nul", "path", "empty", "100k-chars"],
)
def test_bad_names_name_the_tensor(
    many: dict[str, torch.Tensor], stub: pb_grpc.WeightStreamServiceStub, names: list[str], code: Code, message: str
) -> None:
    error = stream_error(stub, pb.StreamTensorsRequest(model=MANY, tensors=[pb.TensorRequest(name=n) for n in names]))
    assert error.code() == code
    assert re.search(message, error.details()), error.details()
    assert len(error.details()) < 1024


@pytest.mark.usefixtures("still_serving")
def test_more_names_than_the_limit_are_refused_before_any_work(
    good: dict[str, torch.Tensor], raw_channel: grpc.Channel
) -> None:
    """MAX_REQUESTED_TENSORS + 1 empty TensorRequests, serialized by hand (building a million messages is slow)."""
    model = pb.StreamTensorsRequest(model=GOOD).SerializeToString()
    raw = model + b"\x12\x00" * (MAX_REQUESTED_TENSORS + 1)
    call = raw_channel.unary_stream(SERVICE + "StreamTensors", request_serializer=None, response_deserializer=None)
    error = rpc_error(lambda: call(raw, timeout=CALL_TIMEOUT_S))
    assert error.code() == Code.INVALID_ARGUMENT
    assert f"{MAX_REQUESTED_TENSORS + 1} tensors, more than {MAX_REQUESTED_TENSORS}" in error.details()


def _ranges(*pairs: tuple[int, int]) -> list[pb.ByteRange]:
    return [pb.ByteRange(start=s, end=e) for s, e in pairs]


W_BYTES = 64 * 32 * 4


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(
    ("ranges", "code", "message"),
    [
        (_ranges((0, W_BYTES + 1)), Code.OUT_OF_RANGE, rf"tensor 'w': byte range \[0, {W_BYTES + 1}\)"),
        (_ranges((W_BYTES, W_BYTES + 8)), Code.OUT_OF_RANGE, "tensor 'w'"),
        (_ranges((0, 2**64 - 1)), Code.OUT_OF_RANGE, "tensor 'w'"),
        (_ranges((2**64 - 2, 2**64 - 1)), Code.OUT_OF_RANGE, "tensor 'w'"),
        (_ranges((100, 10)), Code.OUT_OF_RANGE, r"tensor 'w': byte range \[100, 10\)"),
        (_ranges((7, 7)), Code.OUT_OF_RANGE, "empty"),
        (_ranges((0, 100), (50, 150)), Code.INVALID_ARGUMENT, "tensor 'w': byte ranges overlap at byte 50"),
        (_ranges((0, 100), (0, 100)), Code.INVALID_ARGUMENT, "overlap"),
        (_ranges(*[(i, i + 1) for i in range(MAX_RANGES_PER_TENSOR + 1)]), Code.INVALID_ARGUMENT, "4097 ranges"),
    ],
    ids=["past-end", "after-end", "end-2-64", "start-2-64", "reversed", "empty", "overlap", "same", "too-many"],
)
def test_bad_ranges_name_the_tensor(
    stub: pb_grpc.WeightStreamServiceStub, ranges: list[pb.ByteRange], code: Code, message: str
) -> None:
    request = pb.StreamTensorsRequest(model=GOOD, tensors=[pb.TensorRequest(name="w", ranges=ranges)])
    error = stream_error(stub, request)
    assert error.code() == code, error.details()
    assert re.search(message, error.details()), error.details()


@pytest.mark.usefixtures("still_serving")
def test_ranges_on_an_empty_tensor_are_out_of_range(stub: pb_grpc.WeightStreamServiceStub) -> None:
    request = pb.StreamTensorsRequest(model=GOOD, tensors=[pb.TensorRequest(name="empty", ranges=_ranges((0, 1)))])
    error = stream_error(stub, request)
    assert error.code() == Code.OUT_OF_RANGE and "'empty'" in error.details()


@pytest.mark.usefixtures("many")
def test_more_ranges_in_all_than_the_limit_are_refused(stub: pb_grpc.WeightStreamServiceStub) -> None:
    """Ranges are bounded per request too, so many tensors of many ranges cannot build a huge plan."""
    per_tensor = _ranges(*[(i, i + 1) for i in range(MAX_RANGES_PER_TENSOR)])
    tensors = MAX_RANGES_PER_REQUEST // MAX_RANGES_PER_TENSOR + 1
    request = pb.StreamTensorsRequest(
        model=MANY, tensors=[pb.TensorRequest(name=f"t{i}", ranges=per_tensor) for i in range(tensors)]
    )
    error = stream_error(stub, request)
    assert error.code() == Code.INVALID_ARGUMENT, error.details()
    assert f"more than {MAX_RANGES_PER_REQUEST}" in error.details()


def test_the_most_ranges_allowed_are_served_exactly(
    good: dict[str, torch.Tensor], stub: pb_grpc.WeightStreamServiceStub
) -> None:
    """MAX_RANGES_PER_TENSOR one-byte ranges, given in reverse: exactly those bytes come back."""
    pairs = [(2 * i, 2 * i + 1) for i in reversed(range(MAX_RANGES_PER_TENSOR))]
    request = pb.StreamTensorsRequest(model=GOOD, tensors=[pb.TensorRequest(name="w", ranges=_ranges(*pairs))])
    expected = tensor_bytes(good["w"])
    got = stream(stub, request)["w"]
    assert all(got[s] == expected[s] for s, _ in pairs)
    assert all(got[s + 1] == 0 for s, _ in pairs[1:])


MALFORMED_PROTOBUF = [b"\xff\xff\xff\xff", b"\x0a\x02\xc3\x28", b"\x0a\x05abc", b"\x12\x80\x80\x80\x80\x10"]


@pytest.mark.parametrize(
    "method",
    ["GetManifest", "StreamTensors", "ListModelFiles", "ReadModelFile", "OpenSharedMemory", "StreamTensorsShared"],
)
def test_malformed_protobuf_is_invalid_argument(raw_channel: grpc.Channel, method: str) -> None:
    call = raw_channel.unary_stream(SERVICE + method, request_serializer=None, response_deserializer=None)
    for raw in MALFORMED_PROTOBUF:
        error = rpc_error(lambda raw=raw: call(raw, timeout=CALL_TIMEOUT_S))  # type: ignore[misc]
        if method == "StreamTensorsShared":
            # This server has no --shm-dir, so the call is refused before its first message is read;
            # tests/server/test_admission.py sends these bytes to a server that has one.
            assert error.code() == Code.FAILED_PRECONDITION, (raw, error.code(), error.details())
            continue
        assert error.code() == Code.INVALID_ARGUMENT, (raw, error.code(), error.details())
        assert "is not a valid weightstream.v1." in error.details()


# --- memory of a server process ------------------------------------------------------------------


def _write_memory_cases(root: Path) -> dict[str, tuple[Code, int]]:
    """Checkpoints for the memory test: model name -> (status code of its manifest, header bytes)."""
    cases: dict[str, tuple[Code, int]] = {}
    body_bytes = MAX_HEADER_BYTES - 64
    # 100 MB of the smallest JSON items: parsed, they would take about 2.5 GB of Python objects.
    tiny = b'{"__metadata__": [' + b"[]," * ((body_bytes - 20) // 3) + b"[]]}"
    # 100 MB of valid JSON (one long metadata value): parsed in full, then dropped.
    filler = "a" * (body_bytes - 200)
    text = json.dumps({"__metadata__": {"filler": filler}, "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    long_json = text.encode()
    huge_shape = json.dumps(
        {f"t{i}": {"dtype": "F64", "shape": [2**31] * 16, "data_offsets": [0, 8]} for i in range(1000)}
    ).encode()
    for name, body, data, code in [
        ("items-100mb", tiny, b"", Code.DATA_LOSS),
        ("json-100mb", long_json, bytes(8), Code.OK),
        ("huge-shapes", huge_shape, bytes(8), Code.DATA_LOSS),
    ]:
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(header_file(body, data))
        cases[name] = (code, len(body))
    return cases


@pytest.mark.slow
def test_server_memory_stays_bounded_on_huge_headers(tmp_path: Path) -> None:
    """A `weightstream serve` process: its peak RSS per hostile manifest, and its RSS once each is done."""
    root = tmp_path / "models"
    root.mkdir()
    generator = torch.Generator().manual_seed(11)
    good = {"w": torch.randn(256, 256, generator=generator)}
    (root / GOOD).mkdir()
    save_file(good, str(root / GOOD / "model.safetensors"))
    cases = _write_memory_cases(root)
    (port,) = free_ports(1)
    target = f"{LOOPBACK}:{port}"
    args = ["--model-root", str(root), "--host", LOOPBACK, "--grpc-port", str(port), "--http-port", "0"]
    with serve_process(args, tmp_path) as server, grpc.insecure_channel(target) as channel:
        wait_grpc_ready(server, target, GOOD)
        stub = pb_grpc.WeightStreamServiceStub(channel)
        pid = server.proc.pid
        assert_good_load(stub, good)
        baseline = rss(pid)
        assert baseline > 0, "no VmRSS in /proc: this test needs Linux"
        for name, (code, header_bytes) in cases.items():
            for attempt in range(3):
                reset_peak_rss(pid)
                start = rss(pid)
                try:
                    stub.GetManifest(pb.GetManifestRequest(model=name), timeout=120)
                    got = Code.OK
                except grpc.RpcError as error:
                    got = error.code()
                    assert name in error.details()
                assert got == code, name
                peak_growth = peak_rss(pid) - start
                assert_good_load(stub, good)
                retained = rss(pid) - baseline
                if attempt == 0:
                    figures = {f"{name}_peak_growth_mib": peak_growth / MIB, f"{name}_retained_mib": retained / MIB}
                    record("hostile memory", **figures)
                assert peak_growth < HEADER_PEAK_FACTOR * header_bytes + 16 * MIB, (name, attempt, peak_growth)
                assert retained < RETAINED_BYTES, (name, attempt, retained)
        server.assert_running()
