"""Sparse updates: a chunk sent as a compressed XOR against a revision the client already holds.

A client updating from revision A to B marks the tensors whose destinations hold A's bytes
(TensorRequest.delta) and names A (StreamTensorsRequest.delta_base). While the server holds A's
bytes (a published revision in memory; a storage revision's read units in the RAM cache, as a full
load of them left them, for whole tensors and slices along their first dimension; or its files still
on this node's disk, a tier's disk cache copy of a version rewritten above: base_files), each chunk
of those tensors goes out in the cheapest of:
- a delta: the XOR of B's bytes with A's bytes at the same place (the same tensor, slice and
  offset), sparse or dense, compressed with zstd, when that is cheaper (weightstream.protocol.deltas:
  the forms, the thresholds, the one encoder for every side);
- the bytes themselves: when A's layout of the tensor differs, or the XOR is dense (more than
  DENSE of its bytes nonzero in a few spread samples, then in the whole chunk), so that a chunk
  whose every element changed costs a few small XORs, not a compression that gives up;
and chunks that did not change at all are never asked for (GetChanges, per block CRC32C). The
chunk's crc32c is always B's, so the client checks the result of its XOR: a destination that did
not hold A there (written since) fails the check and is asked for again, whole.

A (model, A, B, tensor, slice, offset, length) delta is computed once and kept (Deltas: single
flight, at most budget_bytes of payloads, least recently used first out), so a fleet of engines
and ranks updating between the same revisions costs one computation per chunk. A publish with
delta_base A (revisions.published) brings B's deltas computed: its payloads, and its choice to send
a chunk of a tensor A holds whole, are kept as the A -> B deltas of their chunks (keep_published), so
the first engine updating from A finds them ready. They match a served chunk only where the layouts
agree: a whole tensor, chunk by chunk (every block changed, or changed ranges that start and end on
the publisher's chunk grid), and the publisher's chunk size the stream's. Elsewhere (another chunk
size, a changed range that starts inside a publisher's chunk, a slice) the served chunk's delta is
computed from A's bytes as without them: one computation per chunk, kept for the engines after. A base that the
server does not hold (a revision no longer kept, units evicted from the cache) gets those chunks
whole, no error, and so does a chunk whose delta cannot be made. Concurrency: Deltas is shared by every
stream; encode runs on the stream's thread, with the stream's own scratch buffer and compressor.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from weightstream.protocol import deltas as delta_forms
from weightstream.protocol import wire
from weightstream.protocol.wire import TensorSlice
from weightstream_server.serving.base_files import BaseFiles
from weightstream_server.serving.cache import UnitCache
from weightstream_server.serving.catalog import Manifest
from weightstream_server.serving.chunks import ServedChunk, unit_key, unit_output
from weightstream_server.serving.read_plan import plan_reads, slice_layout
from weightstream_server.storage.reads import ChunkPlace, UnitPlace

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
# Kept entries at most, whatever their size (a whole-chunk decision holds no payload but a key).
MAX_KEPT = 65536
# How long a stream waits for another one's computation of the same delta before doing it itself.
FLIGHT_WAIT_S = 30.0

# (model, base revision, revision, tensor, slice (dim, start, stop) or None, offset, length)
DeltaKey = tuple[str, str, str, str, tuple[int, int, int] | None, int, int]
# (encoding, payload) of a delta; None: the chunk goes whole.
Delta = tuple[int, bytes] | None
# (tensor, offset, length) of a chunk of a whole tensor, as a publish sent it.
ChunkKey = tuple[str, int, int]
_Compute = Callable[[], Delta]


@dataclass
class DeltaStats:
    """What the deltas cost and saved, since the server started."""

    computed: int = 0
    reused: int = 0
    # Deltas kept from delta publishes (keep_published), each served without a computation.
    published: int = 0
    delta_chunks: int = 0
    # Of those, in the sparse form.
    sparse_chunks: int = 0
    raw_chunks: int = 0
    # Payload bytes of the deltas sent, and the chunk bytes they stood for.
    delta_bytes: int = 0
    covered_bytes: int = 0
    raw_bytes: int = 0
    compute_seconds: float = 0.0


class Deltas:
    """Deltas computed once and kept within budget_bytes (payloads); thread-safe."""

    def __init__(self, budget_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.stats = DeltaStats()
        self._lock = threading.Lock()
        self._kept: OrderedDict[DeltaKey, Delta] = OrderedDict()
        self._kept_bytes = 0
        self._flights: dict[DeltaKey, threading.Event] = {}

    @property
    def kept_bytes(self) -> int:
        return self._kept_bytes

    def snapshot(self) -> DeltaStats:
        """The counters as they are now (a copy)."""
        with self._lock:
            return dataclasses.replace(self.stats)

    def encode(
        self,
        chunks: Iterator[ServedChunk],
        revision: Manifest,
        base: Manifest,
        wanted: Mapping[str, TensorSlice | None],
        cache: UnitCache | None = None,
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
    ) -> Iterator[ServedChunk]:
        """chunks of revision, those of the wanted tensors (name: the slice asked, or None) as deltas
        against base where that is cheaper. base's bytes are read from its memory (a source in_memory),
        else from cache's units (as a load with chunk_bytes read them), else from its files held on disk;
        a chunk they do not cover goes whole."""
        same = {
            name
            for name in wanted
            if name in base.by_name
            and name in revision.by_name
            and base.by_name[name].dtype == revision.by_name[name].dtype
            and base.by_name[name].shape == revision.by_name[name].shape
        }
        work = _Work(cache, chunk_bytes)
        try:
            yield from self._encoded(chunks, revision, base, wanted, same, work)
        finally:
            work.close()

    def _encoded(
        self,
        chunks: Iterator[ServedChunk],
        revision: Manifest,
        base: Manifest,
        wanted: Mapping[str, TensorSlice | None],
        same: set[str],
        work: _Work,
    ) -> Iterator[ServedChunk]:
        for chunk in chunks:
            name = chunk.place.tensor
            if name not in same or not chunk.place.length:
                yield chunk
                continue
            slice_ = wanted[name]
            key: DeltaKey = (
                revision.model,
                base.revision,
                revision.revision,
                name,
                (slice_.dim, slice_.start, slice_.stop) if slice_ is not None else None,
                chunk.place.offset,
                chunk.place.length,
            )
            delta = self._delta(key, functools.partial(self._compute, base, slice_, chunk, work))
            with self._lock:
                if delta is None:
                    self.stats.raw_chunks += 1
                    self.stats.raw_bytes += chunk.place.length
                else:
                    self.stats.delta_chunks += 1
                    self.stats.sparse_chunks += delta[0] == delta_forms.SPARSE_XOR_ZSTD
                    self.stats.delta_bytes += len(delta[1])
                    self.stats.covered_bytes += chunk.place.length
            if delta is None:
                yield chunk
            else:
                encoding, payload = delta
                yield ServedChunk(chunk.place, chunk.crc32c, np.frombuffer(payload, dtype=np.uint8), encoding)

    def _delta(self, key: DeltaKey, compute: _Compute) -> Delta:
        """The kept delta of key, computed here (once for every stream asking at the same time) if it is not kept."""
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                self.stats.reused += 1
                return self._kept[key]
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = threading.Event()
        if not leader:
            flight.wait(FLIGHT_WAIT_S)
            with self._lock:
                if key in self._kept:
                    self.stats.reused += 1
                    return self._kept[key]
            return self._timed(compute)  # the other stream failed or is slow: not kept, not waited for again
        try:
            payload = self._timed(compute)
            with self._lock:
                self._keep(key, payload)
            return payload
        finally:
            with self._lock:
                self._flights.pop(key, None)
            flight.set()

    def keep_published(self, model: str, base: str, revision: str, chunks: Mapping[ChunkKey, Delta]) -> None:
        """Keep what a publish of revision with delta base base sent for its chunks of tensors base holds
        (tensor, offset, length: its payload, or None for a chunk sent whole) as their base -> revision
        deltas, within the budget like the computed ones."""
        with self._lock:
            for (tensor, offset, length), delta in chunks.items():
                self._keep((model, base, revision, tensor, None, offset, length), delta)
            self.stats.published += len(chunks)

    def forget(self, model: str, revision: str) -> None:
        """Drop the deltas from or to model's revision (it is no longer kept: its name may be used again)."""
        with self._lock:
            gone = [key for key in self._kept if key[0] == model and revision in (key[1], key[2])]
            for key in gone:
                dropped = self._kept.pop(key)
                self._kept_bytes -= len(dropped[1]) if dropped is not None else 0

    def _timed(self, compute: _Compute) -> Delta:
        started = time.thread_time()
        try:
            return compute()
        except BaseNotHeld as exc:
            logger.debug("no delta: %s", exc)
            return None
        except Exception:
            # A whole chunk is always right: a delta that cannot be made costs bytes, not the stream.
            logger.exception("a delta could not be computed; the chunk goes whole")
            return None
        finally:
            with self._lock:
                self.stats.computed += 1
                self.stats.compute_seconds += time.thread_time() - started

    def _keep(self, key: DeltaKey, delta: Delta) -> None:
        size = len(delta[1]) if delta is not None else 0
        if size > self.budget_bytes:
            return
        replaced = self._kept.pop(key, None)
        self._kept_bytes -= len(replaced[1]) if replaced is not None else 0
        self._kept[key] = delta
        self._kept_bytes += size
        while self._kept_bytes > self.budget_bytes or len(self._kept) > MAX_KEPT:
            _, dropped = self._kept.popitem(last=False)
            self._kept_bytes -= len(dropped[1]) if dropped is not None else 0

    def _compute(self, base: Manifest, slice_: TensorSlice | None, chunk: ServedChunk, work: _Work) -> Delta:
        """The delta of chunk against base (its encoding and payload), or None when the chunk should go whole."""
        place = chunk.place
        length = place.length
        xor = work.scratch(length)
        # A few samples first: a chunk whose every element changed is known for dense at a small cost.
        sample, starts = delta_forms.sample_starts(length)
        nonzero = 0
        for start in starts:
            _xor_base(
                base, place.tensor, slice_, place.offset + start, chunk.data[start : start + sample], xor[start:], work
            )
            nonzero += int(np.count_nonzero(xor[start : start + sample]))
        if nonzero > delta_forms.DENSE * sample * len(starts):
            return None
        _xor_base(base, place.tensor, slice_, place.offset, chunk.data, xor, work)
        return work.codec.encode(torch.from_numpy(xor[:length]), place.offset)


