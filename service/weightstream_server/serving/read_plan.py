"""A read plan: the byte ranges a stream request needs, file by file, and where each unit's bytes go.

The plan is plain data, written once by plan_reads and only read afterwards by the reader, the
cache and the chunk source.

Reads are cut into units of READ_UNIT_BYTES (a whole number of chunks), larger than the chunks that
are sent: fewer, larger reads cost the storage less per byte (one S3 GET per unit), while the
messages stay at the chunk size that gRPC moves fastest. The reader cuts each unit into chunks.

Slices: a slice along dimension d of a tensor is, in its file, one contiguous segment per "outer
row" (each index of the dimensions before d). With no outer rows (d = 0, or leading dimensions of
size 1) the slice is a plain byte range. Otherwise, when the segments are large they are read as
ranges of their own; when they are small (the usual case for a row-parallel weight) whole rows are
read, in units of whole rows, and the slice is gathered out of them in memory, so that storage sees
few large reads and the client receives only the slice's bytes. Unit boundaries depend only on the
tensor, never on the request, so that every rank of a tensor-parallel load reads the same units and
a server cache can share them.

The limits bound what one request can make the plan hold; plan_reads enforces them for every
caller, and validation.check_stream_request checks the tensor count before a request is converted.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightstream.protocol import wire
from weightstream.protocol.wire import TensorSlice
from weightstream_server.errors import InvalidRequest, RangeOutOfBounds
from weightstream_server.serving.catalog import Manifest, TensorEntry
from weightstream_server.storage.reads import ChunkPlace, FilePlan, Gather, ReadPlan, UnitPlace

MAX_REQUESTED_TENSORS = 1_000_000
MAX_RANGES_PER_TENSOR = 4096
# Ranges of all tensors of one request together: bounds the plan's memory (about 200 bytes a range).
MAX_RANGES_PER_REQUEST = 262_144
READ_UNIT_BYTES = 16 * 1024 * 1024
# Slice segments smaller than this are gathered out of whole rows rather than read one by one.
GATHER_BELOW_BYTES = 1024 * 1024

# (tensor name, byte ranges, slice or None); an empty list of ranges means the whole tensor or slice.
Requested = tuple[str, Sequence[tuple[int, int]], TensorSlice | None]


def plan_reads(manifest: Manifest, requested: Sequence[Requested], chunk_bytes: int) -> ReadPlan:
    """Plan the reads for requested (tensor name, byte ranges, slice), or for every tensor if it is empty.

    An empty list of ranges means the whole tensor (or slice). Ranges are [start, end) within the
    tensor's bytes, or within the slice's bytes laid out contiguously.
    """
    check_tensor_count(len(requested))
    ranges_total = sum(len(ranges) for _, ranges, _ in requested)
    if ranges_total > MAX_RANGES_PER_REQUEST:
        raise InvalidRequest(f"request has {ranges_total} byte ranges in all, more than {MAX_RANGES_PER_REQUEST}")
    unit_bytes = max(1, READ_UNIT_BYTES // chunk_bytes) * chunk_bytes
    per_file: dict[int, FilePlan] = {}
    total = 0
    if not requested:
        for entry in manifest.tensors:
            total += _plan_range(per_file, entry, 0, entry.nbytes, unit_bytes)
    else:
        seen: set[str] = set()
        for name, ranges, slice_ in requested:
            if name in seen:
                raise InvalidRequest(f"tensor {name[:200]!r} is requested more than once")
            seen.add(name)
            entry = manifest.tensor(name)
            if slice_ is None:
                for start, end in _check_ranges(entry.name, entry.nbytes, ranges):
                    total += _plan_range(per_file, entry, start, end, unit_bytes)
            else:
                total += _plan_slice(per_file, entry, slice_, ranges, unit_bytes)
    files = tuple(p for _, p in sorted(per_file.items()) if p.sizes)
    return ReadPlan(files, total, sum(len(p.sizes) for p in files), chunk_bytes)


def check_tensor_count(count: int) -> None:
    """Refuse a request that names more than MAX_REQUESTED_TENSORS tensors."""
    if count > MAX_REQUESTED_TENSORS:
        raise InvalidRequest(f"request names {count} tensors, more than {MAX_REQUESTED_TENSORS}")


def slice_layout(entry: TensorEntry, slice_: TensorSlice) -> tuple[int, int, int, int]:
    """(outer rows, bytes per row, first byte of the slice in a row, slice bytes per row), checked."""
    shape = entry.shape
    what = f"tensor {entry.name!r} of shape {list(shape)}"
    if not shape:
        raise InvalidRequest(f"{what}: a scalar cannot be sliced")
    if slice_.dim >= len(shape):
        raise InvalidRequest(f"{what}: slice dimension {slice_.dim} does not exist")
    if not 0 <= slice_.start < slice_.stop <= shape[slice_.dim]:
        raise RangeOutOfBounds(
            f"{what}: slice [{slice_.start}, {slice_.stop}) of dimension {slice_.dim} is empty or outside "
            f"0..{shape[slice_.dim]}"
        )
    inner = wire.numel(shape[slice_.dim + 1 :]) * entry.dtype.itemsize
    outer = wire.numel(shape[: slice_.dim])
    return outer, shape[slice_.dim] * inner, slice_.start * inner, (slice_.stop - slice_.start) * inner


def _plan_range(per_file: dict[int, FilePlan], entry: TensorEntry, start: int, end: int, unit_bytes: int) -> int:
    """Plan tensor bytes [start, end) read as they lie; returns the bytes to send."""
    plan = per_file.setdefault(entry.file_index, FilePlan(entry.file_index))
    for offset, length in wire.split_range(start, end, unit_bytes):
        plan.offsets.append(entry.file_offset + offset)
        plan.sizes.append(length)
        plan.places.append(UnitPlace(ChunkPlace(entry.name, offset, length)))
    return end - start


def _plan_slice(
    per_file: dict[int, FilePlan],
    entry: TensorEntry,
    slice_: TensorSlice,
    ranges: Sequence[tuple[int, int]],
    unit_bytes: int,
) -> int:
    outer, row_bytes, first, width = slice_layout(entry, slice_)
    wanted = _check_ranges(entry.name, outer * width, ranges)
    plan = per_file.setdefault(entry.file_index, FilePlan(entry.file_index))
    sent = 0
    if outer == 1 or width >= GATHER_BELOW_BYTES:
        # Each row's segment is read as it lies; ranges are cut at row boundaries.
        for start, end in wanted:
            position = start
            while position < end:
                row = position // width
                stop = min(end, (row + 1) * width)
                for offset, length in wire.split_range(position, stop, unit_bytes):
                    plan.offsets.append(entry.file_offset + row * row_bytes + first + (offset - row * width))
                    plan.sizes.append(length)
                    plan.places.append(UnitPlace(ChunkPlace(entry.name, offset, length)))
                sent += stop - position
                position = stop
        return sent
    # Whole rows in units of rows_per_unit, on a grid fixed by the tensor alone; ranges widen to
    # whole rows, so a resumed slice may receive a few bytes it already has (which is harmless).
    rows_per_unit = max(1, unit_bytes // row_bytes)
    gather = Gather(row_bytes, first, width)
    units: set[int] = set()
    for start, end in wanted:
        units.update(range(start // width // rows_per_unit, (end - 1) // width // rows_per_unit + 1))
    for unit in sorted(units):
        first_row = unit * rows_per_unit
        rows = min(rows_per_unit, outer - first_row)
        plan.offsets.append(entry.file_offset + first_row * row_bytes)
        plan.sizes.append(rows * row_bytes)
        plan.places.append(UnitPlace(ChunkPlace(entry.name, first_row * width, rows * width), gather))
        sent += rows * width
    return sent


def _check_ranges(name: str, nbytes: int, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    if not ranges:
        return [(0, nbytes)] if nbytes else []
    if len(ranges) > MAX_RANGES_PER_TENSOR:
        raise InvalidRequest(f"tensor {name!r}: {len(ranges)} ranges, more than {MAX_RANGES_PER_TENSOR}")
    ordered = sorted(ranges)
    previous_end = 0
    for start, end in ordered:
        if not 0 <= start < end <= nbytes:
            raise RangeOutOfBounds(
                f"tensor {name!r}: byte range [{start}, {end}) is empty or outside its {nbytes} bytes"
            )
        if start < previous_end:
            raise InvalidRequest(f"tensor {name!r}: byte ranges overlap at byte {start}")
        previous_end = end
    return ordered
