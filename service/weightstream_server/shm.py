"""The same-host transport: OpenSharedMemory and StreamTensorsShared, chunk bytes in a shared-memory ring.

A client next to the server (same pod, same host) offers a directory both can see (a pod's emptyDir
with medium Memory, or /dev/shm). OpenSharedMemory checks that the server sees it: the client wrote a
nonce file there, and the server must read back the same bytes. StreamTensorsShared then serves the
same chunks as StreamTensors, but their bytes lie in a ring of slots in one segment file in that
directory, and the gRPC messages carry only (tensor, offset, CRC32C, slot, slot offset).

Copies per byte on this side: where every file is local and in the page cache and no slice gathers
rows, one: the kernel reads the file straight into the slot (reader.DirectReader; the CRC32C is
then taken on the slot). Otherwise (S3, a cold page cache, a server cache, gathered slices) two:
the read into the streamer's ring or the cache, then one memmove into the slot; the chunk source
(chunks.serve_chunks, shared with StreamTensors) takes the CRC32C of the source bytes, so a fault
in the copy or in the ring's bookkeeping is caught. The client checks the CRC32C on the slot and
copies the slot into its parameter once. Measured here (benchmarks/shm_load.py), the direct read
cut the server's CPU per byte by about a third and made warm loads about 1.3x faster; from a cold
page cache the streamer's parallel reads were about 1.2x faster, so they keep those loads.

Memory: each stream holds one segment of slots * slot_bytes (at most the server's read-ahead
setting), whatever the client's speed: a slot is filled again only after the client returned it.

Segments: one file per stream, named weightstream-seg-<pid>-<random>, mode 0o640 (owner read-write,
group read: in Kubernetes, run both containers as one user, or give the pod an fsGroup, which
emptyDir files inherit). The server holds an exclusive flock on the file for the stream's life; the
file is unlinked as soon as the client has mapped it (its first message after the announcement)
and at stream end, so that what is left in the directory is only a crashed server's, before its
client attached. Start-up cleanup (remove_stale_segments) deletes segments that no process locks.

Threading: each stream runs on its gRPC worker thread (reads, copies, sends) plus one thread of its
own that reads the client's credits; they meet in _Credits. Filling slots on a thread apart from
the sends measured about 3x slower here (GIL handoffs between the threads), so it stays on one;
only the reads of a direct stream that must wait for storage go to DirectReader's threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import errno
import fcntl
import hmac
import logging
import mmap
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from weightstream import wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.chunks import ServedChunk, serve_chunks
from weightstream_server.errors import InvalidRequest, ServerError, SharedMemoryUnavailable, status_code
from weightstream_server.plan import ChunkPlace, plan_reads
from weightstream_server.reader import DirectRead, DirectReader, page_cached, reads_directly
from weightstream_server.servicer import (
    Handlers,
    Tally,
    parsing,
    parsing_stream,
    register,
    requested_tensors,
    start_stream,
)

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = wire.SHM_SEGMENT_PREFIX
SEGMENT_MODE = 0o640
DEFAULT_SLOTS = 4
CHUNKS_PER_SLOT = 4
MIN_SLOTS = 2
# Threads of a direct stream for the reads that miss the page cache (a file only partly cached):
# several requests in flight for the disk.
READ_THREADS = 8
MAX_SLOTS = 4096
# Chunks packed into one slot start on this boundary, so that every copy starts aligned.
SLOT_ALIGN = 64
# How long a stream that is done waits for its client to map the segment before giving up.
ATTACH_TIMEOUT_S = 60.0
# A nonce file is a few dozen bytes; anything much larger is not one.
MAX_NONCE_BYTES = 1024
_SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)-[0-9a-f]{16}")
# Clients write nonce files under this prefix (weightstream.client.shm) and remove them within a call.
_NONCE_NAME = re.compile(re.escape(wire.SHM_NONCE_PREFIX) + r"[0-9a-f]{16}")
NONCE_MAX_AGE_S = 600.0


class Segment:
    """One stream's ring: slots * slot_bytes in a file of the shared directory, mapped read-write.

    Ownership: the stream that created it; close() unlinks the file (if still there), unmaps it and
    drops the lock. Addresses into it are valid until close().
    """

    def __init__(self, directory: Path, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        size = slots * slot_bytes
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = directory / self.name
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._linked = True
        try:
            # Held until close(): start-up cleanup of another server skips files that someone locks.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(self._fd, SEGMENT_MODE)  # exactly this mode, whatever the umask
            # Allocate the pages now (tmpfs): a write to a hole would fault them in one by one.
            os.posix_fallocate(self._fd, 0, size)
            self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        except BaseException:
            self._unlink()
            os.close(self._fd)
            raise
        self._view = (ctypes.c_char * size).from_buffer(self._map)
        self.address = ctypes.addressof(self._view)

    def slot_address(self, slot: int) -> int:
        return self.address + slot * self.slot_bytes

    def unlink(self) -> None:
        """Remove the file from the directory (the mapping stays); called once the client has mapped it."""
        self._unlink()

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def close(self) -> None:
        self._unlink()
        if self._fd < 0:
            return
        del self._view
        self._map.close()
        os.close(self._fd)
        self._fd = -1


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def remove_stale_segments(directory: Path) -> int:
    """Delete the segments in directory that no process holds (left by a server that crashed); how many.

    A live segment is flock'ed by the server that made it, in whatever process or container, so a
    lock that can be taken means nobody uses the file. Nonce files older than NONCE_MAX_AGE_S (a
    client that crashed while negotiating) go too.
    """
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError as exc:
        logger.warning("shared-memory directory %s: cannot list it: %s", directory, exc.strerror or exc)
        return 0
    now = time.time()
    for entry in entries:
        if _NONCE_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > NONCE_MAX_AGE_S:
                    os.unlink(entry.path)
                    removed += 1
            continue
        if not _SEGMENT_NAME.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                logger.warning("segment %s: cannot check it: %s", entry.path, exc.strerror or exc)
            os.close(fd)
            continue
        try:
            os.unlink(entry.path)
            removed += 1
        except OSError as exc:
            logger.warning("stale segment %s: cannot remove it: %s", entry.path, exc.strerror or exc)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d stale shared-memory segments and nonce files from %s", removed, directory)
    return removed


class _Credits:
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


def _read_credits(requests: Iterator[pb.StreamTensorsSharedRequest], credits: _Credits, segment: Segment) -> None:
    """Return the slots the client releases until its request stream ends; the first message means attached."""
    try:
        for message in requests:
            segment.unlink()
            credits.attach()
            credits.release(message.released_slots)
    except grpc.RpcError:
        pass  # the call was cancelled or ended; the stream's own thread finds out from the context
    except InvalidRequest as exc:
        credits.fail(exc)
    except Exception:
        logger.exception("reading credits failed")
        credits.fail(InvalidRequest("malformed credit message"))
    finally:
        credits.close()


class SharedMemoryServicer(Handlers):
    """OpenSharedMemory and StreamTensorsShared; the stream reuses StreamTensors' checks, plan and reader."""

    @property
    def max_ring_bytes(self) -> int:
        # The ring is this stream's read-ahead as far as memory goes, so the same bound serves.
        return self._settings.read_ahead_bytes

    def OpenSharedMemory(
        self, request: pb.OpenSharedMemoryRequest, context: grpc.ServicerContext
    ) -> pb.OpenSharedMemoryResponse:
        try:
            directory = self._directory()
            check_nonce(directory, request.nonce_file, request.nonce)
            return pb.OpenSharedMemoryResponse(max_ring_bytes=self.max_ring_bytes)
        except Exception as exc:
            self._abort(context, "OpenSharedMemory", "", exc)
            raise  # unreachable: abort raises

    def StreamTensorsShared(
        self, requests: Iterator[pb.StreamTensorsSharedRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StreamTensorsSharedResponse]:
        """The first message names the segment; each later one carries the chunks of one or more filled slots.

        Every stream, however it ends, is counted in the stats, logged in one line at its end, and
        leaves no segment behind.
        """
        started = time.monotonic()
        peer = context.peer()
        tally = Tally()
        model_id = ""
        model: str | None = None
        tensors = 0
        code = grpc.StatusCode.OK
        segment: Segment | None = None
        credits: _Credits | None = None
        self._stats.stream_started()
        try:
            first = next(requests, None)
            if first is None or not first.HasField("request"):
                raise InvalidRequest("the first StreamTensorsSharedRequest must carry the request")
            directory = self._directory()
            request = first.request
            model_id = request.model
            manifest, chunk_bytes = start_stream(request, self._catalog, self._readiness, self._settings.chunk_bytes)
            model = manifest.model
            slots, slot_bytes = self._ring(first.slots, first.slot_bytes, chunk_bytes)
            # Every chunk fits in one slot.
            chunk_bytes = min(chunk_bytes, slot_bytes)
            requested = requested_tensors(request)
            plan = plan_reads(manifest, requested, chunk_bytes)
            tensors = len(requested) or len(manifest.tensors)
            with self._pool.checkout() as streamer:
                segment = Segment(directory, slots, slot_bytes)
                credits = _Credits(slots)
                context.add_callback(credits.close)
                threading.Thread(
                    target=_read_credits,
                    args=(requests, credits, segment),
                    name="weightstream-shm-credits",
                    daemon=True,
                ).start()
                # Straight into the slots when the bytes are local and in the page cache; from
                # storage the streamer's reads are faster (reader.DirectReader).
                direct = self._cache is None and reads_directly(manifest, plan) and page_cached(manifest, plan)
                logger.debug(
                    "shared stream %r from %s: %d tensors, %d bytes, ring %s (%d x %d bytes), %s",
                    request.model,
                    peer,
                    tensors,
                    plan.total_bytes,
                    segment.name,
                    slots,
                    slot_bytes,
                    "read into the slots" if direct else "copied into the slots from the streamer or the cache",
                )
                yield pb.StreamTensorsSharedResponse(segment=segment.name, slots=slots, slot_bytes=slot_bytes)
                with contextlib.ExitStack() as reads:  # closed (its reads finished) before the segment
                    if direct:
                        reader = reads.enter_context(DirectReader(manifest, plan, tally.count_read, READ_THREADS))
                        writes = map(_read_into, reader.reads())
                    else:
                        read_ahead = self._settings.read_ahead_bytes
                        chunks = serve_chunks(manifest, plan, streamer, read_ahead, self._cache, tally.count_read)
                        writes = map(_copied, chunks)
                    for message, payload_bytes in fill_slots(writes, segment, credits):
                        yield message
                        tally.sent += payload_bytes
                # A stream that fits in the ring is done before the client has even opened the
                # segment; ending now would remove the file under it.
                if not credits.wait_attached(ATTACH_TIMEOUT_S):
                    if credits.error is not None:
                        raise credits.error
                    if not context.is_active():
                        raise _ClientGone()
                    raise InvalidRequest(f"the client did not map {segment.name} within {ATTACH_TIMEOUT_S:.0f} s")
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED
            raise
        except _ClientGone:
            code = grpc.StatusCode.CANCELLED
        except Exception as exc:
            code = status_code(exc)
            self._abort(context, "StreamTensorsShared", model_id, exc)
        finally:
            if credits is not None:
                credits.close()
            if segment is not None:
                segment.close()
            self._stream_ended("shared stream", model_id, model, peer, tensors, tally, started, code)

    def _directory(self) -> Path:
        if self._settings.shm_dir is None:
            raise SharedMemoryUnavailable("this server has no shared-memory directory (--shm-dir); use StreamTensors")
        return self._settings.shm_dir

    def _ring(self, slots: int, slot_bytes: int, chunk_bytes: int) -> tuple[int, int]:
        """The ring a stream gets for what it asked (0: the defaults); refuses sizes out of bounds."""
        slots = slots or DEFAULT_SLOTS
        slot_bytes = slot_bytes or min(CHUNKS_PER_SLOT * chunk_bytes, wire.MAX_CHUNK_BYTES)
        if not MIN_SLOTS <= slots <= MAX_SLOTS:
            raise InvalidRequest(f"slots {slots} is outside {MIN_SLOTS}..{MAX_SLOTS} (0 means {DEFAULT_SLOTS})")
        if not wire.MIN_CHUNK_BYTES <= slot_bytes <= wire.MAX_CHUNK_BYTES or slot_bytes % SLOT_ALIGN:
            raise InvalidRequest(
                f"slot_bytes {slot_bytes} is outside {wire.MIN_CHUNK_BYTES}..{wire.MAX_CHUNK_BYTES} or not a "
                f"multiple of {SLOT_ALIGN} (0 means {CHUNKS_PER_SLOT} chunks)"
            )
        if slots * slot_bytes > self.max_ring_bytes:
            raise InvalidRequest(
                f"a ring of {slots} x {slot_bytes} bytes is larger than the {self.max_ring_bytes} bytes this "
                "server grants a stream (OpenSharedMemoryResponse.max_ring_bytes)"
            )
        return slots, slot_bytes


class _ClientGone(Exception):
    """The client cancelled or went away while the stream waited for a free slot."""


@dataclass(frozen=True)
class SlotWrite:
    """One chunk on its way into a slot: where it belongs, and write(address), which puts its
    place.length bytes there and gives their CRC32C, at once or as a future of the read under way."""

    place: ChunkPlace
    write: Callable[[int], int | Future[int]]


def _copied(chunk: ServedChunk) -> SlotWrite:
    """A chunk of StreamTensors' source (its data valid until the next is taken), copied into the slot."""

    def write(address: int) -> int:
        ctypes.memmove(address, chunk.data.ctypes.data, chunk.place.length)
        # Taken on the source bytes; the client checks it on the slot, after both copies.
        return chunk.crc32c

    return SlotWrite(chunk.place, write)


def _read_into(read: DirectRead) -> SlotWrite:
    """A chunk of a local file, read by the kernel straight into the slot; its CRC32C is taken there."""
    return SlotWrite(read.place, read.start)


@dataclass
class _Filling:
    """A slot being filled: its chunks' places, slot offsets and CRC32Cs (or futures of them)."""

    slot: int
    chunks: list[tuple[ChunkPlace, int, int | Future[int]]] = field(default_factory=list)
    nbytes: int = 0

    def futures(self) -> list[Future[int]]:
        return [crc for _, _, crc in self.chunks if isinstance(crc, Future)]

    def done(self) -> bool:
        return all(f.done() for f in self.futures())

    def message(self) -> tuple[pb.StreamTensorsSharedResponse, int]:
        """The response announcing the slot (waits for its reads; a failed read raises here)."""
        chunks = [
            pb.TensorChunk(
                tensor=place.tensor,
                offset=place.offset,
                crc32c=crc.result() if isinstance(crc, Future) else crc,
                length=place.length,
                slot=self.slot,
                slot_offset=at,
            )
            for place, at, crc in self.chunks
        ]
        return pb.StreamTensorsSharedResponse(chunks=chunks), self.nbytes


def fill_slots(
    writes: Iterator[SlotWrite], segment: Segment, credits: _Credits
) -> Iterator[tuple[pb.StreamTensorsSharedResponse, int]]:
    """Write chunks into free slots; yield (response naming one slot's chunks, their payload bytes) per slot.

    Small chunks share a slot (each at a SLOT_ALIGN boundary); a slot is closed once it is full or
    the next chunk does not fit in it. All chunks of a slot are in one message, sent once every
    write into it is done, and the client returns the slot once it has placed that message. Writes
    may still run when they return (futures): then several slots fill at once, and slots are
    announced in the order they were filled. Before waiting for a free slot, every closed slot is
    announced (waiting for its writes), so the client always has every filled slot and the ring
    cannot deadlock. On the way out, however it ends, no write into the segment is left running.
    """
    closed: collections.deque[_Filling] = collections.deque()
    current: _Filling | None = None
    used = 0
    try:
        for item in writes:
            length = item.place.length
            at = _aligned(used)
            if current is not None and at + length > segment.slot_bytes:
                closed.append(current)
                current = None
            if current is None:
                while closed and closed[0].done():
                    yield closed.popleft().message()
                slot = credits.take(block=False)
                while slot is None:
                    if closed:
                        yield closed.popleft().message()
                        slot = credits.take(block=False)
                        continue
                    slot = credits.take()
                    if slot is None:
                        if credits.error is not None:
                            raise credits.error
                        raise _ClientGone()
                current = _Filling(slot)
                at = 0
            current.chunks.append((item.place, at, item.write(segment.slot_address(current.slot) + at)))
            current.nbytes += length
            used = at + length
            if _aligned(used) >= segment.slot_bytes:
                closed.append(current)
                current = None
        if current is not None:
            closed.append(current)
            current = None
        while closed:
            yield closed.popleft().message()
    finally:
        running = [f for filling in (*closed, *([current] if current else [])) for f in filling.futures()]
        for future in running:
            future.cancel()
        concurrent.futures.wait(running)


def _aligned(offset: int) -> int:
    return -(-offset // SLOT_ALIGN) * SLOT_ALIGN


def check_nonce(directory: Path, name: str, nonce: bytes) -> None:
    """Refuse unless directory/name is a plain file holding exactly nonce (the client wrote it there)."""
    if not wire.is_plain_file_name(name):
        raise InvalidRequest(f"nonce_file {name[:200]!r} is not a plain file name")
    if not nonce:
        raise InvalidRequest("nonce is empty")
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise SharedMemoryUnavailable(
            f"the server does not see nonce file {name!r} in its shared-memory directory {directory} "
            f"({exc.strerror or exc}): the client's directory is another one"
        ) from None
    try:
        content = os.read(fd, MAX_NONCE_BYTES + 1)
    except OSError as exc:
        raise SharedMemoryUnavailable(f"cannot read nonce file {name!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if not hmac.compare_digest(content, nonce):
        raise SharedMemoryUnavailable(
            f"nonce file {name!r} in {directory} holds other bytes than the client wrote: "
            "the client's directory is another one"
        )


def add_to_server(servicer: SharedMemoryServicer, server: grpc.Server) -> None:
    """Register the two shared-memory methods (a second generic handler for WeightStreamService)."""
    handlers = {
        "OpenSharedMemory": grpc.unary_unary_rpc_method_handler(
            parsing(pb.OpenSharedMemoryRequest, servicer.OpenSharedMemory),
            request_deserializer=None,
            response_serializer=pb.OpenSharedMemoryResponse.SerializeToString,
        ),
        "StreamTensorsShared": grpc.stream_stream_rpc_method_handler(
            parsing_stream(pb.StreamTensorsSharedRequest, servicer.StreamTensorsShared),
            request_deserializer=None,
            response_serializer=pb.StreamTensorsSharedResponse.SerializeToString,
        ),
    }
    register(server, handlers)
