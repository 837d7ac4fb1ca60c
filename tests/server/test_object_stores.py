"""Models in Google Cloud Storage (gs://) and Azure Blob (az://), read through the Run:ai streamer's own backends.

Real emulator processes on 127.0.0.1 (tests/support/object_stores.py says which and why):
gcp-storage-emulator for GCS, Azurite over TLS for Azure, and `weightstream serve` processes
pointed at them by the stores' standard variables only (STORAGE_EMULATOR_HOST;
AZURE_STORAGE_CONNECTION_STRING, with the proxy and CA that Azurite over TLS needs).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.support.checkpoints import assert_bytes_identical, llama_config, load_folder
from tests.support.commands import clean_env
from tests.support.object_stores import (
    AZURITE_KEY,
    AzuriteTls,
    Emulator,
    azurite_tls,
    gcs_client,
    gcs_emulator,
    namespaced,
    upload_azure,
    upload_gcs,
)
from tests.support.ports import LOOPBACK, free_ports
from tests.support.serve_processes import ServerProcess, serve_process, wait_grpc_ready
from tests.support.servers import loopback_settings, serving
from weightstream.client import (
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
    WeightStreamClient,
)

# Emulator processes and `weightstream serve` processes.
pytestmark = pytest.mark.slow

BUCKET = "ws-models"
OTHER = "ws-not-allowed"
MISSING = "ws-missing"  # served, never created


@dataclass
class Served:
    """A `weightstream serve` process in front of one emulator, and the store's names."""

    scheme: str
    target: str
    http_port: int
    server: ServerProcess
    emulator: Emulator
    upload: Callable[[Path, str, str], None]  # folder, bucket, prefix
    secret: str  # what must never appear in a log or /status
    streamer_reads: Callable[[], str]  # the emulator's record of the reads Run:ai's backend made

    def model(self, path: str, bucket: str = BUCKET) -> str:
        return f"{self.scheme}{bucket}/{path}"


def _folders(root: Path, tiny_llama_folder: Path) -> dict[str, Path]:
    """The folders uploaded to each store, by key prefix."""
    config_only = root / "config-only"
    config_only.mkdir(exist_ok=True)
    (config_only / "config.json").write_text("{}")
    broken_index = root / "broken-index"
    broken_index.mkdir(exist_ok=True)
    save_file({"a": torch.ones(4)}, str(broken_index / "model-00001-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (broken_index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    llama = root / "llama"
    shutil.copytree(tiny_llama_folder, llama, dirs_exist_ok=True)
    llama_config().to_json_file(str(llama / "config.json"))
    (llama / "notes.txt").write_text("a file of the folder that is not the model's: never listed")
    return {"llama/tiny": llama, "config-only": config_only, "broken-index": broken_index}


@contextlib.contextmanager
def _store_served(
    kind: str, workdir: Path, uploads: list[tuple[Path, str, str]], buckets: list[str], model: str, flags: list[str]
) -> Iterator[Served]:
    """The emulator of kind ("gcs", "azure") holding uploads (folder, bucket, prefix), and `weightstream serve`
    serving buckets from it (with flags), ready once model answers."""
    with contextlib.ExitStack() as stack:
        if kind == "gcs":
            emulator = stack.enter_context(gcs_emulator(workdir))
            upload = functools.partial(upload_gcs, gcs_client(emulator))
            env, wrap, scheme, flag, secret = (
                {"STORAGE_EMULATOR_HOST": emulator.endpoint},
                None,
                "gs://",
                "--gcs-bucket",
                "",
            )
            reads = functools.partial(_gcs_reads, emulator)
        else:
            azurite = stack.enter_context(azurite_tls(workdir))
            emulator = azurite.azurite
            upload = functools.partial(upload_azure, azurite.client())
            env, wrap, scheme, flag, secret = (
                azurite.server_env(),
                _wrap(azurite),
                "az://",
                "--azure-container",
                AZURITE_KEY,
            )
            reads = functools.partial(_azure_reads, azurite)
        for folder, bucket, prefix in uploads:
            upload(folder, bucket, prefix)
        grpc_port, http_port = free_ports(2)
        args = [
            "--host",
            LOOPBACK,
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--log-level",
            "DEBUG",
        ]
        args += [*flags, *(item for bucket in buckets for item in (flag, bucket))]
        log = workdir / f"serve-{grpc_port}.log"
        server = stack.enter_context(serve_process(args, workdir, clean_env(**env), log=log, wrap=wrap))
        target = f"{LOOPBACK}:{grpc_port}"
        wait_grpc_ready(server, target, f"{scheme}{model}")
        yield Served(scheme, target, http_port, server, emulator, upload, secret, reads)


@pytest.fixture(scope="module", params=["gcs", "azure"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_llama_folder: Path
) -> Iterator[Served]:
    workdir = tmp_path_factory.mktemp(request.param)
    uploads = [
        (folder, bucket, prefix)
        for prefix, folder in _folders(workdir, tiny_llama_folder).items()
        for bucket in (BUCKET, OTHER)
    ]
    with _store_served(request.param, workdir, uploads, [BUCKET, MISSING], f"{BUCKET}/llama/tiny", []) as served:
        yield served


def _gcs_reads(emulator: Emulator) -> str:
    """The emulator's request lines of the JSON API's media reads: google-cloud-cpp's (the streamer's) form;
    google-cloud-storage reads through /download/storage/v1/..., which these lines leave out."""
    lines = emulator.log.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if '"GET /storage/v1/b/' in line and "alt=media" in line)


def _azure_reads(azurite: AzuriteTls) -> str:
    """Azurite's debug lines of requests from the Azure C++ SDK under Run:ai's name (the streamer's backend)."""
    return "\n".join(line for line in azurite.requests_log().splitlines() if "azpartner-runai azsdk-cpp" in line)


def _wrap(azurite: AzuriteTls) -> Callable[[list[str]], list[str]]:
    return lambda command: namespaced(azurite.bundle_dir, command)


def test_sharded_llama_is_bit_identical_with_same_logits(served: Served, tiny_llama_folder: Path) -> None:
    reference = load_folder(tiny_llama_folder)
    model_id = served.model("llama/tiny")
    with WeightStreamClient(served.target, progress=False) as client:
        manifest = client.manifest(model_id)
        assert len(manifest.files) == 3, "the tiny Llama is sharded into three files"
        torch.manual_seed(99)
        model = transformers.LlamaForCausalLM(llama_config()).eval()
        report = client.load_into(model, model_id)
    assert report.tensors == len(reference)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), reference[name].view(torch.uint8)), name
    reads = served.streamer_reads()
    for shard in ("model-00001-of-00003", "model-00002-of-00003", "model-00003-of-00003"):
        assert shard in reads, f"{shard} was not read by the Run:ai streamer's backend:\n{reads[-2000:]}"
    local = transformers.LlamaForCausalLM(llama_config()).eval()
    local.load_state_dict(reference)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, local(tokens).logits)


