"""Process-wide allocator tuning for the data path: fresh multi-MiB message buffers without page faults."""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_tuned = False


def tune_malloc(arenas: int | None = None) -> bool:
    """Keep glibc from returning freed message buffers to the kernel between messages; True if applied.

    Every gRPC message is a fresh multi-MiB allocation. By default glibc serves those with mmap and
    unmaps them on free, so every message pays page faults on fresh memory (a fifth of the server's
    CPU in a profile here, and as much on the client). Serving them from a heap that is neither
    trimmed nor unmapped reuses the same touched pages. The cost: freed memory up to the largest
    in-flight set of messages stays resident. The server calls this at start-up; an engine that
    loads through the client may call it once at start-up too (`weightstream load` and `bench` do).
    Not glibc (musl, macOS): nothing happens.

    arenas: at most this many malloc arenas from now on (glibc's default is 8 per core). Each
    thread that allocates may get an arena of its own, and what a short stream's threads freed in
    theirs stays there, fragmented, after the stream: the server caps them (see
    benchmarks/churn_memory.py). Only the first call's value counts.
    """
    global _tuned
    if _tuned:
        return True
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
    mallopt(_M_TRIM_THRESHOLD, 1 << 34)
    mallopt(_M_TOP_PAD, 256 * 1024 * 1024)
    if arenas is not None:
        mallopt(_M_ARENA_MAX, arenas)
    _tuned = True
    logger.debug("glibc malloc tuned for large message buffers")
    return True


def release_free_memory() -> bool:
    """Give the heap memory that is free in every malloc arena back to the kernel; True if it ran.

    tune_malloc keeps freed buffers resident for reuse, and each thread that allocated them may
    have an arena of its own: after many short streams, arenas hold a read-ahead's worth of free
    pages each. The server calls this when a stream ends; the next stream's fresh buffers fault
    their pages in again, as a new stream's do anyway. Thread-safe (glibc's malloc_trim). Not
    glibc: nothing happens.
    """
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
