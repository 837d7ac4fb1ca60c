"""S3 failures: rejected credentials (moto checks them), an unreachable store, a store that dies mid-stream."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.support.ports import free_ports
from tests.support.s3_stores import REGION, S3Process, moto, s3_settings, s3rver, upload_folder
from tests.support.serve_processes import start_serve
from tests.support.servers import serving
from weightstream.client import (
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    WeightStreamClient,
)

# moto and s3rver processes, and `weightstream serve` processes.
pytestmark = pytest.mark.slow

BUCKET = "ws-guarded"
SECRET_MARK = "do-not-leak"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Process, dict[str, str], dict[str, str]]]:
    """moto enforcing IAM, a bucket with a model, and keys of two users: one allowed, one with no policy."""
    workdir = tmp_path_factory.mktemp("moto")
    # Unauthenticated bootstrap: create the admin user, its policy and its key.
    with moto(workdir, unauthenticated_actions=3) as store:
        iam = store.client("bootstrap", "bootstrap", service="iam")
        iam.create_user(UserName="admin")
        iam.put_user_policy(
            UserName="admin",
            PolicyName="all",
            PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
            ),
        )
        key = iam.create_access_key(UserName="admin")["AccessKey"]
        admin = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        iam = store.client(admin["AWS_ACCESS_KEY_ID"], admin["AWS_SECRET_ACCESS_KEY"], service="iam")
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        nobody = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        s3 = store.client(admin["AWS_ACCESS_KEY_ID"], admin["AWS_SECRET_ACCESS_KEY"])
        folder = workdir / "model"
        folder.mkdir()
        save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(folder / "model.safetensors"))
        upload_folder(s3, folder, BUCKET, "m")
        yield store, admin, nobody


def _serve(store: S3Process, keys: dict[str, str], workdir: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`weightstream serve` in its own process, whose AWS credential chain holds exactly keys."""
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEIGHTSTREAM_"))}
    env.update(keys, AWS_EC2_METADATA_DISABLED="true", AWS_REGION=REGION)
    log = workdir / f"serve-{port}.log"
    args = ["--host", "127.0.0.1", "--grpc-port", str(port), "--http-port", "0", "--log-level", "DEBUG"]
    args += ["--s3-bucket", BUCKET, "--s3-endpoint", store.endpoint, "--s3-path-style"]
    args += ["--s3-request-timeout-ms", "20000"]
    return start_serve(args, log, env), f"127.0.0.1:{port}", log


def _manifest_when_up(target: str, model: str, proc: subprocess.Popen[bytes]) -> object:
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, "weightstream serve exited"
        try:
            with WeightStreamClient(target, timeout=20, progress=False) as client:
                return client.manifest(model)
        except UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize(
    ("who", "error", "code"),
    [
        ("wrong", UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
        ("nobody", PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    ],
)
def test_rejected_credentials(
    guarded: tuple[S3Process, dict[str, str], dict[str, str]],
    tmp_path: Path,
    who: str,
    error: type[Exception],
    code: grpc.StatusCode,
) -> None:
    store, _admin, nobody = guarded
    keys = nobody if who == "nobody" else {"AWS_ACCESS_KEY_ID": "AKIAWRONG", "AWS_SECRET_ACCESS_KEY": SECRET_MARK}
    proc, target, log = _serve(store, keys, tmp_path)
    try:
        with pytest.raises(error, match=f"s3://{BUCKET}/m") as info:
            _manifest_when_up(target, f"s3://{BUCKET}/m", proc)
        assert info.value.code == code  # type: ignore[attr-defined]
        assert keys["AWS_SECRET_ACCESS_KEY"] not in str(info.value)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert keys["AWS_SECRET_ACCESS_KEY"] not in log.read_text(errors="replace")


def test_right_credentials_load(guarded: tuple[S3Process, dict[str, str], dict[str, str]], tmp_path: Path) -> None:
    """Control for the two above: the same set-up with the allowed user's keys loads the model."""
    store, admin, _nobody = guarded
    proc, target, log = _serve(store, admin, tmp_path)
    try:
        _manifest_when_up(target, f"s3://{BUCKET}/m", proc)
        with WeightStreamClient(target, progress=False) as client:
            got = client.load_state_dict(f"s3://{BUCKET}/m")
        assert torch.equal(got["w"], torch.arange(1000, dtype=torch.float32))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert admin["AWS_SECRET_ACCESS_KEY"] not in log.read_text(errors="replace")


def test_unreachable_store_is_unavailable(s3_store: S3Process) -> None:
    (closed_port,) = free_ports(1)
    closed = S3Process(f"http://127.0.0.1:{closed_port}", 0, s3_store.proc, s3_store.log)
    with serving(s3_settings(closed, s3_buckets=("ws-models",))) as server:
        with WeightStreamClient(f"127.0.0.1:{server.port}", timeout=60, progress=False, retry=None) as client:
            with pytest.raises(UnavailableError, match=r"s3://ws-models/x/.*unreachable") as info:
                client.manifest("s3://ws-models/x")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        started = time.monotonic()
        assert not any(source.reachable() for source in server.catalog.sources)
        assert time.monotonic() - started < 5, "a readiness probe of a dead store must answer within seconds"


def test_store_dying_mid_stream_is_unavailable(tmp_path: Path, model_root: Path) -> None:
    """s3rver is killed while a stream is in flight: the client gets UNAVAILABLE, never a short model."""
    folder = model_root / "s3-dying"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024, generator=generator) for i in range(48)}  # 192 MiB
    save_file(state, str(folder / "model.safetensors"))
    with s3rver(tmp_path) as store:
        s3 = store.client()
        upload_folder(s3, folder, "ws-dying", "m")
        with serving(
            s3_settings(store, s3_buckets=("ws-dying",), read_ahead_bytes=16 * 1024 * 1024, s3_request_timeout_ms=3000)
        ) as server:
            with WeightStreamClient(
                f"127.0.0.1:{server.port}", chunk_bytes=1 << 20, progress=False, retry=None
            ) as client:
                received = 0
                with pytest.raises(UnavailableError, match="s3://ws-dying/m") as info:
                    for _name, _tensor in client.iter_tensors("s3://ws-dying/m"):
                        received += 1
                        if received == 2:
                            store.stop()
                        time.sleep(0.05)
            assert received < len(state)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
