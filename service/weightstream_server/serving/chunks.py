"""The chunks a stream sends: read units turned into checksummed chunks, through the cache when there is one.

serve_chunks is the one source of chunk bytes for every transport (gRPC messages, shared-memory
slots). Without a cache it reads every unit of the plan with the stream's own streamer. With a
cache (weightstream_server.serving.cache) it first takes the units other streams have read or are reading, reads
only the rest, and waits for the units in flight elsewhere once its own reads are done (reading
its own first means two streams that wait on each other always progress).

The plan's local files are opened (beneath the model root, checked against the manifest) when
the chunks start and closed when they end; every read of the stream goes through those
descriptors, and once every chunk is out the files are checked once more: a stream served from
the cache whose files changed meanwhile ends with CheckpointChanged, like one that read them. A
stream given a BlockRecorder checksums the chunks it reads through it (checksums.BlockRecorder) and
commits it only after that check.

Memory ownership: a ServedChunk's data is valid until the next chunk is taken (it may lie in the
streamer's ring).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np

from weightstream.protocol import wire
from weightstream_server.serving.cache import SHARED_READ_WAIT_S, CachedUnit, Claim, UnitCache, UnitKey
from weightstream_server.serving.catalog import Manifest
from weightstream_server.serving.checksums import BlockRecorder
from weightstream_server.serving.reader import PooledStreamer, open_plan, read_units
from weightstream_server.storage.open_files import OpenFiles
from weightstream_server.storage.reads import ChunkPlace, FilePlan, ReadPlan, UnitPlace
from weightstream_server.storage.sources import SourceFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedChunk:
    """One chunk to send: its place, the CRC32C of its bytes, and its payload: the bytes, or with
    encoding set (weightstream.v1 ChunkEncoding) what stands for them (serving.deltas)."""

    place: ChunkPlace
    crc32c: int
    data: np.ndarray
    encoding: int = 0


def serve_chunks(
    manifest: Manifest,
    plan: ReadPlan,
    streamer: PooledStreamer,
    read_ahead_bytes: int,
    cache: UnitCache | None,
    on_read: Callable[[int], None],
    record: BlockRecorder | None = None,
) -> Iterator[ServedChunk]:
    """Every chunk of plan, in an order of the reads' choosing; on_read(n) is told of each n bytes read from
    storage, record of the block CRC32Cs of the chunks checksummed here (plan: whole tensors or byte ranges)."""
    if not plan.files:
        return
    with open_plan(manifest, plan) as files:
        if cache is None:
            # A source whose bytes never change (a published revision) keeps the CRC32Cs of its chunks.
            kept: Callable[[SourceFile, int, np.ndarray], int] | None = getattr(manifest.source, "chunk_crc32c", None)
            for file_id, index, data in read_units(streamer, manifest, plan, read_ahead_bytes, files):
                on_read(data.numel())
                file_plan = plan.files[file_id]
                unit = file_plan.places[index]
                if kept is None or unit.gather is not None:
                    yield from _chunks(unit, data.numpy(), plan.chunk_bytes, record)
                    continue
                file, at = manifest.files[file_plan.file_index], file_plan.offsets[index] - unit.place.offset
                for place, piece in _cut(unit.place, data.numpy(), plan.chunk_bytes):
                    yield ServedChunk(place, kept(file, at + place.offset, piece), piece)
        else:
            yield from _through_cache(manifest, plan, streamer, read_ahead_bytes, cache, on_read, files, record)
        files.check_all_unchanged()
        if record is not None:
            record.commit()


def _through_cache(
    manifest: Manifest,
    plan: ReadPlan,
    streamer: PooledStreamer,
    read_ahead_bytes: int,
    cache: UnitCache,
    on_read: Callable[[int], None],
    files: OpenFiles,
    record: BlockRecorder | None,
) -> Iterator[ServedChunk]:
    claims: list[tuple[UnitPlace, Claim]] = []
    for file_plan in plan.files:
        for index, unit in enumerate(file_plan.places):
            claims.append((unit, cache.claim(unit_key(manifest, file_plan, index))))
    leading = [(unit, claim) for unit, claim in claims if claim.leader]
    # Each claim lets go of its unit once the unit is sent: a stream must not keep every unit it
    # sent alive until it ends (a whole model, however small the cache).
    try:
        for unit, claim in claims:
            if claim.unit is not None:
                yield from _from_cached(unit, claim.unit, plan.chunk_bytes, record)
                claim.unit = None
        if leading:
            sub = _subplan(plan, {id(claim) for _, claim in leading}, claims)
            for file_id, index, data in read_units(streamer, manifest, sub.plan, read_ahead_bytes, files):
                on_read(data.numel())
                unit, claim = sub.claims[file_id][index]
                cached = _to_cached(unit, data.numpy(), plan.chunk_bytes, record)
                cache.publish(claim, cached)
                claim.future = None
                yield from _from_cached(unit, cached, plan.chunk_bytes, record)
        for unit, claim in claims:
            if claim.future is not None and not claim.leader:
                cached = _wait_or_read(
                    manifest, plan, streamer, read_ahead_bytes, cache, unit, claim, on_read, files, record
                )
                claim.future = None
                yield from _from_cached(unit, cached, plan.chunk_bytes, record)
    finally:
        for _, claim in leading:
            if claim.future is not None and not claim.future.done():
                cache.abandon(claim, RuntimeError("the stream that read this unit ended first"))


def unit_key(manifest: Manifest, file_plan: FilePlan, index: int) -> UnitKey:
    """The cache's key of read unit index of file_plan: the file's version and the unit's byte range."""
    f = manifest.files[file_plan.file_index]
    return (f.path, f.size, f.fingerprint, file_plan.offsets[index], file_plan.sizes[index])


