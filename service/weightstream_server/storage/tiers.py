"""A remote source (an upstream server, or S3) behind this server's disk cache: where tiers meet.

TieredSource is the Source the catalog sees for models this server reads from above it. A model
whose files are all in the disk cache (checked, see disk_cache) resolves to those cached files as
local files, and is then served exactly as a model under a model root: the streamer, direct reads
into shared memory, sendfile on the data port. Any other model resolves to its remote files, and
their bytes are read through the disk cache's fills (reader.read_units hands such plans to
read_units here): every stream that wants a file meanwhile reads the one fill's bytes as they
arrive. Without a disk cache, or for a file that does not fit in it, bytes are read from the source
with ranged reads (single-flight only through the RAM cache, --cache-bytes).

While the source cannot be reached (UNAVAILABLE), a model whose files as last listed are all in the
disk cache is served from there, with a WARNING; its revision is the one last listed. Its
companion files are not kept, so a fetch of them fails with the source's error.

Counts: bytes read from the source above (fills and ranged reads), for /status and /metrics.

Concurrency: safe to use from many threads, as its parts are.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from weightstream.protocol.memory import Region
from weightstream_server.errors import CorruptCheckpoint, StorageUnavailable, UpstreamError
from weightstream_server.storage.disk_cache import DiskCache, Fill
from weightstream_server.storage.reads import ReadPlan
from weightstream_server.storage.sources import ModelFiles, Source, SourceFile

logger = logging.getLogger(__name__)

# Upstream codes that mean it cannot be reached now: a model fully in the disk cache is then served from there.
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class RemoteSource(Source, Protocol):
    """A source whose files can be read as a stream of pieces (S3Source, UpstreamSource)."""

    def read_from(self, file: SourceFile, start: int, length: int = 0) -> Iterator[tuple[bytes, int | None]]:
        """(data, whole file's CRC32C or None) pieces of file from start: length bytes, or to its end."""
        ...


class TieredSource:
    def __init__(self, inner: RemoteSource, cache: DiskCache | None) -> None:
        self.inner = inner
        self.cache = cache
        self._lock = threading.Lock()
        self._source_bytes = 0

    @property
    def source_bytes_read(self) -> int:
        """Bytes read from the source above this server, by fills and ranged reads."""
        with self._lock:
            return self._source_bytes

    def claims(self, model: str) -> bool:
        return self.inner.claims(model)

    def describe(self) -> str:
        if self.cache is None:
            return self.inner.describe()
        return f"{self.inner.describe()} through the disk cache {self.cache.directory}"

    def public_name(self) -> str:
        return self.inner.public_name()

    def reachable(self) -> bool:
        return self.inner.reachable()

    def resolve(self, model: str) -> ModelFiles:
        try:
            located = self.inner.resolve(model)
        except (StorageUnavailable, UpstreamError) as exc:
            if isinstance(exc, UpstreamError) and exc.code not in _UNREACHABLE:
                raise
            offline = self._offline(model)
            if offline is None:
                raise
            logger.warning("%s; serving model %r from the disk cache as it was last listed", exc, model)
            return offline
        if self.cache is None:
            return located
        cached = [self.cache.lookup(f) for f in located.files]
        if all(c is not None for c in cached):
            self.cache.remember(model, located.files)
            return ModelFiles(model, tuple(c for c in cached if c is not None), located.weight_map)
        return located

    def _offline(self, model: str) -> ModelFiles | None:
        """The model as it was last listed, if every one of those files is in the disk cache and checked."""
        remembered = self.cache.remembered(model) if self.cache is not None else None
        if not remembered or self.cache is None:
            return None
        cached = [self.cache.lookup(f) for f in remembered]
        if not all(c is not None for c in cached):
            return None
        return ModelFiles(model, tuple(c for c in cached if c is not None), None)

    def held_copy(self, file: SourceFile) -> SourceFile | None:
        """The disk cache's checked copy of file (this version of it) as a local file, never read from the
        source; None if there is none (a version rewritten above is still here until evicted). A file
        resolved to its cached copy already is that copy."""
        if file.local is not None:
            return file
        return self.cache.lookup(file) if self.cache is not None else None

    def companion_files(self, model: str) -> tuple[SourceFile, ...]:
        return self.inner.companion_files(model)

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        """Bytes of a remote file (a header, for a manifest): from its fill, or a ranged read."""
        length = max(0, min(length, file.size - start))
        fill = self._fill(file)
        if fill is not None:
            return fill.read(start, length)
        if not length:
            return b""
        return b"".join(data for data, _ in self._counted(self.inner.read_from(file, start, length)))

    def read_uncached(self, file: SourceFile, start: int, length: int = 0) -> Iterator[tuple[bytes, int | None]]:
        """(data, whole file's CRC32C or None) pieces of a remote file from start (length bytes, or to its end),
        read from the source and counted, never through a fill (fleet fan-out reads a file's header so)."""
        return self._counted(self.inner.read_from(file, start, length))

    def read_units(self, files: Sequence[SourceFile], plan: ReadPlan) -> Iterator[tuple[int, int, torch.Tensor]] | None:
        """The plan's units as this tier reads them; None for files in the disk cache (the streamer reads those)."""
        if files[plan.files[0].file_index].local is not None:
            return None
        return self._read_remote_units(files, plan)

    def _read_remote_units(
        self, files: Sequence[SourceFile], plan: ReadPlan
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield (index in plan.files, index of the unit, its bytes as flat uint8) per read unit of a plan
        of remote files, file after file; each tensor is a view into one buffer, valid until the next
        item is taken. Fills of every file of the plan start at once, so that they read in parallel."""
        largest = max(max(fp.sizes) for fp in plan.files)
        buffer = torch.empty(largest, dtype=torch.uint8)
        fills = [self._fill(files[fp.file_index]) for fp in plan.files]
        for file_id, (file_plan, fill) in enumerate(zip(plan.files, fills, strict=True)):
            file = files[file_plan.file_index]
            for index, (offset, size) in enumerate(zip(file_plan.offsets, file_plan.sizes, strict=True)):
                view = buffer[:size]
                if fill is not None:
                    fill.read_into(offset, _region_of(view, file.path).view(0, size))
                else:
                    self._read_into(file, offset, view)
                yield file_id, index, view

    def _read_into(self, file: SourceFile, offset: int, view: torch.Tensor) -> None:
        """A ranged read of view's size from offset of file, straight into view (a file not cached)."""
        done = 0
        for data, _ in self._counted(self.inner.read_from(file, offset, view.numel())):
            if done + len(data) > view.numel():
                raise CorruptCheckpoint(f"{file.path}: the source sent more than the {view.numel()} bytes asked for")
            _region_of(view, file.path).put(done, data)
            done += len(data)
        if done != view.numel():
            raise StorageUnavailable(f"{file.path}: the source sent {done} of {view.numel()} bytes at {offset}")

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def _fill(self, file: SourceFile) -> Fill | None:
        if self.cache is None or file.local is not None:
            return None
        return self.cache.fill(file, lambda offset: self._counted(self.inner.read_from(file, offset)))

    def _counted(self, pieces: Iterator[tuple[bytes, int | None]]) -> Iterator[tuple[bytes, int | None]]:
        for data, whole in pieces:
            with self._lock:
                self._source_bytes += len(data)
            yield data, whole


@dataclass(frozen=True)
class Tiers:
    """What a server reads from the tiers above it: its disk cache (None without one) and its tiered sources."""

    cache: DiskCache | None = None
    sources: tuple[TieredSource, ...] = ()

    @property
    def source_bytes_read(self) -> int:
        """Bytes read from the tiers above (an upstream server, S3 behind the disk cache)."""
        return sum(source.source_bytes_read for source in self.sources)

    def close(self) -> None:
        for source in self.sources:
            source.close()
        if self.cache is not None:
            self.cache.close()


def _region_of(view: torch.Tensor, path: str) -> Region:
    return Region(view.data_ptr(), view.numel(), f"the receive buffer of {path}")
