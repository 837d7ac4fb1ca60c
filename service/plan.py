"""Turning a stream request into the byte ranges to read, file by file.

Reads are cut into units of READ_UNIT_BYTES (a whole number of chunks), larger than the chunks that
are sent: fewer, larger reads cost the storage less per byte (one S3 GET per unit), while the
messages stay at the chunk size that gRPC moves fastest. The reader cuts each unit into chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from weightstream import wire
from weightstream.server.catalog import Manifest, TensorEntry
from weightstream.server.errors import InvalidRequest, RangeOutOfBounds

MAX_REQUESTED_TENSORS = 1_000_000
MAX_RANGES_PER_TENSOR = 4096
READ_UNIT_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ChunkPlace:
    """Where bytes read from a file belong: their tensor and the byte offset within it."""

    tensor: str
    offset: int
    length: int


@dataclass
class FilePlan:
    """The read units of one file, with a ChunkPlace for each, in the same order."""

    file_index: int
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    places: list[ChunkPlace] = field(default_factory=list)


@dataclass(frozen=True)
class ReadPlan:
    files: tuple[FilePlan, ...]
    total_bytes: int
    num_reads: int
    # Largest payload of one sent chunk; every read unit is a whole number of these but its last.
    chunk_bytes: int


def plan_reads(
    manifest: Manifest,
    requested: Sequence[tuple[str, Sequence[tuple[int, int]]]],
    chunk_bytes: int,
) -> ReadPlan:
    """Plan the reads for requested (tensor name, byte ranges), or for every tensor if it is empty.

    An empty list of ranges means the whole tensor. Ranges are [start, end) within the tensor.
    """
    if len(requested) > MAX_REQUESTED_TENSORS:
        raise InvalidRequest(f"request names {len(requested)} tensors, more than {MAX_REQUESTED_TENSORS}")
    selection: list[tuple[TensorEntry, list[tuple[int, int]]]] = []
    if not requested:
        selection = [(t, [(0, t.nbytes)]) for t in manifest.tensors]
    else:
        seen: set[str] = set()
        for name, ranges in requested:
            if name in seen:
                raise InvalidRequest(f"tensor {name[:200]!r} is requested more than once")
            seen.add(name)
            entry = manifest.tensor(name)
            selection.append((entry, _check_ranges(entry, ranges)))
    unit_bytes = max(1, READ_UNIT_BYTES // chunk_bytes) * chunk_bytes
    per_file: dict[int, FilePlan] = {}
    total = 0
    count = 0
    for entry, ranges in selection:
        plan = per_file.setdefault(entry.file_index, FilePlan(entry.file_index))
        for start, end in ranges:
            for offset, length in wire.split_range(start, end, unit_bytes):
                plan.offsets.append(entry.file_offset + offset)
                plan.sizes.append(length)
                plan.places.append(ChunkPlace(entry.name, offset, length))
                total += length
                count += 1
    files = tuple(p for _, p in sorted(per_file.items()) if p.sizes)
    return ReadPlan(files, total, count, chunk_bytes)


def _check_ranges(entry: TensorEntry, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    if not ranges:
        return [(0, entry.nbytes)]
    if len(ranges) > MAX_RANGES_PER_TENSOR:
        raise InvalidRequest(f"tensor {entry.name!r}: {len(ranges)} ranges, more than {MAX_RANGES_PER_TENSOR}")
    ordered = sorted(ranges)
    previous_end = 0
    for start, end in ordered:
        if not 0 <= start < end <= entry.nbytes:
            raise RangeOutOfBounds(
                f"tensor {entry.name!r}: byte range [{start}, {end}) is empty or outside its {entry.nbytes} bytes"
            )
        if start < previous_end:
            raise InvalidRequest(f"tensor {entry.name!r}: byte ranges overlap at byte {start}")
        previous_end = end
    return ordered
