"""The client's side of deltas, against payloads made by hand: each form XORed in place and checked, and
payloads that lie about their contents refused with the destination untouched."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard

from weightstream.client.deltas import DeltaUnusable, apply_delta
from weightstream.client.placement import Destination
from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb

SPARSE = pb.CHUNK_ENCODING_SPARSE_XOR_ZSTD
DENSE = pb.CHUNK_ENCODING_XOR_ZSTD


def frame(data: bytes) -> torch.Tensor:
    payload = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def sparse(places: list[int], values: list[int], gaps: list[int] | None = None) -> bytes:
    if gaps is None:
        gaps = [p - q for p, q in zip(places, [0, *places[:-1]], strict=True)]
    return (
        struct.pack("<I", len(values)) + struct.pack(f"<{len(gaps)}I", *gaps) + struct.pack(f"<{len(values)}h", *values)
    )


def apply(dest: Destination, payload: torch.Tensor, encoding: int, offset: int = 0, length: int = 4096) -> int:
    return apply_delta(dest, offset, length, payload.data_ptr(), payload.numel(), encoding)


def test_each_form_lands_the_new_bytes() -> None:
    old = torch.arange(4096, dtype=torch.int16).to(torch.bfloat16).view(torch.int16)
    new = old.clone()
    new[[3, 700, 2047]] ^= torch.tensor([1, 0x100, 0x7FFF], dtype=torch.int16)
    xor = (old ^ new).view(torch.uint8)
    for encoding, data in (
        (DENSE, bytes(xor[:4096].numpy())),
        (SPARSE, sparse([3, 700, 2047], [1, 0x100, 0x7FFF])),
    ):
        held = old.clone()
        crc = apply(Destination("t", held), frame(data), encoding)
        assert torch.equal(held, new)
        assert crc == wire.crc32c(bytes(new.view(torch.uint8)[:4096].numpy()))


@pytest.mark.parametrize(
    "data",
    [
        sparse([3, 2048], [1, 1]),  # a word beyond the chunk (2048 words of 2 bytes)
        sparse([5, 3], [1, 1], gaps=[5, 0]),  # a gap of 0: not in order
        sparse([1], [1])[:-1],  # a word short
        struct.pack("<I", 3000) + bytes(10),  # more words than it holds
        b"",  # no count at all
    ],
)
def test_a_sparse_delta_that_lies_is_refused_and_touches_nothing(data: bytes) -> None:
    held = torch.zeros(2048, dtype=torch.int16)
    with pytest.raises(DeltaUnusable):
        apply(Destination("t", held), frame(data), SPARSE)
    assert not held.any()


def test_a_dense_delta_of_another_length_or_not_zstd_is_refused() -> None:
    held = torch.zeros(2048, dtype=torch.int16)
    with pytest.raises(DeltaUnusable):
        apply(Destination("t", held), frame(bytes(4000)), DENSE)
    with pytest.raises(DeltaUnusable):
        apply(Destination("t", held), torch.frombuffer(bytearray(b"not a zstd frame"), dtype=torch.uint8), DENSE)
    # A sparse frame larger than the chunk itself (the dense form would be smaller) is refused too.
    with pytest.raises(DeltaUnusable):
        apply(Destination("t", held), frame(sparse(list(range(1000)), [1] * 1000)), SPARSE)
    assert not held.any()
