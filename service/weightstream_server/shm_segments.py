"""The files of the shared-memory transport in the shared directory: segments, and checking a client's nonce.

Segments: one file per stream, named SEGMENT_PREFIX + <pid>-<random> (weightstream.shm_protocol),
mode 0o640 (owner read-write, group read: in Kubernetes, run both containers as one user, or give
the pod an fsGroup, which emptyDir files inherit). The server holds an exclusive flock on the file
for the stream's life; the file is unlinked as soon as the client has mapped it (its first message
after the announcement) and at stream end, so that what is left in the directory is only a crashed
server's, before its client attached. Start-up cleanup (remove_stale_segments) deletes segments
that no process locks, and nonce files that clients which crashed while negotiating left behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import logging
import os
import time
from pathlib import Path
from types import TracebackType

from weightstream.shm_protocol import NONCE_PREFIX, is_nonce_name, is_segment_name, map_segment, new_segment_name
from weightstream_server.errors import InvalidRequest, SharedMemoryUnavailable

logger = logging.getLogger(__name__)

SEGMENT_MODE = 0o640
# A nonce file is a few dozen bytes; anything much larger is not one.
MAX_NONCE_BYTES = 1024
# Clients remove their nonce files within a call; one this old belongs to a client that crashed.
NONCE_MAX_AGE_S = 600.0


class Segment:
    """One stream's ring: slots * slot_bytes in a file of the shared directory, mapped read-write.

    Ownership: the stream that created it; close() unlinks the file (if still there), unmaps it and
    drops the lock. Addresses into it are valid until close(). Use from one thread, except
    unlink(), which the stream's credit thread may call.
    """

    def __init__(self, directory: Path, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        size = slots * slot_bytes
        self.name = new_segment_name()
        self.path = directory / self.name
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._linked = True
        try:
            # Held until close(): start-up cleanup of another server skips files that someone locks.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(self._fd, SEGMENT_MODE)  # exactly this mode, whatever the umask
            # Allocate the pages now (tmpfs): a write to a hole would fault them in one by one.
            os.posix_fallocate(self._fd, 0, size)
            self._mapping = map_segment(self._fd, size, writable=True)
        except BaseException:
            self._unlink()
            os.close(self._fd)
            raise
        self.address = self._mapping.address

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
        self._mapping.close()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


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
        if is_nonce_name(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > NONCE_MAX_AGE_S:
                    os.unlink(entry.path)
                    removed += 1
            continue
        if not is_segment_name(entry.name) or not entry.is_file(follow_symlinks=False):
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


def check_nonce(directory: Path, name: str, nonce: bytes) -> None:
    """Refuse unless directory/name is a nonce file holding exactly nonce (the client wrote it there).

    Only names of the nonce pattern are opened, so that a client cannot learn whether some other
    small file exists in the directory, or what it holds.
    """
    if not is_nonce_name(name):
        raise InvalidRequest(f"nonce_file {name[:200]!r} is not a nonce file name ({NONCE_PREFIX} and 16 hex digits)")
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
