"""Building the gRPC server: create_server returns it with its bound port, not yet started."""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent import futures
from dataclasses import dataclass

import grpc

from weightstream import wire
from weightstream.server.catalog import Catalog
from weightstream.server.reader import StreamerPool
from weightstream.server.servicer import WeightStreamServicer, add_to_server
from weightstream.server.settings import ServerSettings
from weightstream.server.source import LocalSource, Source
from weightstream.server.stats import ServerStats

logger = logging.getLogger(__name__)

_streamer_configured = False


@dataclass
class WeightStreamServer:
    """A gRPC server and what it serves from; stop() also closes the streamers."""

    grpc_server: grpc.Server
    port: int
    settings: ServerSettings
    catalog: Catalog
    pool: StreamerPool
    stats: ServerStats

    def start(self) -> None:
        self.grpc_server.start()
        served = ", ".join(source.describe() for source in self.catalog.sources)
        logger.info("gRPC serving %s on %s:%d", served, self.settings.host, self.port)

    def stop(self, grace: float | None = None) -> None:
        self.grpc_server.stop(grace).wait()
        self.pool.close()


def configure_process(settings: ServerSettings) -> None:
    """Set process-wide options (Run:ai streamer, allocator), once, before the first stream."""
    global _streamer_configured
    if _streamer_configured:
        return
    _tune_malloc()
    # The streamer's default local strategy is O_DIRECT, which bypasses the page cache (about 2 GB/s
    # here, warm or cold); buffered reads serve a warm checkpoint from memory. An operator's own
    # setting wins.
    os.environ.setdefault("RUNAI_STREAMER_FS_STRATEGY", "sync_buffered")
    if settings.streamer_concurrency is not None:
        os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(settings.streamer_concurrency)
    _streamer_configured = True


def create_server(settings: ServerSettings) -> WeightStreamServer:
    """A gRPC server for settings, bound to settings.host:settings.grpc_port (0 picks a free port)."""
    configure_process(settings)
    catalog = Catalog(build_sources(settings))
    pool = StreamerPool(settings.max_streams)
    stats = ServerStats()
    server = grpc.server(
        # Streams beyond max_streams are refused with RESOURCE_EXHAUSTED by the pool; the extra
        # workers keep manifest calls answered while every stream slot is busy.
        futures.ThreadPoolExecutor(max_workers=settings.max_streams + 8, thread_name_prefix="weightstream-rpc"),
        options=[
            # A message holds up to MAX_CHUNK_BYTES of payload plus its chunk descriptors.
            ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            # Clients ping every 30 s on idle connections to notice dead peers; allow it.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC shares ports by default; a second server on a busy port must fail, not split the traffic.
            ("grpc.so_reuseport", 0),
        ],
    )
    add_to_server(WeightStreamServicer(settings, catalog, pool, stats), server)
    port = server.add_insecure_port(f"{_host_for_grpc(settings.host)}:{settings.grpc_port}")
    if port == 0:
        raise OSError(f"could not bind gRPC to {settings.host}:{settings.grpc_port}")
    return WeightStreamServer(server, port, settings, catalog, pool, stats)


def build_sources(settings: ServerSettings) -> list[Source]:
    """The sources settings name, each checked to be usable at start-up."""
    sources: list[Source] = []
    if settings.model_root is not None:
        local = LocalSource(settings.model_root)
        if not local.reachable():
            raise ValueError(f"model root {settings.model_root} is not a readable directory")
        sources.append(local)
    return sources


def _tune_malloc() -> None:
    """Keep glibc from returning freed message buffers to the kernel between messages.

    Every message is a fresh multi-MiB allocation; by default glibc serves those with mmap and
    unmaps them on free, so each message pays page faults on fresh memory (about a fifth of the
    server's CPU in a profile here). Serving them from a heap that is neither trimmed nor unmapped
    reuses the same touched pages. Not glibc (musl, macOS): nothing to do.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mallopt(m_mmap_threshold, 32 * 1024 * 1024)
    mallopt(m_trim_threshold, 1 << 34)
    mallopt(m_top_pad, 256 * 1024 * 1024)


def _host_for_grpc(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
