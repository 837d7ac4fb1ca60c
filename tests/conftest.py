"""Fixtures: a real weightstream server on a loopback port, serving checkpoints written to a temp folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from weightstream.client import WeightStreamClient
from weightstream.server import ServerSettings, WeightStreamServer, create_server


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's model root; tests add their own model folders to it."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def server(model_root: Path) -> Iterator[WeightStreamServer]:
    settings = ServerSettings(model_root=model_root, host="127.0.0.1", grpc_port=0, http_port=0)
    server = create_server(settings)
    server.start()
    yield server
    server.stop(grace=1.0)


@pytest.fixture(scope="session")
def target(server: WeightStreamServer) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
def client(target: str) -> Iterator[WeightStreamClient]:
    with WeightStreamClient(target, progress=False) as client:
        yield client
