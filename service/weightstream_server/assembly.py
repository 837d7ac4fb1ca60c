"""The assembly of a server: from settings to a WeightStreamServer with its bound port, not yet started."""

from __future__ import annotations

import importlib
import importlib.util
import ipaddress
import logging
import os
import resource
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from runai_model_streamer.s3_utils.s3_utils import S3Credentials

from weightstream.allocator import tune_malloc
from weightstream.protocol import wire
from weightstream_server.ops.auth import AuthInterceptor, TokenFile
from weightstream_server.ops.health import (
    HEALTH_SERVICE_NAME,
    SERVICE_NAME,
    Liveness,
    Readiness,
    ReadinessHealthServicer,
)
from weightstream_server.ops.preload import start_preload
from weightstream_server.ops.stats import ServerStats
from weightstream_server.revisions.changes import Changes
from weightstream_server.revisions.fanout import Fanout
from weightstream_server.revisions.peer_blocks import Holdings
from weightstream_server.revisions.peer_pull import first_block_wait
from weightstream_server.revisions.published import Publisher
from weightstream_server.revisions.relay import Relay
from weightstream_server.revisions.store import RevisionStore
from weightstream_server.revisions.stored_blocks import StoredBlocks
from weightstream_server.serving.cache import UnitCache
from weightstream_server.serving.catalog import Catalog
from weightstream_server.serving.checksums import ReadBlocks
from weightstream_server.serving.deltas import Deltas
from weightstream_server.serving.reader import StreamerPool
from weightstream_server.serving.stalls import StallWatch
from weightstream_server.serving.stream_session import Streams, StreamSlots
from weightstream_server.settings import ServerSettings, split_host_port
from weightstream_server.storage.disk_cache import DiskCache
from weightstream_server.storage.local import LocalSource
from weightstream_server.storage.objects import ObjectSource
from weightstream_server.storage.sources import Source
from weightstream_server.storage.tiers import TieredSource, Tiers
from weightstream_server.transports import peers as peers_servicer
from weightstream_server.transports import revisions as revisions_servicer
from weightstream_server.transports import servicer
from weightstream_server.transports.rpc import HeldCallLimit
from weightstream_server.transports.shm import servicer as shm_servicer
from weightstream_server.transports.shm.segments import remove_stale_segments
from weightstream_server.transports.tcp import servicer as tcp_servicer
from weightstream_server.transports.tcp.listener import DataPort, server_context

logger = logging.getLogger(__name__)

_streamer_configured = False
# The gRPC worker pool: one worker for each stream slot (--max-streams), HELD_CALLS for the other
# calls that hold one while open (reflection; rpc.HeldCallLimit), and SHORT_CALL_WORKERS that no
# open call can take, for health checks, manifests, listings and the refusals of calls over a limit.
HELD_CALLS = 4
SHORT_CALL_WORKERS = 8
# malloc arenas of the server process: with glibc's default (8 per core), memory that short streams'
# threads freed stays resident in their arenas after the churn; with 2 it comes back (+1 MiB after
# 4 clients' open/cancel churn instead of +100, benchmarks/churn_memory.py).
MALLOC_ARENAS = 2


