"""The shared-memory transport's side of the directory: segments, their hand-over, and client nonces.

Segments: one per stream, a memfd sealed against shrinking and growing (shm.SEGMENT_SEALS),
so that a client, which holds the same file, cannot truncate it under the server's mapping: a copy
into a mapping past the end of its file would kill the server with SIGBUS, and every stream with
it. The segment is never a file in the directory. Its descriptor is handed to the client over a
Unix socket the stream listens on there (named in the announcement, mode 0o660: in Kubernetes, run
both containers as one user, or give the pod an fsGroup, which emptyDir files inherit), to the
first connection that sends the stream's ticket; connections without it are closed. The socket
file is removed once the descriptor is handed over and at stream end, so what is left in the
directory is only a crashed server's: start-up cleanup (remove_stale_segments) deletes sockets
nobody listens on, segment files of older versions that no process locks, and nonce files that
clients which crashed while negotiating left behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from weightstream.protocol import shm
from weightstream.protocol.memory import Region
from weightstream.protocol.shm import NONCE_PREFIX, is_nonce_name, is_segment_name, is_socket_name, map_segment
from weightstream_server.errors import InvalidRequest, RequestTimeout, ShmUnavailable

logger = logging.getLogger(__name__)

SOCKET_MODE = 0o660
# A nonce file is a few dozen bytes; anything much larger is not one.
MAX_NONCE_BYTES = 1024
# Clients remove their nonce files within a call; one this old belongs to a client that crashed.
NONCE_MAX_AGE_S = 600.0
# How long one connection to a hand-over socket may take to send its ticket; how often a waiting
# hand-over looks whether its stream has ended.
TICKET_TIMEOUT_S = 2.0
POLL_S = 0.25


class Segment:
    """One stream's ring: slots * slot_bytes of a sealed memfd, mapped read-write, and its hand-over socket.

    Ownership: the stream that created it; close() removes the socket file, unmaps the ring and
    closes the memfd. Addresses into it are valid until close(). Use from one thread, except
    hand_over(), which the stream's credit thread runs, and which closes the listening socket
    itself; close() and hand_over() never use the memfd at the same time.
    """

    def __init__(self, directory: Path, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        size = shm.ring_bytes(slots, slot_bytes)
        self.name = shm.new_segment_name()
        self.socket_name = shm.new_socket_name()
        self.ticket = secrets.token_bytes(shm.TICKET_BYTES)
        self._directory = directory
        self._lock = threading.Lock()  # guards _fd and _linked against close() during a hand-over
        self._linked = False
        self._handing_over = False  # hand_over() owns the listener from its start
        self._fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)
            # Allocate the pages now: a write to a hole would fault them in one by one.
            os.posix_fallocate(self._fd, 0, size)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, shm.SEGMENT_SEALS)
            self._mapping = map_segment(self._fd, size, writable=True)
            with shm.socket_address(directory, self.socket_name) as address:
                self._listener.bind(address)
                self._linked = True
                os.chmod(address, SOCKET_MODE)  # exactly this mode, whatever the umask
            self._listener.listen(8)
            self._listener.settimeout(POLL_S)
        except BaseException:
            self._unlink()
            self._listener.close()
            os.close(self._fd)
            raise
        self.address = self._mapping.address

    def slot_address(self, slot: int) -> int:
        return shm.slot_address(self.address, self.slot_bytes, slot)

    def slot_region(self, slot: int) -> Region:
        """Slot slot's memory: what a chunk written into it is checked against."""
        return Region(self.slot_address(slot), self.slot_bytes, f"slot {slot} of a shared-memory ring")

    def hand_over(self, timeout: float, ended: Callable[[], bool]) -> None:
        """Give the memfd to the first connection that sends the ticket, then close the socket.

        Waits up to timeout s, or until ended() is true (the stream is over: returns quietly).
        Connections that send anything else, or nothing within TICKET_TIMEOUT_S, are closed and
        counted in one log line. Raises RequestTimeout when no client came in time.
        """
        deadline = time.monotonic() + timeout
        refused = 0
        with self._lock:
            if self._fd < 0:
                return
            self._handing_over = True
        try:
            while not ended():
                if time.monotonic() > deadline:
                    raise RequestTimeout(
                        f"the client did not take segment {self.name} from {self.socket_name} within {timeout:.0f} s"
                    )
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    if self._give(conn):
                        return
                refused += 1
        finally:
            self._listener.close()
            with self._lock:
                self._unlink()
            if refused:
                logger.warning("segment %s: closed %d connections without its ticket", self.name, refused)

    def _give(self, conn: socket.socket) -> bool:
        """Read one ticket from conn; send the memfd if it is this segment's. True once handed over."""
        conn.settimeout(TICKET_TIMEOUT_S)
        ticket = b""
        try:
            while len(ticket) < shm.TICKET_BYTES:
                part = conn.recv(shm.TICKET_BYTES - len(ticket))
                if not part:
                    return False
                ticket += part
            if not hmac.compare_digest(ticket, self.ticket):
                return False
            with self._lock:
                if self._fd < 0:
                    return False
                socket.send_fds(conn, [shm.HANDOVER_OK], [self._fd])
            return True
        except OSError:
            return False

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            with (
                contextlib.suppress(FileNotFoundError),
                shm.socket_address(self._directory, self.socket_name) as address,
            ):
                os.unlink(address)

    def close(self) -> None:
        with self._lock:
            self._unlink()
            if self._fd < 0:
                return
            if not self._handing_over:
                self._listener.close()
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
    """Delete what dead servers and clients left in directory; how many entries went.

    A hand-over socket nobody listens on (its server died before the client came); a segment file
    of an older version that no process flocks; a nonce file older than NONCE_MAX_AGE_S (a client
    that crashed while negotiating). A live socket or segment, of whatever process or container,
    is left alone.
    """
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError as exc:
        logger.warning("shared-memory directory %s: cannot list it: %s", directory, exc.strerror or exc)
        return 0
    now = time.time()
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if is_nonce_name(entry.name) and stat.S_ISREG(info.st_mode):
            stale = now - info.st_mtime > NONCE_MAX_AGE_S
        elif is_socket_name(entry.name) and stat.S_ISSOCK(info.st_mode):
            stale = not _listened_on(directory, entry.name)
        elif is_segment_name(entry.name) and stat.S_ISREG(info.st_mode):
            stale = not _locked(entry.path)
        else:
            continue
        if not stale:
            continue
        try:
            os.unlink(entry.path)
            removed += 1
        except OSError as exc:
            logger.warning("stale %s: cannot remove it: %s", entry.path, exc.strerror or exc)
    if removed:
        logger.info("removed %d stale shared-memory sockets, segments and nonce files from %s", removed, directory)
    return removed


def _listened_on(directory: Path, name: str) -> bool:
    """True unless connecting to the socket name is refused (nobody listens: its server is gone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(POLL_S)
        try:
            with shm.socket_address(directory, name) as address:
                probe.connect(address)
        except ConnectionRefusedError:
            return False
        except OSError:
            return True  # not ours to judge (a full backlog, a permission): leave it
    return True


def _locked(path: str) -> bool:
    """True when some process holds a lock on the segment file at path (or it cannot be checked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            logger.warning("segment %s: cannot check it: %s", path, exc.strerror or exc)
        return True
    finally:
        os.close(fd)
    return False


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
        raise ShmUnavailable(
            f"the server does not see nonce file {name!r} in its shared-memory directory {directory} "
            f"({exc.strerror or exc}): the client's directory is another one"
        ) from None
    try:
        content = os.read(fd, MAX_NONCE_BYTES + 1)
    except OSError as exc:
        raise ShmUnavailable(f"cannot read nonce file {name!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if not hmac.compare_digest(content, nonce):
        raise ShmUnavailable(
            f"nonce file {name!r} in {directory} holds other bytes than the client wrote: "
            "the client's directory is another one"
        )