class _Work:
    """One stream's scratch buffer and codec (zstd contexts are not safe to share between threads),
    made when its first delta is computed, gone with the stream."""

    def __init__(self, cache: UnitCache | None = None, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES) -> None:
        self._scratch: np.ndarray | None = None
        self.codec = delta_forms.Codec()
        # Where a storage base's bytes may be found, and the chunk size its units were read for.
        self.cache = cache
        self.chunk_bytes = chunk_bytes
        # A storage base's files still on this node's disk, and a buffer for what is read of them.
        self._files: BaseFiles | None = None
        self._read: np.ndarray | None = None

    def scratch(self, length: int) -> np.ndarray:
        if self._scratch is None or self._scratch.size < length:
            self._scratch = np.empty(max(length, wire.DEFAULT_CHUNK_BYTES), dtype=np.uint8)
        return self._scratch

    def files(self, base: Manifest) -> BaseFiles:
        if self._files is None:
            self._files = BaseFiles(base)
        return self._files

    def read_buffer(self, length: int) -> np.ndarray:
        if self._read is None or self._read.size < length:
            self._read = np.empty(max(length, wire.DEFAULT_CHUNK_BYTES), dtype=np.uint8)
        return self._read[:length]

    def close(self) -> None:
        if self._files is not None:
            self._files.close()


