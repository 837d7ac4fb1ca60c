"""Where tensor bytes are read: Run:ai Model Streamer reads of files and objects, a pool of streamers,
and direct reads of local files into memory the caller names (the shared-memory ring's slots).

Object stores: the streamer's object-storage backend is one per process, the first kind of store
read (claim_backend). The pool reads objects of that kind here and each other kind through a
reader process of its own (StreamerPool.reader_for, serving/store_readers.py), so that one server
serves s3://, gs:// and az:// models at once.

Concurrency: a FileStreamer is not thread-safe and holds one stream at a time, so each stream
checks one out of the StreamerPool for its whole life and returns it when done. Streamers are
kept open for the life of the process: starting one spawns its reader threads, and closing a
streamer that has read S3 tears down the S3 clients of the whole process, so that any other
stream in flight ends early with no error. Once any stream of the process has read S3, closing a
pool parks its streamers for the rest of the process instead of closing them.

Memory: the bytes a stream reads ahead live in its streamer's ring of buffers, bounded by the
read-ahead setting, and a stream reaches that bound by slow start (read_windows): its first reads
cover 16 MiB, each next window twice the last, so that a stream cancelled early costs little.
With owned=False the chunk a reader yields is a view into that ring, valid
only until the next chunk is taken: callers must copy it out before asking for more.

Files: local files are read only through descriptors opened beneath the model root for the reads
(source.OpenFiles, see open_plan), the streamer through their /proc/self/fd paths, and each file is
checked against its listing at the end of its reads: a file changed meanwhile ends the reads with
CheckpointChanged, never with its bytes mixed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import torch
from runai_model_streamer import FileChunks, FileStreamer
from runai_model_streamer.s3_utils.s3_utils import S3Credentials

from weightstream.protocol import wire
from weightstream_server.errors import CorruptCheckpoint, ServerError, StorageUnavailable, TooManyStreams
from weightstream_server.serving.catalog import Manifest
from weightstream_server.serving.checksums import BlockCrc32c, BlockRecorder
from weightstream_server.serving.store_readers import StoreReader
from weightstream_server.storage.file_errors import file_error
from weightstream_server.storage.model_ids import OBJECT_SCHEMES, S3_SCHEME
from weightstream_server.storage.open_files import OpenFiles
from weightstream_server.storage.reads import ChunkPlace, ReadPlan
from weightstream_server.storage.sources import SourceFile

logger = logging.getLogger(__name__)

# Streamers of closed pools, kept open once S3 has been read in this process (see the module doc).
_parked: list[FileStreamer] = []
_s3_used = threading.Event()
# The scheme of the one kind of object store this process's streamers read (see claim_backend).
_backend: list[str] = []
_backend_lock = threading.Lock()


def claim_backend(scheme: str) -> bool:
    """Whether this process's streamers read the objects of scheme ("s3://", "gs://", "az://").

    The streamer loads the plugin of the first object store a process reads and sends every later
    object read of the process to it, whatever its URL: the first scheme claimed is this process's
    for its life, and objects of the others are read in reader processes (StreamerPool.reader_for).
    """
    with _backend_lock:
        if not _backend:
            _backend.append(scheme)
        return _backend[0] == scheme


# Seconds a stream waits for the next read of an object store by default (see StreamerPool).
STORAGE_TIMEOUT_S = 120.0


@dataclass
class PooledStreamer:
    """A FileStreamer checked out of a pool, with the S3 settings its reads use.

    stuck: a read of it outlasted the storage timeout and its stream gave up on it; it is still
    busy in the store's backend and is never used again (see _within). Its pool counts it until
    the backend lets go (then it is parked).
    """

    file_streamer: FileStreamer
    s3_credentials: S3Credentials | None
    storage_timeout: float = STORAGE_TIMEOUT_S
    stuck: bool = False
    pool: StreamerPool | None = None

    def give_up(self) -> None:
        """Its stream stops waiting for it: it stays in the backend, counted as stuck until park()."""
        self.stuck = True
        if self.pool is not None:
            self.pool.stuck_changed(+1)

    def park(self) -> None:
        """The backend let go of it (after give_up): kept for the life of the process, never used again."""
        _parked.append(self.file_streamer)
        if self.pool is not None:
            self.pool.stuck_changed(-1)


class StreamerPool:
    """Up to `size` open FileStreamers, each used by one stream at a time.

    s3_credentials carries the endpoint and region for S3 reads; keys are left to the AWS
    credential chain of the streamer's S3 backend. storage_timeout: the seconds a stream waits for
    each read of an object store. The stores' backends retry on their own, the GCS one for up to
    15 minutes while the store refuses connections: past this the stream ends UNAVAILABLE and its
    streamer is left to finish, then parked, never used again. Such a stuck streamer holds its
    ring (up to the read-ahead) meanwhile, so at most `size` of them are let be: while that many
    wait on their stores, new reads of object stores are refused UNAVAILABLE (refuse_stuck), and
    streams of local files, published revisions and upstream tiers go on.

    Objects of a store other than this process's (claim_backend) are read in that store's reader
    process (reader_for), started at its first read: it has a pool like this one, of the same size,
    settings and bounds, and the stuck streamers of that store are counted there.
    """

    def __init__(
        self, size: int, s3_credentials: S3Credentials | None = None, storage_timeout: float = STORAGE_TIMEOUT_S
    ) -> None:
        self._size = size
        self._s3_credentials = s3_credentials
        self._storage_timeout = storage_timeout
        self._free: list[FileStreamer] = []
        self._lock = threading.Lock()
        self._in_use = 0
        self._stuck = 0
        self._readers: dict[str, StoreReader] = {}

    @contextlib.contextmanager
    def checkout(self) -> Iterator[PooledStreamer]:
        with self._lock:
            if self._in_use >= self._size:
                raise TooManyStreams(f"{self._size} streams are already running; try again later")
            self._in_use += 1
            streamer = self._free.pop() if self._free else None
        pooled = None
        try:
            if streamer is None:
                streamer = FileStreamer()
                streamer.__enter__()
            pooled = PooledStreamer(streamer, self._s3_credentials, self._storage_timeout, pool=self)
            yield pooled
        finally:
            if pooled is not None and pooled.stuck:
                streamer = None  # its reader thread parks it once the backend lets go (_within)
            keep = streamer is not None and _s3_used.is_set()
            with self._lock:
                self._in_use -= 1
                if keep:
                    self._free.append(streamer)
            if streamer is not None and not keep:
                # A streamer holds its last stream's ring (up to the read-ahead) until its next
                # stream, so an idle one is closed: idle streams then hold no ring (a new streamer
                # costs microseconds). Once S3 has been read in this process, closing one would end
                # the process's S3 clients: those are kept for reuse, at most `size` of them.
                streamer.__exit__(None, None, None)

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def stuck(self) -> int:
        """Streamers whose streams gave up on a store that did not answer, still inside its backend."""
        return self._stuck

    def stuck_changed(self, by: int) -> None:
        with self._lock:
            self._stuck += by

    def refuse_stuck(self, model: str) -> None:
        """StorageUnavailable when `size` streamers are stuck in object stores' backends already."""
        if self._stuck >= self._size:
            raise StorageUnavailable(
                f"model {model!r}: {self._stuck} reads of object stores still wait on stores that stopped "
                f"answering (each given up after --storage-timeout {self._storage_timeout:g} s); try again later"
            )

    def reader_for(self, scheme: str) -> StoreReader | None:
        """The reader process of scheme's objects, or None where this process's streamers read them."""
        if claim_backend(scheme):
            return None
        with self._lock:
            reader = self._readers.get(scheme)
            if reader is None:
                credentials = self._s3_credentials if scheme == S3_SCHEME else None
                reader = self._readers[scheme] = StoreReader(scheme, self._size, self._storage_timeout, credentials)
        return reader

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
            readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            reader.close()
        if _s3_used.is_set():
            _parked.extend(free)
            return
        for streamer in free:
            streamer.__exit__(None, None, None)

    def __enter__(self) -> StreamerPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_plan(manifest: Manifest, plan: ReadPlan) -> OpenFiles:
    """The files of plan opened for its reads (by index in manifest.files); the caller closes them."""
    return OpenFiles(
        manifest.source, manifest.model, {fp.file_index: manifest.files[fp.file_index] for fp in plan.files}
    )


