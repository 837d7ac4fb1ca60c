"""The REST endpoint next to the gRPC port: liveness, readiness and status as JSON."""

from __future__ import annotations

import socket
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from weightstream import __version__
from weightstream.server.grpc_server import WeightStreamServer


def create_app(server: WeightStreamServer, serving: threading.Event) -> FastAPI:
    """The FastAPI app reporting on server; serving is set while gRPC accepts requests."""
    app = FastAPI(title="weightstream", version=__version__)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Liveness: the process is up and answering."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """Readiness: gRPC is serving and the model root is readable."""
        sources = _sources(server)
        ready = serving.is_set() and all(s["reachable"] for s in sources)
        body = {"ready": ready, "grpc_serving": serving.is_set(), "sources": sources}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/status")
    def status() -> dict[str, Any]:
        """Version, uptime, ports and stream counters."""
        return {
            "version": __version__,
            "grpc_port": server.port,
            **server.stats.snapshot(),
            "sources": _sources(server),
        }

    return app


def _sources(server: WeightStreamServer) -> list[dict[str, Any]]:
    return [{"source": s.describe(), "reachable": s.reachable()} for s in server.catalog.sources]


def start_http(app: FastAPI, host: str, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    """Run app with uvicorn on a thread; set server.should_exit and join the thread to stop it.

    The socket is bound here, on the caller's thread, so that a port in use is an OSError for the
    caller rather than a message from a background thread while gRPC carries on alone.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    http_server = uvicorn.Server(config)
    thread = threading.Thread(target=http_server.run, kwargs={"sockets": [sock]}, name="weightstream-http", daemon=True)
    thread.start()
    return http_server, thread
