"""Sparse updates on the client: a delta chunk XORed into the bytes its destination holds, then checked.

A delta is the XOR of a chunk's new bytes with the base revision's bytes at the same place, in one of
the forms weightstream.protocol.deltas lays out: dense (CHUNK_ENCODING_XOR_ZSTD, the whole XOR) or
sparse (CHUNK_ENCODING_SPARSE_XOR_ZSTD, only its nonzero words and where they go). apply_delta
decodes it, XORs it into the destination in place (torch ops, on host memory or on the device: no
per-element Python), and returns the CRC32C of the result as it lies there; the load session
compares it with the chunk's, which is the new revision's. A payload that does not decode to what
its form promises (the chunk's length; words inside the chunk, in order) leaves the destination
untouched (DeltaUnusable). A result that fails the CRC32C means the destination did not hold the
base there: the session asks for those bytes again, whole.

Concurrency: one decompressor and one scratch buffer per thread (zstandard's are not safe to share).
"""

from __future__ import annotations

import ctypes
import threading

import torch
import zstandard

from weightstream.client.placement import Destination
from weightstream.protocol import deltas as layout
from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb

_local = threading.local()
ENCODINGS = frozenset((pb.CHUNK_ENCODING_XOR_ZSTD, pb.CHUNK_ENCODING_SPARSE_XOR_ZSTD))


class DeltaUnusable(ValueError):
    """A delta payload that does not decode to what its form promises (corrupt on the way, or not zstd)."""


def apply_delta(dest: Destination, offset: int, length: int, address: int, payload_bytes: int, encoding: int) -> int:
    """XOR the delta (encoding, payload_bytes at address) into dest's bytes [offset, offset + length); their
    CRC32C after. DeltaUnusable (dest untouched) when the payload does not decode as its form says."""
    view = dest.buffer[offset : offset + length]
    if encoding == pb.CHUNK_ENCODING_SPARSE_XOR_ZSTD:
        _xor_sparse(view, offset, address, payload_bytes)
    elif view.device.type == "cpu":
        return _xor_dense_checked(view, decompress(address, payload_bytes, exactly=length))
    else:
        view.bitwise_xor_(decompress(address, payload_bytes, exactly=length).to(view.device))
    if view.device.type != "cpu":
        landed = view.cpu()
        return wire.crc32c_at(landed.data_ptr(), length)
    return wire.crc32c_at(view.data_ptr(), length)


def _xor_dense_checked(view: torch.Tensor, xor: torch.Tensor) -> int:
    """view ^= xor on host memory; the CRC32C of the result. Piece by piece (wire.CACHE_PIECE_BYTES),
    each checksummed while in the core's cache; a piece that size is also below torch's grain for
    splitting an operation over threads, which on a busy host cost more than the XOR itself."""
    length = view.numel()
    words = torch.int64 if view.data_ptr() % 8 == 0 and length % 8 == 0 else torch.uint8
    crc = 0
    for start in range(0, length, wire.CACHE_PIECE_BYTES):
        end = min(length, start + wire.CACHE_PIECE_BYTES)
        view[start:end].view(words).bitwise_xor_(xor[start:end].view(words))
        crc = wire.crc32c_at(view.data_ptr() + start, end - start, crc)
    return crc


def _xor_sparse(view: torch.Tensor, offset: int, address: int, payload_bytes: int) -> None:
    """XOR the sparse delta's words into view, each at its place; checked to lie inside view, in order."""
    length = view.numel()
    word = layout.word_bytes(offset, length)
    words = length // word
    raw = decompress(address, payload_bytes, most=min(layout.sparse_bytes(words, word), length))
    if raw.numel() < layout.COUNT.size:
        raise DeltaUnusable("a sparse delta shorter than its count")
    (count,) = layout.COUNT.unpack(bytes(raw[: layout.COUNT.size]))
    if count > words or raw.numel() != layout.sparse_bytes(count, word):
        raise DeltaUnusable(f"a sparse delta of {raw.numel()} bytes does not hold {count} words of {word} bytes")
    if not count:
        return
    start = layout.COUNT.size
    gaps = raw[start : start + layout.GAP_BYTES * count].view(torch.int32).to(torch.int64)
    if int(gaps[0]) < 0 or (count > 1 and not bool((gaps[1:] > 0).all())):
        raise DeltaUnusable("a sparse delta's words are not in order")
    places = gaps.cumsum_(0)
    if int(places[-1]) >= words:
        raise DeltaUnusable(f"a sparse delta's word {int(places[-1])} lies beyond the chunk's {words}")
    kind = torch.int16 if word == 2 else torch.uint8
    values = raw[start + layout.GAP_BYTES * count :].view(kind)
    target = view.view(kind)
    if target.device.type != "cpu":
        places, values = places.to(target.device), values.to(target.device)
    target[places] = target[places] ^ values


def decompress(address: int, payload_bytes: int, *, exactly: int = -1, most: int = 0) -> torch.Tensor:
    """What a zstd frame at address holds, in this thread's scratch buffer (valid until its next use):
    exactly that many bytes, or at most `most`; DeltaUnusable otherwise."""
    payload = memoryview((ctypes.c_char * payload_bytes).from_address(address)).cast("B") if payload_bytes else b""
    try:
        stated = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise DeltaUnusable(f"not a zstd frame: {exc}") from None
    if stated < 0 or (exactly >= 0 and stated != exactly) or stated > max(exactly, most):
        raise DeltaUnusable(f"the frame holds {stated} bytes, not what the chunk takes")
    out = _scratch(stated)
    target = memoryview((ctypes.c_char * stated).from_address(out.data_ptr())).cast("B") if stated else None
    got = 0
    try:
        with _decompressor().stream_reader(payload) as reader:
            while target is not None and got < stated:
                n = reader.readinto(target[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise DeltaUnusable(f"the frame does not decode: {exc}") from None
    if got != stated or extra:
        raise DeltaUnusable(f"the frame decoded to {'more than ' if extra else ''}{got} bytes, not {stated}")
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
