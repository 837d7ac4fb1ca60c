"""The stall rule of every streaming RPC: a stream whose client stops taking what it is sent is ended.

A stream waits on its client in a few places only: gRPC sending a message (flow control holds the
send while the client reads nothing), a shared-memory ring waiting for the client to return a
slot, the data connection's sends. Each such wait runs inside StallWatch.waiting(); one that lasts
longer than --stall-timeout cancels the call (the client sees CANCELLED), which wakes every wait
of the stream, so the stream ends, gives back its slot and worker thread and frees its buffers,
and a WARNING names the peer. Waits on storage are not the client's and never count.

Threading: waiting() may be entered from any thread; one daemon thread, running only while some
wait is registered, checks them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

logger = logging.getLogger(__name__)


@dataclass
class _Wait:
    since: float
    context: grpc.RpcContext
    describe: Callable[[], str]


class StallWatch:
    """Cancels the calls whose waits on their clients last longer than timeout seconds. Thread-safe."""

    def __init__(self, timeout: float, on_stall: Callable[[], None] | None = None) -> None:
        self.timeout = timeout
        # Told of each call cancelled (ServerStats.stream_stalled).
        self._on_stall = on_stall
        self._lock = threading.Lock()
        self._waits: dict[int, _Wait] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self.stalled = 0  # calls this watch cancelled

    @contextlib.contextmanager
    def waiting(self, context: grpc.RpcContext, describe: Callable[[], str]) -> Iterator[None]:
        """Around one wait on the client of context's call; describe() names the stream for the log line."""
        with self._lock:
            key = self._next
            self._next += 1
            self._waits[key] = _Wait(time.monotonic(), context, describe)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="weightstream-stalls", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._waits.pop(key, None)

    def _run(self) -> None:
        interval = min(1.0, self.timeout / 4)
        while True:
            time.sleep(interval)
            now = time.monotonic()
            with self._lock:
                if not self._waits:
                    self._thread = None
                    return
                expired = [(k, w) for k, w in self._waits.items() if now - w.since > self.timeout]
                for key, _ in expired:
                    del self._waits[key]
                self.stalled += len(expired)
            for _, wait in expired:
                if self._on_stall is not None:
                    self._on_stall()
                logger.warning(
                    "%s: the client took nothing for %.0f s (--stall-timeout); the stream is ended",
                    wait.describe(),
                    now - wait.since,
                )
                wait.context.cancel()
