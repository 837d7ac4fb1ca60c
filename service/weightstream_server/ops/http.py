"""The REST endpoint next to the gRPC port: liveness, readiness, status (JSON) and Prometheus metrics.

/healthz and /readyz are always open (probes send no token), so they name no server path;
/status and /metrics need the server's bearer token when it has one. /openapi.json describes the
endpoints; FastAPI's interactive pages (/docs, /redoc) are off.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from weightstream import __version__
from weightstream_server.assembly import WeightStreamServer
from weightstream_server.ops import metrics
from weightstream_server.ops.health import ReadinessReport, SourceState

logger = logging.getLogger(__name__)


class Health(BaseModel):
    status: str = Field(description='"ok" while the process is up and its gRPC server answers; else "unhealthy"')
    reason: str | None = Field(default=None, description="why gRPC does not answer (only when unhealthy)")


class SourceStatus(BaseModel):
    source: str = Field(
        description="what the source is: in /readyz 'model root', 's3://bucket', 'gs://bucket' or 'az://container'; "
        "/status adds the root's path"
    )
    reachable: bool
    error: str | None = Field(
        default=None, description="why it is not reachable, when checking it failed (/readyz: the error's type only)"
    )


class ReadinessStatus(BaseModel):
    ready: bool
    grpc_serving: bool = Field(description="gRPC has started and not stopped")
    draining: bool = Field(description="SIGTERM arrived: no new streams are taken")
    sources: list[SourceStatus]
    reasons: list[str] = Field(description="why the server is not ready; empty when it is")


class ModelStatus(BaseModel):
    streams: int = Field(description="streams of this model that ended (any status)")
    bytes_served: int = Field(description="tensor bytes sent for this model")


class CacheStatus(BaseModel):
    capacity_bytes: int = Field(description="--cache-bytes: the most tensor bytes kept")
    resident_bytes: int = Field(description="tensor bytes held now")
    units: int = Field(description="read units held now (up to 16 MiB each)")
    hits: int = Field(description="read units served from the cache")
    misses: int = Field(description="read units not in the cache when asked for (read, or shared)")
    shared: int = Field(description="misses that waited for another stream's read of the same unit (single-flight)")
    evictions: int = Field(description="read units dropped to make room, least recently used first")


class DiskCacheStatus(BaseModel):
    directory: str = Field(description="--disk-cache")
    capacity_bytes: int = Field(description="--disk-cache-bytes: the most file bytes kept (files being written count)")
    resident_bytes: int = Field(description="bytes of the complete files held now")
    files: int = Field(description="complete files held now")
    filling: int = Field(description="files being written now, each served as it arrives")
    hits: int = Field(description="lookups of a file that found its checked copy")
    misses: int = Field(description="lookups of a file that found no copy (it is then read from above)")
    evictions: int = Field(description="files removed to make room, least recently used first")
    dropped: int = Field(description="copies found short, changed, failing their checksum or foreign, and removed")
    bypassed: int = Field(description="files served from above uncached because they did not fit")


class PublishStatus(BaseModel):
    revision: str = Field(description="the revision published")
    parts: int = Field(description="the parts it was published in (one per trainer rank that sent one)")
    bytes: int = Field(description="its tensor bytes")
    received_bytes: int = Field(description="payload bytes its parts sent (a delta publish: what changed only)")
    seconds: float = Field(description="from its first part's start to complete")
    updates: int = Field(description="GetChanges answered to it since: one per engine rank that updated to it")
    update_bytes: int = Field(description="changed bytes those answers named (what the updates then fetched)")


class RevisionStatus(BaseModel):
    current: str = Field(description="the model's current revision")
    origin: str = Field(description="where it came from: published or storage")
    total_bytes: int = Field(description="tensor bytes of the current revision")
    digest: str = Field(
        description="the current revision's BLAKE3 digest over its tensors' block hashes; empty for a storage "
        "revision not digested yet"
    )
    kept: list[str] = Field(description="the revisions served by name, oldest first (--keep-revisions)")
    last_publish_s: float | None = Field(description="seconds the model's last publish took; null if none")
    publishes: list[PublishStatus] = Field(
        default_factory=list, description="the model's last publishes, oldest first: what each training step cost"
    )


class RelayStatus(BaseModel):
    followed: list[str] = Field(description="models whose upstream revisions this tier follows")
    transport: str = Field(description="how relayed revisions come from the upstream: tcp, shm or grpc")
    revisions_total: int = Field(description="published revisions of the upstream taken here")
    pulled_bytes_total: int = Field(description="bytes of those asked of the upstream (what changed)")
    copied_bytes_total: int = Field(description="bytes of those copied from revisions held here (unchanged)")
    shared_bytes_total: int = Field(description="bytes of those shared with a published revision held here")
    seconds_total: float = Field(description="seconds spent taking them")


class DeltasStatus(BaseModel):
    delta_chunks_total: int = Field(description="changed chunks sent as XOR deltas against the revision clients held")
    whole_chunks_total: int = Field(description="changed chunks that could have gone as deltas but were sent whole")
    delta_bytes_total: int = Field(description="payload bytes of the deltas sent")
    covered_bytes_total: int = Field(description="chunk bytes those deltas stood for (delta/covered: the ratio)")
    computed_total: int = Field(description="deltas computed (each (A, B, chunk) once while kept)")
    reused_total: int = Field(description="deltas served from the kept ones (other engines, other ranks)")
    published_total: int = Field(description="deltas kept from delta publishes (computed by the publisher)")
    compute_seconds_total: float = Field(description="CPU seconds spent computing them")
    kept_bytes: int = Field(description="payload bytes of the deltas kept (--delta-cache-bytes)")


class RevisionsStatus(BaseModel):
    models: dict[str, RevisionStatus] = Field(description="each model's revisions, by model id")
    publishes_total: int = Field(description="publishes completed since the server started")
    published_bytes_total: int = Field(description="tensor bytes of the completed publishes")
    published_bytes_held: int = Field(description="memory the kept published revisions hold (--publish-max-bytes)")
    publish_received_bytes_total: int = Field(
        default=0, description="payload bytes publishers sent (a delta publish: what changed only)"
    )
    changes_total: int = Field(description="GetChanges answered: what updates asked")
    changed_bytes_total: int = Field(description="changed bytes those answers named (what the updates then fetch)")
    digested_bytes_total: int = Field(description="bytes of storage files read to learn their block CRC32Cs")
    relay: RelayStatus | None = Field(default=None, description="the upstream's revisions followed (--upstream)")
    deltas: DeltasStatus | None = Field(default=None, description="sparse updates; null with --delta-cache-bytes 0")


class ServerStatus(BaseModel):
    version: str
    uptime_s: float
    grpc_port: int
    data_port: int = Field(description="port of the tcp transport's data connections; 0 when off")
    tls: bool = Field(description="gRPC is served over TLS")
    auth: bool = Field(description="gRPC calls and /status, /metrics need a bearer token")
    draining: bool
    max_streams: int
    active_streams: int
    streams_total: int = Field(description="streams started since the server started")
    bytes_served_total: int = Field(description="tensor bytes handed to gRPC for sending")
    storage_bytes_read_total: int = Field(description="tensor bytes read from storage")
    errors_total: dict[str, int] = Field(description="RPCs that ended in an error, by gRPC status code name")
    data_connections_refused_total: int = Field(
        description="connections to the data port closed without a valid ticket (garbage, silence, wrong peer)"
    )
    sources: list[SourceStatus]
    models: dict[str, ModelStatus] = Field(description="per-model counters, by model id")
    cache: CacheStatus | None = Field(description="the shared cache; null when --cache-bytes is 0")
    disk_cache: DiskCacheStatus | None = Field(description="the disk cache; null without --disk-cache")
    upstream_bytes_read_total: int = Field(
        description="file bytes read from the tier above: the --upstream server, or S3 behind the disk cache"
    )
    revisions: RevisionsStatus | None = Field(default=None, description="revisions, publishes and updates")


_UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"description": "The server has tokens and the request carries none it accepts"}
}
_bearer = HTTPBearer(auto_error=False, description="a token from the server's --token-file")


def create_app(server: WeightStreamServer) -> FastAPI:
    """The FastAPI app reporting on server."""
    app = FastAPI(
        title="weightstream",
        version=__version__,
        description="Health, readiness, status and metrics of a weightstream server (the data is served over gRPC).",
        # No interactive pages: they are served without a token, and nothing here needs them.
        docs_url=None,
        redoc_url=None,
    )
    registry = metrics.create_registry(
        server.stats,
        server.settings.max_streams,
        server.cache,
        server.tiers,
        server.revisions,
        server.changes,
        server.deltas,
        server.pool,
        server.holdings.counts if server.holdings is not None else None,
    )
    tokens = server.tokens

    def require_token(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        if tokens is not None and (credentials is None or not tokens.accepts(credentials.credentials)):
            raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    guard = [Depends(require_token)] if tokens is not None else []
    unauthorized = _UNAUTHORIZED if tokens is not None else {}

    @app.get(
        "/healthz",
        response_model=Health,
        responses={503: {"model": Health, "description": "The gRPC server does not answer; `reason` says why"}},
    )
    def healthz() -> JSONResponse:
        """Liveness: the process is up and its gRPC server answers (a worker of its pool is free)."""
        problem = server.liveness.problem()
        if problem is not None:
            return JSONResponse(Health(status="unhealthy", reason=problem).model_dump(), status_code=503)
        return JSONResponse(Health(status="ok").model_dump(exclude_none=True))

    @app.get(
        "/readyz",
        response_model=ReadinessStatus,
        responses={503: {"model": ReadinessStatus, "description": "Not ready; `reasons` says why"}},
    )
    def readyz() -> JSONResponse:
        """Readiness: gRPC is serving, the server is not draining, and every source is reachable."""
        report = server.readiness.report().public()
        body = _readiness(report)
        return JSONResponse(body.model_dump(), status_code=200 if report.ready else 503)

    @app.get("/status", response_model=ServerStatus, dependencies=guard, responses=unauthorized)
    def status() -> ServerStatus:
        """Version, uptime, ports, stream and byte counters, errors by code, sources, per-model counters."""
        snap = server.stats.snapshot()
        report = server.readiness.report()
        disk = server.tiers.cache
        return ServerStatus(
            version=__version__,
            uptime_s=snap.uptime_s,
            grpc_port=server.port,
            data_port=server.data_port.port if server.data_port is not None else 0,
            tls=server.tls,
            auth=tokens is not None,
            draining=report.draining,
            max_streams=server.settings.max_streams,
            active_streams=snap.active_streams,
            streams_total=snap.streams_total,
            bytes_served_total=snap.bytes_served_total,
            storage_bytes_read_total=snap.storage_bytes_read_total,
            errors_total=snap.errors_total,
            data_connections_refused_total=snap.data_connections_refused_total,
            sources=[_source(s) for s in report.sources],
            models={m: ModelStatus(streams=c.streams, bytes_served=c.bytes_served) for m, c in snap.models.items()},
            cache=CacheStatus(**dataclasses.asdict(server.cache.snapshot())) if server.cache is not None else None,
            disk_cache=DiskCacheStatus(**dataclasses.asdict(disk.snapshot())) if disk is not None else None,
            upstream_bytes_read_total=server.tiers.source_bytes_read,
            revisions=_revisions(server),
        )

    @app.get(
        "/metrics",
        response_class=Response,
        dependencies=guard,
        responses={
            200: {
                "description": "Prometheus text exposition; every name starts with weightstream_",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **unauthorized,
        },
    )
    def prometheus_metrics() -> Response:
        """Prometheus metrics: bytes served, active streams, stream durations, errors by code, storage bytes read."""
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    return app


def _revisions(server: WeightStreamServer) -> RevisionsStatus | None:
    store, changes = server.revisions, server.changes
    if store is None or changes is None:
        return None
    return RevisionsStatus(
        models={
            model: RevisionStatus(
                current=current.id,
                origin=current.origin,
                total_bytes=current.manifest.total_bytes,
                digest=current.digest,
                kept=kept,
                last_publish_s=store.publish_seconds.get(model),
                publishes=[PublishStatus(**dataclasses.asdict(r)) for r in store.publish_records(model)],
            )
            for model, (current, kept) in store.snapshot().items()
        },
        publishes_total=store.publishes,
        published_bytes_total=store.published_bytes,
        published_bytes_held=store.held_bytes(),
        publish_received_bytes_total=server.publisher.received_bytes if server.publisher is not None else 0,
        changes_total=changes.asked,
        changed_bytes_total=changes.changed_bytes,
        digested_bytes_total=changes.bytes_digested,
        relay=_relay(server),
        deltas=_deltas(server),
    )


def _deltas(server: WeightStreamServer) -> DeltasStatus | None:
    if server.deltas is None:
        return None
    d = server.deltas.snapshot()
    return DeltasStatus(
        delta_chunks_total=d.delta_chunks,
        whole_chunks_total=d.raw_chunks,
        delta_bytes_total=d.delta_bytes,
        covered_bytes_total=d.covered_bytes,
        computed_total=d.computed,
        reused_total=d.reused,
        published_total=d.published,
        compute_seconds_total=d.compute_seconds,
        kept_bytes=server.deltas.kept_bytes,
    )


def _relay(server: WeightStreamServer) -> RelayStatus | None:
    relay = server.relay
    if relay is None:
        return None
    counts = relay.counts
    return RelayStatus(
        followed=relay.followed(),
        transport=relay.transport,
        revisions_total=counts.revisions,
        pulled_bytes_total=counts.pulled_bytes,
        copied_bytes_total=counts.copied_bytes,
        shared_bytes_total=counts.shared_bytes,
        seconds_total=round(counts.seconds, 3),
    )


def _source(state: SourceState) -> SourceStatus:
    return SourceStatus(source=state.source, reachable=state.reachable, error=state.error)


def _readiness(report: ReadinessReport) -> ReadinessStatus:
    return ReadinessStatus(
        ready=report.ready,
        grpc_serving=report.grpc_serving,
        draining=report.draining,
        sources=[_source(s) for s in report.sources],
        reasons=report.reasons,
    )


@dataclass
class RestServer:
    """A running uvicorn server on its own thread, and the port it is bound to."""

    uvicorn_server: uvicorn.Server
    thread: threading.Thread
    port: int

    def stop(self, timeout: float) -> None:
        """Ask uvicorn to exit and wait up to timeout seconds for its thread."""
        self.uvicorn_server.should_exit = True
        self.thread.join(timeout=timeout)
        if self.thread.is_alive():
            logger.warning("the REST endpoint did not stop within %.1f s", timeout)


def start_http(app: FastAPI, host: str, port: int) -> RestServer:
    """Run app with uvicorn on a thread (port 0 picks a free port); RestServer.stop() ends it.

    The socket is bound here, on the caller's thread, so that a port in use is an OSError for the
    caller rather than a message from a background thread while gRPC carries on alone.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    http_server = uvicorn.Server(config)
    thread = threading.Thread(target=http_server.run, kwargs={"sockets": [sock]}, name="weightstream-http", daemon=True)
    thread.start()
    return RestServer(http_server, thread, sock.getsockname()[1])
