"""Readiness: whether the server takes new streams, as REST /readyz and grpc.health.v1 report it.

A server is ready while gRPC is serving, it is not draining, and every source (model root, S3
bucket) answers. Sources are asked again when their last answer is older than PROBE_TTL_S, by one
caller at a time: a store that hangs (an S3 endpoint gone quiet) holds at most one thread, and
every other probe meanwhile gets the last answer at once. Serving and draining are never cached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2

from weightstream_server.rpc import SERVICE
from weightstream_server.source import Source

logger = logging.getLogger(__name__)

SERVICE_NAME: str = SERVICE.full_name
HEALTH_SERVICE_NAME: str = health.SERVICE_NAME
# A health service name that is SERVING while the process answers at all, for gRPC liveness probes
# (Kubernetes `grpc: {port: 50051, service: liveness}`); "" and SERVICE_NAME report readiness.
LIVENESS_SERVICE_NAME = "liveness"
# How long a source's reachability answer is reused; probes come every few seconds at most.
PROBE_TTL_S = 1.0


@dataclass(frozen=True)
class SourceState:
    source: str
    reachable: bool
    error: str | None = None


@dataclass(frozen=True)
class ReadinessReport:
    ready: bool
    grpc_serving: bool
    draining: bool
    sources: tuple[SourceState, ...]
    # Models still being read into the cache at start-up (--preload), and preloads that failed.
    preloading: tuple[str, ...] = ()
    preload_errors: tuple[str, ...] = ()

    @property
    def reasons(self) -> list[str]:
        """Why the server is not ready, one phrase per cause; empty when it is."""
        reasons = []
        if not self.grpc_serving:
            reasons.append("gRPC is not serving")
        if self.draining:
            reasons.append("draining: the server is shutting down")
        reasons += [
            f"{s.source} is not reachable" + (f" ({s.error})" if s.error else "")
            for s in self.sources
            if not s.reachable
        ]
        reasons += [f"preloading {model} into the cache" for model in self.preloading]
        reasons += list(self.preload_errors)
        return reasons


class Readiness:
    """The server's lifecycle (serving, draining) and its sources' reachability. Thread-safe.

    serving is set once gRPC has started; draining once shutdown has begun. Neither is undone.
    """

    def __init__(self, sources: Sequence[Source]) -> None:
        self._sources = tuple(sources)
        self._serving = threading.Event()
        self._draining = threading.Event()
        self._probe_lock = threading.Lock()
        self._states = tuple(_probe(source) for source in self._sources)
        self._probed_at = time.monotonic()
        # Not the probe lock: a probe of a hung store may hold that one for seconds.
        self._preload_lock = threading.Lock()
        self._preloading: tuple[str, ...] = ()
        self._preload_errors: tuple[str, ...] = ()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def mark_serving(self) -> None:
        self._serving.set()

    def start_draining(self) -> None:
        self._draining.set()

    def preload_started(self, models: Sequence[str]) -> None:
        with self._preload_lock:
            self._preloading = tuple(models)

    def preload_ended(self, model: str, error: str | None) -> None:
        """One preload finished; error (why it failed) keeps the server not ready, since it was asked for."""
        with self._preload_lock:
            self._preloading = tuple(m for m in self._preloading if m != model)
            if error is not None:
                self._preload_errors += (f"preloading {model} failed: {error}",)

    def report(self) -> ReadinessReport:
        sources = self._source_states()
        serving, draining = self._serving.is_set(), self._draining.is_set()
        preloading, errors = self._preloading, self._preload_errors
        ready = serving and not draining and all(s.reachable for s in sources) and not preloading and not errors
        return ReadinessReport(ready, serving, draining, sources, preloading, errors)

    def _source_states(self) -> tuple[SourceState, ...]:
        if time.monotonic() - self._probed_at < PROBE_TTL_S:
            return self._states
        if not self._probe_lock.acquire(blocking=False):
            return self._states  # another thread is probing; its answer is at most as fresh
        try:
            self._states = tuple(_probe(source) for source in self._sources)
            self._probed_at = time.monotonic()
        finally:
            self._probe_lock.release()
        return self._states


class ReadinessHealthServicer(health.HealthServicer):
    """grpc.health.v1.Health answering from Readiness: SERVING when ready, else NOT_SERVING.

    It knows the overall service ("") and weightstream.v1.WeightStreamService (readiness), and
    "liveness" (SERVING while the process answers); other names are NOT_FOUND. Check asks
    Readiness afresh; Watch streams see a change when refresh() runs, which every Check and every
    lifecycle change (start, drain) does.
    """

    def __init__(self, readiness: Readiness) -> None:
        super().__init__()
        self._readiness = readiness
        self.refresh()

    def refresh(self) -> bool:
        """Set every known service's status from Readiness now; whether the server is ready."""
        ready = self._readiness.report().ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (health.OVERALL_HEALTH, SERVICE_NAME):
            self.set(name, status)
        # Liveness is not readiness: a store outage or a drain must not get a server restarted.
        self.set(LIVENESS_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        return ready

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self.refresh()
        return super().Check(request, context)


def _probe(source: Source) -> SourceState:
    try:
        return SourceState(source.describe(), bool(source.reachable()))
    except Exception as exc:
        # A probe must answer, not raise: an error here is the source being unreachable.
        logger.warning("checking %s failed: %s", source.describe(), exc)
        return SourceState(source.describe(), False, f"{type(exc).__name__}: {exc}")
