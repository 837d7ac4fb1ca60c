"""Sparse updates on the client: a delta chunk XORed into the bytes its destination holds, then checked.

The forms, and how a payload is decoded and checked, are weightstream.protocol.deltas'. apply_delta
XORs a delta into the destination in place (on host memory or on the device) and returns the
CRC32C of the result as it lies there; the load session compares it with the chunk's, which is the
new revision's. A payload that does not decode to what its form promises leaves the destination
untouched (DeltaUnusable). A result that fails the CRC32C means the destination did not hold the
base there: the session asks for those bytes again, whole.

Host destinations go faster through an Applier: the stream's thread receives and decodes each
delta, a thread of the Applier's XORs it into the destination and checksums the result, so that
receiving and decoding the next chunk overlaps applying this one.

Concurrency: one Codec per thread (zstd contexts are not safe to share). An Applier is driven by
one thread (the stream's); its worker touches only the destinations handed to it, until their
results are taken.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import numpy as np
import torch

from weightstream.client.placement import Destination
from weightstream.protocol.deltas import ENCODINGS, Codec, DeltaUnusable

__all__ = ["ENCODINGS", "Applier", "DeltaUnusable", "apply_delta", "codec"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


def applier_threads(cores: int) -> int:
    """The threads of a load's Appliers together, on a host where this process may run on cores: half of
    them (the rest for the stream's thread, the engine and a server beside it), at least two, so that
    decoding one delta overlaps XORing another into memory and checksumming it, and at most eight,
    beyond which the XOR and checksum only contend for the memory bus they are bound by."""
    return max(2, min(8, cores // 2))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


# The threads of a load's Appliers on this host, and how many deltas an Applier holds at most (each a
# copy of its payload): enough to keep its threads busy.
APPLIER_THREADS = applier_threads(_cores())
APPLIER_DEPTH = max(8, 2 * APPLIER_THREADS)

_local = threading.local()


def codec() -> Codec:
    """This thread's Codec."""
    own: Codec | None = getattr(_local, "codec", None)
    if own is None:
        own = _local.codec = Codec()
    return own


def apply_delta(dest: Destination, offset: int, length: int, address: int, payload_bytes: int, encoding: int) -> int:
    """XOR the delta (encoding, payload_bytes at address) into dest's bytes [offset, offset + length); their
    CRC32C after. DeltaUnusable (dest untouched) when the payload does not decode as its form says."""
    return codec().xor_into(dest.buffer[offset : offset + length], offset, address, payload_bytes, encoding)


class Applier(Generic[T]):
    """Decodes deltas and XORs them into host destinations on threads of its own (at most APPLIER_THREADS).

    submit hands one over with a token (its payload copied: the caller may reuse its buffer at
    once); results yields (token, CRC32C of the result) in the order submitted, for those done;
    None for one that did not decode (the destination untouched there) or whose worker failed
    (logged; the bytes there are unknown). At most APPLIER_DEPTH are in flight: submit waits for
    the oldest beyond that. close waits for all of them (their results are then dropped): nothing
    writes into a destination after it returns.
    """

    def __init__(self, label: str, threads: int = APPLIER_THREADS) -> None:
        # Named in the log lines of deltas that did not decode.
        self._label = label
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="weightstream-deltas")
        self._pending: deque[tuple[T, Future[int | None]]] = deque()

    def submit(self, token: T, view: torch.Tensor, offset: int, payload: memoryview | bytes, encoding: int) -> None:
        """XOR the delta payload (of encoding, for the chunk at offset) into view (host memory), later."""
        if len(self._pending) >= APPLIER_DEPTH:
            self._pending[0][1].exception()  # waits; its error is the results' to report
        job = self._pool.submit(
            self._apply, view, offset, payload if isinstance(payload, bytes) else bytes(payload), encoding
        )
        self._pending.append((token, job))

    def results(self, *, wait: bool) -> Iterator[tuple[T, int | None]]:
        """(token, CRC32C or None) of each delta submitted, oldest first: those done already, or all when wait."""
        while self._pending and (wait or self._pending[0][1].done()):
            token, future = self._pending.popleft()
            try:
                crc = future.result()
            except Exception:
                logger.exception("%s: applying a delta failed; its bytes are asked for again, whole", self._label)
                crc = None
            yield token, crc

    def close(self) -> None:
        """Wait until no delta is being applied, dropping their results; stop the workers."""
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def _apply(self, view: torch.Tensor, offset: int, payload: bytes, encoding: int) -> int | None:
        try:
            address = np.frombuffer(payload, dtype=np.uint8).ctypes.data if payload else 0
            decoded = codec().decode(view.numel(), offset, address, len(payload), encoding)
        except DeltaUnusable as exc:
            logger.warning("%s: a delta did not decode (%s)", self._label, exc)
            return None
        return decoded.xor_into(view)
