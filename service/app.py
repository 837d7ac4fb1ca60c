"""Running the server as a process: gRPC plus REST, until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import threading

from weightstream.server.grpc_server import create_server
from weightstream.server.settings import ServerSettings

logger = logging.getLogger(__name__)

# Seconds that streams in flight get to finish after SIGTERM before they are cancelled.
STOP_GRACE_S = 10.0


def serve(settings: ServerSettings) -> None:
    """Serve until a signal arrives; logs where it listens."""
    server = create_server(settings)
    serving = threading.Event()
    stop = threading.Event()
    http = None
    if settings.http_port:
        from weightstream.server.http import create_app, start_http

        http = start_http(create_app(server, serving), settings.host, settings.http_port)
        logger.info("REST endpoint on http://%s:%d (/healthz, /readyz, /status)", settings.host, settings.http_port)

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    serving.set()
    # Printed for scripts and tests that start the server on port 0 and need the real port.
    logger.info("weightstream ready: grpc_port=%d", server.port)
    stop.wait()
    serving.clear()
    server.stop(STOP_GRACE_S)
    if http is not None:
        http_server, thread = http
        http_server.should_exit = True
        thread.join(timeout=STOP_GRACE_S)
    logger.info("stopped")
