"""Counters of what the server has done: the one record that REST /status and /metrics both read."""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from dataclasses import dataclass

# Upper bounds (seconds) of the stream duration histogram: a manifest-sized stream takes
# milliseconds, a 100 GB checkpoint over a slow link many minutes.
DURATION_BUCKETS_S: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class ModelCounts:
    """Streams of one model (or over one transport), and the tensor bytes they sent."""

    streams: int
    bytes_served: int


@dataclass(frozen=True)
class StatsSnapshot:
    """The counters at one moment.

    duration_counts[i] counts the ended streams that took at most DURATION_BUCKETS_S[i] seconds
    (cumulative, as Prometheus histograms are); streams_ended counts them all.
    """

    uptime_s: float
    active_streams: int
    streams_total: int
    bytes_served_total: int
    storage_bytes_read_total: int
    errors_total: dict[str, int]
    data_connections_refused_total: int
    models: dict[str, ModelCounts]
    # By the transport the stream's bytes travelled on: grpc, tcp (the data port) or shm.
    transports: dict[str, ModelCounts]
    # Streams the stall rule ended (the client took nothing for --stall-timeout).
    stalls_total: int
    # Streams refused a slot, by reason: "slots" (every slot taken) or "share" (the client holds its share).
    refused_total: dict[str, int]
    streams_ended: int
    duration_counts: tuple[int, ...]
    duration_sum_s: float


class ServerStats:
    """Thread-safe counters shared by the gRPC handlers and the REST endpoint.

    Every stream calls stream_started once and stream_ended once, from the thread serving it;
    wait_idle may be called from any other thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._started = time.monotonic()
        self._active = 0
        self._streams = 0
        self._bytes_served = 0
        self._storage_bytes_read = 0
        self._errors: Counter[str] = Counter()
        self._data_refused = 0
        self._model_streams: Counter[str] = Counter()
        self._model_bytes: Counter[str] = Counter()
        self._transport_streams: Counter[str] = Counter()
        self._transport_bytes: Counter[str] = Counter()
        self._stalls = 0
        self._refused: Counter[str] = Counter()
        # One count per bucket, the last for streams longer than the largest bound.
        self._durations = [0] * (len(DURATION_BUCKETS_S) + 1)
        self._duration_sum = 0.0

    @property
    def active_streams(self) -> int:
        with self._lock:
            return self._active

    def stream_started(self) -> None:
        with self._lock:
            self._active += 1
            self._streams += 1

    def stream_ended(self, model: str | None, *, transport: str, sent: int, read: int, seconds: float) -> None:
        """Record a finished stream; model is None when the stream ended before its model was found."""
        with self._lock:
            self._active -= 1
            self._bytes_served += sent
            self._storage_bytes_read += read
            if model is not None:
                self._model_streams[model] += 1
                self._model_bytes[model] += sent
            self._transport_streams[transport] += 1
            self._transport_bytes[transport] += sent
            self._durations[bisect.bisect_left(DURATION_BUCKETS_S, seconds)] += 1
            self._duration_sum += seconds
            if self._active == 0:
                self._idle.notify_all()

    def storage_read(self, nbytes: int) -> None:
        """Count bytes read from storage outside any stream (a preload)."""
        with self._lock:
            self._storage_bytes_read += nbytes

    def error(self, code_name: str) -> None:
        with self._lock:
            self._errors[code_name] += 1

    def stream_stalled(self) -> None:
        """Count a stream the stall rule ended."""
        with self._lock:
            self._stalls += 1

    def stream_refused(self, reason: str) -> None:
        """Count a stream refused a slot: reason "slots" (none free) or "share" (its client holds its share)."""
        with self._lock:
            self._refused[reason] += 1

    def data_connection_refused(self) -> None:
        """Count a connection the data port closed without admitting it."""
        with self._lock:
            self._data_refused += 1

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to timeout seconds for every stream to end; whether none is left."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._active > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            cumulative = []
            total = 0
            for count in self._durations[:-1]:
                total += count
                cumulative.append(total)
            return StatsSnapshot(
                uptime_s=round(time.monotonic() - self._started, 3),
                active_streams=self._active,
                streams_total=self._streams,
                bytes_served_total=self._bytes_served,
                storage_bytes_read_total=self._storage_bytes_read,
                errors_total=dict(self._errors),
                data_connections_refused_total=self._data_refused,
                models={
                    model: ModelCounts(self._model_streams[model], self._model_bytes[model])
                    for model in sorted(self._model_streams)
                },
                transports={
                    name: ModelCounts(self._transport_streams[name], self._transport_bytes[name])
                    for name in sorted(self._transport_streams)
                },
                stalls_total=self._stalls,
                refused_total=dict(self._refused),
                streams_ended=sum(self._durations),
                duration_counts=tuple(cumulative),
                duration_sum_s=self._duration_sum,
            )
