"""The server's cache of read units, shared by every stream, with single-flight reads.

Keys name a read unit by what was read: the file (path, size and fingerprint: modification time
or ETag, and a local file's device, inode and change time, so a changed or replaced file never
hits), and the byte range. Values are CachedUnit: the unit's bytes,
with the CRC32C of each chunk as first sent, so a later stream sending the same chunks computes no
checksum.

Single-flight: the first stream to miss a unit claims it and reads it; streams that want it
meanwhile wait for that read instead of reading it again. A claimer that fails or is cancelled
abandons its claims, and waiters then read the unit themselves.

Memory: resident bytes stay within capacity_bytes; least recently used units are evicted first,
and a unit larger than the whole cache is shared with its waiters but not kept. Units are never
written after they are made, so a stream may keep using one after it was evicted; its memory is
unmapped when the last reference goes.

Concurrency: every method may be called from any thread.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from weightstream_server.storage.reads import ChunkPlace

UnitKey = tuple[str, int, str, int, int]  # path, file size, file fingerprint, offset, length
# How long a stream waits for another stream's read of a unit before reading it itself: the other
# stream moves at its own client's pace, and a stalled client must not stall everyone.
SHARED_READ_WAIT_S = 30.0


@dataclass(frozen=True)
class CachedUnit:
    """A read unit's bytes, in memory of their own, and the CRC32C of each chunk they were first sent as."""

    data: np.ndarray
    # (chunk place, CRC32C) of each chunk in the layout the reading stream sent; None for rows to gather.
    chunks: tuple[tuple[ChunkPlace, int], ...] | None

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    @classmethod
    def copy_of(cls, data: np.ndarray, chunks: tuple[tuple[ChunkPlace, int], ...] | None) -> CachedUnit:
        """A copy of data in an anonymous mapping of its own, which goes back to the kernel when the unit is dropped.

        Cached units outlive the streams and threads that read them; out of malloc's heaps, freed
        units would stay resident in whichever thread's arena held them, and the process would grow
        well past the cache's bound, several times over.
        """
        buffer = np.frombuffer(mmap.mmap(-1, max(1, data.size)), dtype=np.uint8, count=data.size)
        buffer[:] = data
        return cls(buffer, chunks)


@dataclass(frozen=True)
class CacheSnapshot:
    capacity_bytes: int
    resident_bytes: int
    units: int
    hits: int
    misses: int
    # Misses that waited for another stream's read of the same unit instead of reading it again.
    shared: int
    evictions: int


class Claim:
    """What a stream does about one unit: use `unit` (a hit), wait for `future`, or read it (`leader`)."""

    __slots__ = ("future", "key", "leader", "unit")

    def __init__(self, key: UnitKey, unit: CachedUnit | None, future: Future[CachedUnit] | None, leader: bool) -> None:
        self.key = key
        self.unit = unit
        self.future = future
        self.leader = leader


class UnitCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._units: OrderedDict[UnitKey, CachedUnit] = OrderedDict()
        self._in_flight: dict[UnitKey, Future[CachedUnit]] = {}
        self._resident = 0
        self._hits = 0
        self._misses = 0
        self._shared = 0
        self._evictions = 0

    def claim(self, key: UnitKey) -> Claim:
        """A hit, a read in flight to wait for, or a claim this caller must publish() or abandon()."""
        with self._lock:
            unit = self._units.get(key)
            if unit is not None:
                self._units.move_to_end(key)
                self._hits += 1
                return Claim(key, unit, None, False)
            self._misses += 1
            future = self._in_flight.get(key)
            if future is not None:
                self._shared += 1
                return Claim(key, None, future, False)
            future = Future()
            self._in_flight[key] = future
            return Claim(key, None, future, True)

    def peek(self, key: UnitKey) -> CachedUnit | None:
        """The unit of key if it is kept now (no claim, no read; not counted as a hit or a miss)."""
        with self._lock:
            unit = self._units.get(key)
            if unit is not None:
                self._units.move_to_end(key)
            return unit

    def publish(self, claim: Claim, unit: CachedUnit) -> None:
        """Hand a claimed unit's bytes to its waiters and keep them, evicting older units to fit."""
        assert claim.leader and claim.future is not None
        with self._lock:
            self._in_flight.pop(claim.key, None)
            size = unit.nbytes
            if size <= self.capacity_bytes and claim.key not in self._units:
                while self._resident + size > self.capacity_bytes and self._units:
                    _, evicted = self._units.popitem(last=False)
                    self._resident -= evicted.nbytes
                    self._evictions += 1
                self._units[claim.key] = unit
                self._resident += size
        claim.future.set_result(unit)

    def get_or_read(self, key: UnitKey, read: Callable[[], np.ndarray]) -> tuple[CachedUnit, bool]:
        """The unit of key: kept, read by another caller meanwhile (waited for up to SHARED_READ_WAIT_S),
        or else read() here and published; and whether it was read here."""
        claim = self.claim(key)
        if claim.unit is not None:
            return claim.unit, False
        if not claim.leader:
            assert claim.future is not None
            try:
                return claim.future.result(timeout=SHARED_READ_WAIT_S), False
            except Exception:  # that read failed or took too long (FutureTimeout): read it here
                claim = self.claim(key)
                if claim.unit is not None:
                    return claim.unit, False
        try:
            unit = CachedUnit.copy_of(read(), None)
        except BaseException as exc:
            if claim.leader:
                self.abandon(claim, exc)
            raise
        if claim.leader:
            self.publish(claim, unit)
        return unit, True

    def abandon(self, claim: Claim, error: BaseException) -> None:
        """Give up a claim (the read failed or its stream ended); waiters then read the unit themselves."""
        assert claim.leader and claim.future is not None
        with self._lock:
            if self._in_flight.get(claim.key) is claim.future:
                del self._in_flight[claim.key]
        if not claim.future.done():
            claim.future.set_exception(error)

    def snapshot(self) -> CacheSnapshot:
        with self._lock:
            return CacheSnapshot(
                self.capacity_bytes,
                self._resident,
                len(self._units),
                self._hits,
                self._misses,
                self._shared,
                self._evictions,
            )
