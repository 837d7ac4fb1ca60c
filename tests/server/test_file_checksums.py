"""The whole-file CRC32C of a ReadModelFile does not cost a read of the whole file on every call.

A file read from an offset ends with the CRC32C of the whole file (so that a resumed download checks
the bytes it already had). The server computes it once per version of a file and keeps it: a read
of the last byte of a large file then reads about one byte, not the file. Bytes read are counted
twice: by the server's own counter (GET /status storage_bytes_read_total) and by the kernel
(/proc/self/io rchar: every byte this process, where the server runs, read with read() or pread()).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.servers import Running, running
from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

MIB = 1024 * 1024
FILE_BYTES = 32 * MIB
WEIGHTS = "model.safetensors"
# What a read of the last byte may cost: the byte, and small reads of the model's headers and listing.
SMALL_READ = MIB


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Running, pb_grpc.WeightStreamServiceStub, Path]]:
    path = tmp_path / "big" / WEIGHTS
    path.parent.mkdir()
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + os.urandom(FILE_BYTES - 16))
    with running(tmp_path) as r, grpc.insecure_channel(r.target) as channel:
        yield r, pb_grpc.WeightStreamServiceStub(channel), path


def kernel_bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def read_from(r: Running, stub: pb_grpc.WeightStreamServiceStub, offset: int) -> tuple[int, int, int, bytes]:
    """(file CRC32C, bytes the server says it read, bytes the kernel says this process read, data) of one read."""
    counted = r.get("/status").json()["storage_bytes_read_total"]
    kernel = kernel_bytes_read()
    request = pb.ReadModelFileRequest(model="big", file=WEIGHTS, offset=offset)
    pieces = list(stub.ReadModelFile(request, timeout=60))
    kernel = kernel_bytes_read() - kernel
    counted = r.get("/status").json()["storage_bytes_read_total"] - counted
    assert pieces[-1].HasField("file_crc32c")
    return pieces[-1].file_crc32c, counted, kernel, b"".join(p.data for p in pieces)


def test_reading_the_last_byte_again_reads_about_one_byte(
    served: tuple[Running, pb_grpc.WeightStreamServiceStub, Path],
) -> None:
    r, stub, path = served
    whole = wire.crc32c(path.read_bytes())
    crc, counted, kernel, data = read_from(r, stub, FILE_BYTES - 1)
    assert (crc, data) == (whole, path.read_bytes()[-1:])
    assert counted >= FILE_BYTES and kernel >= FILE_BYTES, "the first read computes the checksum from the file"
    for offset in (FILE_BYTES - 1, FILE_BYTES, FILE_BYTES - 4096):
        crc, counted, kernel, data = read_from(r, stub, offset)
        assert (crc, data) == (whole, path.read_bytes()[offset:])
        assert counted == FILE_BYTES - offset, f"the server counted {counted} bytes read for a read from {offset}"
        assert kernel < SMALL_READ, f"{kernel} bytes were read for a read from {offset}"


def test_a_changed_file_gets_its_own_checksum(
    served: tuple[Running, pb_grpc.WeightStreamServiceStub, Path],
) -> None:
    r, stub, path = served
    read_from(r, stub, FILE_BYTES - 1)
    before = path.stat()
    with path.open("r+b") as f:
        f.seek(FILE_BYTES // 2)
        f.write(b"changed")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    crc, _, kernel, _ = read_from(r, stub, FILE_BYTES - 1)
    assert crc == wire.crc32c(path.read_bytes())
    assert kernel >= FILE_BYTES


def test_reads_from_an_offset_cancelled_after_one_piece_read_the_prefix_once(
    served: tuple[Running, pb_grpc.WeightStreamServiceStub, Path],
) -> None:
    """The attack: ask for the tail of a large file, take one piece, cancel, again and again."""
    r, stub, path = served
    counted = r.get("/status").json()["storage_bytes_read_total"]
    kernel = kernel_bytes_read()
    for _ in range(4):
        request = pb.ReadModelFileRequest(model="big", file=WEIGHTS, offset=FILE_BYTES // 2, max_chunk_bytes=64 * 1024)
        call = stub.ReadModelFile(request, timeout=60)
        next(call)
        call.cancel()
    kernel = kernel_bytes_read() - kernel
    counted = r.get("/status").json()["storage_bytes_read_total"] - counted
    # One read of the whole file for its checksum, then only what each call sends and reads ahead.
    assert FILE_BYTES <= counted < FILE_BYTES + 4 * SMALL_READ, counted
    assert kernel < 2 * FILE_BYTES, kernel
    crc, counted, _, data = read_from(r, stub, FILE_BYTES - 1)
    assert (crc, data, counted) == (wire.crc32c(path.read_bytes()), path.read_bytes()[-1:], 1)
