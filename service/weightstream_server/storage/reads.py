"""What a source reads for a stream: the read plan's units, file by file, and where each unit's bytes go.

Plain data, written once by serving.read_plan.plan_reads and only read afterwards by the sources
(storage), the reader, the cache and the chunk source. It lies beside the sources, which read it,
and imports nothing of the serving layer that plans it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Gather:
    """How a unit of whole rows becomes slice bytes: of each row_bytes, keep [first, first + width)."""

    row_bytes: int
    first: int
    width: int


@dataclass(frozen=True)
class ChunkPlace:
    """Where bytes belong: their tensor and the byte offset within it (within the slice, for a slice)."""

    tensor: str
    offset: int
    length: int


@dataclass(frozen=True)
class UnitPlace:
    """Where one read unit's bytes go: to place (whose length is the bytes sent), through gather if set."""

    place: ChunkPlace
    gather: Gather | None = None


@dataclass
class FilePlan:
    """The read units of one file (offsets and sizes in the file), with a UnitPlace for each, in order."""

    file_index: int
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    places: list[UnitPlace] = field(default_factory=list)


@dataclass(frozen=True)
class ReadPlan:
    files: tuple[FilePlan, ...]
    # Bytes to send (slices count their own bytes only).
    total_bytes: int
    num_reads: int
    # Largest payload of one sent chunk; every read unit is a whole number of these but its last.
    chunk_bytes: int
