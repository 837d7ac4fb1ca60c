"""Wire-format helpers shared by the server and the client: checksums, chunk sizes, file names, slices.

Element types live in dtypes.py, how data messages are framed in framing.py. Both sides import
these modules, so that a dtype, a checksum or a chunk boundary is defined once.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from awscrt import checksums

# Payload bytes per chunk. Messages of a few MiB move fastest over gRPC; much larger ones are
# slower because each message is buffered whole on both sides.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 16 * 1024 * 1024
# Room in a gRPC message for everything but the payload (names, offsets, framing), so that a
# message of several small chunks still fits under the channel's limit.
MESSAGE_OVERHEAD_BYTES = 1024 * 1024
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + MESSAGE_OVERHEAD_BYTES
# Bytes checksummed right after they were written (received, copied), so that the checksum reads
# them from the core's cache rather than from memory: well under a core's L2.
CACHE_PIECE_BYTES = 256 * 1024
# A file name in a model folder, as ListModelFiles lists it: one path component, not hidden, so
# that neither side can be talked into a path outside the folder ("..", "/", "\\", ".partial").
_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")


@dataclass(frozen=True)
class TensorSlice:
    """Elements [start, stop) of dimension dim of a tensor, every other dimension whole.

    The one name for a slice on both sides: the client asks for one (weightstream.v1 TensorSlice on
    the wire), the server plans its reads from it.
    """

    dim: int
    start: int
    stop: int


def crc32c(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of data, as TensorChunk.crc32c carries it."""
    return crc32c_extend(0, data)


def crc32c_extend(crc: int, data: bytes | memoryview) -> int:
    """CRC32C of the bytes crc covers followed by data (crc32c_extend(0, data) == crc32c(data))."""
    return int(checksums.crc32c(data, crc))


def crc32c_combine(crc: int, then: int, then_length: int) -> int:
    """CRC32C of two runs of bytes back to back, from each run's CRC32C (then: the second's, then_length bytes)."""
    return int(checksums.combine_crc32c(crc, then, then_length))


def crc32c_of_range(
    read_at: Callable[[int, int], bytes], start: int, length: int, *, block_bytes: int = 4 * 1024 * 1024, crc: int = 0
) -> tuple[int, int]:
    """The CRC32C of length bytes from start (after what crc covers), read as read_at(offset, size) block by block.

    Returns (crc, bytes read); a read shorter than asked ends it early, so a caller that got fewer
    bytes than length knows the file was shorter. Holds one block at a time.
    """
    done = 0
    while done < length:
        want = min(block_bytes, length - done)
        block = read_at(start + done, want)
        crc = crc32c_extend(crc, block)
        done += len(block)
        if len(block) < want:
            break
    return crc, done


def is_plain_file_name(name: str) -> bool:
    """Whether name is a single, non-hidden file name of letters, digits, ".", "_" and "-"."""
    return _PLAIN_FILE_NAME.fullmatch(name) is not None


def crc32c_at(address: int, length: int, crc: int = 0) -> int:
    """CRC32C of the bytes crc covers followed by the length bytes at address, without copying them.

    Any memory: a tensor, a ring slot, a slice of a received message. The AWS Common Runtime's
    checksum (awscrt) releases the GIL while it runs; it checksums about twice as fast as
    google-crc32c on bytes read from memory, and three times on bytes in the core's cache.
    """
    return crc32c_extend(crc, memory_at(address, length))


def memory_at(address: int, size: int) -> memoryview:
    """A writable view of the size bytes at address, without copying them (the caller keeps them alive).

    One call into the interpreter: a ctypes array type made for every size costs more than the
    small chunks it would look at.
    """
    return _memory_from(address, size, _PYBUF_WRITE) if size else memoryview(bytearray())


def copy_crc32c(destination: int, source: int, length: int) -> int:
    """Copy length bytes from source to destination; the CRC32C of the bytes as they landed there.

    The copy goes in CACHE_PIECE_BYTES pieces, each checksummed at destination right after it is
    written, while it is still in the core's cache: one pass over memory instead of two. The
    caller keeps both alive and checks the CRC32C before it counts the bytes as received.
    """
    crc = 0
    for start in range(0, length, CACHE_PIECE_BYTES):
        size = min(CACHE_PIECE_BYTES, length - start)
        ctypes.memmove(destination + start, source + start, size)
        crc = crc32c_at(destination + start, size, crc)
    return crc


_PYBUF_WRITE = 0x200
_memory_from = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_from.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_from.restype = ctypes.py_object


def clamp_chunk_bytes(requested: int) -> int:
    """The chunk size a request gets: the default for 0, otherwise within the allowed bounds."""
    if requested <= 0:
        return DEFAULT_CHUNK_BYTES
    return max(MIN_CHUNK_BYTES, min(requested, MAX_CHUNK_BYTES))


def split_range(start: int, end: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Cut [start, end) into (offset, length) pieces of at most chunk_bytes each."""
    offset = start
    while offset < end:
        length = min(chunk_bytes, end - offset)
        yield offset, length
        offset += length


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a shape (1 for a 0-dim tensor)."""
    count = 1
    for dim in shape:
        count *= dim
    return count
