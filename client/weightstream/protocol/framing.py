"""Framing of StreamTensorsResponse messages by hand, on both sides of the data path.

The bytes are exactly protobuf's encoding of weightstream.v1.StreamTensorsResponse (tests check
both directions against the protobuf library), so the proto stays the contract; only the data path
skips protobuf objects, which would copy every payload into the object and out again.

Server: encode_chunk frames one TensorChunk around its payload (one copy of the payload, into the
message). Client: decode_response finds each chunk's fields and where its payload lies inside the
received message, so the payload is checksummed and placed straight from the message's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

# Field keys (field number << 3 | wire type) of TensorChunk and StreamTensorsResponse.
_KEY_TENSOR = 0x0A  # 1, length-delimited
_KEY_OFFSET = 0x10  # 2, varint
_KEY_CRC32C = 0x18  # 3, varint
_KEY_LENGTH = 0x20  # 4, varint
_KEY_ENCODING = 0x38  # 7, varint
_KEY_ENCODED_LENGTH = 0x40  # 8, varint
_KEY_DATA = 0x7A  # 15, length-delimited
_KEY_CHUNKS = 0x0A  # StreamTensorsResponse.chunks: 1, length-delimited
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class FramingError(ValueError):
    """A received message is not a well-formed StreamTensorsResponse."""


@dataclass(frozen=True)
class RawChunk:
    """One TensorChunk of a received message; its payload is message[data_start : data_start + data_length]."""

    tensor: str
    offset: int
    crc32c: int
    length: int
    data_start: int
    data_length: int
    # ChunkEncoding; for an encoded chunk the payload is its encoded_length bytes.
    encoding: int = 0
    encoded_length: int = 0


def varint(value: int) -> bytes:
    """value as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(
    tensor: str, offset: int, crc32c: int, data: bytes | memoryview, *, length: int | None = None, encoding: int = 0
) -> bytes:
    """One `chunks` entry of a StreamTensorsResponse, payload included; entries concatenate into a message.

    data may be any buffer (a view of a reused read buffer); it is copied once, into the result.
    An encoded chunk (encoding set) carries length, the bytes it stands for, and data as its payload.
    """
    name = tensor.encode()
    size = len(data)
    length = size if length is None else length
    head = bytearray()
    if name:
        head += bytes([_KEY_TENSOR]) + varint(len(name)) + name
    if offset:
        head += bytes([_KEY_OFFSET]) + varint(offset)
    if crc32c:
        head += bytes([_KEY_CRC32C]) + varint(crc32c)
    if length:
        head += bytes([_KEY_LENGTH]) + varint(length)
    if encoding:
        head += bytes([_KEY_ENCODING]) + varint(encoding) + bytes([_KEY_ENCODED_LENGTH]) + varint(size)
    if size:
        head += bytes([_KEY_DATA]) + varint(size)
    return b"".join((bytes([_KEY_CHUNKS]) + varint(len(head) + size) + bytes(head), data))


def encode_response(chunks: list[tuple[str, int, int, bytes]]) -> bytes:
    """A whole StreamTensorsResponse of (tensor, offset, crc32c, data) chunks."""
    return b"".join(encode_chunk(*chunk) for chunk in chunks)


def decode_response(message: bytes) -> list[RawChunk]:
    """The chunks of a serialized StreamTensorsResponse, without copying their payloads.

    Unknown fields are skipped, as protobuf does, so that later fields (a shared-memory slot)
    can be added without breaking this reader. Every length is checked against the message.
    """
    chunks = []
    position, end = 0, len(message)
    while position < end:
        key, position = _read_varint(message, position, end)
        if key == _KEY_CHUNKS:
            size, position = _read_varint(message, position, end)
            if size > end - position:
                raise FramingError("a chunk runs past the end of the message")
            chunks.append(_decode_chunk(message, position, position + size))
            position += size
        else:
            position = _skip(message, key, position, end)
    return chunks


def _decode_chunk(message: bytes, position: int, end: int) -> RawChunk:
    tensor, offset, crc, length, data_start, data_length = "", 0, 0, 0, position, 0
    encoding = encoded_length = 0
    while position < end:
        key, position = _read_varint(message, position, end)
        if key == _KEY_TENSOR:
            size, position = _read_varint(message, position, end)
            if size > end - position:
                raise FramingError("a tensor name runs past the end of its chunk")
            try:
                tensor = message[position : position + size].decode()
            except UnicodeDecodeError as exc:
                raise FramingError("a tensor name is not UTF-8") from exc
            position += size
        elif key == _KEY_OFFSET:
            offset, position = _read_varint(message, position, end)
        elif key == _KEY_CRC32C:
            crc, position = _read_varint(message, position, end)
        elif key == _KEY_LENGTH:
            length, position = _read_varint(message, position, end)
        elif key == _KEY_ENCODING:
            encoding, position = _read_varint(message, position, end)
        elif key == _KEY_ENCODED_LENGTH:
            encoded_length, position = _read_varint(message, position, end)
        elif key == _KEY_DATA:
            data_length, position = _read_varint(message, position, end)
            if data_length > end - position:
                raise FramingError("a payload runs past the end of its chunk")
            data_start = position
            position += data_length
        else:
            position = _skip(message, key, position, end)
    if crc > 0xFFFFFFFF:
        raise FramingError("a crc32c does not fit 32 bits")
    return RawChunk(tensor, offset, crc, length, data_start, data_length, encoding, encoded_length)


def _read_varint(message: bytes, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= end or shift > 63:
            raise FramingError("truncated or overlong varint")
        byte = message[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _skip(message: bytes, key: int, position: int, end: int) -> int:
    wire_type = key & 7
    if wire_type == _VARINT:
        return _read_varint(message, position, end)[1]
    if wire_type == _FIXED64:
        position += 8
    elif wire_type == _FIXED32:
        position += 4
    elif wire_type == _LENGTH_DELIMITED:
        size, position = _read_varint(message, position, end)
        position += size
    else:
        raise FramingError(f"unsupported wire type {wire_type}")
    if position > end:
        raise FramingError("a field runs past the end of the message")
    return position