@dataclass
class _SubPlan:
    plan: ReadPlan
    # claims[i][j]: the unit and claim of read j of plan.files[i].
    claims: list[list[tuple[UnitPlace, Claim]]]


def _subplan(plan: ReadPlan, chosen: set[int], claims: list[tuple[UnitPlace, Claim]]) -> _SubPlan:
    """The part of plan whose claims are in chosen (by id), in plan order."""
    files: list[FilePlan] = []
    owners: list[list[tuple[UnitPlace, Claim]]] = []
    position = 0
    for file_plan in plan.files:
        part = FilePlan(file_plan.file_index)
        mine: list[tuple[UnitPlace, Claim]] = []
        for index, unit in enumerate(file_plan.places):
            claim = claims[position][1]
            position += 1
            if id(claim) in chosen:
                part.offsets.append(file_plan.offsets[index])
                part.sizes.append(file_plan.sizes[index])
                part.places.append(unit)
                mine.append((unit, claim))
        if part.sizes:
            files.append(part)
            owners.append(mine)
    count = sum(len(f.sizes) for f in files)
    total = sum(unit.place.length for f in files for unit in f.places)
    return _SubPlan(ReadPlan(tuple(files), total, count, plan.chunk_bytes), owners)


def _wait_or_read(
    manifest: Manifest,
    plan: ReadPlan,
    streamer: PooledStreamer,
    read_ahead_bytes: int,
    cache: UnitCache,
    unit: UnitPlace,
    claim: Claim,
    on_read: Callable[[int], None],
    files: OpenFiles,
    record: BlockRecorder | None,
) -> CachedUnit:
    """The unit another stream is reading; read here instead if that read fails or takes too long."""
    assert claim.future is not None
    try:
        return claim.future.result(timeout=SHARED_READ_WAIT_S)
    except FutureTimeout:
        logger.info("tensor %r: a shared read took over %.0f s; reading it here", unit.place.tensor, SHARED_READ_WAIT_S)
    except Exception:
        pass  # the reading stream ended first; read it here
    again = cache.claim(claim.key)
    if again.unit is not None:
        return again.unit
    path, _, _, offset, length = claim.key
    file_index = next(i for i, f in enumerate(manifest.files) if f.path == path)
    single = FilePlan(file_index, [offset], [length], [unit])
    one = ReadPlan((single,), unit.place.length, 1, plan.chunk_bytes)
    try:
        for _, _, data in read_units(streamer, manifest, one, read_ahead_bytes, files):
            on_read(data.numel())
            cached = _to_cached(unit, data.numpy(), plan.chunk_bytes, record)
            if again.leader:
                cache.publish(again, cached)
            return cached
    finally:
        if again.leader and again.future is not None and not again.future.done():
            cache.abandon(again, RuntimeError("the stream that read this unit ended first"))
    raise AssertionError("read_units checks that every read arrives")  # pragma: no cover


def _to_cached(unit: UnitPlace, data: np.ndarray, chunk_bytes: int, record: BlockRecorder | None) -> CachedUnit:
    """The unit's bytes copied out of the streamer's ring, with its chunks' CRC32Cs (not for rows to gather)."""
    if unit.gather is not None:
        return CachedUnit.copy_of(data, None)
    chunks = tuple((place, _checksum(place, piece, record)) for place, piece in _cut(unit.place, data, chunk_bytes))
    return CachedUnit.copy_of(data, chunks)


def _from_cached(
    unit: UnitPlace, cached: CachedUnit, chunk_bytes: int, record: BlockRecorder | None
) -> Iterator[ServedChunk]:
    """The chunks of unit out of a cached unit, with the cached CRC32Cs when the chunks are the same."""
    if unit.gather is None and cached.chunks is not None:
        layout = list(_cut(unit.place, cached.data, chunk_bytes))
        if [place for place, _ in layout] == [place for place, _ in cached.chunks]:
            for (place, piece), (_, crc) in zip(layout, cached.chunks, strict=True):
                yield ServedChunk(place, crc, piece)
            return
    yield from _chunks(unit, cached.data, chunk_bytes, record)


def unit_output(unit: UnitPlace, data: np.ndarray) -> np.ndarray:
    """What a read unit's bytes give to unit.place: themselves, or the slice gathered out of its rows."""
    gather = unit.gather
    if gather is None:
        return data
    rows = data.size // gather.row_bytes
    return np.ascontiguousarray(
        data.reshape(rows, gather.row_bytes)[:, gather.first : gather.first + gather.width]
    ).reshape(-1)


def _chunks(unit: UnitPlace, data: np.ndarray, chunk_bytes: int, record: BlockRecorder | None) -> Iterator[ServedChunk]:
    """The unit's output (gathered, for a slice of rows) cut into checksummed chunks."""
    data = unit_output(unit, data)
    if unit.gather is not None:
        record = None  # rows of a slice: not a range of the tensor's bytes
    for place, piece in _cut(unit.place, data, chunk_bytes):
        yield ServedChunk(place, _checksum(place, piece, record), piece)


def _checksum(place: ChunkPlace, piece: np.ndarray, record: BlockRecorder | None) -> int:
    """The CRC32C of a chunk's bytes, its blocks' recorded when record is given."""
    if record is None:
        return wire.crc32c_at(piece.ctypes.data, place.length)
    return record.checksum(place, piece.ctypes.data)


def _cut(place: ChunkPlace, data: np.ndarray, chunk_bytes: int) -> Iterator[tuple[ChunkPlace, np.ndarray]]:
    for start, length in wire.split_range(0, place.length, chunk_bytes):
        yield ChunkPlace(place.tensor, place.offset + start, length), data[start : start + length]
