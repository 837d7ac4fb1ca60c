"""Models served from S3 (a real s3rver process on 127.0.0.1) through the Run:ai streamer's S3 backend."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.support.checkpoints import assert_bytes_identical, llama_config, load_folder, write_raw_safetensors
from tests.support.s3_stores import S3_BUCKET, S3_OTHER_BUCKET, S3Process, upload_folder
from weightstream.client import (
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    WeightStreamClient,
)
from weightstream_server import WeightStreamServer

# Every test here needs the s3rver process (the s3_store fixture).
pytestmark = pytest.mark.slow

LLAMA = f"s3://{S3_BUCKET}/llama/tiny"
MANY = f"s3://{S3_BUCKET}/many-dtypes"


@pytest.fixture(scope="module")
def uploaded(
    s3_store: S3Process, tiny_llama_folder: Path, many_dtypes: dict[str, torch.Tensor], model_root: Path
) -> None:
    client = s3_store.client()
    upload_folder(client, tiny_llama_folder, S3_BUCKET, "llama/tiny")
    upload_folder(client, model_root / "many-dtypes", S3_BUCKET, "many-dtypes")
    for i in range(4):
        folder = model_root / f"s3-small-{i}"
        folder.mkdir(exist_ok=True)
        torch.manual_seed(100 + i)
        save_file({f"w{j}": torch.randn(256, 256) for j in range(8)}, str(folder / "model.safetensors"))
        upload_folder(client, folder, S3_BUCKET, f"small/{i}")
    upload_folder(client, tiny_llama_folder, S3_OTHER_BUCKET, "llama")


@pytest.fixture
def s3_client(s3_target: str) -> WeightStreamClient:
    return WeightStreamClient(s3_target, progress=False)


@pytest.mark.usefixtures("uploaded")
def test_llama_from_s3_is_bit_identical_with_same_logits(
    tiny_llama_folder: Path, s3_client: WeightStreamClient
) -> None:
    reference = load_folder(tiny_llama_folder)
    manifest = s3_client.manifest(LLAMA)
    assert len(manifest.files) == 3 and manifest.total_bytes == sum(t.nbytes for t in manifest.tensors)
    torch.manual_seed(99)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    report = s3_client.load_into(model, LLAMA)
    assert report.tensors == len(reference)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), reference[name].view(torch.uint8)), name
    local = transformers.LlamaForCausalLM(llama_config()).eval()
    local.load_state_dict(reference)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, local(tokens).logits)


@pytest.mark.usefixtures("uploaded")
def test_many_dtypes_from_s3_are_bit_identical(
    many_dtypes: dict[str, torch.Tensor], s3_client: WeightStreamClient
) -> None:
    assert_bytes_identical(many_dtypes, s3_client.load_state_dict(MANY))


@pytest.mark.usefixtures("uploaded")
def test_manifest_is_cached_per_etag(s3_store: S3Process, s3_client: WeightStreamClient, model_root: Path) -> None:
    first = s3_client.manifest(f"s3://{S3_BUCKET}/small/0")
    assert s3_client.manifest(f"s3://{S3_BUCKET}/small/0").revision == first.revision
    folder = model_root / "s3-changing"
    folder.mkdir()
    save_file({"x": torch.zeros(4)}, str(folder / "model.safetensors"))
    upload_folder(s3_store.client(), folder, S3_BUCKET, "changing")
    before = s3_client.manifest(f"s3://{S3_BUCKET}/changing")
    save_file({"x": torch.ones(4)}, str(folder / "model.safetensors"))
    upload_folder(s3_store.client(), folder, S3_BUCKET, "changing")
    after = s3_client.manifest(f"s3://{S3_BUCKET}/changing")
    assert after.revision != before.revision
    assert torch.equal(s3_client.load_state_dict(f"s3://{S3_BUCKET}/changing")["x"], torch.ones(4))


@pytest.mark.usefixtures("uploaded")
def test_four_clients_load_different_models_while_another_stream_is_cancelled(
    model_root: Path, s3_target: str, s3_server: WeightStreamServer
) -> None:
    """Concurrent S3 streams, one abandoned halfway: every other client still gets every byte right."""
    expected = {i: load_folder(model_root / f"s3-small-{i}") for i in range(4)}
    cancelled = threading.Event()

    def load(i: int) -> dict[str, torch.Tensor]:
        with WeightStreamClient(s3_target, chunk_bytes=64 * 1024, progress=False) as client:
            return client.load_state_dict(f"s3://{S3_BUCKET}/small/{i}")

    def cancel_halfway() -> None:
        with WeightStreamClient(s3_target, chunk_bytes=64 * 1024, progress=False) as client:
            for count, _item in enumerate(client.iter_tensors(MANY), start=1):
                if count == 10:
                    break
        cancelled.set()

    with concurrent.futures.ThreadPoolExecutor(max_workers=5) as pool:
        canceller = pool.submit(cancel_halfway)
        loads = {i: pool.submit(load, i) for i in range(4)}
        results = {i: f.result(timeout=120) for i, f in loads.items()}
        canceller.result(timeout=120)
    assert cancelled.is_set()
    for i, got in results.items():
        assert_bytes_identical(expected[i], got)
    # After the cancellation, S3 still works for new streams in this process.
    with WeightStreamClient(s3_target, progress=False) as client:
        assert_bytes_identical(expected[0], client.load_state_dict(f"s3://{S3_BUCKET}/small/0"))


@pytest.mark.usefixtures("uploaded")
def test_bucket_not_allowed_is_permission_denied(s3_client: WeightStreamClient) -> None:
    """The bucket exists and holds a model, but is not allowed: refused, so nothing is fetched."""
    with pytest.raises(PermissionDeniedError, match=S3_OTHER_BUCKET) as info:
        s3_client.manifest(f"s3://{S3_OTHER_BUCKET}/llama")
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.usefixtures("uploaded")
def test_missing_bucket_and_prefix_are_not_found(s3_client: WeightStreamClient) -> None:
    with pytest.raises(NotFoundError, match="ws-missing-bucket"):
        s3_client.manifest("s3://ws-missing-bucket/anything")
    with pytest.raises(NotFoundError, match=f"s3://{S3_BUCKET}/no/such/prefix/"):
        s3_client.manifest(f"s3://{S3_BUCKET}/no/such/prefix")


@pytest.mark.usefixtures("uploaded")
def test_invalid_s3_ids(s3_client: WeightStreamClient) -> None:
    with pytest.raises(InvalidArgumentError, match="bucket name"):
        s3_client.manifest("s3://A_B/x")


@pytest.mark.usefixtures("uploaded")
def test_truncated_object_and_bad_header_are_data_loss(
    s3_store: S3Process, s3_client: WeightStreamClient, tmp_path: Path
) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"x": torch.randn(1000)}, str(good))
    client = s3_store.client()
    client.put_object(Bucket=S3_BUCKET, Key="broken/truncated/model.safetensors", Body=good.read_bytes()[:-100])
    with pytest.raises(IntegrityError, match=rf"s3://{S3_BUCKET}/broken/truncated.*model\.safetensors.*truncated"):
        s3_client.manifest(f"s3://{S3_BUCKET}/broken/truncated")
    header = {
        "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    write_raw_safetensors(tmp_path / "overlap.safetensors", header, bytes(24))
    client.put_object(
        Bucket=S3_BUCKET, Key="broken/overlap/m.safetensors", Body=(tmp_path / "overlap.safetensors").read_bytes()
    )
    with pytest.raises(IntegrityError, match="overlap") as info:
        s3_client.manifest(f"s3://{S3_BUCKET}/broken/overlap")
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    # The server keeps serving.
    assert len(s3_client.manifest(LLAMA).tensors) > 0


def test_readiness_reports_each_bucket(s3_server: WeightStreamServer) -> None:
    """The allowed bucket that exists is reachable; the allowed one that does not is not (and says so fast)."""
    by_name = {source.describe(): source for source in s3_server.catalog.sources}
    assert by_name[f"s3://{S3_BUCKET}"].reachable()
    started = time.monotonic()
    assert not by_name["s3://ws-missing-bucket"].reachable()
    assert time.monotonic() - started < 5