def test_listing_and_fetch_give_weights_and_companion_files(
    served: Served, tiny_llama_folder: Path, tmp_path: Path
) -> None:
    model_id = served.model("llama/tiny")
    with WeightStreamClient(served.target, progress=False) as client:
        listed = {f.name for f in client.list_files(model_id).files}
        report = client.fetch(model_id, tmp_path / "fetched")
    on_disk = {p.name for p in tiny_llama_folder.iterdir() if p.is_file()} | {"config.json"}
    assert listed == on_disk, "every weight and companion file, nothing else (notes.txt stays private)"
    assert sorted(report.files) == sorted(on_disk)
    for name in on_disk - {"config.json"}:
        assert (tmp_path / "fetched" / name).read_bytes() == (tiny_llama_folder / name).read_bytes(), name
    assert json.loads((tmp_path / "fetched" / "config.json").read_text())["model_type"] == "llama"


def test_missing_objects_are_not_found_and_name_the_url(served: Served) -> None:
    with WeightStreamClient(served.target, progress=False, retry=None) as client:
        with pytest.raises(NotFoundError, match=rf"{served.scheme}{BUCKET}/config-only") as info:
            client.manifest(served.model("config-only"))
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(NotFoundError, match=rf"{served.scheme}{BUCKET}/nothing-here"):
            client.manifest(served.model("nothing-here"))
        with pytest.raises(NotFoundError, match=MISSING):
            client.manifest(served.model("m", bucket=MISSING))
        with pytest.raises(IntegrityError, match=r"model-00002-of-00002\.safetensors"):
            client.manifest(served.model("broken-index"))


