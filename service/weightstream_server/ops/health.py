"""Readiness and liveness, as REST /readyz and /healthz and grpc.health.v1 report them.

Readiness: whether the server takes new streams. A server is ready while gRPC is serving, it is
not draining, and every source (model root, S3 bucket) answers. Sources are asked again when their
last answer is older than PROBE_TTL_S, by one caller at a time: a store that hangs (an S3 endpoint
gone quiet) holds at most one thread, and every other probe meanwhile gets the last answer at once.
Serving and draining are never cached. ReadinessReport.public() is what callers without a token
may see: sources by kind (never a server path), errors by type.

Liveness: whether the gRPC server still answers at all. It has started and not stopped, and a
no-op handed to gRPC's own worker pool runs within LIVENESS_TIMEOUT_S: a pool whose every worker
is held (calls that never end, a store that hangs every manifest) answers no RPC either, while
REST, on threads of its own, would still answer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2

from weightstream_server.storage.sources import Source
from weightstream_server.transports.rpc import SERVICE

logger = logging.getLogger(__name__)

SERVICE_NAME: str = SERVICE.full_name
HEALTH_SERVICE_NAME: str = health.SERVICE_NAME
# A health service name that is SERVING while the process answers at all, for gRPC liveness probes
# (Kubernetes `grpc: {port: 50051, service: liveness}`); "" and SERVICE_NAME report readiness.
LIVENESS_SERVICE_NAME = "liveness"
# How long a source's reachability answer is reused; probes come every few seconds at most.
PROBE_TTL_S = 1.0
# How long /healthz waits for a gRPC worker; Kubernetes' probes give up after 1 s by default.
LIVENESS_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class SourceState:
    source: str
    reachable: bool
    error: str | None = None
    # What callers without a token are told: the source's kind or public id, and the error's type.
    public_name: str = ""
    error_type: str | None = None


@dataclass(frozen=True)
class ReadinessReport:
    ready: bool
    grpc_serving: bool
    draining: bool
    sources: tuple[SourceState, ...]
    # Models still being read into the cache at start-up (--preload), and preloads that failed
    # (model, why; why is empty in a public report).
    preloading: tuple[str, ...] = ()
    preload_errors: tuple[tuple[str, str], ...] = ()

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
        reasons += [f"preloading {model} failed" + (f": {why}" if why else "") for model, why in self.preload_errors]
        return reasons

    def public(self) -> ReadinessReport:
        """This report as a caller without a token may see it: no server path, no error message.

        Sources are named by kind ("model root") or by the s3:// id clients name models by, errors
        by their type; /status (which can ask for a token) and the log have the rest.
        """
        sources = tuple(
            SourceState(s.public_name, s.reachable, s.error_type, s.public_name, s.error_type) for s in self.sources
        )
        failures = tuple((model, "") for model, _why in self.preload_errors)
        return dataclasses.replace(self, sources=sources, preload_errors=failures)


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
        self._preload_errors: tuple[tuple[str, str], ...] = ()

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
                self._preload_errors += ((model, error),)

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


class Liveness:
    """Whether the gRPC server still answers: started, not stopped, and a worker of its pool free. Thread-safe.

    workers is the pool gRPC runs its calls on. At most one probe (a no-op) is queued in it at a
    time: checks that come while one waits wait on the same one, so a wedged server's queue grows
    by one no-op at most.
    """

    def __init__(self, workers: futures.Executor) -> None:
        self._workers = workers
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._probe: futures.Future[None] | None = None

    def mark_started(self) -> None:
        self._started.set()

    def mark_stopped(self) -> None:
        self._stopped.set()

    def problem(self, timeout: float = LIVENESS_TIMEOUT_S) -> str | None:
        """Why gRPC does not answer, or None when a worker took a no-op within timeout seconds."""
        if not self._started.is_set():
            return "gRPC has not started"
        if self._stopped.is_set():
            return "gRPC has stopped"
        with self._lock:
            if self._probe is None or self._probe.done():
                try:
                    self._probe = self._workers.submit(_nothing)
                except RuntimeError:  # the pool has been shut down
                    return "gRPC's worker pool has shut down"
            probe = self._probe
        done, _pending = futures.wait([probe], timeout)
        if not done:
            return f"no gRPC worker was free within {timeout:g} s"
        return None


def _nothing() -> None:
    pass


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
    name = source.public_name()
    try:
        return SourceState(source.describe(), bool(source.reachable()), public_name=name)
    except Exception as exc:
        # A probe must answer, not raise: an error here is the source being unreachable.
        logger.warning("checking %s failed: %s", source.describe(), exc)
        kind = type(exc).__name__
        return SourceState(source.describe(), False, f"{kind}: {exc}", public_name=name, error_type=kind)