@dataclass(kw_only=True)
class WeightStreamServer:
    """A gRPC server and what it serves from; stop() also closes the streamers.

    Lifecycle: start(), then optionally drain() (no new streams, health NOT_SERVING, wait for the
    streams in flight), then stop(). tokens is None when the server takes requests without a token.
    workers is the pool gRPC runs every call on; liveness probes it.
    """

    grpc_server: grpc.Server
    port: int
    settings: ServerSettings
    catalog: Catalog
    pool: StreamerPool
    stats: ServerStats
    readiness: Readiness
    health: ReadinessHealthServicer
    tokens: TokenFile | None
    workers: futures.ThreadPoolExecutor
    liveness: Liveness
    # Shared by every stream; None when --cache-bytes is 0.
    cache: UnitCache | None = None
    # The tcp transport's listening port; None when --data-port is 0.
    data_port: DataPort | None = None
    # The disk cache and the sources read from a tier above (--upstream, S3 behind --disk-cache).
    tiers: Tiers = field(default_factory=Tiers)
    # Each model's kept revisions, the publishes they came from and the changes between them.
    revisions: RevisionStore | None = None
    publisher: Publisher | None = None
    changes: Changes | None = None
    # Follows the upstream's revisions of the models asked for (--upstream); None without one.
    relay: Relay | None = None
    # XOR deltas against revisions this server holds, shared by every stream; None when --delta-cache-bytes is 0.
    deltas: Deltas | None = None
    # Fleet fan-out: the blocks of revisions kept or being pulled here that peers may take.
    holdings: Holdings | None = None

    @property
    def tls(self) -> bool:
        return self.settings.tls_cert is not None

    def start(self) -> None:
        if self.settings.shm_dir is not None:
            remove_stale_segments(self.settings.shm_dir)
        self.grpc_server.start()
        if self.data_port is not None:
            self.data_port.start()
        self.readiness.mark_serving()
        self.liveness.mark_started()
        if self.cache is not None and self.settings.preload:
            start_preload(
                self.settings.preload,
                self.catalog,
                self.pool,
                self.cache,
                self.stats,
                self.readiness,
                read_ahead_bytes=self.settings.read_ahead_bytes,
                chunk_bytes=self.settings.chunk_bytes,
            )
        self.health.refresh()
        served = ", ".join(source.describe() for source in self.catalog.sources)
        security = ("mutual TLS" if self.settings.tls_client_ca else "TLS") if self.tls else "plaintext"
        auth = "bearer tokens" if self.tokens is not None else "no authentication"
        logger.info("gRPC serving %s on %s:%d (%s, %s)", served, self.settings.host, self.port, security, auth)
        if self.data_port is not None:
            logger.info(
                "data port %d for tcp streams (%s, announced as %s)",
                self.data_port.port,
                security,
                _advertised_text(self.settings, self.data_port.port),
            )

    def drain(self, timeout: float) -> int:
        """Refuse new streams, report NOT_SERVING, wait up to timeout s for streams in flight; how many remain."""
        self.readiness.start_draining()
        self.health.refresh()
        self.stats.wait_idle(timeout)
        return self.stats.active_streams

    def stop(self, grace: float | None = None) -> None:
        self.readiness.start_draining()
        self.health.refresh()
        self.liveness.mark_stopped()
        self.grpc_server.stop(grace).wait()
        if self.publisher is not None and not self.publisher.wait_written(self.settings.drain_seconds):
            logger.warning(
                "a published revision is still being written to %s after %.1f s; it may be missing after a restart",
                self.settings.publish_dir,
                self.settings.drain_seconds,
            )
        if self.relay is not None:
            self.relay.close()
        if self.data_port is not None:
            self.data_port.close()
        self.pool.close()
        self.tiers.close()


def configure_process(settings: ServerSettings) -> None:
    """Set process-wide options (Run:ai streamer, allocator), once, before the first stream."""
    global _streamer_configured
    if _streamer_configured:
        return
    tune_malloc(arenas=MALLOC_ARENAS)
    raise_open_file_limit()
    # The streamer's default local strategy is O_DIRECT, which bypasses the page cache: every read
    # waits for storage, warm or cold. Buffered reads serve a warm checkpoint from memory. An
    # operator's own setting wins.
    os.environ.setdefault("RUNAI_STREAMER_FS_STRATEGY", "sync_buffered")
    if settings.streamer_concurrency is not None:
        os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(settings.streamer_concurrency)
    if settings.streamer_chunk_bytes is not None:
        os.environ["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(settings.streamer_chunk_bytes)
    _streamer_configured = True


def raise_open_file_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit.

    Each stream holds a descriptor per file of its plan for as long as it reads them, so a model of
    many shards times --max-streams streams can pass the usual soft limit of 1024.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or soft == resource.RLIM_INFINITY:
        return
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)


