"""A delta publish's part starts from its base lazily (Part.take_base): whatever chunks come, the bytes
and the per-block checks it ends with are those of the revision the publisher meant.

A part of a publish with a delta base takes the base's bytes only as its chunks reach them: each delta
XORs into the base's bytes just copied, a whole chunk overwrites them, skipped ranges are copied when
the next chunk (or the commit, take_all_base) passes them. The blocks no chunk touched keep the base's
checks; the others are checked as chunks land or at the end. Hypothesis drives random sequences of
skips, whole chunks, deltas and empty chunks over an unaligned tensor spanning several 1 MiB blocks,
and checks the bytes, each block's CRC32C and BLAKE3 hash against ones computed afresh from the
expected bytes. A part that fails lets its base go.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightstream.protocol import deltas as forms
from weightstream.protocol import dtypes, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import InvalidRequest
from weightstream_server.revisions.layout import lay_out
from weightstream_server.revisions.parts import Part, PartInFlight
from weightstream_server.revisions.published_source import BLOCK_BYTES, check_blocks

# A tensor published whole before the based one, of an odd size: the based tensor lies unaligned.
LEAD = 1001


class _Assembly:
    """What the publisher gives a part, minus the other parts: records a drop."""

    def __init__(self) -> None:
        self.dropped: list[str] = []

    def drop(self, index: int, reason: str) -> None:
        self.dropped.append(reason)

    def check_open(self) -> None:
        pass

    def hand_over(self, part: Part, payload_bytes: int, alive: object) -> None:
        return None


def _based_part(base: np.ndarray) -> tuple[Part, PartInFlight, _Assembly]:
    """A part of tensors "lead" (whole) and "w" (base's bytes, unaligned), as start_from leaves it: w's
    base bytes held, its blocks' checks known from the base."""
    u8 = dtypes.BY_TORCH[torch.uint8].wire
    announced = [
        pb.PublishedTensor(name="lead", dtype=u8, shape=[LEAD]),
        pb.PublishedTensor(name="w", dtype=u8, shape=[base.size]),
    ]
    part = Part.allocate(0, lay_out("m", announced))
    part.buffer.fill_(0xAB)  # what the base copy must overwrite
    held = torch.from_numpy(base)
    part.base_bytes["w"] = held
    part.received["w"], part.based["w"], part.base = base.size, 0, "base"
    checks = check_blocks(held, 0, base.size, range(-(-base.size // BLOCK_BYTES)))
    part.known["w"] = list(checks)
    assembly = _Assembly()
    flight = PartInFlight(assembly, "m", part, 60.0, keep_bytes=1 << 30)  # type: ignore[arg-type]
    lead = np.arange(LEAD, dtype=np.uint8)
    flight.land("lead", 0, LEAD, _crc(lead), _writer(lead))
    return part, flight, assembly


def _crc(data: np.ndarray) -> int:
    return wire.crc32c_at(int(data.ctypes.data), data.size)


def _writer(data: np.ndarray):  # type: ignore[no-untyped-def]
    return lambda at: wire.copy_crc32c(at, int(data.ctypes.data), data.size)


_CHUNK = st.tuples(
    st.integers(0, 300_000),  # bytes skipped before the chunk (unchanged)
    st.integers(0, 1_400_000),  # the chunk's length (0: an empty chunk)
    st.sampled_from(["whole", "delta", "delta"]),
    st.integers(1, 4096),  # every how many bytes one changes in it
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(1, 3 * BLOCK_BYTES + 4321), chunks=st.lists(_CHUNK, max_size=8), seed=st.integers(0, 2**32 - 1))
def test_the_bytes_and_block_checks_of_a_based_part_are_the_revisions_whatever_chunks_come(
    size: int, chunks: list[tuple[int, int, str, int]], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size, dtype=np.uint8)
    new = base.copy()
    part, flight, _ = _based_part(base)
    codec = forms.Codec()
    offset = 0
    for skip, length, kind, every in chunks:
        offset += skip
        length = min(length, size - offset)
        if length < 0:
            break
        changed = np.arange(offset, offset + length, every)
        new[changed] ^= rng.integers(1, 256, changed.size, dtype=np.uint8)
        piece = np.ascontiguousarray(new[offset : offset + length])
        delta = (
            codec.encode(torch.from_numpy(piece ^ base[offset : offset + length]), offset)
            if kind == "delta" and length
            else None
        )
        if delta is None:
            flight.land("w", offset, length, _crc(piece), _writer(piece))
        else:
            encoding, payload = delta
            buffer = np.frombuffer(payload, dtype=np.uint8)
            flight.land_delta("w", offset, length, _crc(piece), encoding, int(buffer.ctypes.data), buffer.size)
        offset += length
    part.take_all_base()
    part.compute_blocks()
    assert not part.base_bytes
    placed = part.tensors["w"]
    got = part.buffer[placed.offset : placed.offset + size].numpy()
    assert np.array_equal(got, new)
    expected = check_blocks(torch.from_numpy(new), 0, size, range(-(-size // BLOCK_BYTES)))
    assert part.blocks["w"] == tuple(crc for crc, _ in expected)
    assert part.block_hashes["w"] == tuple(digest for _, digest in expected)
    lead = part.tensors["lead"]
    assert np.array_equal(part.buffer[lead.offset : lead.offset + LEAD].numpy(), np.arange(LEAD, dtype=np.uint8))


def test_a_based_part_that_fails_lets_its_base_go_and_is_dropped() -> None:
    base = np.random.default_rng(7).integers(0, 256, 3 * BLOCK_BYTES, dtype=np.uint8)
    part, flight, assembly = _based_part(base)
    piece = np.ascontiguousarray(base[:4096] ^ 1)
    flight.land("w", 0, 4096, _crc(piece), _writer(piece))
    assert "w" in part.base_bytes
    flight.fail(InvalidRequest("publish of model 'm': cut midway"))
    assert not part.base_bytes
    assert assembly.dropped == ["part 0 failed: publish of model 'm': cut midway"]
