"""The ring of a shared stream: credit flow control over its slots, and writing chunks into them.

Memory: each stream holds one segment of slots * slot_bytes, whatever the client's speed: a slot is
filled again only after the client has returned it (a credit).

Threading: the stream's own thread fills slots (fill_slots) and sends; one thread per stream reads
the client's credits (read_credits); they meet in Credits. Filling slots on a thread apart from the
sends is slower (GIL handoffs between the threads), so filling stays on the stream's thread; only
direct reads that must wait for storage run on reader.DirectReader's threads, as futures.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from weightstream.protocol.shm import aligned
from weightstream_server.errors import ClientGone, InvalidRequest, RequestTimeout, ServerError
from weightstream_server.serving.chunks import ServedChunk
from weightstream_server.serving.reader import DirectRead
from weightstream_server.storage.reads import ChunkPlace
from weightstream_server.transports.shm.segments import Segment

logger = logging.getLogger(__name__)


class Credits:
    """The free slots of one ring: the stream's thread takes them, the credit thread returns them.

    close() wakes a waiting take(), which then returns None; fail() also records why.
    """

    def __init__(self, slots: int) -> None:
        self._free = list(range(slots - 1, -1, -1))
        self._in_flight: set[int] = set()
        self._slots = slots
        self._cond = threading.Condition()
        self._closed = False
        self._attached = False
        self.error: ServerError | None = None

    def attach(self) -> None:
        with self._cond:
            self._attached = True
            self._cond.notify_all()

    def wait_attached(self, timeout: float) -> bool:
        """Wait up to timeout s until the client has mapped the segment; False if closed first or too late."""
        with self._cond:
            self._cond.wait_for(lambda: self._attached or self._closed, timeout)
            return self._attached

    @property
    def closed(self) -> bool:
        return self._closed

    def take(self, block: bool = True) -> int | None:
        """A free slot; None once closed, or (block False) when none is free now."""
        with self._cond:
            while block and not self._free and not self._closed:
                self._cond.wait()
            if self._closed or not self._free:
                return None
            slot = self._free.pop()
            self._in_flight.add(slot)
            return slot

    def release(self, slots: Iterable[int]) -> None:
        with self._cond:
            for slot in slots:
                if slot not in self._in_flight:
                    raise InvalidRequest(f"released slot {slot} is not in flight (the ring has {self._slots} slots)")
                self._in_flight.discard(slot)
                self._free.append(slot)
            self._cond.notify_all()

    def fail(self, error: ServerError) -> None:
        with self._cond:
            if self.error is None:
                self.error = error
        self.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def read_credits(
    releases: Iterator[Iterable[int]], credits: Credits, segment: Segment, handover_timeout: float
) -> None:
    """Hand the segment over, then return the slots the client releases (one iterable per client
    message) until its messages end. The first message means the client has mapped the segment.
    """
    try:
        segment.hand_over(handover_timeout, ended=lambda: credits.closed)
        for released in releases:
            credits.attach()
            credits.release(released)
    except grpc.RpcError:
        pass  # the call was cancelled or ended; the stream's own thread finds out from the context
    except (InvalidRequest, RequestTimeout) as exc:
        credits.fail(exc)
    except Exception:
        logger.exception("reading credits failed")
        credits.fail(InvalidRequest("malformed credit message"))
    finally:
        credits.close()


@dataclass(frozen=True)
class SlotWrite:
    """One chunk on its way into a slot: where it belongs, and write(address), which puts its
    payload there (place.length bytes, or encoded_length for an encoded chunk) and gives the
    chunk's CRC32C, at once or as a future of the read under way."""

    place: ChunkPlace
    write: Callable[[int], int | Future[int]]
    encoding: int = 0
    encoded_length: int = 0

    @property
    def size(self) -> int:
        """The bytes it takes in the slot."""
        return self.encoded_length if self.encoding else self.place.length


def copied(chunk: ServedChunk) -> SlotWrite:
    """A chunk of the chunk source (its data valid until the next is taken), copied into the slot."""

    def write(address: int) -> int:
        ctypes.memmove(address, chunk.data.ctypes.data, chunk.data.size)
        # Taken on the source bytes; the client checks it on the slot, after both copies.
        return chunk.crc32c

    encoded = chunk.data.size if chunk.encoding else 0
    return SlotWrite(chunk.place, write, chunk.encoding, encoded)


