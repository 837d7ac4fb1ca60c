"""The node-local disk cache (--disk-cache DIR --disk-cache-bytes N): model files as read from a remote source.

Layout: DIR/files/KEY is a file's bytes, bit-identical to the source's, and DIR/files/KEY.json what
they are (the source path, size and version, and the CRC32C of the whole file); KEY is a digest of
the path, size and version, so a file whose version changes at the source (a new ETag, a new
modification time upstream) has another key and never hits an old copy; the old copy stays (until
evicted like any other) as the base of XOR deltas to the clients that hold it. DIR/partial/ holds files
being written (Fill), each renamed into DIR/files/ once complete and checked; DIR/models/ the files
each model last resolved to, so that a model can be served while its source is unreachable; whatever a process
left in DIR/partial/ (it died mid-fill) is removed at start-up, never trusted.

A cached file is checked before its bytes are first served, and again whenever its identity on
disk changes (device, inode, size, modification or change time): its size and its whole CRC32C
must match its record. The record keeps the identity the file had when its checksum last matched,
so a restarted server trusts an untouched file without reading it; any write to the file, a
rename onto it or a truncation changes that identity (a change time cannot be set back). One
that is short, changed, fails its checksum or has no record (a foreign file) is removed and read
again from the source. DIR must be writable by the server
only: whoever can write both a file and its record can make the server serve them.

Bound: the bytes of complete files and of the files being written (counted at their full size from
the start) stay within capacity_bytes; least recently used complete files are evicted to make room,
and a file that does not fit even then is served from its source without being cached (a bypass).
A stream still reading an evicted file keeps its descriptor, so its bytes stay on disk until it
ends. Use order survives restarts (each record's modification time is its last use).

Single-flight: one Fill per file at a time; every stream that wants the file's bytes meanwhile
reads them from that fill as they arrive (a load never waits for a whole file), and the source is
read once. A Placement (fleet fan-out: a storage revision's file written by its caller, block by
block in any order, revisions.storage_pull) is such a fill too: streams that want the file meanwhile
wait for it whole; it is kept only once its size and whole CRC32C are checked, as a fill's are.

Concurrency: every method of DiskCache and Fill may be called from any thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import queue
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from weightstream.protocol import wire
from weightstream_server.errors import CorruptCheckpoint, ServerError, StorageUnavailable, UpstreamError
from weightstream_server.storage.sources import LocalFile, SourceFile

logger = logging.getLogger(__name__)

FILES = "files"
MODELS = "models"
PARTIAL = "partial"
LOCK_FILE = "lock"
# Files copied from the source at once; more wait for a turn.
FILLS_AT_ONCE = 4
# After a write to the disk cache failed, files are served uncached for this long.
UNWRITABLE_S = 60.0
RECORD_SUFFIX = ".json"
# Bytes read at a time to check a cached file's CRC32C.
_CHECK_BLOCK_BYTES = 8 * 1024 * 1024
# A reader waits this long for a fill that makes no progress before it gives up (UNAVAILABLE).
FILL_STALL_S = 60.0
# A fill that fails with an error worth retrying resumes where it stopped, this many times in a row.
FILL_TRIES = 5
# Codes of upstream errors a fill resumes after (a dropped connection, a restarting upstream).
_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}

# (data, whole file's CRC32C or None) pieces of a file from an offset to its end.
Fetch = Callable[[int], Iterator[tuple[bytes, "int | None"]]]


@dataclass(frozen=True)
class DiskCacheSnapshot:
    directory: str
    capacity_bytes: int
    resident_bytes: int
    files: int
    filling: int
    hits: int
    misses: int
    evictions: int
    # Cached files found short, changed, failing their checksum or foreign, and removed.
    dropped: int
    # Files served from their source uncached because they did not fit.
    bypassed: int


@dataclass
class _Entry:
    size: int
    path: str
    version: str
    crc32c: int
    # The file's identity on disk (device, inode, size, modification and change time) when its
    # checksum last matched; a later process trusts a file that still has it without reading it.
    checked: tuple[int, ...] | None = None

    def record(self) -> str:
        fields = {"path": self.path, "size": self.size, "version": self.version, "crc32c": self.crc32c}
        return json.dumps({**fields, "checked": list(self.checked) if self.checked is not None else None})


def cache_key(file: SourceFile) -> str:
    """The name a file's bytes are kept under: a digest of its source path, size and version."""
    return _digest(f"{file.path}\0{file.size}\0{file.version}")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:40]


