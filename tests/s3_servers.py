"""Real S3-protocol server processes on 127.0.0.1 for tests: s3rver (fast) and moto (checks credentials)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

S3RVER_JS = Path(__file__).parent / "s3" / "node_modules" / "s3rver" / "bin" / "s3rver.js"
S3RVER_KEY = "S3RVER"  # s3rver accepts any keys; these are its documented defaults
REGION = "us-east-1"
START_TIMEOUT_S = 30.0


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"S3 test server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"S3 test server did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S} s")


@contextlib.contextmanager
def s3rver(workdir: Path, port: int | None = None) -> Iterator[S3Process]:
    """s3rver (npm) serving a folder; installed by `make test` into tests/s3/node_modules."""
    node = shutil.which("node")
    if node is None or not S3RVER_JS.exists():
        raise RuntimeError(
            f"s3rver is not installed ({S3RVER_JS}): run `make test`, or `npm install --prefix tests/s3`"
        )
    port = port or free_port()
    data = workdir / "s3rver-data"
    data.mkdir(parents=True, exist_ok=True)
    log = workdir / f"s3rver-{port}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [node, str(S3RVER_JS), "--directory", str(data), "--address", "127.0.0.1", "--port", str(port), "--silent"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = S3Process(f"http://127.0.0.1:{port}", port, proc, log)
    try:
        _wait_listening(proc, port, log)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def moto(workdir: Path, unauthenticated_actions: int) -> Iterator[S3Process]:
    """moto in server mode, enforcing IAM credentials after the first `unauthenticated_actions` requests."""
    port = free_port()
    log = workdir / f"moto-{port}.log"
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(unauthenticated_actions))
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    server = S3Process(f"http://127.0.0.1:{port}", port, proc, log)
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
