"""The client's side of deltas, against payloads made by hand: each form XORed in place and checked, and
payloads that lie about their contents refused with the destination untouched, and the Applier that
applies host deltas on threads of its own."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard

from weightstream.client.deltas import Applier, DeltaUnusable, applier_threads, apply_delta
from weightstream.client.placement import Destination
from weightstream.protocol import wire
from weightstream.protocol.deltas import Decoded
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


def test_the_applier_reports_each_delta_in_order_and_none_for_one_that_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Host deltas are decoded and applied on the Applier's threads; results come in the order given,
    whatever thread finished first, with None for a payload that does not decode (its bytes untouched)
    and for a worker that failed (logged)."""
    old = torch.arange(4 * 2048, dtype=torch.int16)
    new = old.clone()
    new[[1, 2048 + 5, 3 * 2048 + 7]] ^= 3
    held = old.clone()
    views = held.view(torch.uint8).split(4096)
    payloads = [frame(sparse([1], [3])), frame(sparse([5], [3])), frame(b"\x01"), frame(sparse([7], [3]))]
    applier: Applier[int] = Applier("model 'm'")
    try:
        for token, (view, payload) in enumerate(zip(views, payloads, strict=True)):
            applier.submit(token, view, 0, wire.memory_at(payload.data_ptr(), payload.numel()), SPARSE)
        got = list(applier.results(wait=True))
    finally:
        applier.close()
    crcs = [wire.crc32c(bytes(piece.numpy())) for piece in new.view(torch.uint8).split(4096)]
    assert got == [(0, crcs[0]), (1, crcs[1]), (2, None), (3, crcs[3])]
    assert torch.equal(held[4096:6144], old[4096:6144])  # the one that did not decode left its bytes alone
    assert torch.equal(held[:4096], new[:4096]) and torch.equal(held[6144:], new[6144:])
    assert "a delta did not decode" in caplog.text

    def broken(self: Decoded, view: torch.Tensor) -> None:
        raise MemoryError("no room")

    monkeypatch.setattr(Decoded, "xor_into", broken)
    applier = Applier("model 'm'")
    try:
        applier.submit(0, views[0], 0, wire.memory_at(payloads[0].data_ptr(), payloads[0].numel()), SPARSE)
        assert list(applier.results(wait=True)) == [(0, None)]
    finally:
        applier.close()
    assert "applying a delta failed" in caplog.text


@pytest.mark.parametrize(("cores", "threads"), [(1, 2), (2, 2), (5, 2), (6, 3), (16, 8), (96, 8)])
def test_delta_threads_follow_the_cores_a_client_may_use(cores: int, threads: int) -> None:
    # Half the cores: two on a small host (decoding overlaps applying), never more than the memory bus takes.
    assert applier_threads(cores) == threads


def test_the_applier_holds_at_most_its_depth_of_deltas_and_the_stream_waits_for_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each delta in flight is a copy of its payload: a server sending deltas faster than they are applied
    makes the stream's thread wait, not the client's memory grow."""
    import threading

    from weightstream.client import deltas

    release = threading.Event()
    started = threading.Semaphore(0)

    def held(self: Decoded, view: torch.Tensor) -> int:
        started.release()
        release.wait(10)
        return 0

    monkeypatch.setattr(Decoded, "xor_into", held)
    total = deltas.APPLIER_DEPTH + 3
    target = torch.zeros(total * 4096, dtype=torch.uint8)
    payload = frame(sparse([0], [1]))
    submitted: list[int] = []
    applier: Applier[int] = Applier("model 'm'", threads=1)

    def stream() -> None:
        for token in range(total):
            view = target[4096 * token : 4096 * (token + 1)]
            applier.submit(token, view, 0, wire.memory_at(payload.data_ptr(), payload.numel()), SPARSE)
            submitted.append(token)

    feeder = threading.Thread(target=stream)
    try:
        feeder.start()
        assert started.acquire(timeout=10)  # the worker holds the first delta
        feeder.join(0.5)
        assert feeder.is_alive() and len(submitted) == deltas.APPLIER_DEPTH
        release.set()
        feeder.join(10)
        assert [token for token, _ in applier.results(wait=True)] == list(range(total))
    finally:
        release.set()
        feeder.join(10)
        applier.close()