class DiskCache:
    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._files = self.directory / FILES
        self._partial = self.directory / PARTIAL
        self._models = self.directory / MODELS
        for folder in (self.directory, self._files, self._partial, self._models):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # One server per directory: another's start-up would remove this one's files being written.
        self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ValueError(f"disk cache {self.directory} is in use by another weightstream server") from None
        # Fills waiting for one of the FILLS_AT_ONCE copying threads (an upstream limits its streams
        # too); a waiting fill holds no thread. The threads are daemons: a stuck source must not hold
        # up the process's exit.
        self._queue: queue.SimpleQueue[Fill] = queue.SimpleQueue()
        self._copiers: list[threading.Thread] = []
        # After a failed write (a full disk), files are served uncached until then (time.monotonic()).
        self._unwritable_until = 0.0
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._filling: dict[str, Fill] = {}
        self._reserved = 0
        self._resident = 0
        # (key, identity) of cached files whose checksum matched in this process.
        self._checked: set[tuple[str, tuple[int, ...]]] = set()
        self._hits = self._misses = self._evictions = self._dropped = self._bypassed = 0
        self._load()

    def lookup(self, file: SourceFile) -> SourceFile | None:
        """The cached copy of file as a local file (checked, see the module doc), or None if there is none."""
        key = cache_key(file)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.size != file.size or entry.version != file.version or entry.path != file.path:
                self._misses += 1
                return None
        local = self._checked_copy(key, entry)
        with self._lock:
            if local is None:
                self._misses += 1
                return None
            self._hits += 1
            if key in self._entries:
                self._entries.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(self._files / f"{key}{RECORD_SUFFIX}", follow_symlinks=False)
        return SourceFile(file.name, str(self._files / key), file.size, file.version, local)

    def fill(self, file: SourceFile, fetch: Fetch) -> Fill | None:
        """The fill that copies file into the cache (started now, or already running); None when it does not fit."""
        key = cache_key(file)
        cached = self.lookup(file)
        fd = _open_checked(cached) if cached is not None else None
        if fd is not None:
            return Fill(self, key, file, fetch, fd)
        with self._lock:
            running = self._filling.get(key)
            if running is not None:
                return running
            if time.monotonic() < self._unwritable_until:
                self._bypassed += 1
                return None
            if not self._make_room(file.size):
                self._bypassed += 1
                logger.info(
                    "disk cache: %s (%d bytes) does not fit in %d bytes; served from its source uncached",
                    file.path,
                    file.size,
                    self.capacity_bytes,
                )
                return None
            self._reserved += file.size
            fill = Fill(self, key, file, fetch)
            self._filling[key] = fill
            if len(self._copiers) < FILLS_AT_ONCE:
                copier = threading.Thread(target=self._copy, name="weightstream-fill", daemon=True)
                self._copiers.append(copier)
                copier.start()
        self._queue.put(fill)
        return fill

    def place(self, file: SourceFile) -> Placement | None:
        """A file for the caller to write in place (Placement), kept only once whole and checked; None when
        it is cached already, being filled, or does not fit (it is then read the usual way)."""
        if self.lookup(file) is not None:
            return None
        key = cache_key(file)
        with self._lock:
            if key in self._filling or time.monotonic() < self._unwritable_until:
                return None
            if not self._make_room(file.size):
                self._bypassed += 1
                return None
            self._reserved += file.size
            placement = Placement(self, key, file)
            self._filling[key] = placement
        return placement

    def remember(self, model: str, files: tuple[SourceFile, ...]) -> None:
        """Keep which files (source paths, sizes, versions) model last resolved to, for remembered()."""
        listing = [{"name": f.name, "path": f.path, "size": f.size, "version": f.version} for f in files]
        path = self._models / _digest(model)
        with contextlib.suppress(OSError):
            if path.exists() and json.loads(path.read_text()) == listing:
                return
            written = self._partial / f"{_digest(model)}.model"
            written.write_text(json.dumps(listing))
            os.replace(written, path)

    def remembered(self, model: str) -> tuple[SourceFile, ...] | None:
        """The files model last resolved to (as the source listed them), None if none are remembered."""
        try:
            listing = json.loads((self._models / _digest(model)).read_text())
            return tuple(SourceFile(str(f["name"]), str(f["path"]), int(f["size"]), str(f["version"])) for f in listing)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def close(self) -> None:
        """Let another server use the directory (fills still running go on writing until they end)."""
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def snapshot(self) -> DiskCacheSnapshot:
        with self._lock:
            return DiskCacheSnapshot(
                str(self.directory),
                self.capacity_bytes,
                self._resident,
                len(self._entries),
                len(self._filling),
                self._hits,
                self._misses,
                self._evictions,
                self._dropped,
                self._bypassed,
            )

    # -- fills report here --

    def _finished(self, fill: Fill, partial: Path, crc32c: int) -> None:
        """Keep a complete, checked fill: its record, then its bytes renamed into place."""
        key = fill.key
        target = self._files / key
        entry = _Entry(fill.file.size, fill.file.path, fill.file.version, crc32c)
        try:
            # The record last: a file without one is removed at the next start.
            os.replace(partial, target)
            kept = os.stat(target)
            entry.checked = _identity(kept)
            self._write_record(key, entry)
        except OSError as exc:
            logger.warning("disk cache: could not keep %s: %s", fill.file.path, exc)
            self._forget_fill(fill)
            self._remove(key)
            return
        with self._lock:
            self._filling.pop(key, None)
            self._reserved -= fill.file.size
            replaced = self._entries.pop(key, None)  # the same bytes, kept again
            if replaced is not None:
                self._resident -= replaced.size
            self._entries[key] = entry
            self._resident += fill.file.size
            self._checked.add((key, _identity(kept)))
        logger.info("disk cache: kept %s (%d bytes)", fill.file.path, fill.file.size)

    def _failed(self, fill: Fill, partial: Path, *, unwritable: bool) -> None:
        self._forget_fill(fill)
        if unwritable:
            with self._lock:
                self._unwritable_until = time.monotonic() + UNWRITABLE_S
        with contextlib.suppress(OSError):
            partial.unlink()

    def _forget_fill(self, fill: Fill) -> None:
        with self._lock:
            if self._filling.get(fill.key) is fill:
                del self._filling[fill.key]
                self._reserved -= fill.file.size

    # -- inside --

    def _load(self) -> None:
        """Drop what a dead process left half-written, then take in the complete files, oldest use first."""
        for name in os.listdir(self._partial):
            with contextlib.suppress(OSError):
                os.unlink(self._partial / name)
        found: list[tuple[int, str, _Entry]] = []
        names = set(os.listdir(self._files))
        for name in names:
            if name.endswith(RECORD_SUFFIX):
                continue
            entry = self._record(name) if f"{name}{RECORD_SUFFIX}" in names else None
            if entry is None:
                logger.warning("disk cache: %s has no valid record (a foreign or broken file); removed", name)
                self._dropped += 1
                self._remove(name)
                continue
            used = os.stat(self._files / f"{name}{RECORD_SUFFIX}").st_mtime_ns
            found.append((used, name, entry))
        for name in names:
            if name.endswith(RECORD_SUFFIX) and name[: -len(RECORD_SUFFIX)] not in names:
                self._remove(name[: -len(RECORD_SUFFIX)])
        for _, key, entry in sorted(found):
            self._entries[key] = entry
            self._resident += entry.size
        with self._lock:
            self._make_room(0)
        logger.info(
            "disk cache %s: %d files, %d of %d bytes",
            self.directory,
            len(self._entries),
            self._resident,
            self.capacity_bytes,
        )

    def _record(self, key: str) -> _Entry | None:
        """The record of key, if it is one this cache wrote for these bytes (its key matches its contents)."""
        try:
            record = json.loads((self._files / f"{key}{RECORD_SUFFIX}").read_text())
            entry = _Entry(int(record["size"]), str(record["path"]), str(record["version"]), int(record["crc32c"]))
            checked = record.get("checked")
            if checked is not None:
                entry.checked = tuple(int(v) for v in checked)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if cache_key(SourceFile("", entry.path, entry.size, entry.version)) != key:
            return None
        return entry

    def _checked_copy(self, key: str, entry: _Entry) -> LocalFile | None:
        """The cached file of key as a LocalFile, once its size and checksum are found right; else removed, None."""
        path = self._files / key
        try:
            now = os.stat(path, follow_symlinks=False)
        except OSError:
            self._drop(key, "is gone")
            return None
        if not stat.S_ISREG(now.st_mode) or now.st_size != entry.size:
            self._drop(key, f"is {now.st_size} bytes, not the {entry.size} of its record")
            return None
        identity = _identity(now)
        with self._lock:
            checked = (key, identity) in self._checked or entry.checked == identity
        if not checked:
            crc = _crc_of(path, entry.size)
            if crc != entry.crc32c:
                self._drop(key, "fails its checksum")
                return None
            entry.checked = identity
            with contextlib.suppress(OSError):
                self._write_record(key, entry)
        with self._lock:
            self._checked.add((key, identity))
        return LocalFile((str(self._files),), key, now.st_dev, now.st_ino, now.st_mtime_ns, now.st_ctime_ns)

    def _write_record(self, key: str, entry: _Entry) -> None:
        written = self._partial / f"{key}{RECORD_SUFFIX}"
        written.write_text(entry.record())
        os.replace(written, self._files / f"{key}{RECORD_SUFFIX}")

    def _drop(self, key: str, why: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            self._resident -= entry.size
            self._dropped += 1
        logger.warning("disk cache: the copy of %s %s; removed, to be read again", entry.path, why)
        self._remove(key)

    def _make_room(self, size: int) -> bool:
        """Evict least recently used files until size more bytes fit (under the lock); whether they do."""
        if size > self.capacity_bytes:
            return False
        while self._resident + self._reserved + size > self.capacity_bytes and self._entries:
            key, entry = self._entries.popitem(last=False)
            self._resident -= entry.size
            self._evictions += 1
            self._remove(key)
            logger.info("disk cache: evicted %s (%d bytes)", entry.path, entry.size)
        return self._resident + self._reserved + size <= self.capacity_bytes

    def _copy(self) -> None:
        """One copying thread: runs the queued fills, one after the other, for the life of the process."""
        while True:
            self._queue.get().run()

    def _remove(self, key: str) -> None:
        for name in (key, f"{key}{RECORD_SUFFIX}"):
            try:
                os.unlink(self._files / name)
            except FileNotFoundError:
                pass
            except OSError as exc:  # a folder put there, a file the server may not remove
                logger.warning("disk cache: cannot remove %s: %s", self._files / name, exc)


class Fill:
    """One file being copied from its source into the disk cache, its bytes readable as they arrive.

    The copy runs on one of the cache's copying threads, resuming where it stopped after errors worth retrying
    (FILL_TRIES in a row), and is checked at its end against the whole-file CRC32C the source gives
    (an upstream server does; S3 does not, and the CRC32C of what was written is recorded). Readers
    call read_into, which waits for the bytes it wants and reads them from the file being written;
    a fill that failed raises its error to every reader, and the next stream starts a new fill.

    Ownership: the file being written and its descriptor, until the fill is garbage-collected (readers
    may still read a fill that has finished).
    """

    def __init__(self, cache: DiskCache, key: str, file: SourceFile, fetch: Fetch, complete: int | None = None) -> None:
        """A fill to start() into a new partial file; or, given complete (a descriptor of the file's
        checked copy in the cache), one that is done already and only reads."""
        self.key = key
        self.file = file
        self._cache = cache
        self._fetch = fetch
        self._partial = cache._partial / f"{key}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}"
        if complete is None:
            self._fd = os.open(self._partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        else:
            self._fd = complete
        weakref.finalize(self, os.close, self._fd)
        self._changed = threading.Condition()
        self._done = 0 if complete is None else file.size
        self._error: BaseException | None = None
        self._copying = False

    def read_into(self, offset: int, into: memoryview) -> None:
        """Copy len(into) bytes of the file from offset into into, once they are written; raises the fill's error."""
        length = len(into)
        end = offset + length
        with self._changed:
            while self._done < end and self._error is None:
                before = self._done
                self._changed.wait(FILL_STALL_S)
                # A fill still waiting for its turn is not stalled.
                if self._done == before and self._error is None and self._copying:
                    raise StorageUnavailable(
                        f"{self.file.path}: no byte arrived from the source for {FILL_STALL_S:.0f} s; try again"
                    )
            if self._error is not None and self._done < end:
                raise self._error
        done = 0
        while done < length:
            n = os.preadv(self._fd, [into[done:]], offset + done)
            if n <= 0:
                raise CorruptCheckpoint(f"{self.file.path}: the disk cache's copy ended at {offset + done} bytes")
            done += n

    def read(self, offset: int, length: int) -> bytes:
        data = bytearray(length)
        if length:
            self.read_into(offset, memoryview(data))
        return bytes(data)

    def run(self) -> None:
        """Copy the file (on one of the cache's copying threads)."""
        with self._changed:
            self._copying = True
        self._run()

    def _run(self) -> None:
        crc = 0
        source_crc: int | None = None
        tries = 0
        try:
            while self._done < self.file.size:
                before = self._done
                try:
                    for data, whole in self._fetch(self._done):
                        if self._done + len(data) > self.file.size:
                            raise CorruptCheckpoint(
                                f"{self.file.path}: the source sent more than {self.file.size} bytes"
                            )
                        try:
                            _write_all(self._fd, data, self._done)
                        except OSError as exc:
                            raise _Unwritable(f"{self.file.path}: writing the disk cache failed: {exc}") from exc
                        crc = wire.crc32c_extend(crc, data)
                        with self._changed:
                            self._done += len(data)
                            self._changed.notify_all()
                        if whole is not None:
                            source_crc = whole
                    if self._done < self.file.size:
                        raise StorageUnavailable(f"{self.file.path}: the source's stream ended at {self._done} bytes")
                except (StorageUnavailable, UpstreamError) as exc:
                    if isinstance(exc, UpstreamError) and exc.code not in _RETRY_CODES:
                        raise
                    tries = 0 if self._done > before else tries + 1
                    if tries >= FILL_TRIES:
                        raise
                    logger.warning(
                        "disk cache: filling %s failed at %d bytes (%s); resuming", self.file.path, self._done, exc
                    )
                    time.sleep(min(5.0, 0.2 * 2**tries))
            if self._done != self.file.size:
                raise CorruptCheckpoint(f"{self.file.path}: the source sent {self._done} bytes, not {self.file.size}")
            if source_crc is not None and source_crc != crc:
                raise CorruptCheckpoint(
                    f"{self.file.path}: the whole file's CRC32C does not match what the source sent; not cached"
                )
        except BaseException as exc:
            failed = f"{self.file.path}: filling failed: {exc}"
            error = exc if isinstance(exc, ServerError) else StorageUnavailable(failed)
            logger.warning("disk cache: filling %s failed: %s", self.file.path, error)
            with self._changed:
                self._error = error
                self._changed.notify_all()
            self._cache._failed(self, self._partial, unwritable=isinstance(exc, _Unwritable))
            return
        self._cache._finished(self, self._partial, crc)


class Placement(Fill):
    """A file of the cache written by its caller, in any order (buffer()), then kept (keep) or dropped (discard).

    Until then it stands in the cache as the file's fill: a stream that wants the file waits for it
    whole and reads the kept copy; after discard it gets the error, and the next stream reads the
    file the usual way. keep checks the size and the whole file's CRC32C (the source's, where it gave
    one) exactly as a fill's end does; nothing is renamed into the cache unchecked, and a placement
    neither kept nor discarded is removed with its partial file at the next start.

    Ownership: the partial file and its descriptor as a Fill's; buffer() maps the file writable, with its
    blocks allocated first (a full filesystem fails buffer() with _Unwritable, never a write into the
    map, which would end the process with SIGBUS). The caller ends every use of views of that map
    before close_buffer(): a view made with torch.frombuffer holds no export of the map, so the map
    closes under it, and reading it then is invalid.
    """

    def __init__(self, cache: DiskCache, key: str, file: SourceFile) -> None:
        super().__init__(cache, key, file, _no_fetch)
        self._map: mmap.mmap | None = None
        self._ended = False

    def buffer(self) -> mmap.mmap:
        """The partial file, its blocks allocated and mapped writable (shared: what is written is the file's);
        _Unwritable (the placement dropped, the cache not written a while, as after a fill's failed write)
        where the filesystem has no room for it."""
        if self._map is None:
            try:
                if self.file.size:
                    os.posix_fallocate(self._fd, 0, self.file.size)
            except OSError as exc:
                error = _Unwritable(f"{self.file.path}: no room for it in the disk cache's filesystem: {exc}")
                self.discard(error, unwritable=True)
                raise error from exc
            self._map = mmap.mmap(self._fd, self.file.size)
        return self._map

    def keep(self, source_crc: int | None) -> None:
        """Check the written file (its size, and its CRC32C against source_crc, the source's whole-file
        CRC32C, if not None) and keep it in the cache; CorruptCheckpoint (the file dropped) if it fails."""
        if self._ended:
            raise CorruptCheckpoint(f"{self.file.path}: this placement has ended")
        fd = self._fd
        crc, read = wire.crc32c_of_range(
            lambda start, length: os.pread(fd, length, start), 0, self.file.size + 1, block_bytes=_CHECK_BLOCK_BYTES
        )
        if read != self.file.size or (source_crc is not None and crc != source_crc):
            error = CorruptCheckpoint(
                f"{self.file.path}: the file written from peers' blocks does not match the source's size and CRC32C; "
                "not cached"
            )
            self.discard(error)
            raise error
        self._ended = True
        self._cache._finished(self, self._partial, crc)
        with self._changed:
            self._done = self.file.size
            self._changed.notify_all()

    def discard(self, error: ServerError | None = None, *, unwritable: bool = False) -> None:
        """Drop the partial file; streams waiting for it get error (UNAVAILABLE by default); unwritable: the
        cache is not written a while (a full filesystem). Idempotent."""
        if self._ended:
            return
        self._ended = True
        with self._changed:
            self._error = error or StorageUnavailable(f"{self.file.path}: its copy from peers failed; try again")
            self._changed.notify_all()
        self._cache._failed(self, self._partial, unwritable=unwritable)

    def close_buffer(self) -> None:
        """Unmap buffer(): after every use of its views has ended (see the class's ownership)."""
        mapped, self._map = self._map, None
        if mapped is not None:
            with contextlib.suppress(BufferError):
                mapped.close()


def _no_fetch(offset: int) -> Iterator[tuple[bytes, int | None]]:
    raise StorageUnavailable("a placement is written by its caller, never fetched")


def _open_checked(cached: SourceFile) -> int | None:
    """A descriptor of a checked cached file, if it is still the file that was checked (not evicted
    since, not swapped for another or for a link); None otherwise."""
    local = cached.local
    assert local is not None
    try:
        fd = os.open(cached.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns) != (
        local.device,
        local.inode,
        cached.size,
        local.mtime_ns,
        local.ctime_ns,
    ) or not stat.S_ISREG(now.st_mode):
        os.close(fd)
        return None
    return fd


def _identity(now: os.stat_result) -> tuple[int, ...]:
    return (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns)


class _Unwritable(StorageUnavailable):
    """The disk cache could not be written (a full disk, an I/O error): files are served uncached a while."""


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _crc_of(path: Path, size: int) -> int | None:
    """The CRC32C of the file at path (read through), or None if it cannot be read whole."""
    try:
        # O_NOFOLLOW: a link swapped in after the lstat of the check is not followed out of DIR.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb", buffering=0) as f:
            # One byte past size: a file that grew reads more than size and fails the check.
            crc, read = wire.crc32c_of_range(
                lambda start, length: os.pread(f.fileno(), length, start), 0, size + 1, block_bytes=_CHECK_BLOCK_BYTES
            )
    except OSError:
        return None
    return crc if read == size else None
