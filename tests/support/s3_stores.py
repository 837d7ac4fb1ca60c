"""Real S3-protocol servers on 127.0.0.1 for tests: s3rver (fast) and moto (checks credentials).

Both run as processes (s3rver from npm, moto from the dev extra); s3_settings points a weightstream
server at one of them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from tests.support.ports import LOOPBACK, free_ports, wait_port
from weightstream_server import ServerSettings

S3RVER_JS = Path(__file__).resolve().parent.parent / "s3" / "node_modules" / "s3rver" / "bin" / "s3rver.js"
S3RVER_KEY = "S3RVER"  # s3rver accepts any keys; these are its documented defaults
REGION = "us-east-1"
START_TIMEOUT_S = 30.0
# The buckets of the session's s3rver store (the s3_store fixture): one served, one not allowed.
S3_BUCKET = "ws-models"
S3_OTHER_BUCKET = "ws-not-allowed"


@dataclass
class S3Process:
    """A running S3-protocol server: its endpoint, and how to stop it."""

    endpoint: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self, access_key: str = S3RVER_KEY, secret_key: str = S3RVER_KEY, service: str = "s3") -> Any:
        return boto3.session.Session().client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    try:
        wait_port(port, START_TIMEOUT_S, alive=lambda: proc.poll() is None)
    except RuntimeError:
        raise RuntimeError(
            f"S3 test server exited with {proc.returncode}:\n{log.read_text(errors='replace')}"
        ) from None


@contextlib.contextmanager
def s3rver(workdir: Path, port: int | None = None) -> Iterator[S3Process]:
    """s3rver (npm) serving a folder; installed by `make test` into tests/s3/node_modules."""
    node = shutil.which("node")
    if node is None or not S3RVER_JS.exists():
        raise RuntimeError(
            f"s3rver is not installed ({S3RVER_JS}): run `make test`, or `npm install --prefix tests/s3`"
        )
    port = port or free_ports(1)[0]
    data = workdir / "s3rver-data"
    data.mkdir(parents=True, exist_ok=True)
    log = workdir / f"s3rver-{port}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [node, str(S3RVER_JS), "--directory", str(data), "--address", LOOPBACK, "--port", str(port), "--silent"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = S3Process(f"http://{LOOPBACK}:{port}", port, proc, log)
    try:
        _wait_listening(proc, port, log)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def moto(workdir: Path, unauthenticated_actions: int) -> Iterator[S3Process]:
    """moto in server mode, enforcing IAM credentials after the first `unauthenticated_actions` requests."""
    (port,) = free_ports(1)
    log = workdir / f"moto-{port}.log"
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(unauthenticated_actions))
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", LOOPBACK, "-p", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    server = S3Process(f"http://{LOOPBACK}:{port}", port, proc, log)
    try:
        _wait_listening(proc, port, log)
        yield server
    finally:
        server.stop()


def upload_folder(client: Any, folder: Path, bucket: str, prefix: str) -> None:
    """Upload every file of folder to s3://bucket/prefix/ (creating the bucket if needed)."""
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=bucket)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


def s3_settings(store: S3Process, **overrides: object) -> ServerSettings:
    """Settings of a server on loopback port 0 that serves only S3, from store's S3_BUCKET."""
    values: dict[str, object] = {
        "host": LOOPBACK,
        "grpc_port": 0,
        "http_port": 0,
        "data_port": 0,
        "s3_buckets": (S3_BUCKET, "ws-missing-bucket"),
        "s3_endpoint": store.endpoint,
        "s3_region": REGION,
        "s3_path_style": True,
    }
    values.update(overrides)
    return ServerSettings(**values)  # type: ignore[arg-type]
