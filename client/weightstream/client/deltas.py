"""Sparse updates on the client: a delta chunk XORed into the bytes its destination holds, then checked.

The forms, and how a payload is decoded and checked, are weightstream.protocol.deltas'. apply_delta
XORs a delta into the destination in place (on host memory or on the device) and returns the
CRC32C of the result as it lies there; the load session compares it with the chunk's, which is the
new revision's. A payload that does not decode to what its form promises leaves the destination
untouched (DeltaUnusable). A result that fails the CRC32C means the destination did not hold the
base there: the session asks for those bytes again, whole.

Concurrency: one Codec per thread (zstd contexts are not safe to share).
"""

from __future__ import annotations

import threading

from weightstream.client.placement import Destination
from weightstream.protocol import wire
from weightstream.protocol.deltas import ENCODINGS, Codec, DeltaUnusable

__all__ = ["ENCODINGS", "DeltaUnusable", "apply_delta", "codec"]

_local = threading.local()


def codec() -> Codec:
    """This thread's Codec."""
    own: Codec | None = getattr(_local, "codec", None)
    if own is None:
        own = _local.codec = Codec()
    return own


def apply_delta(dest: Destination, offset: int, length: int, address: int, payload_bytes: int, encoding: int) -> int:
    """XOR the delta (encoding, payload_bytes at address) into dest's bytes [offset, offset + length); their
    CRC32C after. DeltaUnusable (dest untouched) when the payload does not decode as its form says."""
    view = dest.buffer[offset : offset + length]
    codec().xor_into(view, offset, address, payload_bytes, encoding)
    if view.device.type != "cpu":
        landed = view.cpu()
        return wire.crc32c_at(landed.data_ptr(), length)
    return wire.crc32c_at(view.data_ptr(), length)
