"""Running the server as a process: gRPC plus REST, until SIGTERM or SIGINT, then a drain.

The first SIGTERM (or SIGINT) starts the drain: new streams are refused with UNAVAILABLE, /readyz
and gRPC health report not serving, and the streams in flight get drain_seconds to finish; those
still running then are cancelled and the process exits 0. A second signal exits at once, with 1.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from weightstream_server.assembly import create_server
from weightstream_server.settings import ServerSettings

logger = logging.getLogger(__name__)

# Seconds that RPCs other than streams (manifests, health checks) get after the drain.
STOP_GRACE_S = 1.0
HTTP_STOP_TIMEOUT_S = 5.0


def serve(settings: ServerSettings) -> None:
    """Serve until a signal arrives, then drain and stop; logs where it listens."""
    server = create_server(settings)
    stop = threading.Event()
    received: list[str] = []
    rest = None
    if settings.http_port:
        from weightstream_server.ops.http import create_app, start_http

        rest = start_http(create_app(server), settings.host, settings.http_port)
        logger.info("REST endpoint on http://%s:%d (/healthz, /readyz, /status, /metrics)", settings.host, rest.port)

    def on_signal(signum: int, _frame: object) -> None:
        # Runs on the main thread between bytecodes: only set state here (logging could deadlock
        # on a lock the interrupted code holds), except for the second signal, which must not wait.
        if stop.is_set():
            os.write(2, f"received {signal.Signals(signum).name} again; exiting now\n".encode())
            os._exit(1)
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    # Printed for scripts and tests that start the server on port 0 and need the real port.
    logger.info("weightstream ready: grpc_port=%d", server.port)
    stop.wait()
    logger.info(
        "received %s; draining: no new streams, %d in flight get up to %.1f s to finish",
        received[0],
        server.stats.active_streams,
        settings.drain_seconds,
    )
    left = server.drain(settings.drain_seconds)
    if left:
        logger.warning("%d streams still running after %.1f s; cancelling them", left, settings.drain_seconds)
    # Past the deadline nothing more is waited for; otherwise calls other than streams get a moment.
    server.stop(0 if left else STOP_GRACE_S)
    if rest is not None:
        rest.stop(HTTP_STOP_TIMEOUT_S)
    logger.info("stopped")
