"""Fixtures: a real weightstream server on a loopback port, serving checkpoints written to a temp folder.

Everything they start comes from tests/support (servers, S3 stores, checkpoints).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from tests.support.checkpoints import write_many_dtypes, write_tiny_llama
from tests.support.s3_stores import S3_BUCKET, S3_OTHER_BUCKET, S3RVER_KEY, S3Process, s3_settings, s3rver
from tests.support.servers import loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import ServerSettings, WeightStreamServer

# Chaos, load and fuzz tests record figures there; they are printed at the end of the run.
pytest_plugins = ["tests.support.reliability_report"]


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's model root; tests add their own model folders to it."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def server(model_root: Path) -> Iterator[WeightStreamServer]:
    with serving(loopback_settings(model_root=model_root)) as server:
        yield server


@pytest.fixture(scope="session")
def target(server: WeightStreamServer) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
def client(target: str) -> Iterator[WeightStreamClient]:
    with WeightStreamClient(target, progress=False) as client:
        yield client


@pytest.fixture(scope="session")
def tiny_llama_folder(model_root: Path) -> Path:
    """model_root/tiny-llama: a random transformers Llama in 3 shards with an index."""
    folder = model_root / "tiny-llama"
    write_tiny_llama(folder)
    return folder


@pytest.fixture(scope="session")
def many_dtypes(model_root: Path) -> dict[str, torch.Tensor]:
    """model_root/many-dtypes: over 300 MB, thousands of tensors of every dtype; returns what was written."""
    state = write_many_dtypes(model_root / "many-dtypes")
    assert sum(t.numel() * t.element_size() for t in state.values()) > 300 * 1000 * 1000
    return state


@pytest.fixture(scope="module")
def root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model root of the test module's own, empty: the module writes its models into it."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))


@pytest.fixture(scope="module")
def root_settings(root: Path) -> ServerSettings:
    """The settings of root_server: loopback, port 0, the module's root (a module overrides this to tune them)."""
    return loopback_settings(model_root=root)


@pytest.fixture(scope="module")
def root_server(root_settings: ServerSettings) -> Iterator[WeightStreamServer]:
    """A server of the module's own, on the module's root."""
    with serving(root_settings) as server:
        yield server


@pytest.fixture(scope="module")
def stub_target(request: pytest.FixtureRequest) -> str:
    """Where raw_channel connects: root_server, or the session's server in a module that sets
    STUB_ON_SESSION_SERVER = True (its requests then meet the models of every other test)."""
    if getattr(request.module, "STUB_ON_SESSION_SERVER", False):
        return str(request.getfixturevalue("target"))
    return f"127.0.0.1:{request.getfixturevalue('root_server').port}"


@pytest.fixture(scope="module")
def raw_channel(stub_target: str) -> Iterator[grpc.Channel]:
    """A plain gRPC channel to stub_target that takes messages of up to 64 MiB both ways."""
    limit = 64 * 1024 * 1024
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    with grpc.insecure_channel(stub_target, options=options) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(raw_channel: grpc.Channel) -> pb_grpc.WeightStreamServiceStub:
    """The raw service stub on raw_channel, for requests that the client library would never send."""
    return pb_grpc.WeightStreamServiceStub(raw_channel)


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Process]:
    """An s3rver process on 127.0.0.1, with the AWS credential chain of this process pointed at its keys."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": S3RVER_KEY,
        "AWS_SECRET_ACCESS_KEY": S3RVER_KEY,
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        os.environ[name] = value
    with s3rver(tmp_path_factory.mktemp("s3rver")) as store:
        client = store.client()
        for bucket in (S3_BUCKET, S3_OTHER_BUCKET):
            client.create_bucket(Bucket=bucket)
        yield store


@pytest.fixture(scope="session")
def s3_server(s3_store: S3Process) -> Iterator[WeightStreamServer]:
    """A weightstream server that serves only S3 (no model root), from the s3rver store."""
    with serving(s3_settings(s3_store)) as server:
        yield server


@pytest.fixture(scope="session")
def s3_target(s3_server: WeightStreamServer) -> str:
    return f"127.0.0.1:{s3_server.port}"


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """An HTTP client for servers on loopback."""
    # trust_env=False: never send loopback requests through a proxy from the environment.
    with httpx.Client(trust_env=False) as client:
        yield client


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep this process's gRPC channels off any proxy from the environment."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
