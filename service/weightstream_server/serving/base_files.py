"""A delta base's files as this server still holds them on disk, for the deltas of one stream.

A storage revision whose files were rewritten at its source may still lie on this node: a tier's
disk cache keeps a file's copy per version (storage.disk_cache; TieredSource.held_copy finds the
checked copy of a version without reading the source). Files under a model root are not taken
(a base whose files are still there unchanged could be, later). Those bytes are trusted only as
far as their checks go: a copy is taken
only once the disk cache found it whole and matching its recorded CRC32C, each file is opened by
descriptor and checked to be the file so found, and again after every read (any write, truncation or
rename since changes its identity). A read that cannot be trusted says so, and the chunk goes whole.
What slips past these checks (a damage that keeps the identity) costs a wrong delta, never a wrong
result: the client checks each delta's result against the new revision's CRC32C and asks for the
chunk again, whole.

Ownership: the descriptors, opened on first use, until close(). One stream's thread uses it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator

import numpy as np

from weightstream.protocol.wire import TensorSlice
from weightstream_server.errors import ServerError
from weightstream_server.serving.catalog import Manifest
from weightstream_server.serving.read_plan import slice_layout
from weightstream_server.storage.open_files import OpenFiles, read_exactly
from weightstream_server.storage.sources import SourceFile

logger = logging.getLogger(__name__)


def held_copy(base: Manifest, index: int) -> SourceFile | None:
    """The copy of base's file of index that this server holds on disk (checked), or None."""
    find = getattr(base.source, "held_copy", None)
    return find(base.files[index]) if find is not None else None


def may_hold(base: Manifest, tensors: Iterable[str]) -> bool:
    """Whether a file of base that some of tensors lie in is held on disk as it was listed (a quick
    look; reads check again)."""
    for index in sorted({base.by_name[name].file_index for name in tensors if name in base.by_name}):
        copy = held_copy(base, index)
        local = copy.local if copy is not None else None
        if copy is None or local is None:
            continue
        try:
            now = os.stat(os.path.join(local.roots[0], local.relative))
        except OSError:
            continue
        if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns) == (
            local.device,
            local.inode,
            copy.size,
            local.mtime_ns,
            local.ctime_ns,
        ):
            return True
    return False


class BaseFiles:
    """base's files held on disk, read by tensor bytes."""

    def __init__(self, base: Manifest) -> None:
        self.base = base
        # Per file index: its opened copy, or None when it is not held (asked once per stream).
        self._opened: dict[int, OpenFiles | None] = {}

    def read_into(self, tensor: str, slice_: TensorSlice | None, offset: int, into: np.ndarray) -> bool:
        """into[:] = base's bytes of tensor (of its slice, in the slice's numbering) from offset; whether
        they were read from a held, unchanged file (False: not held, or not trusted now)."""
        entry = self.base.by_name.get(tensor)
        if entry is None:
            return False
        opened = self._open(entry.file_index)
        if opened is None:
            return False
        fd = opened.fd(entry.file_index)
        try:
            for start, at, length in _spans(self.base, tensor, slice_, offset, into.size):
                read_exactly(fd, into[at : at + length].data, entry.file_offset + start)
            opened.check_unchanged(entry.file_index)
        except (OSError, ServerError, EOFError) as exc:
            logger.warning(
                "model %r: the held copy of %s cannot be read as the delta base: %s",
                self.base.model,
                self.base.files[entry.file_index].name,
                exc,
            )
            self._forget(entry.file_index)
            return False
        return True

    def close(self) -> None:
        for index in list(self._opened):
            self._forget(index)

    def _open(self, index: int) -> OpenFiles | None:
        if index in self._opened:
            return self._opened[index]
        copy = held_copy(self.base, index)
        opened = None
        if copy is not None and copy.local is not None:
            try:
                opened = OpenFiles(self.base.source, self.base.model, {index: copy})
            except (OSError, ServerError) as exc:
                logger.debug("model %r: %s is not held as listed: %s", self.base.model, copy.name, exc)
        self._opened[index] = opened
        return opened

    def _forget(self, index: int) -> None:
        opened = self._opened.get(index)
        self._opened[index] = None
        if opened is not None:
            opened.close()


def _spans(
    base: Manifest, tensor: str, slice_: TensorSlice | None, offset: int, length: int
) -> Iterator[tuple[int, int, int]]:
    """(byte in the tensor, byte in the output, length) of the runs that bytes [offset, offset + length)
    of tensor (of its slice, numbered as the slice's bytes, row after row) are made of."""
    if slice_ is None:
        yield offset, 0, length
        return
    _, row_bytes, first, per_row = slice_layout(base.tensor(tensor), slice_)
    at = 0
    while at < length:
        row, within = divmod(offset + at, per_row)
        run = min(per_row - within, length - at)
        yield row * row_bytes + first + within, at, run
        at += run
