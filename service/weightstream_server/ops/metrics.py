"""Prometheus metrics: the server's counters (ServerStats) as Prometheus text, for REST /metrics.

The metrics are read from ServerStats at scrape time rather than kept in prometheus-client objects
beside it, so /status and /metrics can never disagree. Each server has its own registry: several
servers in one process (tests, the demo) do not mix their numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from weightstream import __version__
from weightstream_server.ops.stats import DURATION_BUCKETS_S, ServerStats
from weightstream_server.revisions.changes import Changes
from weightstream_server.revisions.peer_blocks import PeerCounts
from weightstream_server.revisions.store import RevisionStore
from weightstream_server.serving.cache import CacheSnapshot, UnitCache
from weightstream_server.serving.deltas import Deltas
from weightstream_server.serving.reader import StreamerPool
from weightstream_server.storage.disk_cache import DiskCacheSnapshot
from weightstream_server.storage.tiers import Tiers

PREFIX = "weightstream_"
CONTENT_TYPE = CONTENT_TYPE_LATEST


class StatsCollector(Collector):
    """Every weightstream_* metric, read from one ServerStats snapshot per scrape."""

    def __init__(
        self,
        stats: ServerStats,
        max_streams: int,
        cache: UnitCache | None,
        tiers: Tiers,
        pool: StreamerPool | None = None,
    ) -> None:
        self._stats = stats
        self._max_streams = max_streams
        self._cache = cache
        self._tiers = tiers
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        s = self._stats.snapshot()
        info = GaugeMetricFamily(PREFIX + "info", "The server's version; always 1.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield GaugeMetricFamily(PREFIX + "active_streams", "Streams in flight now.", value=s.active_streams)
        yield GaugeMetricFamily(
            PREFIX + "max_streams", "Concurrent streams allowed; more get RESOURCE_EXHAUSTED.", value=self._max_streams
        )
        if self._pool is not None:
            yield GaugeMetricFamily(
                PREFIX + "store_reads_stuck",
                "Reads of object stores given up on (--storage-timeout) and still inside the store's backend; "
                "at max_streams, new reads of object stores are refused UNAVAILABLE.",
                value=self._pool.stuck,
            )
        streams = CounterMetricFamily(
            PREFIX + "streams",
            "Streams ended, by model (empty when the stream ended before its model was found).",
            labels=["model"],
        )
        served = CounterMetricFamily(
            PREFIX + "bytes_served", "Tensor bytes handed to gRPC for sending, by model.", labels=["model"]
        )
        unresolved_streams = s.streams_ended - sum(m.streams for m in s.models.values())
        if unresolved_streams:
            streams.add_metric([""], unresolved_streams)
        for model, counts in s.models.items():
            streams.add_metric([model], counts.streams)
            served.add_metric([model], counts.bytes_served)
        yield streams
        yield served
        transport_streams = CounterMetricFamily(
            PREFIX + "transport_streams",
            "Streams ended, by the transport their bytes travelled on (grpc, tcp: the data port, shm).",
            labels=["transport"],
        )
        transport_served = CounterMetricFamily(
            PREFIX + "transport_bytes_served",
            "Tensor bytes handed to a transport for sending, by transport.",
            labels=["transport"],
        )
        for transport, counts in s.transports.items():
            transport_streams.add_metric([transport], counts.streams)
            transport_served.add_metric([transport], counts.bytes_served)
        yield transport_streams
        yield transport_served
        yield CounterMetricFamily(
            PREFIX + "stalls",
            "Calls ended by the stall rule (streams, and watches whose client stopped reading): "
            "the client took nothing for --stall-timeout.",
            value=s.stalls_total,
        )
        refused = CounterMetricFamily(
            PREFIX + "streams_refused",
            "Streams refused RESOURCE_EXHAUSTED, by reason: slots (every --max-streams slot taken) or share (the "
            "client holds its --max-streams-per-client share).",
            labels=["reason"],
        )
        for reason in ("slots", "share"):
            refused.add_metric([reason], s.refused_total.get(reason, 0))
        yield refused
        yield CounterMetricFamily(
            PREFIX + "storage_bytes_read",
            "Tensor bytes read from storage by streams (more than served when a stream ends early).",
            value=s.storage_bytes_read_total,
        )
        errors = CounterMetricFamily(PREFIX + "errors", "RPCs that ended in an error, by gRPC status.", labels=["code"])
        for code, count in sorted(s.errors_total.items()):
            errors.add_metric([code], count)
        yield errors
        yield CounterMetricFamily(
            PREFIX + "data_connections_refused",
            "Connections to the data port closed without being admitted (no valid ticket, garbage, silence).",
            value=s.data_connections_refused_total,
        )
        if self._cache is not None:
            yield from _cache_metrics(self._cache.snapshot())
        if self._tiers.sources:
            yield CounterMetricFamily(
                PREFIX + "upstream_bytes_read",
                "File bytes read from the tier above (the --upstream server, or S3 behind the disk cache).",
                value=self._tiers.source_bytes_read,
            )
        if self._tiers.cache is not None:
            yield from _disk_cache_metrics(self._tiers.cache.snapshot())
        buckets = [(_bound(le), count) for le, count in zip(DURATION_BUCKETS_S, s.duration_counts, strict=True)]
        buckets.append(("+Inf", s.streams_ended))
        yield HistogramMetricFamily(
            PREFIX + "stream_duration_seconds",
            "Wall time of each stream, from its request to its end (any status).",
            buckets=buckets,
            sum_value=s.duration_sum_s,
        )


def _cache_metrics(c: CacheSnapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        PREFIX + "cache_capacity_bytes", "The most tensor bytes the cache keeps.", value=c.capacity_bytes
    )
    yield GaugeMetricFamily(
        PREFIX + "cache_resident_bytes", "Tensor bytes the cache holds now.", value=c.resident_bytes
    )
    yield CounterMetricFamily(PREFIX + "cache_hits", "Read units served from the cache.", value=c.hits)
    yield CounterMetricFamily(PREFIX + "cache_misses", "Read units not in the cache when asked for.", value=c.misses)
    yield CounterMetricFamily(
        PREFIX + "cache_shared_reads",
        "Misses that waited for another stream's read of the same unit instead of reading storage.",
        value=c.shared,
    )
    yield CounterMetricFamily(PREFIX + "cache_evictions", "Read units dropped to make room.", value=c.evictions)


def _disk_cache_metrics(d: DiskCacheSnapshot) -> Iterator[Metric]:
    disk = PREFIX + "disk_cache_"
    yield GaugeMetricFamily(
        disk + "capacity_bytes", "The most file bytes the disk cache keeps.", value=d.capacity_bytes
    )
    yield GaugeMetricFamily(
        disk + "resident_bytes", "Bytes of complete files in the disk cache.", value=d.resident_bytes
    )
    yield GaugeMetricFamily(disk + "files", "Complete files in the disk cache.", value=d.files)
    yield GaugeMetricFamily(disk + "filling", "Files being written into the disk cache.", value=d.filling)
    yield CounterMetricFamily(disk + "hits", "Lookups that found a checked copy.", value=d.hits)
    yield CounterMetricFamily(disk + "misses", "Lookups that found no copy.", value=d.misses)
    yield CounterMetricFamily(disk + "evictions", "Files removed to make room.", value=d.evictions)
    yield CounterMetricFamily(
        disk + "dropped", "Copies found short, changed, failing their checksum or foreign.", value=d.dropped
    )
    yield CounterMetricFamily(disk + "bypassed", "Files served uncached because they did not fit.", value=d.bypassed)


def create_registry(
    stats: ServerStats,
    max_streams: int,
    cache: UnitCache | None = None,
    tiers: Tiers | None = None,
    revisions: RevisionStore | None = None,
    changes: Changes | None = None,
    deltas: Deltas | None = None,
    pool: StreamerPool | None = None,
    peers: PeerCounts | None = None,
) -> CollectorRegistry:
    """A registry holding only this server's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats, max_streams, cache, tiers if tiers is not None else Tiers(), pool))
    if revisions is not None and changes is not None:
        registry.register(RevisionsCollector(revisions, changes))
    if deltas is not None:
        registry.register(DeltasCollector(deltas))
    if peers is not None:
        registry.register(PeersCollector(peers))
    return registry


