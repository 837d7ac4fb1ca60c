"""Sparse updates on the client: a delta chunk XORed into the bytes its destination holds, then checked.

A delta (weightstream.v1 CHUNK_ENCODING_XOR_ZSTD) is a zstd frame of the XOR of the new bytes with
the base revision's bytes at the same place. apply_delta decodes it, XORs it into the destination
in place (torch's XOR, on host memory or on the device: no per-element Python), and returns the CRC32C
of the result as it lies there; the load session compares it with the chunk's, which is the new
revision's. A frame that does not decode to exactly the chunk's length leaves the destination
untouched (DeltaUnusable). A result that fails the CRC32C means the destination did not hold the
base there: the session asks for those bytes again, whole.

Concurrency: one decompressor per thread (zstandard's are not safe to share).
"""

from __future__ import annotations

import ctypes
import threading

import torch
import zstandard

from weightstream.client.placement import Destination
from weightstream.protocol import wire

_local = threading.local()


class DeltaUnusable(ValueError):
    """A delta payload that does not decode to the chunk's bytes (corrupt on the way, or not zstd)."""


def apply_delta(dest: Destination, offset: int, length: int, address: int, payload_bytes: int) -> int:
    """XOR the delta of payload_bytes at address into dest's bytes [offset, offset + length); their CRC32C after.

    DeltaUnusable (dest untouched) when the payload does not decode to exactly length bytes. On host
    memory the XOR and the checksum go piece by piece (wire.CACHE_PIECE_BYTES), each piece checksummed
    while it is in the core's cache; a piece that size is also below torch's grain for splitting an
    operation over threads, which on a busy host cost more than the XOR itself.
    """
    xor = decode(address, payload_bytes, length)
    view = dest.buffer[offset : offset + length]
    if view.device.type != "cpu":
        view.bitwise_xor_(xor.to(view.device))
        landed = view.cpu()
        return wire.crc32c_at(landed.data_ptr(), length)
    words = torch.int64 if offset % 8 == 0 and length % 8 == 0 else torch.uint8
    crc = 0
    for start in range(0, length, wire.CACHE_PIECE_BYTES):
        end = min(length, start + wire.CACHE_PIECE_BYTES)
        view[start:end].view(words).bitwise_xor_(xor[start:end].view(words))
        crc = wire.crc32c_at(view.data_ptr() + start, end - start, crc)
    return crc


def decode(address: int, payload_bytes: int, length: int) -> torch.Tensor:
    """The XOR bytes a delta payload stands for, in this thread's scratch buffer (valid until its next
    decode); DeltaUnusable if the payload does not decode to exactly length bytes."""
    payload = memoryview((ctypes.c_char * payload_bytes).from_address(address)).cast("B") if payload_bytes else b""
    try:
        stated = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise DeltaUnusable(f"not a zstd frame: {exc}") from None
    if stated != length or length > wire.MAX_CHUNK_BYTES:
        raise DeltaUnusable(f"the frame holds {stated} bytes, not the chunk's {length}")
    out = _scratch(length)
    target = memoryview((ctypes.c_char * length).from_address(out.data_ptr())).cast("B")
    got = 0
    try:
        with _decompressor().stream_reader(payload) as reader:
            while got < length:
                n = reader.readinto(target[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise DeltaUnusable(f"the frame does not decode: {exc}") from None
    if got != length or extra:
        raise DeltaUnusable(
            f"the frame decoded to {'more than ' if extra else ''}{got} bytes, not the chunk's {length}"
        )
    return out


def _scratch(length: int) -> torch.Tensor:
    scratch: torch.Tensor | None = getattr(_local, "scratch", None)
    if scratch is None or scratch.numel() < length:
        scratch = _local.scratch = torch.empty(max(length, wire.DEFAULT_CHUNK_BYTES), dtype=torch.uint8)
    return scratch[:length]


def _decompressor() -> zstandard.ZstdDecompressor:
    decompressor: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor
