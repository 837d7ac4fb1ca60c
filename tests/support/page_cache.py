"""The page cache as a test's premise: which pages of a file it holds (mincore), and a file made partly cached.

A test that asserts what follows from cached or uncached bytes establishes that state here and
checks it first; the kernel may read ahead or keep pages it was asked to drop, so building the
state is retried, and a state that cannot be built fails the test naming the premise.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import evict_from_page_cache

PAGE = mmap.PAGESIZE
ATTEMPTS = 10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_pages(path: Path) -> list[bool]:
    """For each page of path, whether the page cache holds it now (mincore over a read-only mapping)."""
    size = path.stat().st_size
    if not size:
        return []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vector = ctypes.create_string_buffer(-(-size // PAGE))
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return [bool(byte & 1) for byte in vector.raw]
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def make_partly_cached(path: Path, start: int, cached: int, end: int) -> None:
    """Leave [start, start + cached) of path in the page cache and none of the rest of [start, end), checked.

    start and start + cached must be page-aligned. Readahead is turned off for the read that warms
    the pages (POSIX_FADV_RANDOM), and the whole state is checked with mincore; after ATTEMPTS
    tries that the kernel undid, AssertionError says which pages it kept or dropped.
    """
    assert start % PAGE == 0 and cached % PAGE == 0, "page-aligned ranges only"
    first, warm_end, last = start // PAGE, (start + cached) // PAGE, -(-end // PAGE)
    pages: list[bool] = []
    for _ in range(ATTEMPTS):
        evict_from_page_cache(path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, cached, start)
        finally:
            os.close(fd)
        pages = cached_pages(path)
        if all(pages[first:warm_end]) and not any(pages[warm_end:last]):
            return
    kept = sum(pages[warm_end:last])
    dropped = warm_end - first - sum(pages[first:warm_end])
    raise AssertionError(
        f"premise not established: {path} should have pages {first}..{warm_end} cached and {warm_end}..{last} not, "
        f"but after {ATTEMPTS} tries {kept} of the uncached pages stayed and {dropped} of the cached ones were dropped"
    )


def make_uncached(path: Path, also: Callable[[], bool] | None = None) -> None:
    """Drop every page of path from the page cache, checked with mincore and by also() where given.

    Retried (readahead still in flight may bring pages back); AssertionError if it cannot be done,
    for example while another process maps the file.
    """
    pages: list[bool] = []
    for attempt in range(ATTEMPTS):
        evict_from_page_cache(path)
        pages = cached_pages(path)
        if not any(pages) and (also is None or also()):
            return
        time.sleep(0.05 * attempt)
    raise AssertionError(
        f"premise not established: {sum(pages)} pages of {path} stayed cached after {ATTEMPTS} evictions"
        + ("" if any(pages) else ", or the caller's own check still found it cached")
    )


def make_cached(path: Path) -> None:
    """Read path whole into the page cache, checked with mincore (retried; AssertionError if it cannot)."""
    pages: list[bool] = []
    for _ in range(ATTEMPTS):
        path.read_bytes()
        pages = cached_pages(path)
        if all(pages):
            return
    raise AssertionError(f"premise not established: {pages.count(False)} pages of {path} stayed uncached")
