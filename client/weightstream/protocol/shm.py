"""The shared-memory protocol, as both sides see it: file names, ring sizes, and mapping a segment.

A client on the server's host offers a directory both can see. It proves the server sees it with a
nonce file (NONCE_PREFIX + 16 hex digits, written by the client, read back by the server). Each
shared stream then gets one segment holding a ring of `slots` slots of `slot_bytes` each; chunks
packed into a slot start on SLOT_ALIGN boundaries.

A segment is never a file in the directory: it is a memfd (named SEGMENT_PREFIX + pid + "-" + 16
hex digits, as /proc/PID/maps shows it) sealed against shrinking and growing (SEGMENT_SEALS), so
that no holder of it can truncate it under the other side's mapping (a mapping past the end of a
file faults with SIGBUS). The server hands its descriptor over a Unix socket it listens on in the
directory (SOCKET_PREFIX + pid + "-" + 16 hex digits, one per stream, named in the stream's
announcement): the client connects, sends the stream's ticket (TICKET_BYTES, from the
announcement, so from an authenticated call), and receives HANDOVER_OK with the descriptor
(SCM_RIGHTS). Socket paths go through /proc/self/fd/DIRFD/NAME (socket_address), so that a
directory of any length works (a socket path holds at most 107 bytes).

Both the server (which creates and fills a segment) and the client (which reads it) import this
module, so that a name, a default or the slot-size rule is written once, and both map a segment
the same way (map_segment).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

from weightstream.protocol import wire

SEGMENT_PREFIX = "weightstream-seg-"
NONCE_PREFIX = "weightstream-nonce-"
SOCKET_PREFIX = "weightstream-sock-"
_SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"\d+-[0-9a-f]{16}")
_SOCKET_NAME = re.compile(re.escape(SOCKET_PREFIX) + r"\d+-[0-9a-f]{16}")
_NONCE_NAME = re.compile(re.escape(NONCE_PREFIX) + r"[0-9a-f]{16}")
# The ring a stream gets when it asks for none: 4 slots of one chunk each (16 MiB at 4 MiB chunks).
# Each stream allocates its ring afresh (its pages are zeroed by the kernel), so a small ring starts
# sooner: a 415 MB load into touched parameters took 0.100 s with this ring against 0.155 s with
# 4 slots of 4 chunks (64 MiB; same run, medians of 6), and 8 slots were no faster than 4.
DEFAULT_SLOTS = 4
CHUNKS_PER_SLOT = 1
MIN_SLOTS = 2
MAX_SLOTS = 4096
# Chunks packed into one slot start on this boundary, so that every copy starts aligned.
SLOT_ALIGN = 64
# The hand-over: the client's ticket, then the server's one-byte answer with the descriptor.
TICKET_BYTES = 16
HANDOVER_OK = b"\x01"
# A segment's size is fixed for good once these are set: nobody can shrink, grow or unseal it.
SEGMENT_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def new_segment_name() -> str:
    """A fresh segment file name for this process."""
    return f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def new_socket_name() -> str:
    """A fresh hand-over socket name for this process."""
    return f"{SOCKET_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def new_nonce_name() -> str:
    """A fresh nonce file name."""
    return f"{NONCE_PREFIX}{secrets.token_hex(8)}"


def is_segment_name(name: str) -> bool:
    """True for a name new_segment_name() could have made (and so a plain file name)."""
    return _SEGMENT_NAME.fullmatch(name) is not None


def is_socket_name(name: str) -> bool:
    """True for a name new_socket_name() could have made (and so a plain file name)."""
    return _SOCKET_NAME.fullmatch(name) is not None


def is_nonce_name(name: str) -> bool:
    """True for a name new_nonce_name() could have made (and so a plain file name)."""
    return _NONCE_NAME.fullmatch(name) is not None


@contextlib.contextmanager
def socket_address(directory: Path, name: str) -> Iterator[str]:
    """The address of the socket name in directory, for bind() or connect(), valid inside the block.

    The directory is held open, and the address goes through its descriptor, so that its length
    does not count against the 107 bytes of a socket path.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def is_sealed(fd: int) -> bool:
    """True when the segment fd can no longer change size (it carries SEGMENT_SEALS)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEGMENT_SEALS == SEGMENT_SEALS
    except OSError:
        return False  # not a memfd: a file anyone with write access could truncate


def default_slot_bytes(chunk_bytes: int) -> int:
    """The slot size for chunks of chunk_bytes when a stream asks for none: CHUNKS_PER_SLOT chunks, capped."""
    return min(CHUNKS_PER_SLOT * chunk_bytes, wire.MAX_CHUNK_BYTES)


def ring_bytes(slots: int, slot_bytes: int) -> int:
    """The size of a ring's segment: its slots laid back to back from the segment's start."""
    return slots * slot_bytes


def slot_address(base: int, slot_bytes: int, slot: int, offset: int = 0) -> int:
    """Where byte offset of slot lies in a ring mapped at base (both sides address slots this way)."""
    return base + slot * slot_bytes + offset


def aligned(offset: int) -> int:
    """offset rounded up to the next SLOT_ALIGN boundary."""
    return -(-offset // SLOT_ALIGN) * SLOT_ALIGN


class Mapping:
    """size bytes of a segment file mapped into this process at address (libc mmap: no buffer object).

    Ownership: whoever mapped it; close() unmaps it, after which addresses into it are invalid.
    close() is idempotent. Not thread-safe: one owner closes it once its users are done.
    """

    def __init__(self, address: int, size: int, writable: bool) -> None:
        self.address = address
        self.size = size
        self.writable = writable

    def close(self) -> None:
        if self.address:
            _libc.munmap(self.address, self.size)
            self.address = 0


def map_segment(fd: int, size: int, *, writable: bool) -> Mapping:
    """Map the first size bytes of the open segment file fd, shared, every page populated at once.

    The descriptor may be closed afterwards; the mapping stays until Mapping.close(). Raises
    OSError (with errno) when the kernel refuses.
    """
    protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    address = _libc.mmap(None, size, protection, mmap.MAP_SHARED | _MAP_POPULATE, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return Mapping(address, size, writable)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
# Map every page at once: one call instead of a fault per 4 KiB page on first touch.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
