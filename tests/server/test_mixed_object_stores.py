"""One server serving S3, Google Cloud Storage and Azure Blob at once, each read through the Run:ai streamer.

The streamer's object-storage backend is chosen once per process (serving/store_readers.py), so
without reader processes per kind of store every read of the second store would fail. Real
emulators on 127.0.0.1 (s3rver, gcp-storage-emulator, Azurite over TLS: tests/support) and one
`weightstream serve` process pointed at all three by the stores' standard variables. Each store
holds different bytes under the same names, so a read sent to the wrong store cannot pass.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.checkpoints import assert_bytes_identical, load_folder
from tests.support.commands import clean_env
from tests.support.object_stores import (
    azurite_tls,
    gcs_client,
    gcs_emulator,
    namespaced,
    upload_azure,
    upload_gcs,
)
from tests.support.ports import LOOPBACK, free_ports
from tests.support.s3_stores import REGION, S3_BUCKET, S3Process, upload_folder
from tests.support.serve_processes import ServerProcess, serve_process, wait_grpc_ready
from weightstream.client import WeightStreamClient

# Three emulators and a `weightstream serve` process.
pytestmark = pytest.mark.slow

BUCKET = "ws-mixed"
SCHEMES = ("s3://", "gs://", "az://")


@dataclass
class Mixed:
    """The server in front of the three stores, and what each store's models hold."""

    target: str
    server: ServerProcess
    expected: dict[str, dict[str, torch.Tensor]]  # by model id
    streamer_reads: dict[str, Callable[[], str]]  # by scheme: the emulator's log of the reads Run:ai's backend made

    def models(self, name: str) -> list[str]:
        bucket = {"s3://": S3_BUCKET, "gs://": BUCKET, "az://": BUCKET}
        return [f"{scheme}{bucket[scheme]}/{name}" for scheme in SCHEMES]


def _big(folder: Path, seed: int) -> None:
    """Two shards of 12 MiB: a stream of it reads in more than one window (--read-ahead-bytes 16 MiB)."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    for shard in range(2):
        state = {f"layer{shard}.w{i}": torch.randn(256, 1024, generator=generator) for i in range(12)}
        save_file(state, str(folder / f"model-0000{shard + 1}-of-00002.safetensors"))


@pytest.fixture(scope="module")
def mixed(s3_store: S3Process, tmp_path_factory: pytest.TempPathFactory, tiny_llama_folder: Path) -> Iterator[Mixed]:
    workdir = tmp_path_factory.mktemp("mixed")
    with contextlib.ExitStack() as stack:
        gcs = stack.enter_context(gcs_emulator(workdir))
        azurite = stack.enter_context(azurite_tls(workdir))
        uploads = {
            "s3://": lambda folder, prefix: upload_folder(s3_store.client(), folder, S3_BUCKET, prefix),
            "gs://": lambda folder, prefix: upload_gcs(gcs_client(gcs), folder, BUCKET, prefix),
            "az://": lambda folder, prefix: upload_azure(azurite.client(), folder, BUCKET, prefix),
        }
        expected: dict[str, dict[str, torch.Tensor]] = {}
        llama = load_folder(tiny_llama_folder)
        for seed, (scheme, upload) in enumerate(uploads.items()):
            big = workdir / f"big-{seed}"
            _big(big, seed)
            upload(big, "mixed/big")
            upload(tiny_llama_folder, "mixed/llama")
            bucket = S3_BUCKET if scheme == "s3://" else BUCKET
            expected[f"{scheme}{bucket}/mixed/big"] = load_folder(big)
            expected[f"{scheme}{bucket}/mixed/llama"] = llama
        grpc_port, http_port = free_ports(2)
        args = ["--host", LOOPBACK, "--grpc-port", str(grpc_port), "--http-port", str(http_port)]
        args += ["--s3-bucket", S3_BUCKET, "--s3-endpoint", s3_store.endpoint, "--s3-region", REGION, "--s3-path-style"]
        args += ["--gcs-bucket", BUCKET, "--azure-container", BUCKET, "--read-ahead-bytes", str(16 * 1024 * 1024)]
        env = clean_env(STORAGE_EMULATOR_HOST=gcs.endpoint, **azurite.server_env())
        server = stack.enter_context(
            serve_process(args, workdir, env, wrap=lambda command: namespaced(azurite.bundle_dir, command))
        )
        target = f"{LOOPBACK}:{grpc_port}"
        wait_grpc_ready(server, target, f"s3://{S3_BUCKET}/mixed/llama")

        def gcs_reads() -> str:
            lines = gcs.log.read_text(errors="replace").splitlines()
            return "\n".join(line for line in lines if '"GET /storage/v1/b/' in line and "alt=media" in line)

        def azure_reads() -> str:
            lines = azurite.requests_log().splitlines()
            return "\n".join(line for line in lines if "azpartner-runai azsdk-cpp" in line)

        reads: dict[str, Callable[[], str]] = {"gs://": gcs_reads, "az://": azure_reads}
        yield Mixed(target, server, expected, reads)


def _load(target: str, model: str) -> dict[str, torch.Tensor]:
    with WeightStreamClient(target, progress=False, retry=None) as client:
        return client.load_state_dict(model)


def test_one_server_loads_a_model_of_each_store_bit_for_bit(mixed: Mixed) -> None:
    """S3 first, then GCS and Azure, then back: every store's reads go to that store, through its streamer."""
    for model in [*mixed.models("mixed/llama"), *reversed(mixed.models("mixed/big"))]:
        assert_bytes_identical(mixed.expected[model], _load(mixed.target, model))
    for scheme, reads in mixed.streamer_reads.items():
        log = reads()
        for shard in ("model-00001-of-00003", "model-00002-of-00002"):  # of the llama, of the big model
            assert shard in log, f"{scheme}: {shard} was not read by the Run:ai streamer's backend:\n{log[-2000:]}"
    mixed.server.assert_running()


def test_the_three_stores_load_concurrently(mixed: Mixed) -> None:
    """Loads of all three stores at once, twice over: each bit for bit."""
    models = mixed.models("mixed/big") * 2
    start = threading.Barrier(len(models))

    def load(model: str) -> dict[str, torch.Tensor]:
        start.wait(timeout=60)
        return _load(mixed.target, model)

    with ThreadPoolExecutor(len(models)) as pool:
        results = list(pool.map(load, models))
    for model, got in zip(models, results, strict=True):
        assert_bytes_identical(mixed.expected[model], got)
    mixed.server.assert_running()
