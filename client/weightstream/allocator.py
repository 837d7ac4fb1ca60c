"""Process-wide allocator tuning for the data path: fresh multi-MiB message buffers without page faults,
and fresh memory faulted in ahead of the bytes that land there (populate, PopulateAhead)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections.abc import Callable

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


MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        function = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def _probe() -> bool:
    """Whether this kernel knows MADV_POPULATE_WRITE: tried once on a page of fresh anonymous memory.

    A refusal later says nothing about the kernel (EINVAL is also the answer for memory without
    write permission), so it is asked here, where only an unknown advice can fail.
    """
    if _MADVISE is None:
        return False
    with mmap.mmap(-1, PAGE) as page:
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        known = _MADVISE(address, PAGE, MADV_POPULATE_WRITE) == 0
    if not known:
        logger.debug("madvise(MADV_POPULATE_WRITE) is not supported here; destinations fault on first write")
    return known


_supported = _probe()


def populate_supported() -> bool:
    """Whether populate can do anything here (the kernel knows MADV_POPULATE_WRITE)."""
    return _supported


def populate(address: int, length: int) -> bool:
    """Fault in the pages of [address, address + length) writable, contents unchanged; False if not done
    (an old kernel; memory that refuses writes).

    The span is widened to whole pages: the pages at its ends hold bytes of it, so they are mapped.
    """
    if not _supported or _MADVISE is None or length <= 0:
        return False
    start = address - address % PAGE
    end = -(-(address + length) // PAGE) * PAGE
    return _MADVISE(start, end - start, MADV_POPULATE_WRITE) == 0


class PopulateAhead:
    """Faults in [address, address + length) on a daemon thread, step by step from its start, while
    bytes land there from the front (a receive into fresh memory): most pages are there before
    the bytes are. close() stops it between two steps and waits for it."""

    STEP_BYTES = 32 * 1024 * 1024

    def __init__(self, address: int, length: int) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if _supported and length > 0:
            self._thread = threading.Thread(
                target=self._run, args=(address, length), name="weightstream-populate", daemon=True
            )
            self._thread.start()

    def _run(self, address: int, length: int) -> None:
        for offset in range(0, length, self.STEP_BYTES):
            if self._stop.is_set() or not populate(address + offset, min(self.STEP_BYTES, length - offset)):
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
