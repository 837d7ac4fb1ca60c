"""Warming the cache at start-up: every tensor of each --preload model is read once into the cache."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from weightstream_server.ops.health import Readiness
from weightstream_server.ops.stats import ServerStats
from weightstream_server.serving.cache import UnitCache
from weightstream_server.serving.catalog import Catalog
from weightstream_server.serving.chunks import serve_chunks
from weightstream_server.serving.read_plan import plan_reads
from weightstream_server.serving.reader import StreamerPool

logger = logging.getLogger(__name__)


def start_preload(
    models: Sequence[str],
    catalog: Catalog,
    pool: StreamerPool,
    cache: UnitCache,
    stats: ServerStats,
    readiness: Readiness,
    *,
    read_ahead_bytes: int,
    chunk_bytes: int,
) -> threading.Thread:
    """Read models into cache on a background thread; readiness reports them as preloading until each is done.

    The preload uses one streamer of the pool, so it counts against --max-streams while it runs.
    """
    readiness.preload_started(models)

    def run() -> None:
        for model in models:
            started = time.monotonic()
            try:
                manifest = catalog.manifest(model)
                plan = plan_reads(manifest, [], chunk_bytes)
                read = 0
                with pool.checkout() as streamer:
                    for _ in serve_chunks(manifest, plan, streamer, read_ahead_bytes, cache, stats.storage_read):
                        pass
                read = plan.total_bytes
                logger.info(
                    "preloaded %s: %d bytes in %.2f s; cache holds %d bytes",
                    model,
                    read,
                    time.monotonic() - started,
                    cache.snapshot().resident_bytes,
                )
                if read > cache.capacity_bytes:
                    logger.warning(
                        "%s (%d bytes) is larger than the cache (%d bytes)", model, read, cache.capacity_bytes
                    )
                readiness.preload_ended(model, None)
            except Exception as exc:
                logger.error("preloading %s failed: %s", model, exc)
                readiness.preload_ended(model, f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, name="weightstream-preload", daemon=True)
    thread.start()
    return thread