def read_units(
    streamer: PooledStreamer,
    manifest: Manifest,
    plan: ReadPlan,
    read_ahead_bytes: int,
    files: OpenFiles | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield (index in plan.files, index of the unit in that FilePlan, its bytes as flat uint8) per read unit.

    Files interleave. Each yielded tensor is a view into the streamer's ring, valid until the next
    item is taken. Every read's length is checked, and so is the count of reads: a short or missing
    read is an error, never a silently short stream: CorruptCheckpoint for local files, and
    StorageUnavailable (worth a retry) for S3, where the usual cause is the store or the network.
    A local file is checked against its listing before its last unit is yielded, and after any
    failed read: one that changed is CheckpointChanged. files: the plan's files, opened by the
    caller (open_plan) for a stream that reads in several plans; by default they are opened here
    for this plan's reads and closed once the streamer is done with them.
    """
    if not plan.files:
        return
    # Files of a tier above (an upstream server, S3 through the disk cache) are read as they arrive.
    units = manifest.source.read_units(manifest.files, plan)
    if units is not None:
        yield from units
        return
    first = manifest.files[plan.files[0].file_index]
    reader = None
    if first.local is None and streamer.pool is not None:
        reader = streamer.pool.reader_for(next((s for s in OBJECT_SCHEMES if first.path.startswith(s)), ""))
    if reader is not None:
        yield from reader.read_units(manifest.model, manifest.files, plan, read_ahead_bytes)
        return
    with contextlib.ExitStack() as stack:
        opened = files if files is not None else stack.enter_context(open_plan(manifest, plan))
        yield from _read_units(streamer, manifest.model, manifest.files, plan, read_ahead_bytes, opened)


def read_object_units(
    streamer: PooledStreamer, model: str, files: Sequence[SourceFile], plan: ReadPlan, read_ahead_bytes: int
) -> Generator[tuple[int, int, torch.Tensor]]:
    """As read_units, for a plan of objects (files of an object store) read by this process's streamers."""
    if not plan.files:
        return
    yield from _read_units(streamer, model, files, plan, read_ahead_bytes, _ObjectUrls(files))


class _Paths(Protocol):
    """Where the streamer reads each file of a plan, and the check that it is still as listed (OpenFiles)."""

    def path(self, index: int) -> str: ...

    def check_unchanged(self, index: int) -> None: ...


@dataclass(frozen=True)
class _ObjectUrls:
    """The _Paths of objects: their URLs; a listed version is checked by the store's backend, not here."""

    files: Sequence[SourceFile]

    def path(self, index: int) -> str:
        return self.files[index].path

    def check_unchanged(self, index: int) -> None:
        return None


# A stream's first reads cover this much, and each next window twice the last, up to the read-ahead:
# a stream cancelled early (open/cancel churn) has allocated and read this much, not its whole ring.
SLOW_START_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class _Window:
    """Consecutive read units of a plan read by one stream_files call: (file in plan, first unit, end) each."""

    spans: tuple[tuple[int, int, int], ...]
    nbytes: int
    largest: int


def read_windows(plan: ReadPlan, read_ahead_bytes: int) -> Iterator[_Window]:
    """The plan's units, file after file, in windows of SLOW_START_BYTES, then doubling, then the rest.

    Once a window would reach the read-ahead, the rest of the plan is one window: from there the
    streamer's ring recycles its buffers under memory_limit, with no barrier between windows.
    """
    target = min(SLOW_START_BYTES, read_ahead_bytes)
    spans: list[tuple[int, int, int]] = []
    nbytes = largest = 0
    for file_id, file_plan in enumerate(plan.files):
        start = 0
        for index, size in enumerate(file_plan.sizes):
            nbytes += size
            largest = max(largest, size)
            if nbytes >= target and target < read_ahead_bytes:
                spans.append((file_id, start, index + 1))
                yield _Window(tuple(spans), nbytes, largest)
                spans, nbytes, largest, start = [], 0, 0, index + 1
                target *= 2
        if start < len(file_plan.sizes):
            spans.append((file_id, start, len(file_plan.sizes)))
    if spans:
        yield _Window(tuple(spans), nbytes, largest)


def _read_units(
    streamer: PooledStreamer,
    model: str,
    files: Sequence[SourceFile],
    plan: ReadPlan,
    read_ahead_bytes: int,
    opened: _Paths,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    file_names = ", ".join(files[fp.file_index].name for fp in plan.files)
    remote = files[plan.files[0].file_index].local is None
    if remote:
        if streamer.pool is not None:
            streamer.pool.refuse_stuck(model)
        _s3_used.set()
    failure = StorageUnavailable if remote else CorruptCheckpoint
    # Units of each file of the plan not received yet; at 0, the unit in hand is the file's last.
    remaining = [len(fp.sizes) for fp in plan.files]
    received = 0
    file_streamer = streamer.file_streamer
    try:
        for window in read_windows(plan, read_ahead_bytes):
            requests = [
                FileChunks(
                    k,
                    opened.path(plan.files[file_id].file_index),
                    plan.files[file_id].offsets[start:end],
                    plan.files[file_id].sizes[start:end],
                )
                for k, (file_id, start, end) in enumerate(window.spans)
            ]
            try:
                file_streamer.stream_files(
                    requests,
                    streamer.s3_credentials if remote else None,
                    "cpu",
                    memory_limit=max(min(window.nbytes, read_ahead_bytes), window.largest),
                    owned=False,
                )
            except BaseException:
                # Reads submitted before the failure would open the /proc paths of descriptors closed by then.
                file_streamer.drain_live_submissions()
                raise
            chunks = file_streamer.get_chunks()
            try:
                for k, relative_index, data in _within(chunks, streamer, model) if remote else chunks:
                    file_id, start, _ = window.spans[k]
                    range_index = start + relative_index
                    file_plan = plan.files[file_id]
                    unit = file_plan.places[range_index]
                    flat = data.view(-1)
                    if flat.numel() != file_plan.sizes[range_index]:
                        _check_unchanged(opened, plan)
                        raise failure(
                            f"model {model!r}: tensor {unit.place.tensor!r}: read {flat.numel()} bytes at "
                            f"file offset {file_plan.offsets[range_index]}, expected {file_plan.sizes[range_index]}"
                        )
                    received += 1
                    remaining[file_id] -= 1
                    if remaining[file_id] == 0:
                        # Before its last bytes go out: a file rewritten while it was read is never sent whole.
                        opened.check_unchanged(file_plan.file_index)
                    yield file_id, range_index, flat
            finally:
                if not streamer.stuck:
                    chunks.close()
                    # The window's ring goes now, not when the next window's ring is already allocated
                    # (stream_files builds the new one before it drops the old).
                    file_streamer.requests_iterator = None
    except ValueError as exc:
        # The streamer's errors are terse ("End of file reached", "File access error"): name the
        # model and files. Locally the usual cause is a file changed after its header was read.
        _check_unchanged(opened, plan)
        raise failure(f"model {model!r}: reading {file_names} failed: {exc}") from exc
    if received != plan.num_reads:
        _check_unchanged(opened, plan)
        raise failure(f"model {model!r}: the read of {file_names} ended after {received} of {plan.num_reads} reads")


_END = object()


def _within(
    chunks: Iterator[tuple[int, int, torch.Tensor]], streamer: PooledStreamer, model: str
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """chunks, each taken on a thread of its own and awaited at most streamer.storage_timeout seconds.

    Lockstep: the thread takes the next item only when this generator is asked for it, since each
    is a view into the streamer's ring, valid until the next is taken. A wait past the timeout
    raises StorageUnavailable and marks the streamer stuck: the thread, still inside the backend,
    closes its reads and parks it when the backend lets go.
    """
    handoff: queue.SimpleQueue[tuple[object, object]] = queue.SimpleQueue()
    wanted = threading.Semaphore(0)
    done = threading.Event()
    # Held while the thread ends and while the stream gives up: a thread that ended (its last item
    # on the way) is never given up on, and one given up on parks its streamer, whichever is first.
    ending = threading.Lock()
    ended = False

    def take() -> None:
        nonlocal ended
        try:
            while True:
                wanted.acquire()
                if done.is_set():
                    return
                try:
                    handoff.put((None, next(chunks)))
                except StopIteration:
                    handoff.put((_END, None))
                    return
                except BaseException as exc:
                    handoff.put((exc, None))
                    return
        finally:
            with ending:
                ended = True
            if streamer.stuck:
                with contextlib.suppress(Exception):
                    chunks.close()  # type: ignore[attr-defined]
                streamer.file_streamer.requests_iterator = None
                streamer.park()
                logger.info("model %r: the store answered after its stream gave up; streamer parked", model)

    thread = threading.Thread(target=take, name="weightstream-store-read", daemon=True)
    thread.start()
    try:
        while True:
            wanted.release()
            try:
                failure, item = handoff.get(timeout=streamer.storage_timeout)
            except queue.Empty:
                with ending:
                    if not ended:
                        streamer.give_up()
                if not streamer.stuck:
                    continue  # the thread ended just now: its item is in the handoff
                raise StorageUnavailable(
                    f"model {model!r}: no bytes from the store for {streamer.storage_timeout:g} s "
                    "(--storage-timeout); try again"
                ) from None
            if failure is _END:
                return
            if isinstance(failure, BaseException):
                raise failure
            yield item  # type: ignore[misc]
    finally:
        done.set()
        wanted.release()
        if not streamer.stuck:
            thread.join()


def _check_unchanged(opened: _Paths, plan: ReadPlan) -> None:
    """Raise CheckpointChanged if a file of plan changed: then that, not corruption, is why a read failed."""
    for file_plan in plan.files:
        opened.check_unchanged(file_plan.file_index)


def reads_directly(manifest: Manifest, plan: ReadPlan) -> bool:
    """Whether read_direct can serve plan: local files only, and no unit that gathers slice rows."""
    return all(
        manifest.files[fp.file_index].local is not None and all(u.gather is None for u in fp.places)
        for fp in plan.files
    )


def page_cached(manifest: Manifest, plan: ReadPlan, samples: int = 32) -> bool:
    """Whether the page cache seems to hold plan's bytes: one page in the middle of each of up to
    about `samples` read units, spread over the plan, must be readable without waiting for storage.

    False where the kernel cannot tell (no RWF_NOWAIT) or a file cannot be read.
    """
    if _NOWAIT is None:
        return False
    units = [(fp.file_index, off, size) for fp in plan.files for off, size in zip(fp.offsets, fp.sizes, strict=True)]
    probe = bytearray(1)
    try:
        with open_plan(manifest, plan) as files:
            for file_index, offset, size in units[:: max(1, len(units) // samples)]:
                if size and os.preadv(files.fd(file_index), [probe], offset + size // 2, _NOWAIT) != 1:
                    return False
    except (OSError, ServerError):  # BlockingIOError: that page must come from storage
        return False
    return True


@dataclass(frozen=True)
class UnitChunks:
    """One read unit of a plan without gathers, cut into its chunks: each chunk's file offset and place."""

    file_index: int
    length: int
    chunks: list[tuple[int, ChunkPlace]]


def unit_chunks(plan: ReadPlan) -> Iterator[UnitChunks]:
    """The read units of plan (see reads_directly), file after file, each with its chunks in order."""
    for file_plan in plan.files:
        for offset, length, unit in zip(file_plan.offsets, file_plan.sizes, file_plan.places, strict=True):
            chunks = [
                (offset + start, ChunkPlace(unit.place.tensor, unit.place.offset + start, piece))
                for start, piece in wire.split_range(0, length, plan.chunk_bytes)
            ]
            yield UnitChunks(file_plan.file_index, length, chunks)


@dataclass(frozen=True)
class DirectRead:
    """One chunk of a local file: start(address) reads its place.length bytes to address and gives
    their CRC32C: at once when the page cache holds them, else as a future of a read on the
    reader's threads. A failed read raises CorruptCheckpoint (from the future, if one)."""

    place: ChunkPlace
    start: Callable[[int], int | Future[int]]


class DirectReader:
    """Reads a plan's chunks (see reads_directly) from local files straight into memory the caller names.

    One copy per byte: the kernel's page cache -> the destination (pread), then the CRC32C of the
    bytes there. The streamer's path costs two on the shared-memory transport (page cache -> the
    streamer's ring -> the slot), and the second, on the stream's one thread, was what bounded it.
    What the page cache holds is copied on the caller's thread (preadv2 with RWF_NOWAIT); the rest
    is read on a pool of threads (preadv and the CRC32C release the GIL), so that a cold file is read
    with several requests in flight: a thread handoff costs more than copying cached bytes, and
    one thread waiting for storage at a time is too few. Asking the kernel to read ahead
    (posix_fadvise WILLNEED) makes cold loads slower, not faster. From a warm page cache this path is faster
    than the streamer's; from a cold one the streamer's parallel reads are, which is why callers
    check page_cached() first (benchmarks/shm_load.py compares both). A short read is a
    CorruptCheckpoint, as on the streamer's path; a file that is not as it was listed, when it is
    opened (the constructor), when a read fails, or once every read is done (on a clean exit from
    the with block), is CheckpointChanged. Each chunk's CRC32C is combined from its pieces between
    its tensor's block boundaries; with a recorder, those go to it (from the thread that read the
    chunk), and it is committed on a clean exit, once that check passed.

    Ownership: the files it opens (all of the plan's, in the constructor) and its threads, until
    close(), which waits for every read started (so that none writes to the destination
    afterwards). Use from one thread.
    """

    def __init__(
        self,
        manifest: Manifest,
        plan: ReadPlan,
        on_read: Callable[[int], None],
        threads: int,
        record: BlockRecorder | None = None,
    ) -> None:
        self._manifest = manifest
        self._plan = plan
        self._on_read = on_read
        self._record = record
        self._files = open_plan(manifest, plan)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weightstream-read")

    def reads(self) -> Iterator[DirectRead]:
        """Every chunk of the plan, file after file, each unit's chunks in order."""
        manifest = self._manifest
        for unit in unit_chunks(self._plan):
            source = manifest.files[unit.file_index]
            fd = self._files.fd(unit.file_index)
            check = functools.partial(self._files.check_unchanged, unit.file_index)
            for file_offset, place in unit.chunks:
                chunk = _ChunkRead(fd, file_offset, place, manifest.model, source.name, check, self._record)
                yield DirectRead(place, functools.partial(self._start, chunk))
            self._on_read(unit.length)

    def _start(self, chunk: _ChunkRead, address: int) -> int | Future[int]:
        # What the page cache holds is copied here and now: a thread handoff costs more than the
        # copy. Only what must wait for storage goes to the threads.
        done, crcs = chunk.read_cached(address)
        if done == chunk.length:
            return chunk.finish(crcs)
        return self._pool.submit(chunk.read_into, address, done, crcs)

    def close(self) -> None:
        # Files are closed only here: reads of a file may still be queued when the next file starts.
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
        finally:
            self._files.close()

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
            if exc_type is None:
                # Every read is done now: a file rewritten meanwhile must not end the stream OK.
                self._files.check_all_unchanged()
                if self._record is not None:
                    self._record.commit()
        finally:
            self.close()


# preadv2 flag: fail with EAGAIN rather than wait for storage (Linux 4.14; buffered reads since 5.9).
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


@dataclass(frozen=True)
class _ChunkRead:
    fd: int
    offset: int
    place: ChunkPlace
    model: str
    file_name: str
    # Raises CheckpointChanged if the file is no longer as listed: then that is why a read failed.
    check_unchanged: Callable[[], None]
    record: BlockRecorder | None

    @property
    def length(self) -> int:
        return self.place.length

    def finish(self, crcs: BlockCrc32c) -> int:
        """The CRC32C of the chunk, every byte of it read and fed to crcs (its blocks' recorded)."""
        crc = crcs.finish()
        if self.record is not None:
            self.record.record(self.place.tensor, crcs.pieces)
        return crc

    def read_cached(self, address: int) -> tuple[int, BlockCrc32c]:
        """Read what the page cache holds of the chunk, from its start, to address; how many bytes, and their CRC32Cs.

        Never waits for storage (RWF_NOWAIT); nothing where the kernel does not offer that, and on
        any error, which read_into then meets and reports. The bytes come in wire.CACHE_PIECE_BYTES
        pieces, each checksummed right after it landed, while it is still in the core's cache.
        """
        done, crcs = 0, BlockCrc32c(self.place.offset)
        if _NOWAIT is None:
            return done, crcs
        with contextlib.suppress(OSError):  # BlockingIOError: the rest is not cached
            while done < self.length:
                size = min(wire.CACHE_PIECE_BYTES, self.length - done)
                n = os.preadv(
                    self.fd, [(ctypes.c_char * size).from_address(address + done)], self.offset + done, _NOWAIT
                )
                if n == 0:
                    break
                crcs.feed(address + done, n)
                done += n
        return done, crcs

    def read_into(self, address: int, done: int, crcs: BlockCrc32c) -> int:
        """Read the chunk's bytes from done on to address; the CRC32C of all its bytes (crcs: of those before done)."""
        start = done
        while done < self.length:
            buffer = (ctypes.c_char * (self.length - done)).from_address(address + done)
            try:
                n = os.preadv(self.fd, [buffer], self.offset + done)
            except OSError as exc:
                self.check_unchanged()
                raise file_error(exc, f"model {self.model!r}: file {self.file_name!r}", listed=True) from exc
            if n == 0:
                self.check_unchanged()
                raise CorruptCheckpoint(
                    f"model {self.model!r}: tensor {self.place.tensor!r}: read {done} bytes at file offset "
                    f"{self.offset} of {self.file_name}, expected {self.length}; the file ended early"
                )
            done += n
        crcs.feed(address + start, self.length - start)
        return self.finish(crcs)
