"""The data port's protocol, written once for both sides: the handshake and the frames.

A StreamTensorsBulk call announces a data port and a one-time ticket. The client opens a TCP
connection there (TLS when the server's gRPC port runs TLS, with the same certificates) and
sends MAGIC followed by the ticket; the server answers one byte, ADMITTED or REFUSED, and, once
admitted, writes the stream's frames and nothing else. Each frame is a header (HEADER: kind,
name length, offset, length, CRC32C; little-endian), then the tensor's name in UTF-8, then the
payload. A CHUNK frame carries `length` bytes of tensor `name` from byte `offset` (of the slice,
for a slice), with their CRC32C. A DELTA frame stands for `length` bytes of the tensor too, with
their CRC32C, but its payload is encoded (weightstream.v1 CHUNK_ENCODING_XOR_ZSTD): after the name
come DELTA_HEADER (the payload's size and its ChunkEncoding) and the payload. The END frame closes the stream and
carries, in offset and length, how many chunks and payload bytes (as sent: an encoded payload's
size) came before it. The server sends END only after every chunk was sent; a connection that ends
without one was cut, and the call's status says why.

A publish uses the same handshake and frames the other way: a PublishTensors call whose
PublishStart sets data_port is answered with the port and a ticket, and the client writes the
part's CHUNK frames (offsets within each tensor, in order) and then END with its counts; the server
writes nothing on that connection, and the call's last answer says the revision is current.

A file read (ReadModelFile with data_port, between tiers) sends the file's pieces as CHUNK frames
named by the file, offsets within it; END carries, in crc32c, the whole file's CRC32C on a read to
the file's end.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from weightstream.protocol import wire

MAGIC = b"WSBULK1\n"
TICKET_BYTES = 32
ADMITTED = b"\x01"
REFUSED = b"\x02"
HELLO_BYTES = len(MAGIC) + TICKET_BYTES

CHUNK = 1
END = 2
DELTA = 3
HEADER = struct.Struct("<BHQQI")
DELTA_HEADER = struct.Struct("<IB")
# Longer names are refused by the server's catalog long before they could reach a frame.
MAX_NAME_BYTES = 4096


class FrameError(ValueError):
    """A frame header that no server of this protocol writes."""


@dataclass(frozen=True)
class Frame:
    """A decoded header: for CHUNK, name_bytes of name follow, then length payload bytes."""

    kind: int
    name_bytes: int
    offset: int
    length: int
    crc32c: int


def hello(ticket: bytes) -> bytes:
    """What a client sends first on its data connection."""
    return MAGIC + ticket


def chunk_header(name: bytes, offset: int, length: int, crc32c: int) -> bytes:
    """The header and name of a CHUNK frame; its payload follows."""
    return HEADER.pack(CHUNK, len(name), offset, length, crc32c) + name


def delta_header(name: bytes, offset: int, length: int, crc32c: int, payload_bytes: int, encoding: int) -> bytes:
    """The header, name, payload size and encoding of a DELTA frame standing for length bytes; its payload follows."""
    return HEADER.pack(DELTA, len(name), offset, length, crc32c) + name + DELTA_HEADER.pack(payload_bytes, encoding)


def end_frame(chunks: int, payload_bytes: int, crc32c: int = 0) -> bytes:
    """The END frame; crc32c is a file read's whole-file CRC32C (0 elsewhere)."""
    return HEADER.pack(END, 0, chunks, payload_bytes, crc32c)


def decode_header(data: bytes | bytearray | memoryview, *, deltas: bool = False) -> Frame:
    """A header, checked against what any chunk can be (FrameError if not); DELTA frames only with deltas
    (tensor streams: file reads and publishes carry none)."""
    kind, name_bytes, offset, length, crc = HEADER.unpack(data)
    if kind == CHUNK or (kind == DELTA and deltas):
        if not 0 < name_bytes <= MAX_NAME_BYTES or length > wire.MAX_CHUNK_BYTES:
            raise FrameError(f"chunk frame with a {name_bytes}-byte name and {length} payload bytes")
    elif kind != END or name_bytes:
        raise FrameError(f"frame of kind {kind} with a {name_bytes}-byte name")
    return Frame(kind, name_bytes, offset, length, crc)