def test_bucket_not_allowed_is_permission_denied(served: Served) -> None:
    with WeightStreamClient(served.target, progress=False, retry=None) as client:
        with pytest.raises(PermissionDeniedError, match=rf"{served.scheme}{OTHER} is not served") as info:
            client.manifest(served.model("llama/tiny", bucket=OTHER))
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_readiness_status_and_metrics_name_the_store_and_no_secret_leaks(served: Served) -> None:
    with WeightStreamClient(served.target, progress=False) as client:
        client.load_state_dict(served.model("llama/tiny"))
    with httpx.Client(base_url=f"http://{LOOPBACK}:{served.http_port}", timeout=30) as http:
        ready = http.get("/readyz").json()
        status = http.get("/status").text
        metrics = http.get("/metrics").text
    states = {s["source"]: s["reachable"] for s in ready["sources"]}
    assert states == {f"{served.scheme}{BUCKET}": True, f"{served.scheme}{MISSING}": False}
    assert f"{served.scheme}{BUCKET}" in status
    label = f'model="{served.model("llama/tiny")}"'
    assert any(line.startswith("weightstream_bytes_served_total{") and label in line for line in metrics.splitlines())
    if served.secret:
        for text in (served.server.output(), status, metrics, json.dumps(ready)):
            assert served.secret not in text


def test_a_model_uploaded_later_loads_bit_for_bit(
    served: Served, many_dtypes: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """A model uploaded after the server started is found, and tensors of every dtype come back bit for bit."""
    folder = tmp_path / "many"
    folder.mkdir()
    save_file(many_dtypes, str(folder / "model.safetensors"))
    served.upload(folder, BUCKET, "many")
    with WeightStreamClient(served.target, progress=False) as client:
        assert_bytes_identical(many_dtypes, client.load_state_dict(served.model("many")))


@pytest.fixture(params=["gcs", "azure"])
def dying(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Served]:
    """A server and an emulator of its own, with a 64 MiB model, for a test that kills the emulator."""
    folder = tmp_path / "big"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(512, 1024, generator=generator) for i in range(32)}
    save_file(state, str(folder / "model.safetensors"))
    flags = ["--read-ahead-bytes", str(16 * 1024 * 1024), "--storage-timeout", "5", "--s3-request-timeout-ms", "3000"]
    with _store_served(request.param, tmp_path, [(folder, BUCKET, "big")], [BUCKET], f"{BUCKET}/big", flags) as served:
        yield served


def test_emulator_killed_mid_stream_is_unavailable(dying: Served) -> None:
    """The store dies while a stream is in flight: the client gets UNAVAILABLE naming the model, never a short model."""
    model_id = dying.model("big")
    received = 0
    started = time.monotonic()
    with WeightStreamClient(dying.target, chunk_bytes=1 << 20, progress=False, retry=None) as client:
        with pytest.raises(UnavailableError, match=model_id) as info:
            for _name, _tensor in client.iter_tensors(model_id):
                received += 1
                if received == 2:
                    dying.emulator.stop()
                time.sleep(0.05)
    assert received < 32
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    print(f"{dying.scheme}: UNAVAILABLE {time.monotonic() - started:.1f} s after the stream started")
    dying.server.assert_running()


def test_abfs_is_az_and_gcs_is_no_scheme(served: Served) -> None:
    with WeightStreamClient(served.target, progress=False, retry=None) as client:
        if served.scheme == "az://":
            assert (
                client.manifest(f"abfs://{BUCKET}/llama/tiny").revision
                == client.manifest(served.model("llama/tiny")).revision
            )
        else:
            with pytest.raises(InvalidArgumentError, match="unsupported URL scheme"):
                client.manifest(f"gcs://{BUCKET}/llama/tiny")


def test_a_wrong_azure_key_is_refused_and_not_logged(tmp_path: Path, tiny_llama_folder: Path) -> None:
    wrong = base64.b64encode(b"not the account's key, 64 bytes long......................").decode()
    with azurite_tls(tmp_path) as azurite:
        upload_azure(azurite.client(), tiny_llama_folder, BUCKET, "llama")
        grpc_port, http_port = free_ports(2)
        args = ["--host", LOOPBACK, "--grpc-port", str(grpc_port), "--http-port", str(http_port)]
        args += ["--azure-container", BUCKET, "--log-level", "DEBUG"]
        with serve_process(args, tmp_path, clean_env(**azurite.server_env(key=wrong)), wrap=_wrap(azurite)) as server:
            server.wait_listening(grpc_port)
            with WeightStreamClient(f"{LOOPBACK}:{grpc_port}", progress=False, retry=None) as client:
                # Azurite answers a wrong signature 403 AuthorizationFailure, which is PERMISSION_DENIED;
                # Azure's own answer, AuthenticationFailed, is UNAUTHENTICATED (test_object_store_settings).
                with pytest.raises(
                    PermissionDeniedError, match=rf"az://{BUCKET}/llama.*denied access \(AuthorizationFailure\)"
                ) as info:
                    client.manifest(f"az://{BUCKET}/llama")
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert wrong not in server.output() and AZURITE_KEY not in server.output()


