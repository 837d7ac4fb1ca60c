"""The files of one model, opened for reading: by descriptor beneath the root for local files, by URL for objects.

Each listed local file records its identity (device, inode, size, modification and change times).
OpenFiles checks a descriptor against it when it opens the file and again when its reads end: a
file that is another one, or was rewritten, is CheckpointChanged (FAILED_PRECONDITION), never
served mixed. A rewrite within the file system's timestamp granularity of the previous write leaves
the times as they were, and is not seen. Only regular files are ever opened (a FIFO or a device
under a checkpoint's name is refused before any open, so it cannot block a worker), and their
bytes are read only through the descriptors so opened: a file or folder swapped for a link after
the check is never read. Hard links are outside any path check: a hard link inside the root to a
file elsewhere is an ordinary file here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from types import TracebackType

from weightstream_server.errors import CheckpointChanged
from weightstream_server.storage.file_errors import file_error
from weightstream_server.storage.safe_walk import FILE_FLAGS, SafeWalk
from weightstream_server.storage.sources import Source, SourceFile

# What the Run:ai streamer opens to read a descriptor's file (this process's own descriptors).
_FD_PATH = "/proc/self/fd/{}"


class OpenFiles:
    """Some files of one model, open for the reads of one stream (or one manifest, one file read).

    Local files are opened beneath their model root (see the module's docstring), each checked to
    be the file its SourceFile describes, and read only through that descriptor: the Run:ai streamer
    is given path(), /proc/self/fd/N, which opens this very file whatever its name now leads to.
    Objects (S3) are read by URL through their source. check_unchanged compares a descriptor's size
    and times with the listing's at the end of a file's reads; a file replaced by rename meanwhile
    keeps its bytes but loses its name (its change time moves), so that too is a change.

    Ownership: the descriptors, from the constructor (which opens them all or none) until close().
    The reads and checks may run on several threads at once; close comes after the last.
    """

    def __init__(self, source: Source, model: str, files: Mapping[int, SourceFile]) -> None:
        self.model = model
        self._source = source
        self._files = dict(files)
        self._fds: dict[int, int] = {}
        try:
            for index, file in self._files.items():
                if file.local is not None:
                    self._fds[index] = _open_local(model, file)
        except BaseException:
            self.close()
            raise

    def path(self, index: int) -> str:
        """Where the streamer reads the file of index: its descriptor's /proc path, or its URL."""
        fd = self._fds.get(index)
        return self._files[index].path if fd is None else _FD_PATH.format(fd)

    def fd(self, index: int) -> int:
        """The descriptor of the local file of index."""
        return self._fds[index]

    def read_range(self, index: int, start: int, length: int) -> bytes:
        """Up to length bytes of the file of index from start (fewer only at its end)."""
        fd = self._fds.get(index)
        if fd is None:
            return self._source.read_range(self._files[index], start, length)
        parts: list[bytes] = []
        done = 0
        while done < length:
            try:
                data = os.pread(fd, length - done, start + done)
            except OSError as exc:
                raise file_error(exc, self._what(index), listed=True) from exc
            if not data:
                break
            parts.append(data)
            done += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def check_unchanged(self, index: int) -> None:
        """Raise CheckpointChanged if the local file of index is no longer as it was listed."""
        fd = self._fds.get(index)
        if fd is not None:
            _check_identity(self.model, self._files[index], os.fstat(fd))

    def check_all_unchanged(self) -> None:
        for index in self._fds:
            self.check_unchanged(index)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _what(self, index: int) -> str:
        return f"model {self.model!r}: file {self._files[index].name!r}"


def _open_local(model: str, file: SourceFile) -> int:
    """A descriptor of file, opened beneath its root and checked to be the regular file that was listed."""
    local = file.local
    assert local is not None
    what = f"model {model!r}: file {file.name!r}"
    try:
        with SafeWalk(local.roots) as walk:
            leaf = walk.follow(local.relative, what)
            if leaf is None or not stat.S_ISREG(leaf[1].st_mode):
                raise CheckpointChanged(f"{what} is no longer a regular file; it changed on disk")
            fd = os.open(leaf[0], FILE_FLAGS, dir_fd=walk.fd)
    except OSError as exc:
        raise file_error(exc, what, listed=True) from exc
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise CheckpointChanged(f"{what} is no longer a regular file; it changed on disk")
        os.set_blocking(fd, True)
        _check_identity(model, file, opened)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_identity(model: str, file: SourceFile, now: os.stat_result) -> None:
    local = file.local
    assert local is not None
    what = f"model {model!r}: {file.name}"
    if (now.st_dev, now.st_ino) != (local.device, local.inode):
        raise CheckpointChanged(f"{what} is another file than the one listed; it changed on disk")
    if now.st_size != file.size:
        raise CheckpointChanged(
            f"{what} is {now.st_size} bytes, not the {file.size} bytes it had when it was listed; it changed on disk"
        )
    if (now.st_mtime_ns, now.st_ctime_ns) != (local.mtime_ns, local.ctime_ns):
        raise CheckpointChanged(f"{what} was written, renamed or replaced since it was listed; it changed on disk")


def read_exactly(fd: int, into: memoryview, offset: int) -> None:
    """Fill into with the bytes of fd from offset (pread: the descriptor's position is left alone);
    EOFError when the file ends first."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got <= 0:
            raise EOFError(f"the file ended at {offset + done} bytes, {len(into) - done} bytes early")
        done += got
