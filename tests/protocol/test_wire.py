"""The shared wire helpers: dtype table, chunk splitting, hand-built messages, landed ranges."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import _TYPES as SAFETENSORS_TYPES  # the dtype spellings safetensors writes

from weightstream.client.ranges import RangeSet
from weightstream.protocol import dtypes, framing, wire
from weightstream.v1 import weightstream_pb2 as pb


@pytest.mark.parametrize(
    "chunks",
    [
        [("a", 0, 0, b"")],
        [("model.layers.0.w", 0, 123, b"xyz")],
        [("t", 2**40 + 5, 2**32 - 1, bytes(range(256)) * 700), ("", 1, 1, b"\x00")],
        [(f"n{i}", i * 300, i, bytes([i % 256]) * i) for i in range(200)],
        [("ünïcode", 7, 9, b"\x01\x02")],
    ],
)
def test_encoded_response_equals_protobuf(chunks: list[tuple[str, int, int, bytes]]) -> None:
    message = pb.StreamTensorsResponse(
        chunks=[pb.TensorChunk(tensor=t, offset=o, crc32c=c, length=len(d), data=d) for t, o, c, d in chunks]
    )
    encoded = framing.encode_response(chunks)
    assert encoded == message.SerializeToString()
    assert pb.StreamTensorsResponse.FromString(encoded) == message
    decoded = framing.decode_response(encoded)
    assert [(c.tensor, c.offset, c.crc32c, c.length, encoded[c.data_start : c.data_start + c.data_length])
            for c in decoded] == [(t, o, c, len(d), d) for t, o, c, d in chunks]  # fmt: skip


def test_decoder_skips_unknown_fields_and_reads_protobuf_output() -> None:
    """A later field (a shared-memory slot, say) must not break today's decoder."""
    chunk = pb.TensorChunk(tensor="w", offset=5, crc32c=7, length=3, data=b"abc")
    extra = b"\x30\x2a" + b"\x4a\x03xyz" + b"\x2d\x01\x00\x00\x00"  # varint 6, bytes 9, fixed32 5
    message = b"\x0a" + bytes([len(chunk.SerializeToString()) + len(extra)]) + chunk.SerializeToString() + extra
    (decoded,) = framing.decode_response(message + b"\x12\x00")  # and an unknown field 2 of the response
    assert (decoded.tensor, decoded.offset, decoded.crc32c, decoded.length) == ("w", 5, 7, 3)
    assert message[decoded.data_start : decoded.data_start + decoded.data_length] == b"abc"


@pytest.mark.parametrize(
    "message",
    [b"\x0a\x10abc", b"\x0a\x05\x7a\x10ab", b"\x0a\x02\x0a\x09", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
     b"\x0b", b"\x0a\x03\x0a\x01\xff"],
)  # fmt: skip
def test_decoder_refuses_malformed_messages(message: bytes) -> None:
    with pytest.raises(framing.FramingError):
        framing.decode_response(message)