def read_into(read: DirectRead) -> SlotWrite:
    """A chunk of a local file, read by the kernel straight into the slot; its CRC32C is taken there."""
    return SlotWrite(read.place, read.start)


@dataclass(frozen=True)
class SlotChunk:
    """A chunk in a filled slot: its place, where in the slot it starts, and the CRC32C of its bytes."""

    place: ChunkPlace
    slot_offset: int
    crc32c: int
    encoding: int = 0
    encoded_length: int = 0


@dataclass(frozen=True)
class FilledSlot:
    """A slot whose writes are all done: its chunks, and their payload bytes together."""

    slot: int
    chunks: tuple[SlotChunk, ...]
    nbytes: int


@dataclass
class _Filling:
    """A slot being filled: its chunks' places, slot offsets and CRC32Cs (or futures of them)."""

    slot: int
    chunks: list[tuple[SlotWrite, int, int | Future[int]]] = field(default_factory=list)
    nbytes: int = 0

    def futures(self) -> list[Future[int]]:
        return [crc for _, _, crc in self.chunks if isinstance(crc, Future)]

    def done(self) -> bool:
        return all(f.done() for f in self.futures())

    def filled(self) -> FilledSlot:
        """The slot once its writes are done (waits for them; a failed read raises here)."""
        chunks = tuple(
            SlotChunk(
                item.place, at, crc.result() if isinstance(crc, Future) else crc, item.encoding, item.encoded_length
            )
            for item, at, crc in self.chunks
        )
        return FilledSlot(self.slot, chunks, self.nbytes)


def fill_slots(
    writes: Iterator[SlotWrite],
    segment: Segment,
    credits: Credits,
    waiting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> Iterator[FilledSlot]:
    """Write chunks into free slots; yield each slot once it is filled and every write into it is done.

    Small chunks share a slot (each at a SLOT_ALIGN boundary); a slot is closed once it is full or
    the next chunk does not fit in it. The caller announces each slot yielded to the client in one
    message, and the client returns the slot once it has placed that message. Writes may still run
    when they return (futures): then several slots fill at once, and slots are yielded in the
    order they were filled. Before waiting for a free slot, every closed slot is yielded (waiting
    for its writes), so the client always has every filled slot and the ring cannot deadlock.
    Raises ClientGone when the ring closes while a slot is awaited, or the error the credit
    thread met. A wait for a slot the client must return runs inside waiting() (the stall rule).
    On the way out, however it ends, no write into the segment is left running.
    """
    closed: collections.deque[_Filling] = collections.deque()
    current: _Filling | None = None
    used = 0
    try:
        for item in writes:
            length = item.size
            at = aligned(used)
            if current is not None and at + length > segment.slot_bytes:
                closed.append(current)
                current = None
            if current is None:
                while closed and closed[0].done():
                    yield _take_filled(closed)
                slot = credits.take(block=False)
                while slot is None:
                    if closed:
                        yield _take_filled(closed)
                        slot = credits.take(block=False)
                        continue
                    with waiting():
                        slot = credits.take()
                    if slot is None:
                        if credits.error is not None:
                            raise credits.error
                        raise ClientGone()
                current = _Filling(slot)
                at = 0
            current.chunks.append((item, at, item.write(segment.slot_region(current.slot).at(at, length))))
            current.nbytes += length
            used = at + length
            if aligned(used) >= segment.slot_bytes:
                closed.append(current)
                current = None
        if current is not None:
            closed.append(current)
            current = None
        while closed:
            yield _take_filled(closed)
    finally:
        running = [f for filling in (*closed, *([current] if current else [])) for f in filling.futures()]
        for future in running:
            future.cancel()
        concurrent.futures.wait(running)


def _take_filled(closed: collections.deque[_Filling]) -> FilledSlot:
    """The oldest closed slot, once its writes are done; if one failed, the slot stays for the cleanup."""
    filled = closed[0].filled()
    closed.popleft()
    return filled
