"""Fuzzing with hypothesis: the safetensors header parser, and request messages sent to a real server.

Profiles (the environment variable WEIGHTSTREAM_FUZZ_PROFILE picks one):

- ci (the default): a few hundred cases in all, well under a minute, the same cases on every run;
- nightly: 10,000 new random cases per test, for a long run:
  `WEIGHTSTREAM_FUZZ_PROFILE=nightly python -m pytest tests/e2e/test_fuzz.py`.

The parser is called directly on in-memory files and may only return checked tensors or raise the
server's CorruptCheckpoint or UnsupportedCheckpoint. Requests go to the session server over loopback,
each with a deadline (a hang shows as DEADLINE_EXCEEDED, which is not expected); random bytes are
sent as requests through a raw channel method, so that malformed protobuf reaches the server. After
each test the server must still answer a good manifest. Counts are recorded in the "fuzz" section
of the reliability summary.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tests.support.reliability_report import record
from tests.support.surfaces import mutated
from weightstream.protocol import dtypes, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.errors import CorruptCheckpoint, UnsupportedCheckpoint
from weightstream_server.storage.header import HeaderTensor, read_header

# Hundreds of cases per test, seconds each: `make test` runs them, `make test-fast` does not.
pytestmark = pytest.mark.slow

_PROFILES = {
    # CI gates every change, so its cases are the same on every run (derandomize): a failure there
    # is the change's, reproducible as it is. The nightly profile explores new random cases.
    "ci": settings(
        max_examples=150,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    ),
    "nightly": settings(
        max_examples=10_000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    ),
}
PROFILE = os.environ.get("WEIGHTSTREAM_FUZZ_PROFILE", "ci")
if PROFILE not in _PROFILES:
    raise pytest.UsageError(f"WEIGHTSTREAM_FUZZ_PROFILE={PROFILE!r}: use one of {sorted(_PROFILES)}")
FUZZ = _PROFILES[PROFILE]

MODEL = "fuzz-good"
CALL_TIMEOUT_S = 10.0
SERVICE = "/weightstream.v1.WeightStreamService/"
Code: TypeAlias = grpc.StatusCode
# What a bad request may end with; anything else (INTERNAL, UNKNOWN, DEADLINE_EXCEEDED) is a failure.
REQUEST_CODES = {
    Code.OK,
    Code.INVALID_ARGUMENT,
    Code.OUT_OF_RANGE,
    Code.NOT_FOUND,
    Code.FAILED_PRECONDITION,  # a revision that does not match
    Code.PERMISSION_DENIED,  # s3:// and other URL ids this server does not serve
}
# Messages travel in trailers; gRPC refuses trailers over 8 KiB.
MAX_MESSAGE_CHARS = 4096


# The raw stub (conftest.stub) talks to the session's server, next to the other tests' models.
STUB_ON_SESSION_SERVER = True


@pytest.fixture(scope="module")
def good(model_root: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    state = {
        "a.weight": torch.randn(32, 16, generator=generator),
        "b": torch.randn(10, generator=generator).half(),
        "c": torch.arange(7, dtype=torch.int64),
        "empty": torch.zeros(0),
        "scalar": torch.tensor(3.0),
    }
    (model_root / MODEL).mkdir()
    save_file(state, str(model_root / MODEL / "model.safetensors"))
    return state


@pytest.fixture
def still_serving(good: dict[str, torch.Tensor], stub: pb_grpc.WeightStreamServiceStub) -> Iterator[None]:
    """After the test body the server must still answer a good manifest."""
    yield
    manifest = stub.GetManifest(pb.GetManifestRequest(model=MODEL), timeout=CALL_TIMEOUT_S)
    assert {t.name for t in manifest.tensors} == set(good)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --- the header parser ---------------------------------------------------------------------------


def parse(content: bytes, file_size: int | None = None) -> list[HeaderTensor] | Exception:
    """read_header on content as a file: its tensors, or the domain error it raised (anything else propagates)."""
    size = len(content) if file_size is None else file_size

    def read_range(start: int, length: int) -> bytes:
        return content[start : start + length]

    try:
        return read_header(read_range, size, "model 'fuzz', file 'f.safetensors'")
    except (CorruptCheckpoint, UnsupportedCheckpoint) as exc:
        assert "f.safetensors" in str(exc)
        assert len(str(exc)) < MAX_MESSAGE_CHARS
        return exc


def check_tensors(tensors: list[HeaderTensor], header_len: int, file_size: int) -> None:
    """What read_header promises about the tensors it returns."""
    previous_end = 0
    for tensor in tensors:
        assert isinstance(tensor.name, str) and tensor.name and "\x00" not in tensor.name
        tensor.name.encode("utf-8")
        assert all(isinstance(d, int) and d >= 0 for d in tensor.shape)
        assert tensor.nbytes == wire.numel(tensor.shape) * tensor.dtype.itemsize
        assert 8 + header_len <= tensor.start <= tensor.end <= file_size
        if tensor.nbytes:
            assert tensor.start >= previous_end
            previous_end = tensor.end


def with_prefix(body: bytes, data_len: int) -> bytes:
    return struct.pack("<Q", len(body)) + body + bytes(data_len)


def record_counts(counts: Counter[str], **names: str) -> None:
    """Record counters under their figure names (zero when the counter never ran)."""
    record("fuzz", **{figure: counts[key] for figure, key in names.items()})


# (before, repeated token, after): headers that nest deeply, or hold very long numbers or lists.
_REPEATS = [
    (b'{"__metadata__": ', b"[", b""),
    (b'{"a": ', b'{"a": ', b""),
    (b'{"x": {"dtype": "F32", "shape": [', b"9", b'], "data_offsets": [0, 4]}}'),
    (b'{"x": {"dtype": "F32", "shape": [', b"1, ", b'1], "data_offsets": [0, 4]}}'),
    (b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, ', b"4", b"]}}"),
]


def _repeated(parts: tuple[bytes, bytes, bytes], count: int) -> bytes:
    before, token, after = parts
    return before + token * count + after


@pytest.mark.parametrize("parts", _REPEATS, ids=lambda parts: parts[1].decode().strip(", "))
@pytest.mark.parametrize("count", [4000, 4295])
@pytest.mark.parametrize("data_len", [0, 4])
def test_header_with_long_numbers_gets_a_short_message(
    parts: tuple[bytes, bytes, bytes], count: int, data_len: int
) -> None:
    """The cases the random search found first: numbers thousands of digits long stay out of messages."""
    result = parse(with_prefix(_repeated(parts, count), data_len))
    assert isinstance(result, (CorruptCheckpoint, UnsupportedCheckpoint))


def test_header_parser_on_arbitrary_bytes() -> None:
    counts: Counter[str] = Counter()

    @FUZZ
    @given(
        st.one_of(
            st.binary(max_size=2048),
            st.builds(with_prefix, st.binary(max_size=2048), st.integers(0, 64)),
            st.builds(
                with_prefix,
                st.builds(_repeated, st.sampled_from(_REPEATS), st.integers(1, 20_000)),
                st.sampled_from([0, 4]),
            ),
        ),
        st.one_of(st.none(), st.integers(0, 2**64)),
    )
    def run(content: bytes, file_size: int | None) -> None:
        counts["cases"] += 1
        try:
            result = parse(content, file_size)
        except Exception:
            counts["crashes"] += 1
            raise
        if isinstance(result, list):
            (header_len,) = struct.unpack("<Q", content[:8])
            check_tensors(result, header_len, len(content) if file_size is None else file_size)
            counts["parsed"] += 1

    try:
        run()
    finally:
        record_counts(counts, header_cases="cases", crashes="crashes", header_parsed_ok="parsed")
    assert counts["cases"] > 0


# JSON values of every type, for fields that should hold something else.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
_INTS = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.sampled_from([2**31, 2**32, 2**63, 2**64]))
_DTYPE_CODES = [*sorted(dtypes.BY_SAFETENSORS), "C64", "F8_E8M0", "F4", "Q99", "", "f32", "F32 "]
_NAMES = st.one_of(
    st.from_regex(r"[a-z0-9._]{1,10}", fullmatch=True),
    st.from_regex(r"[a-z0-9._]{1,10}", fullmatch=True),
    st.text(max_size=12),
    st.sampled_from(["__metadata__", "", "a\x00b", "../../x", "/abs", "\ud800", "n" * 1025]),
)


@st.composite
def near_valid_header(draw: Any) -> tuple[bytes, int]:
    """A JSON header whose entries are mostly consistent, with some fields made wrong; and its data size."""
    header: dict[str, Any] = {}
    cursor = 0
    for _ in range(draw(st.integers(0, 6))):
        dtype = draw(st.sampled_from(_DTYPE_CODES))
        shape: Any = draw(st.lists(st.integers(0, 5), max_size=4))
        itemsize = dtypes.BY_SAFETENSORS[dtype].itemsize if dtype in dtypes.BY_SAFETENSORS else 4
        begin = cursor + draw(st.sampled_from([0] * 8 + [1, -4]))
        offsets: Any = [begin, begin + wire.numel(tuple(shape)) * itemsize]
        cursor = max(cursor, offsets[1])
        entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        broken = draw(st.sampled_from(["none"] * 6 + ["shape", "offsets", "dtype", "missing", "extra", "entry"]))
        if broken == "shape":
            entry["shape"] = draw(st.one_of(st.lists(st.one_of(_INTS, _JSON), max_size=18), _JSON))
        elif broken == "offsets":
            entry["data_offsets"] = draw(st.one_of(st.lists(_INTS, min_size=2, max_size=2), _JSON))
        elif broken == "dtype":
            entry["dtype"] = draw(_JSON)
        elif broken == "missing":
            del entry[draw(st.sampled_from(sorted(entry)))]
        elif broken == "extra":
            entry[draw(st.text(max_size=6))] = draw(_JSON)
        header[draw(_NAMES)] = draw(_JSON) if broken == "entry" else entry
    if draw(st.booleans()):
        header["__metadata__"] = draw(_JSON)
    body = json.dumps(header, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    return body, max(0, cursor + draw(st.sampled_from([0] * 6 + [-1, 1, 100])))


def test_header_parser_on_near_valid_headers() -> None:
    counts: Counter[str] = Counter()

    @FUZZ
    @given(near_valid_header())
    def run(case: tuple[bytes, int]) -> None:
        body, data_len = case
        counts["cases"] += 1
        content = with_prefix(body, data_len)
        try:
            result = parse(content)
        except Exception:
            counts["crashes"] += 1
            raise
        if isinstance(result, list):
            check_tensors(result, len(body), len(content))
            counts["parsed"] += 1
        else:
            counts[type(result).__name__] += 1

    try:
        run()
    finally:
        record_counts(
            counts,
            header_cases="cases",
            crashes="crashes",
            header_parsed_ok="parsed",
            header_corrupt="CorruptCheckpoint",
            header_unsupported="UnsupportedCheckpoint",
        )
    # The generator must reach both sides of the parser, or it tests nothing.
    assert counts["parsed"] > 0 and counts["CorruptCheckpoint"] > 0


# --- requests to a real server -------------------------------------------------------------------

_HOSTILE_IDS = ["..", "../fuzz-good", "/etc/passwd", "a\x00b", "s3://bucket/x", "http://x/y", "", "x" * 600, "a//b"]
_TEXT = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=24)
_U64 = st.one_of(st.integers(0, 600), st.integers(0, 2**64 - 1))
_MODELS = st.one_of(st.sampled_from([MODEL] * 8 + _HOSTILE_IDS), _TEXT)


def outcome(run: Any) -> tuple[Code, str, Any]:
    """(status code, details, result) of run(); the result is None unless the call succeeded."""
    try:
        return Code.OK, "", run()
    except grpc.RpcError as error:
        return error.code(), error.details() or "", None


@st.composite
def valid_tensors(draw: Any, sizes: dict[str, int]) -> list[pb.TensorRequest]:
    """Distinct tensors of the fuzz model, each whole or with disjoint ranges inside it."""
    chosen = draw(st.lists(st.sampled_from(sorted(sizes)), unique=True, max_size=len(sizes)))
    requests = []
    for name in chosen:
        points = draw(st.lists(st.integers(0, sizes[name]), unique=True, max_size=8)) if sizes[name] else []
        requests.append(pb.TensorRequest(name=name, ranges=_disjoint_ranges(points)))
    return requests


def _disjoint_ranges(points: list[int]) -> list[pb.ByteRange]:
    """Pairs of sorted distinct points as disjoint ranges, given in reverse order (mostly in bounds)."""
    ordered = sorted(points)
    return [pb.ByteRange(start=s, end=e) for s, e in reversed(list(zip(ordered[::2], ordered[1::2], strict=False)))]


# Codes that mean the server failed rather than refused: counted as crashes.
CRASH_CODES = {Code.INTERNAL, Code.UNKNOWN, Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED}


def check_code(counts: Counter[str], code: Code, details: str, allowed: set[Code]) -> None:
    counts[code.name] += 1
    if code in CRASH_CODES:
        counts["crashes"] += 1
    if code not in allowed:
        counts["unexpected"] += 1
        raise AssertionError(f"unexpected {code.name}: {details}")
    if code != Code.OK:
        assert details and len(details) < MAX_MESSAGE_CHARS, details


@pytest.mark.usefixtures("still_serving")
def test_stream_requests(good: dict[str, torch.Tensor], stub: pb_grpc.WeightStreamServiceStub) -> None:
    revision = stub.GetManifest(pb.GetManifestRequest(model=MODEL), timeout=CALL_TIMEOUT_S).revision
    names = st.one_of(st.sampled_from(sorted(good)), st.sampled_from(sorted(good)), _TEXT)
    ranges = st.one_of(
        st.lists(st.builds(pb.ByteRange, start=_U64, end=_U64), max_size=5),
        st.lists(st.integers(0, 520), unique=True, max_size=8).map(_disjoint_ranges),
    )
    sizes = {name: len(tensor_bytes(t)) for name, t in good.items()}
    counts: Counter[str] = Counter()

    @FUZZ
    @given(
        model=_MODELS,
        tensors=st.one_of(
            st.lists(st.builds(pb.TensorRequest, name=names, ranges=ranges), max_size=6),
            valid_tensors(sizes),
        ),
        max_chunk_bytes=st.one_of(
            st.just(0), st.just(0), st.integers(0, 2**32 - 1), st.sampled_from([4095, 4096, 2**24, 2**24 + 1])
        ),
        revision=st.one_of(st.just(""), st.just(""), st.just(revision), _TEXT),
    )
    def run(model: str, tensors: list[pb.TensorRequest], max_chunk_bytes: int, revision: str) -> None:
        counts["cases"] += 1
        request = pb.StreamTensorsRequest(
            model=model, tensors=tensors, max_chunk_bytes=max_chunk_bytes, revision=revision
        )
        code, details, responses = outcome(lambda: list(stub.StreamTensors(request, timeout=CALL_TIMEOUT_S)))
        check_code(counts, code, details, REQUEST_CODES)
        if code != Code.OK:
            return
        # A request the server took must get exactly the bytes it asked for.
        wanted = {t.name: [(r.start, r.end) for r in t.ranges] for t in tensors} or {n: [] for n in good}
        got: Counter[str] = Counter()
        for response in responses:
            for chunk in response.chunks:
                expected = tensor_bytes(good[chunk.tensor])
                assert chunk.data == expected[chunk.offset : chunk.offset + len(chunk.data)]
                got[chunk.tensor] += len(chunk.data)
        for name, spans in wanted.items():
            size = len(tensor_bytes(good[name]))
            assert got[name] == (sum(e - s for s, e in spans) if spans else size), name

    try:
        run()
    finally:
        record_counts(counts, request_cases="cases", crashes="crashes", unexpected_codes="unexpected", stream_ok="OK")
    assert counts["cases"] > 0


@pytest.mark.usefixtures("still_serving")
def test_slice_requests(good: dict[str, torch.Tensor], stub: pb_grpc.WeightStreamServiceStub) -> None:
    """Slices of every dimension and bound, in and out of range, with and without byte ranges."""
    counts: Counter[str] = Counter()
    small = st.integers(0, 40)
    bound = st.one_of(small, small, small, _U64)

    @st.composite
    def in_bounds(draw: Any) -> tuple[str, int, int, int]:
        name = draw(st.sampled_from(["a.weight", "b", "c"]))
        dim = draw(st.integers(0, good[name].dim() - 1))
        start = draw(st.integers(0, good[name].shape[dim] - 1))
        return name, dim, start, draw(st.integers(start + 1, good[name].shape[dim]))

    anything = st.tuples(
        st.sampled_from(sorted(good)),
        st.one_of(st.integers(0, 1), st.integers(0, 3), st.integers(0, 2**32 - 1)),
        bound,
        bound,
    )

    @FUZZ
    @given(
        spec=st.one_of(in_bounds(), anything),
        points=st.one_of(st.just([]), st.just([]), st.lists(st.integers(0, 600), unique=True, max_size=6)),
    )
    def run(spec: tuple[str, int, int, int], points: list[int]) -> None:
        name, dim, start, stop = spec
        counts["cases"] += 1
        ranges = _disjoint_ranges(points)
        piece = pb.TensorSlice(dim=dim, start=start, stop=stop)
        request = pb.StreamTensorsRequest(
            model=MODEL, tensors=[pb.TensorRequest(name=name, slice=piece, ranges=ranges)]
        )
        code, details, responses = outcome(lambda: list(stub.StreamTensors(request, timeout=CALL_TIMEOUT_S)))
        check_code(counts, code, details, REQUEST_CODES - {Code.FAILED_PRECONDITION, Code.PERMISSION_DENIED})
        if code != Code.OK:
            return
        # Taken: the bytes are those of the slice, laid out contiguously.
        full = good[name]
        assert 0 <= dim < full.dim() and 0 <= start < stop <= full.shape[dim]
        expected = tensor_bytes(full.narrow(dim, start, stop - start).contiguous())
        for response in responses:
            for chunk in response.chunks:
                assert chunk.data == expected[chunk.offset : chunk.offset + len(chunk.data)]

    try:
        run()
    finally:
        record_counts(
            counts,
            slice_cases="cases",
            crashes="crashes",
            unexpected_codes="unexpected",
            slice_ok="OK",
            slice_out_of_range="OUT_OF_RANGE",
            slice_invalid="INVALID_ARGUMENT",
        )
    assert counts["cases"] > 0


@pytest.mark.usefixtures("still_serving")
def test_manifest_requests(good: dict[str, torch.Tensor], stub: pb_grpc.WeightStreamServiceStub) -> None:
    counts: Counter[str] = Counter()

    @FUZZ
    @given(model=_MODELS)
    def run(model: str) -> None:
        counts["cases"] += 1
        code, details, manifest = outcome(
            lambda: stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S)
        )
        check_code(counts, code, details, REQUEST_CODES - {Code.OUT_OF_RANGE, Code.FAILED_PRECONDITION})
        if code == Code.OK:
            assert manifest.model == model
        elif model == MODEL:
            raise AssertionError(f"{MODEL!r} refused: {details}")

    try:
        run()
    finally:
        record_counts(counts, request_cases="cases", crashes="crashes", unexpected_codes="unexpected", manifest_ok="OK")
    assert counts["cases"] > 0


@pytest.mark.usefixtures("still_serving")
def test_raw_request_bytes(good: dict[str, torch.Tensor], raw_channel: grpc.Channel) -> None:
    """Random and mutated bytes as the request of each RPC; malformed protobuf included."""
    valid = {
        "StreamTensors": pb.StreamTensorsRequest(
            model=MODEL, tensors=[pb.TensorRequest(name="c", ranges=[pb.ByteRange(start=8, end=24)])]
        ).SerializeToString(),
        "GetManifest": pb.GetManifestRequest(model=MODEL).SerializeToString(),
        "ListModelFiles": pb.ListModelFilesRequest(model=MODEL).SerializeToString(),
        "ReadModelFile": pb.ReadModelFileRequest(model=MODEL, file="model.safetensors").SerializeToString(),
    }
    calls = {
        method: raw_channel.unary_stream(SERVICE + method, request_serializer=None, response_deserializer=None)
        for method in valid
    }
    counts: Counter[str] = Counter()

    @FUZZ
    @given(method=st.sampled_from(sorted(valid)), how=st.sampled_from(["random", "mutated"]), data=st.data())
    def run(method: str, how: str, data: Any) -> None:
        counts["cases"] += 1
        payload = data.draw(st.binary(max_size=256)) if how == "random" else data.draw(mutated(valid[method]))
        code, details, _ = outcome(lambda: list(calls[method](payload, timeout=CALL_TIMEOUT_S)))
        if code == Code.INVALID_ARGUMENT and "is not a valid weightstream.v1." in details:
            counts["malformed"] += 1
        check_code(counts, code, details, REQUEST_CODES)

    try:
        run()
    finally:
        record_counts(
            counts,
            request_cases="cases",
            crashes="crashes",
            unexpected_codes="unexpected",
            malformed_protobuf_refused="malformed",
        )
    assert counts["cases"] > 0


@pytest.fixture(scope="module", autouse=True)
def figures() -> Any:
    """Which profile the figures of this module come from."""
    record("fuzz", profile=PROFILE)
    yield