class BaseNotHeld(Exception):
    """The base revision's bytes of a chunk are not in this server's memory (the chunk goes whole)."""


def _xor_base(
    base: Manifest,
    tensor: str,
    slice_: TensorSlice | None,
    offset: int,
    new: np.ndarray,
    out: np.ndarray,
    work: _Work,
) -> None:
    """out[: new.size] = new XOR base's bytes of tensor (its slice) from offset, read from base's memory (a
    published revision), else from the RAM cache's units of base's files, else from those files as this
    node's disk still holds them (base_files); BaseNotHeld where they are in none of these."""
    end = offset + new.size
    if getattr(base.source, "in_memory", False):
        plan = plan_reads(base, [(tensor, [(offset, end)], slice_)], wire.MAX_CHUNK_BYTES)
        units = base.source.read_units(base.files, plan)
        if units is None:
            raise BaseNotHeld(f"model {base.model!r}: revision {base.revision} is not held in memory")
        pieces: Iterator[tuple[UnitPlace, np.ndarray]] = (
            (plan.files[f].places[i], unit_output(plan.files[f].places[i], d.numpy())) for f, i, d in units
        )
        covered = _xor_pieces(pieces, offset, new, out)
        if covered != new.size:
            raise BaseNotHeld(f"tensor {tensor!r}: the base's bytes at {offset}..{end} came to {covered} bytes")
        return
    if work.cache is not None:
        try:
            pieces = _cached_pieces(base, tensor, slice_, work)
            if slice_ is not None:  # a plain range of the tensor's bytes (dim 0): in the tensor's numbering
                first = slice_layout(base.tensor(tensor), slice_)[2]
                pieces = (
                    (UnitPlace(ChunkPlace(u.place.tensor, u.place.offset - first, u.place.length)), p)
                    for u, p in pieces
                )
            if _xor_pieces(pieces, offset, new, out) == new.size:
                return
        except BaseNotHeld:
            pass
    held = work.read_buffer(new.size)
    if not work.files(base).read_into(tensor, slice_, offset, held):
        raise BaseNotHeld(f"tensor {tensor!r}: the base's bytes at {offset}..{end} are not held here")
    np.bitwise_xor(new, held, out=out[: new.size])


