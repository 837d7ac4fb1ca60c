"""Headers and indexes are parsed once per file version: concurrent requests share a parse, failures are kept."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.support.checkpoints import write_raw_safetensors
from tests.support.s3_stores import S3_BUCKET, S3Process, upload_folder
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import WeightStreamServer
from weightstream_server.errors import CorruptCheckpoint, StorageUnavailable
from weightstream_server.storage.parse_once import ParseOnce

CALL_TIMEOUT_S = 30
CALLERS = 4


def bad_header_model(folder: Path) -> None:
    """A header of many valid entries and one whose dtype is no dtype: it fails only when parsed whole."""
    header: dict[str, object] = {
        f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(20_000)
    }
    header["broken"] = {"dtype": "NOPE", "shape": [1], "data_offsets": [80_000, 80_004]}
    write_raw_safetensors(folder / "model.safetensors", header, bytes(80_004))


def manifests_at_once(stub: pb_grpc.WeightStreamServiceStub, model: str) -> list[grpc.StatusCode]:
    def call() -> grpc.StatusCode:
        try:
            stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    with futures.ThreadPoolExecutor(CALLERS) as pool:
        return list(pool.map(lambda _: call(), range(CALLERS)))


def test_a_bad_header_is_parsed_once_for_every_request_until_the_file_changes(
    root: Path, root_server: WeightStreamServer, stub: pb_grpc.WeightStreamServiceStub
) -> None:
    bad_header_model(root / "bad")
    headers = root_server.catalog.headers
    before = headers.parses
    assert manifests_at_once(stub, "bad") == [grpc.StatusCode.DATA_LOSS] * CALLERS
    assert manifests_at_once(stub, "bad") == [grpc.StatusCode.DATA_LOSS] * CALLERS
    assert headers.parses - before == 1, "one parse for eight requests of one file version"
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetManifest(pb.GetManifestRequest(model="bad"), timeout=CALL_TIMEOUT_S)
    assert "'broken'" in (raised.value.details() or ""), raised.value.details()
    # A new version of the file (rewritten, mended) is parsed again, and served.
    path = root / "bad" / "model.safetensors"
    save_file({"fixed": torch.ones(3)}, str(path))
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9, path.stat().st_mtime_ns + 10**9))
    manifest = stub.GetManifest(pb.GetManifestRequest(model="bad"), timeout=CALL_TIMEOUT_S)
    assert [t.name for t in manifest.tensors] == ["fixed"]
    assert headers.parses - before == 2


def test_callers_of_one_version_share_one_parse_and_others_do_not_wait() -> None:
    once: ParseOnce[int] = ParseOnce(max_weight=10, keep_results=False)
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow() -> int:
        calls.append("v1")
        started.set()
        assert release.wait(10)
        return 42

    with futures.ThreadPoolExecutor(CALLERS + 1) as pool:
        waiting = [pool.submit(once.get, "f", "v1", slow) for _ in range(CALLERS)]
        assert started.wait(10)
        # Another version of the file, or another file, is not held up by the parse in flight.
        assert once.get("f", "v2", lambda: 7) == 7
        release.set()
        assert [w.result(10) for w in waiting] == [42] * CALLERS
    assert calls == ["v1"]
    assert once.get("f", "v1", lambda: 43) == 43, "results are not kept unless asked for"


def failing(error: Exception) -> Callable[[], int]:
    def parse() -> int:
        raise error

    return parse


def test_only_content_errors_are_remembered() -> None:
    once: ParseOnce[int] = ParseOnce(max_weight=10, keep_results=True)
    with pytest.raises(StorageUnavailable):
        once.get("f", "v1", failing(StorageUnavailable("store down")))
    assert once.get("f", "v1", lambda: 5) == 5  # the outage said nothing of the file: parsed again
    assert once.get("f", "v1", lambda: 6) == 5  # and the result is kept
    with pytest.raises(CorruptCheckpoint, match="bad json"):
        once.get("g", "v1", failing(CorruptCheckpoint("bad json")))
    with pytest.raises(CorruptCheckpoint, match="bad json"):
        once.get("g", "v1", lambda: 1)
    assert once.parses == 3


@pytest.mark.slow
def test_an_s3_index_is_parsed_once_per_etag(
    s3_store: S3Process, s3_server: WeightStreamServer, model_root: Path, tmp_path: Path
) -> None:
    from weightstream.samples import llama_like_state_dict, save_sharded

    save_sharded(llama_like_state_dict(layers=1, hidden=64, intermediate=128, vocab=128), tmp_path / "m", shards=2)
    upload_folder(s3_store.client(), tmp_path / "m", S3_BUCKET, "parse-once/indexed")
    (source,) = [s for s in s3_server.catalog.sources if s.describe() == f"s3://{S3_BUCKET}"]
    indexes = source._indexes  # type: ignore[attr-defined]
    before = indexes.parses
    with grpc.insecure_channel(f"127.0.0.1:{s3_server.port}") as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        for _ in range(3):
            stub.GetManifest(
                pb.GetManifestRequest(model=f"s3://{S3_BUCKET}/parse-once/indexed"), timeout=CALL_TIMEOUT_S
            )
    assert indexes.parses - before == 1
