"""Wire-format helpers shared by the server and the client: dtypes, checksums, chunk sizes.

Both sides import this module, so that a dtype, a checksum or a chunk boundary is defined once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import google_crc32c
import torch

from weightstream.v1 import weightstream_pb2 as pb

# Payload bytes per chunk. 1 to 4 MiB messages move fastest over gRPC here; 16 MiB and more are
# slower because each message is buffered whole on both sides.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 16 * 1024 * 1024
# Room in a gRPC message for everything but the payload (names, offsets, framing), so that a
# message of several small chunks still fits under the channel's limit.
MESSAGE_OVERHEAD_BYTES = 1024 * 1024
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + MESSAGE_OVERHEAD_BYTES


@dataclass(frozen=True)
class DType:
    """One element type as each layer spells it."""

    safetensors: str
    wire: int
    torch: torch.dtype
    itemsize: int


_DTYPES: tuple[DType, ...] = (
    DType("BOOL", pb.DATA_TYPE_BOOL, torch.bool, 1),
    DType("U8", pb.DATA_TYPE_UINT8, torch.uint8, 1),
    DType("I8", pb.DATA_TYPE_INT8, torch.int8, 1),
    DType("I16", pb.DATA_TYPE_INT16, torch.int16, 2),
    DType("U16", pb.DATA_TYPE_UINT16, torch.uint16, 2),
    DType("I32", pb.DATA_TYPE_INT32, torch.int32, 4),
    DType("U32", pb.DATA_TYPE_UINT32, torch.uint32, 4),
    DType("I64", pb.DATA_TYPE_INT64, torch.int64, 8),
    DType("U64", pb.DATA_TYPE_UINT64, torch.uint64, 8),
    DType("F16", pb.DATA_TYPE_FLOAT16, torch.float16, 2),
    DType("BF16", pb.DATA_TYPE_BFLOAT16, torch.bfloat16, 2),
    DType("F32", pb.DATA_TYPE_FLOAT32, torch.float32, 4),
    DType("F64", pb.DATA_TYPE_FLOAT64, torch.float64, 8),
    DType("F8_E4M3", pb.DATA_TYPE_FLOAT8_E4M3FN, torch.float8_e4m3fn, 1),
    DType("F8_E5M2", pb.DATA_TYPE_FLOAT8_E5M2, torch.float8_e5m2, 1),
)
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _DTYPES}
BY_WIRE: dict[int, DType] = {d.wire: d for d in _DTYPES}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in _DTYPES}


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of data, as TensorChunk.crc32c carries it."""
    return int(google_crc32c.value(data))


def clamp_chunk_bytes(requested: int) -> int:
    """The chunk size a request gets: the default for 0, otherwise within the allowed bounds."""
    if requested <= 0:
        return DEFAULT_CHUNK_BYTES
    return max(MIN_CHUNK_BYTES, min(requested, MAX_CHUNK_BYTES))


def split_range(start: int, end: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Cut [start, end) into (offset, length) pieces of at most chunk_bytes each."""
    offset = start
    while offset < end:
        length = min(chunk_bytes, end - offset)
        yield offset, length
        offset += length


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a shape (1 for a 0-dim tensor)."""
    count = 1
    for dim in shape:
        count *= dim
    return count


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Field tags of TensorChunk and StreamTensorsResponse (field number << 3 | wire type).
_TAG_TENSOR = b"\x0a"  # 1, length-delimited
_TAG_OFFSET = b"\x10"  # 2, varint
_TAG_CRC32C = b"\x18"  # 3, varint
_TAG_LENGTH = b"\x20"  # 4, varint
_TAG_DATA = b"\x7a"  # 15, length-delimited
_TAG_CHUNKS = b"\x0a"  # StreamTensorsResponse.chunks, 1, length-delimited


def encode_stream_response(chunks: list[tuple[str, int, int, bytes]]) -> bytes:
    """Serialize a StreamTensorsResponse of (tensor, offset, crc32c, data) chunks.

    The bytes are exactly what protobuf's SerializeToString gives for the same message (a test
    checks this); building them here copies each payload once, into the message, where going
    through a protobuf object copies it twice (into the object, then out of it).
    """
    parts: list[bytes] = []
    for tensor, offset, crc, data in chunks:
        name = tensor.encode()
        head = bytearray()
        if name:
            head += _TAG_TENSOR + _varint(len(name)) + name
        if offset:
            head += _TAG_OFFSET + _varint(offset)
        if crc:
            head += _TAG_CRC32C + _varint(crc)
        if data:
            head += _TAG_LENGTH + _varint(len(data)) + _TAG_DATA + _varint(len(data))
        parts.append(_TAG_CHUNKS + _varint(len(head) + len(data)) + bytes(head))
        parts.append(data)
    return b"".join(parts)
