"""Hostile and heavy model.safetensors.index.json files: bounded before parsing, parsed once per version.

An index of too many JSON items is refused unparsed, like a header of too many items; an index that
is a directory, nested too deeply or holding a number too long to convert is DATA_LOSS naming the
model and the file, logged as one line with no traceback. A large valid index costs one parse per
version of the file, not one per request: parses are counted by wrapping index.parse_index in
this process, where the server runs.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tests.support.checkpoints import received, write_raw_safetensors
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.storage import index, local

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CALL_TIMEOUT_S = 60.0
# More items than any real index holds (the largest open checkpoints list about 100,000 tensors).
TOO_MANY_ITEMS = 600_000
LARGE_TENSORS = 20_000


def byte_tensors(folder: Path, count: int) -> None:
    """WEIGHTS in folder: count one-byte U8 tensors t.0 ... (byte i is i % 256)."""
    header: dict[str, object] = {
        f"t.{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(count)
    }
    write_raw_safetensors(folder / WEIGHTS, header, bytes(i % 256 for i in range(count)))


def index_of(count: int) -> bytes:
    return json.dumps(
        {"metadata": {"total_size": count}, "weight_map": {f"t.{i}": WEIGHTS for i in range(count)}}
    ).encode()


def manifest_error(stub: pb_grpc.WeightStreamServiceStub, model: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S)
    return info.value


def rpc_errors(stub: pb_grpc.WeightStreamServiceStub, model: str) -> dict[str, grpc.RpcError]:
    """The error of each RPC that reads the model's index: GetManifest, ListModelFiles, ReadModelFile."""
    calls: dict[str, Callable[[], object]] = {
        "GetManifest": lambda: stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S),
        "ListModelFiles": lambda: stub.ListModelFiles(pb.ListModelFilesRequest(model=model), timeout=CALL_TIMEOUT_S),
        "ReadModelFile": lambda: list(
            stub.ReadModelFile(pb.ReadModelFileRequest(model=model, file=WEIGHTS), timeout=CALL_TIMEOUT_S)
        ),
    }
    errors = {}
    for rpc, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        errors[rpc] = info.value
    return errors


def assert_logged_without_traceback(caplog: pytest.LogCaptureFixture, count: int) -> None:
    lines = [r for r in caplog.records if r.name == "weightstream_server.transports.rpc"]
    assert len(lines) == count, [r.getMessage() for r in lines]
    assert not [r for r in lines if r.exc_info]
    assert "Traceback" not in caplog.text
    assert "internal error" not in caplog.text


@pytest.mark.slow
def test_an_index_of_too_many_items_is_refused_unparsed(stub: pb_grpc.WeightStreamServiceStub, root: Path) -> None:
    folder = root / "too-many"
    byte_tensors(folder, 10)
    raw = index_of(TOO_MANY_ITEMS)
    assert len(raw) < 32 * 1024 * 1024
    (folder / INDEX).write_bytes(raw)
    started = time.monotonic()
    error = manifest_error(stub, "too-many")
    assert time.monotonic() - started < 2.0, "the index was parsed (about 4 s here) rather than refused"
    details = error.details() or ""
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert f"model 'too-many': {INDEX} holds" in details and "JSON items, more than" in details, details


def test_a_large_index_is_parsed_once_per_version(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = root / "large-index"
    byte_tensors(folder, LARGE_TENSORS)
    (folder / INDEX).write_bytes(index_of(LARGE_TENSORS))
    parses: list[str] = []
    original = index.parse_index

    def counted(model: str, raw: bytes) -> dict[str, str]:
        parses.append(model)
        return original(model, raw)

    monkeypatch.setattr(local, "parse_index", counted)
    for _ in range(3):
        manifest = stub.GetManifest(pb.GetManifestRequest(model="large-index"), timeout=CALL_TIMEOUT_S)
        assert len(manifest.tensors) == LARGE_TENSORS
    listing = stub.ListModelFiles(pb.ListModelFilesRequest(model="large-index"), timeout=CALL_TIMEOUT_S)
    assert {f.name for f in listing.files} == {WEIGHTS, INDEX}
    request = pb.StreamTensorsRequest(model="large-index", tensors=[pb.TensorRequest(name="t.300")])
    assert received(stub.StreamTensors(request, timeout=CALL_TIMEOUT_S)) == (grpc.StatusCode.OK, {"t.300": b"\x2c"})
    assert parses == ["large-index"], f"{len(parses)} parses of one version of the index"
    # A new version of the index (the same bytes written again: a new modification time) is parsed again.
    before = (folder / INDEX).stat()
    (folder / INDEX).write_bytes(index_of(LARGE_TENSORS))
    os.utime(folder / INDEX, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    stub.GetManifest(pb.GetManifestRequest(model="large-index"), timeout=CALL_TIMEOUT_S)
    assert parses == ["large-index"] * 2


BROKEN_INDEXES: dict[str, tuple[bytes | None, str]] = {
    "directory": (None, "is not a regular file"),
    "nested-lists": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "nested-objects": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    "long-number": (b'{"weight_map": {}, "n": ' + b"7" * 5000 + b"}", "is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_INDEXES))
def test_a_broken_index_is_data_loss_logged_in_one_line(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="weightstream_server")
    model = f"broken-index-{case}"
    folder = root / model
    byte_tensors(folder, 4)
    raw, message = BROKEN_INDEXES[case]
    if raw is None:
        (folder / INDEX).mkdir()
    else:
        (folder / INDEX).write_bytes(raw)
    errors = rpc_errors(stub, model)
    for rpc, error in errors.items():
        details = error.details() or ""
        assert error.code() == grpc.StatusCode.DATA_LOSS, (rpc, details)
        assert f"model '{model}': {INDEX}" in details and message in details, (rpc, details)
    assert_logged_without_traceback(caplog, len(errors))