def configure_s3(settings: ServerSettings) -> None:
    """Set the streamer's S3 options; they are process-wide, so the last S3 server made decides."""
    if settings.s3_path_style:
        os.environ["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
    os.environ["RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"] = str(settings.s3_request_timeout_ms)
    if settings.s3_ca_bundle:
        os.environ["AWS_CA_BUNDLE"] = settings.s3_ca_bundle


def create_server(settings: ServerSettings) -> WeightStreamServer:
    """A gRPC server for settings, bound to settings.host:settings.grpc_port (0 picks a free port)."""
    configure_process(settings)
    sources, tiered = build_sources(settings)
    revisions = RevisionStore(settings.keep_revisions)
    if settings.allow_publish and settings.publish_token_file is None and not _loopback(settings.host):
        logger.warning(
            "--allow-publish on %s: anyone who reaches this port may publish a model's next revision; "
            "use --publish-token-file beyond loopback and trusted networks",
            settings.host,
        )
    catalog = Catalog(sources, revisions)
    tiers = Tiers(next((s.cache for s in tiered if s.cache is not None), None), tuple(tiered))
    s3_credentials = None
    if settings.object_buckets:
        configure_s3(settings)  # the GCS backend reads the streamer's request timeout too
    if settings.s3_buckets:
        s3_credentials = S3Credentials(endpoint=settings.s3_endpoint, region_name=settings.s3_region)
    pool = StreamerPool(settings.max_streams, s3_credentials, settings.storage_timeout)
    stats = ServerStats()
    tokens = TokenFile(settings.token_file) if settings.token_file is not None else None
    publish_tokens = TokenFile(settings.publish_token_file) if settings.publish_token_file is not None else None
    readiness = Readiness(catalog.sources)
    cache = UnitCache(settings.cache_bytes) if settings.cache_bytes else None
    # Calls beyond their limit are refused RESOURCE_EXHAUSTED as they start, before they wait for
    # anything (streams by their StreamSession, the others by HeldCallLimit): they hold a worker
    # for moments only, and the SHORT_CALL_WORKERS stay free.
    workers = futures.ThreadPoolExecutor(
        max_workers=settings.max_streams + settings.max_watches + HELD_CALLS + SHORT_CALL_WORKERS,
        thread_name_prefix="weightstream-rpc",
    )
    # Auth first: a call it refuses takes no place of HeldCallLimit's.
    interceptors: list[grpc.ServerInterceptor] = (
        [AuthInterceptor(tokens, stats, publish_tokens)] if tokens is not None else []
    )
    interceptors.append(HeldCallLimit(HELD_CALLS, stats))
    server = grpc.server(
        workers,
        interceptors=interceptors,
        options=[
            # A message holds up to MAX_CHUNK_BYTES of payload plus its chunk descriptors.
            ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            # Clients ping after 10 s without reads to notice a dead server (weightstream.client.channels).
            # gRPC's default accepts one ping per 5 min without data and answers more with GOAWAY
            # "too_many_pings", which would cut every stream in flight; accept one per 5 s, also on
            # connections with no call (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS).
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # The server pings too: a client that vanished (node lost, cable cut) is found within
            # about 25 s, and its stream ends and frees its slot and read-ahead memory, instead of
            # blocking on flow control until TCP gives up after minutes.
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
            # A ping already in flight (a bandwidth probe) would otherwise get 60 s to be answered.
            ("grpc.http2.ping_timeout_ms", 5_000),
            # gRPC shares ports by default; a second server on a busy port must fail, not split the traffic.
            ("grpc.so_reuseport", 0),
        ],
    )
    streams = Streams(
        settings=settings,
        catalog=catalog,
        pool=pool,
        stats=stats,
        readiness=readiness,
        # A client may hold every slot but one by default: there is always one for somebody else.
        slots=StreamSlots(
            settings.max_streams,
            settings.max_streams_per_client or max(1, settings.max_streams - 1),
            on_refused=stats.stream_refused,
        ),
        stalls=StallWatch(settings.stall_timeout, on_stall=stats.stream_stalled),
        cache=cache,
        deltas=Deltas(settings.delta_cache_bytes) if settings.delta_cache_bytes else None,
        read_blocks=ReadBlocks(),
    )
    upload = None
    if settings.publish_s3_prefix is not None:
        from weightstream_server.storage.model_ids import parse_s3_model_id
        from weightstream_server.storage.s3 import make_client

        configure_s3(settings)
        upload = (make_client(settings), parse_s3_model_id(settings.publish_s3_prefix))
    publisher = Publisher(
        revisions,
        catalog,
        settings.publish_max_bytes,
        settings.stall_timeout,
        settings.publish_dir,
        upload,
        assembly_timeout=settings.publish_assembly_timeout,
        deltas=streams.deltas,
    )
    if streams.deltas is not None:
        deltas = streams.deltas
        revisions.on_evicted.append(lambda revision: deltas.forget(revision.model, revision.id))
    publisher.restore()
    changes = Changes(revisions, streams.read_blocks)
    holdings = Holdings(revisions, first_block_wait(settings.peer_stall_seconds), publisher.deltas_budget)
    relay = Relay(settings, revisions, catalog, publisher, holdings) if settings.upstream is not None else None
    # Storage revisions' blocks for peers: an upstream (--fanout) reads them from its own source; a sidecar
    # (--peers) only from its disk cache's copies of the models it follows.
    if settings.fanout:
        holdings.stored = StoredBlocks(revisions)
    elif settings.peers and relay is not None:
        holdings.stored = StoredBlocks(revisions, relay.follows)
    shm_servicer.add_to_server(shm_servicer.ShmServicer(streams), server)
    data_port = None
    if settings.data_port:
        tls = None
        if settings.tls_cert is not None and settings.tls_key is not None:
            client_ca = str(settings.tls_client_ca) if settings.tls_client_ca is not None else None
            tls = server_context(str(settings.tls_cert), str(settings.tls_key), client_ca)
        try:
            data_port = DataPort(settings.host, settings.data_port, tls, stats)
        except OSError as exc:
            raise OSError(f"could not bind the data port {settings.host}:{settings.data_port}: {exc.strerror}") from exc
    host, port = advertised(settings)
    announced = (host, port if port is not None else (data_port.port if data_port is not None else 0))
    servicer.add_to_server(servicer.WeightStreamServicer(streams, data_port, announced), server)
    tcp_servicer.add_to_server(tcp_servicer.TcpServicer(streams, data_port, announced), server)
    # Fan-out is opt-in: an upstream plans peers only with --fanout; a sidecar serves blocks to its
    # peers only with --peers.
    fanout = Fanout(settings.fanout_roots, settings.fanout_degree) if settings.fanout else None
    revisions_servicer.add_to_server(
        revisions_servicer.RevisionsServicer(
            streams, revisions, publisher, changes, publish_tokens, data_port=data_port, advertise=announced,
            fanout=fanout,
        ),
        server,
    )  # fmt: skip
    peers_servicer.add_to_server(
        peers_servicer.PeersServicer(streams, revisions, holdings, fanout, settings.peer_stall_seconds, changes),
        server,
        hashes=settings.fanout,
        blocks=settings.fanout or settings.peers,
    )
    health_servicer = ReadinessHealthServicer(readiness)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Reflection lets grpcurl and similar tools call the server without the .proto files.
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{_host_for_grpc(settings.host)}:{settings.grpc_port}"
    credentials = server_credentials(settings)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind gRPC to {settings.host}:{settings.grpc_port}")
    if relay is not None:
        relay.peer_port = port
    return WeightStreamServer(
        grpc_server=server,
        port=port,
        settings=settings,
        catalog=catalog,
        pool=pool,
        stats=stats,
        readiness=readiness,
        health=health_servicer,
        tokens=tokens,
        workers=workers,
        liveness=Liveness(workers),
        cache=cache,
        data_port=data_port,
        tiers=tiers,
        revisions=revisions,
        publisher=publisher,
        changes=changes,
        relay=relay,
        deltas=streams.deltas,
        holdings=holdings,
    )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS credentials from settings' PEM files (mutual TLS with tls_client_ca); None for plaintext."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    chain = _read_pem(settings.tls_cert, "tls_cert")
    key = _read_pem(settings.tls_key, "tls_key")
    client_ca = _read_pem(settings.tls_client_ca, "tls_client_ca") if settings.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file")
    return data


def build_sources(settings: ServerSettings) -> tuple[list[Source], list[TieredSource]]:
    """The sources settings name, each checked to be usable at start-up, and those of them that are tiers."""
    sources: list[Source] = []
    tiered: list[TieredSource] = []
    if settings.model_root is not None:
        local = LocalSource(settings.model_root)
        if not local.reachable():
            raise ValueError(f"model root {settings.model_root} is not a readable directory")
        sources.append(local)
    disk_cache = DiskCache(settings.disk_cache, settings.disk_cache_bytes) if settings.disk_cache is not None else None
    for source in object_sources(settings):
        if disk_cache is None:
            sources.append(source)
        else:
            tiered.append(TieredSource(source, disk_cache))
            sources.append(tiered[-1])
    if settings.upstream is not None:
        from weightstream_server.storage.upstream import UpstreamSource

        # Last: it claims every model id the sources before it do not.
        tiered.append(TieredSource(UpstreamSource(settings), disk_cache))
        sources.append(tiered[-1])
    return sources, tiered


def object_sources(settings: ServerSettings) -> list[ObjectSource]:
    """A source per bucket and container settings name, on one SDK client per store; the streamer's
    backend for each store configured from the same settings. ValueError names what is missing."""
    sources: list[ObjectSource] = []
    if settings.s3_buckets:
        from weightstream_server.storage.s3 import S3Store, make_client

        s3 = S3Store(make_client(settings), make_client(settings, probe=True))
        sources += [ObjectSource(bucket, s3) for bucket in settings.s3_buckets]
    if settings.gcs_buckets:
        gcs = _extra("gcs", "weightstream_server.storage.gcs", "runai_model_streamer_gcs")
        gcs.configure_gcs()
        store = gcs.GcsStore(gcs.make_client())
        sources += [ObjectSource(bucket, store) for bucket in settings.gcs_buckets]
    if settings.azure_containers:
        azure = _extra("azure", "weightstream_server.storage.azure", "runai_model_streamer_azure")
        account = azure.account_settings()
        azure.configure_azure(account)
        store = azure.AzureStore(azure.make_client(account), azure.make_client(account, probe=True))
        sources += [ObjectSource(container, store) for container in settings.azure_containers]
    return sources


def _extra(extra: str, module: str, backend: str) -> Any:
    """module, imported; ValueError naming the extra to install when it or the streamer's backend is missing."""
    scheme = {"gcs": "gs://", "azure": "az://"}[extra]
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or str(exc)
    else:
        if importlib.util.find_spec(backend) is not None:
            return imported
        missing = backend
    raise ValueError(
        f"{scheme} models need the {extra} extra: pip install 'weightstream[{extra}]' ({missing} is not installed)"
    )


def advertised(settings: ServerSettings) -> tuple[str, int | None]:
    """The host (and port, if another) tcp streams announce: --data-advertise, else --host unless it
    means every interface, else "" (the client dials its own target's host)."""
    if settings.data_advertise:
        return split_host_port(settings.data_advertise)
    return ("" if settings.host in ("", "0.0.0.0", "::", "[::]") else settings.host), None


def _advertised_text(settings: ServerSettings, bound: int) -> str:
    host, port = advertised(settings)
    return f"{host or 'the host of each client target'}:{port or bound}"


def _host_for_grpc(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
