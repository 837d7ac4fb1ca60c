"""A checkpoint changed on disk while a stream reads it is never served mixed with OK.

A stream either ends FAILED_PRECONDITION (naming the model and the file) or sends bytes of one
version only, bit for bit: the server holds each file open for the stream's reads, so a file
replaced by rename is still read whole from the old version, and it compares the file's size and
times at the end of its reads with those the manifest recorded, so a rewrite in place is caught
before the stream ends. Every change is real: files rewritten or renamed on disk while a client
that reads slowly holds the stream in flight. The shared-memory transport's direct reads (the
kernel reads into the ring's slots) are checked through reader.DirectReader on real files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from tests.support.checkpoints import pattern_tensors, received, write_pattern_file
from tests.support.servers import loopback_settings
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import ServerSettings
from weightstream_server.errors import ServerError, status_code
from weightstream_server.serving.catalog import Catalog
from weightstream_server.serving.read_plan import plan_reads
from weightstream_server.serving.reader import DirectReader
from weightstream_server.storage.local import LocalSource

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
OLD = b"old-version-"
NEW = b"NEW-VERSION-"
# Six read units of 16 MiB against a read-ahead of one: most of the file is read after the change.
FILE_BYTES = 96 * MIB
CALL_TIMEOUT_S = 60.0
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def root_settings(root: Path) -> ServerSettings:
    return loopback_settings(model_root=root, read_ahead_bytes=16 * MIB)


def write_old(root: Path, model: str) -> Path:
    path = root / model / WEIGHTS
    write_pattern_file(path, OLD, FILE_BYTES, tensors=4)
    return path


def rewrite_in_place(path: Path) -> Callable[[], None]:
    """The same file (inode), the same size, other bytes."""

    def rewrite() -> None:
        other = path.with_name("other.bin")
        write_pattern_file(other, NEW, FILE_BYTES, tensors=4)
        data = other.read_bytes()
        other.unlink()
        with path.open("r+b") as f:
            f.write(data)

    return rewrite


def replace_by_rename(path: Path) -> Callable[[], None]:
    """Another file of the same size and layout renamed over the name (how most tools write)."""

    def replace() -> None:
        other = path.with_name(f".{path.name}.new")
        write_pattern_file(other, NEW, FILE_BYTES, tensors=4)
        os.replace(other, path)

    return replace


CHANGES = {"rewritten-in-place": rewrite_in_place, "replaced-by-rename": replace_by_rename}


def assert_one_version(code: grpc.StatusCode, got: dict[str, bytes], old: dict[str, bytes]) -> None:
    if code == grpc.StatusCode.OK:
        assert got == old, "the stream ended OK with bytes that are not the old version's, bit for bit"
    else:
        assert code == grpc.StatusCode.FAILED_PRECONDITION, code


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_stream_over_a_changing_file_fails_or_sends_one_version(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, change: str
) -> None:
    model = f"stream-{change}"
    path = write_old(root, model)
    old = pattern_tensors(path)
    revision = stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S).revision
    request = pb.StreamTensorsRequest(model=model, max_chunk_bytes=MIB, revision=revision)
    code, got = received(stub.StreamTensors(request, timeout=CALL_TIMEOUT_S), between=CHANGES[change](path))
    assert_one_version(code, got, old)
    # The next manifest describes the new version, which then streams whole.
    manifest = stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S)
    assert manifest.revision != revision
    again = pb.StreamTensorsRequest(model=model, max_chunk_bytes=MIB, revision=manifest.revision)
    assert received(stub.StreamTensors(again, timeout=CALL_TIMEOUT_S)) == (grpc.StatusCode.OK, pattern_tensors(path))


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_file_read_over_a_changing_file_fails_or_sends_one_version(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, change: str
) -> None:
    model = f"read-{change}"
    path = write_old(root, model)
    old = {"": path.read_bytes()}
    request = pb.ReadModelFileRequest(model=model, file=WEIGHTS, max_chunk_bytes=256 * 1024)
    code, got = received(stub.ReadModelFile(request, timeout=CALL_TIMEOUT_S), between=CHANGES[change](path))
    assert_one_version(code, got, old)


def test_direct_reads_of_a_file_rewritten_meanwhile_fail_failed_precondition(tmp_path: Path) -> None:
    """The shared-memory transport's direct reads: a rewrite in place while the reads run ends the reads
    FAILED_PRECONDITION, naming the model and the file."""
    path = write_old(tmp_path, "direct")
    catalog = Catalog([LocalSource(tmp_path)])
    manifest = catalog.manifest("direct")
    plan = plan_reads(manifest, [], 4 * MIB)
    buffer = torch.zeros(FILE_BYTES, dtype=torch.uint8)
    rewrite = rewrite_in_place(path)
    with pytest.raises(ServerError) as info:
        with DirectReader(manifest, plan, lambda n: None, threads=2) as reader:
            for index, read in enumerate(reader.reads()):
                crc = read.start(buffer.data_ptr() + index * 4 * MIB)
                if not isinstance(crc, int):
                    crc.result()
                if index == 0:
                    rewrite()
    assert status_code(info.value) == grpc.StatusCode.FAILED_PRECONDITION, info.value
    assert "model 'direct'" in str(info.value)
    assert WEIGHTS in str(info.value)