def _crc32c_bitwise(data: bytes) -> int:
    """CRC32C by its definition (reflected polynomial 0x82F63B78), one bit at a time."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_is_castagnolis_over_bytes_and_raw_memory() -> None:
    import ctypes
    import os

    assert wire.crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    data = os.urandom(3_001)
    assert wire.crc32c(data) == _crc32c_bitwise(data)
    address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    assert wire.crc32c_at(address, len(data)) == wire.crc32c(data)
    assert wire.crc32c_at(address + 10, 500) == _crc32c_bitwise(data[10:510])
    assert wire.crc32c_at(address + 510, 1000, wire.crc32c(data[:510])) == wire.crc32c(data[:1510])
    assert wire.crc32c_extend(wire.crc32c(data[:7]), data[7:]) == wire.crc32c(data)
    assert wire.crc32c_at(address, 0, 1234) == 1234


@pytest.mark.parametrize("split", [0, 1, 4095, 65536, 100_000])
def test_crc32c_combine_gives_the_crc32c_of_the_two_runs_back_to_back(split: int) -> None:
    data = random.Random(split).randbytes(100_000)
    first, second = data[:split], data[split:]
    assert wire.crc32c_combine(wire.crc32c(first), wire.crc32c(second), len(second)) == wire.crc32c(data)


@pytest.mark.parametrize(
    "length", [0, 1, wire.CACHE_PIECE_BYTES - 1, wire.CACHE_PIECE_BYTES, 3 * wire.CACHE_PIECE_BYTES + 12_345]
)
def test_copy_crc32c_copies_exactly_and_checksums_what_landed(length: int) -> None:
    import os

    source = torch.frombuffer(bytearray(os.urandom(length + 2)), dtype=torch.uint8)
    destination = torch.full((length + 64,), 0xAB, dtype=torch.uint8)
    crc = wire.copy_crc32c(destination.data_ptr() + 32, source.data_ptr() + 1, length)
    assert crc == wire.crc32c(bytes(source[1 : length + 1].numpy()))
    assert torch.equal(destination[32 : 32 + length], source[1 : length + 1])
    # Not a byte outside the range.
    assert bool((destination[:32] == 0xAB).all()) and bool((destination[32 + length :] == 0xAB).all())


def test_dtype_table_covers_safetensors_spellings_torch_holds() -> None:
    for code, dtype in SAFETENSORS_TYPES.items():
        if code in dtypes.BY_SAFETENSORS:
            assert dtypes.BY_SAFETENSORS[code].torch == dtype, code
    for entry in dtypes.BY_SAFETENSORS.values():
        assert torch.empty((), dtype=entry.torch).element_size() == entry.itemsize
        assert dtypes.BY_WIRE[entry.wire] is entry and dtypes.BY_TORCH[entry.torch] is entry
    assert len(dtypes.BY_WIRE) == len(pb.DataType.values()) - 1  # every enum value but UNSPECIFIED


def test_split_range_and_clamp() -> None:
    assert list(wire.split_range(10, 35, 10)) == [(10, 10), (20, 10), (30, 5)]
    assert list(wire.split_range(5, 5, 10)) == []
    assert wire.clamp_chunk_bytes(0) == wire.DEFAULT_CHUNK_BYTES
    assert wire.clamp_chunk_bytes(1 << 30) == wire.MAX_CHUNK_BYTES
    assert wire.clamp_chunk_bytes(1) == wire.MIN_CHUNK_BYTES


def test_range_set_merges_out_of_order_and_repeated_ranges() -> None:
    ranges = RangeSet(100)
    assert ranges.add(50, 60) == 10
    assert ranges.add(0, 10) == 10
    assert ranges.missing() == [(10, 50), (60, 100)]
    assert ranges.add(5, 55) == 40  # overlaps both: only the gap is new
    assert ranges.add(0, 60) == 0  # re-sent bytes count once
    assert not ranges.complete
    assert ranges.add(60, 100) == 40
    assert ranges.complete and ranges.missing() == []
    with pytest.raises(ValueError, match="outside"):
        ranges.add(90, 101)


@pytest.mark.parametrize("length", [0, 1, 4095, 4096, 4097, 3 * 4096])
def test_crc32c_of_range_reads_in_blocks_and_stops_at_a_short_read(length: int) -> None:
    data = bytes(random.Random(length).randrange(256) for _ in range(5 * 4096))
    asked: list[tuple[int, int]] = []

    def read_at(start: int, size: int) -> bytes:
        asked.append((start, size))
        return data[start : start + size]

    crc, read = wire.crc32c_of_range(read_at, 7, length, block_bytes=4096)
    assert (crc, read) == (wire.crc32c(data[7 : 7 + length]), length)
    assert all(size <= 4096 for _, size in asked)
    # A source shorter than asked: the bytes it had, and how many.
    crc, read = wire.crc32c_of_range(read_at, len(data) - 100, length + 100, block_bytes=4096)
    assert read == min(length + 100, 100)
    assert crc == wire.crc32c(data[len(data) - 100 :][:read])