class PeersCollector(Collector):
    """Fleet fan-out: revision bytes from peers, the upstream and local copies, their cost on the wire, blocks
    refused, peers left, deltas encoded, bytes served to peers."""

    def __init__(self, counts: PeerCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        c = self._counts
        pulled = CounterMetricFamily(
            PREFIX + "fanout_bytes_received",
            "Published revisions' block bytes taken, by source (local: copied from the revision held here, "
            "unchanged by the upstream's block hashes).",
            labels=["source"],
        )
        pulled.add_metric(["peer"], c.peer_bytes)
        pulled.add_metric(["upstream"], c.upstream_bytes)
        pulled.add_metric(["local"], c.copied_bytes)
        yield pulled
        wire = CounterMetricFamily(
            PREFIX + "fanout_wire_bytes_received",
            "What the blocks taken from peers and the upstream cost on the wire (a delta's payload, else the block).",
            labels=["source"],
        )
        wire.add_metric(["peer"], c.peer_wire_bytes)
        wire.add_metric(["upstream"], c.upstream_wire_bytes)
        yield wire
        yield CounterMetricFamily(
            PREFIX + "fanout_blocks_encoded",
            "Blocks encoded here as deltas against a puller's since (at most once per block and since while kept).",
            value=c.encoded_blocks,
        )
        yield CounterMetricFamily(
            PREFIX + "fanout_deltas_served",
            "Blocks served to peers as deltas against their since.",
            value=c.served_deltas,
        )
        yield CounterMetricFamily(
            PREFIX + "fanout_blocks_refused",
            "Blocks from a peer refused: not the block asked for, or not the upstream's BLAKE3 hash.",
            value=c.refused_blocks,
        )
        yield CounterMetricFamily(
            PREFIX + "fanout_fallbacks",
            "Pulls whose peer was left (refused, failed, ended early or stalled) for the upstream.",
            value=c.fallbacks,
        )
        yield CounterMetricFamily(
            PREFIX + "fanout_bytes_served",
            "Block bytes served to peers (StreamRevisionBlocks; a delta's payload for a block sent as one).",
            value=c.served_bytes,
        )


class DeltasCollector(Collector):
    """The sparse-update metrics: changed chunks by form, delta bytes against the bytes they stood for, the work."""

    def __init__(self, deltas: Deltas) -> None:
        self._deltas = deltas

    def collect(self) -> Iterator[Metric]:
        d = self._deltas.snapshot()
        chunks = CounterMetricFamily(
            PREFIX + "delta_chunks", "Changed chunks that could go as XOR deltas, by the form sent.", labels=["form"]
        )
        chunks.add_metric(["delta"], d.delta_chunks)
        chunks.add_metric(["whole"], d.raw_chunks)
        yield chunks
        yield CounterMetricFamily(PREFIX + "delta_bytes", "Payload bytes of the deltas sent.", value=d.delta_bytes)
        yield CounterMetricFamily(
            PREFIX + "delta_covered_bytes", "Chunk bytes the deltas sent stood for.", value=d.covered_bytes
        )
        yield CounterMetricFamily(PREFIX + "delta_computations", "Deltas computed.", value=d.computed)
        yield CounterMetricFamily(PREFIX + "delta_reuses", "Deltas served from those kept.", value=d.reused)
        yield CounterMetricFamily(
            PREFIX + "delta_publishes",
            "Deltas kept from delta publishes (computed by the publisher).",
            value=d.published,
        )
        yield CounterMetricFamily(
            PREFIX + "delta_compute_seconds", "CPU seconds spent computing deltas.", value=d.compute_seconds
        )
        yield GaugeMetricFamily(
            PREFIX + "delta_kept_bytes", "Payload bytes of the deltas kept.", value=self._deltas.kept_bytes
        )


class RevisionsCollector(Collector):
    """The revision metrics: each model's current revision, publishes, updates asked and their bytes."""

    def __init__(self, revisions: RevisionStore, changes: Changes) -> None:
        self._revisions = revisions
        self._changes = changes

    def collect(self) -> Iterator[Metric]:
        store, changes = self._revisions, self._changes
        current = GaugeMetricFamily(
            PREFIX + "model_revision",
            "Each model's current revision; always 1.",
            labels=["model", "revision", "origin"],
        )
        for model, (revision, _) in store.snapshot().items():
            current.add_metric([model, revision.id, revision.origin], 1)
        yield current
        yield CounterMetricFamily(PREFIX + "publishes", "Publishes completed.", value=store.publishes)
        yield CounterMetricFamily(
            PREFIX + "published_bytes", "Tensor bytes of the completed publishes.", value=store.published_bytes
        )
        yield GaugeMetricFamily(
            PREFIX + "published_bytes_held", "Memory the kept published revisions hold.", value=store.held_bytes()
        )
        yield CounterMetricFamily(PREFIX + "changes", "GetChanges answered (updates asked).", value=changes.asked)
        yield CounterMetricFamily(
            PREFIX + "changed_bytes",
            "Changed bytes named by GetChanges (what updates fetch).",
            value=changes.changed_bytes,
        )


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of registry (CONTENT_TYPE)."""
    return generate_latest(registry)


def _bound(seconds: float) -> str:
    return repr(float(seconds))