def test_the_disk_cache_keeps_gcs_files(tmp_path: Path, tiny_llama_folder: Path) -> None:
    """gs:// through --disk-cache: the first load fills the cache, the second is served from it, both bit for bit."""
    reference = load_folder(tiny_llama_folder)
    cache = tmp_path / "cache"
    uploads = [(tiny_llama_folder, BUCKET, "llama")]
    with _store_served("gcs", tmp_path, uploads, [BUCKET], f"{BUCKET}/llama", ["--disk-cache", str(cache)]) as served:
        emulator = served.emulator
        with WeightStreamClient(served.target, progress=False) as client:
            assert_bytes_identical(reference, client.load_state_dict(f"gs://{BUCKET}/llama"))
            cached = [p for p in (cache / "files").iterdir() if p.suffix != ".json"]
            assert len(cached) == 3, cached
            reads = emulator.log.read_text().count("GET /download/storage/v1/b/ws-models/o/llama")
            assert reads >= 3, "the cache is filled through google-cloud-storage"
            assert_bytes_identical(reference, client.load_state_dict(f"gs://{BUCKET}/llama"))
            assert emulator.log.read_text().count("GET /download/storage/v1/b/ws-models/o/llama") == reads, (
                "the second load came from the disk cache"
            )


def test_a_sidecar_serves_the_store_through_its_upstream_and_disk_cache(
    served: Served, tiny_llama_folder: Path, tmp_path: Path
) -> None:
    """gs:// and az:// ids pass through a sidecar tier (--upstream, --disk-cache) unchanged, bit for bit."""
    reference = load_folder(tiny_llama_folder)
    settings = loopback_settings(upstream=served.target, disk_cache=tmp_path / "cache")
    with serving(settings) as sidecar:
        with WeightStreamClient(f"{LOOPBACK}:{sidecar.port}", progress=False) as client:
            assert_bytes_identical(reference, client.load_state_dict(served.model("llama/tiny")))
            with pytest.raises(PermissionDeniedError, match=rf"{served.scheme}{OTHER} is not served"):
                client.manifest(served.model("llama/tiny", bucket=OTHER))
    cached = [p for p in (tmp_path / "cache" / "files").iterdir() if p.suffix != ".json"]
    assert len(cached) == 3, "the sidecar keeps the three shards on its disk"


def test_a_dead_store_is_unavailable_within_a_call_and_local_models_still_load(
    tmp_path: Path, tiny_llama_folder: Path
) -> None:
    """GCS stops answering mid-stream under --max-streams 1: the stream ends UNAVAILABLE after --storage-timeout
    while the streamer's backend goes on retrying; the next call for the model is UNAVAILABLE within the client's
    deadline (the SDK's retries are bounded), and a local model still loads through the one stream slot.
    (Reads stuck in the backend are capped: tests/server/test_store_timeouts.py.)"""
    folder = tmp_path / "big"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(512, 1024, generator=generator) for i in range(32)}
    save_file(state, str(folder / "model.safetensors"))
    root = tmp_path / "root"
    shutil.copytree(tiny_llama_folder, root / "tiny")
    flags = ["--max-streams", "1", "--storage-timeout", "2", "--read-ahead-bytes", str(16 * 1024 * 1024)]
    flags += ["--model-root", str(root)]
    with _store_served("gcs", tmp_path, [(folder, BUCKET, "big")], [BUCKET], f"{BUCKET}/big", flags) as served:
        model_id = served.model("big")
        with WeightStreamClient(served.target, chunk_bytes=1 << 20, progress=False, retry=None) as client:
            with pytest.raises(UnavailableError, match=rf"{model_id}.*--storage-timeout"):
                for received, _ in enumerate(client.iter_tensors(model_id)):
                    if received == 1:
                        served.emulator.stop()
                    time.sleep(0.05)
            with pytest.raises(
                UnavailableError, match=rf"{model_id}.*Google Cloud Storage failed for 15 s of retries"
            ) as info:
                client.load_state_dict(model_id)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            # The bucket is now known not to answer: its other models fail at once, naming why,
            # instead of holding a worker for short calls through another 15 s of retries.
            started = time.monotonic()
            with pytest.raises(UnavailableError, match=rf"{BUCKET}/other.*did not answer .*15 s of retries") as info:
                client.manifest(f"{model_id.rsplit('/', 1)[0]}/other")
            assert time.monotonic() - started < 5 and info.value.code == grpc.StatusCode.UNAVAILABLE
            assert_bytes_identical(load_folder(tiny_llama_folder), client.load_state_dict("tiny"))
        served.server.assert_running()
