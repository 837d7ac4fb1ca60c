"""The weightstream server in this process, on loopback port 0: started, waited on, stopped.

serving() is the one launcher of an in-process server; running() adds its REST endpoint and an
HTTP client for it. Servers that must run as their own process are in serve_processes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.ports import LOOPBACK
from weightstream_server import ServerSettings, WeightStreamServer, create_server
from weightstream_server.ops.http import RestServer, create_app, start_http

# Source reachability is cached for about a second (health.PROBE_TTL_S); waits for a change are bounded by this.
CHANGE_TIMEOUT_S = 5.0


def loopback_settings(**values: object) -> ServerSettings:
    """ServerSettings of values, listening on 127.0.0.1 with gRPC and REST on port 0 and no data port
    (clients fall back to gRPC) unless values say otherwise."""
    given: dict[str, object] = {"host": LOOPBACK, "grpc_port": 0, "http_port": 0, "data_port": 0}
    given.update(values)
    return ServerSettings(**given)  # type: ignore[arg-type]


@contextlib.contextmanager
def serving(settings: ServerSettings) -> Iterator[WeightStreamServer]:
    """create_server(settings), started; stopped with a one-second grace on the way out."""
    server = create_server(settings)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=1.0)


@dataclass
class Running:
    """A started gRPC server, its REST endpoint, and an HTTP client for it."""

    server: WeightStreamServer
    rest: RestServer
    http: httpx.Client

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.server.port}"

    @property
    def base(self) -> str:
        return f"http://{LOOPBACK}:{self.rest.port}"

    def get(self, path: str, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return self.http.get(self.base + path, headers=headers, timeout=10.0)


@contextlib.contextmanager
def running(model_root: Path | None, **settings: object) -> Iterator[Running]:
    """serving() on model_root (None: the settings say what it serves) plus start_http on port 0, both
    stopped on the way out."""
    rooted = {"model_root": model_root} if model_root is not None else {}
    with serving(loopback_settings(**rooted, **settings)) as server:
        rest = start_http(create_app(server), LOOPBACK, 0)
        # trust_env=False: never send loopback requests through a proxy from the environment.
        http = httpx.Client(trust_env=False)
        try:
            yield Running(server, rest, http)
        finally:
            http.close()
            rest.stop(5.0)


def eventually(check: Callable[[], bool], what: str, timeout: float = CHANGE_TIMEOUT_S) -> None:
    """Poll check every 50 ms until it is true; fail with what after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {timeout} s")
        time.sleep(0.05)
