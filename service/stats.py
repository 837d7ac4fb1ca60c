"""Counters of what the server has done, for logs and the REST status endpoint."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any


class ServerStats:
    """Thread-safe counters shared by the gRPC handlers and the REST endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.active_streams = 0
        self.streams_total = 0
        self.bytes_served_total = 0
        self.errors_total: Counter[str] = Counter()

    def stream_started(self) -> None:
        with self._lock:
            self.active_streams += 1
            self.streams_total += 1

    def stream_ended(self, nbytes: int) -> None:
        with self._lock:
            self.active_streams -= 1
            self.bytes_served_total += nbytes

    def error(self, code_name: str) -> None:
        with self._lock:
            self.errors_total[code_name] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "uptime_s": round(time.monotonic() - self.started, 3),
                "active_streams": self.active_streams,
                "streams_total": self.streams_total,
                "bytes_served_total": self.bytes_served_total,
                "errors_total": dict(self.errors_total),
            }
