"""What a publish and a relay keep of the deltas they received is bounded, whatever is sent.

A part of a delta publish keeps what arrived for the base's tensors (Part.sent) up to its budget, each
entry counted at least KEPT_ENTRY_BYTES, so a flood of one-byte chunks keeps a bounded number of
them; and no delta payload larger than its chunk is decoded at all (a zstd skippable frame after the
real one would otherwise carry megabytes through a tiny chunk).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard

from weightstream.protocol import deltas as forms
from weightstream.protocol import dtypes, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.revisions.layout import lay_out
from weightstream_server.revisions.parts import KEPT_ENTRY_BYTES, Part, PartInFlight


class _Open:
    """An assembly that never drops the part (what the publisher gives a part, minus the other parts)."""

    def drop(self, index: int, reason: str) -> None:
        raise AssertionError(f"dropped: {reason}")

    def check_open(self) -> None:
        pass

    def hand_over(self, part: Part, payload_bytes: int, alive: object) -> None:
        return None


def test_a_flood_of_one_byte_chunks_keeps_a_bounded_number_of_entries() -> None:
    announced = [pb.PublishedTensor(name="w", dtype=dtypes.BY_TORCH[torch.uint8].wire, shape=[1 << 20])]
    part = Part.allocate(0, lay_out("m", announced))
    part.buffer.zero_()
    # As start_from leaves a tensor the delta base holds.
    part.received["w"], part.based["w"], part.base = 1 << 20, 0, "base"
    budget = 64 * 1024
    flight = PartInFlight(_Open(), "m", part, 60.0, keep_bytes=budget)  # type: ignore[arg-type]
    one = np.zeros(1, dtype=np.uint8)
    crc = wire.crc32c_at(one.ctypes.data, 1)
    for offset in range(50_000):
        flight.land("w", offset, 1, crc, lambda at: wire.copy_crc32c(at, int(one.ctypes.data), 1))
    assert len(part.sent) == budget // KEPT_ENTRY_BYTES
    assert part.sent_bytes <= budget


@pytest.mark.parametrize("trailer", [5000, 16 << 20])
def test_a_delta_payload_larger_than_its_chunk_is_refused_unread(trailer: int) -> None:
    length = 4096
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(forms.COUNT.pack(0))
    payload = np.frombuffer(frame + struct.pack("<II", 0x184D2A50, trailer) + b"J" * trailer, dtype=np.uint8).copy()
    view = torch.zeros(length, dtype=torch.uint8)
    with pytest.raises(forms.DeltaUnusable, match="payload bytes for a chunk of 4096"):
        forms.Codec().xor_into(view, 0, int(payload.ctypes.data), payload.size, forms.SPARSE_XOR_ZSTD)
    assert not view.any()