def _xor_pieces(pieces: Iterator[tuple[UnitPlace, np.ndarray]], offset: int, new: np.ndarray, out: np.ndarray) -> int:
    """out = new XOR the pieces where they overlap new's range (from offset); the bytes so covered.

    A slice gathered out of whole rows may come in units wider than the range: only the range is taken.
    """
    end = offset + new.size
    covered = 0
    for unit, piece in pieces:
        lo, hi = max(offset, unit.place.offset), min(end, unit.place.offset + piece.size)
        if lo >= hi:
            continue
        np.bitwise_xor(
            new[lo - offset : hi - offset],
            piece[lo - unit.place.offset : hi - unit.place.offset],
            out=out[lo - offset : hi - offset],
        )
        covered += hi - lo
    return covered


def _cached_pieces(
    base: Manifest, tensor: str, slice_: TensorSlice | None, work: _Work
) -> Iterator[tuple[UnitPlace, np.ndarray]]:
    """The read units of base's tensor that the cache keeps, as a whole load of it read them."""
    cache = work.cache
    if cache is None:
        raise BaseNotHeld(f"model {base.model!r}: revision {base.revision} is not held (no cache)")
    if slice_ is not None and slice_layout(base.tensor(tensor), slice_)[0] != 1:
        raise BaseNotHeld(f"tensor {tensor!r}: a gathered slice of a storage revision")
    plan = plan_reads(base, [(tensor, [], None)], work.chunk_bytes)
    for file_plan in plan.files:
        for index, unit in enumerate(file_plan.places):
            cached = cache.peek(unit_key(base, file_plan, index))
            if cached is not None:
                yield unit, cached.data
