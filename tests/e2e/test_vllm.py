"""vLLM with load_format="weightstream" against its own safetensors loader: the same tokens, no weight files.

A real vLLM (the CPU build, in its own environment .venv-vllm, which `make test` and these tests
build with scripts/vllm_venv.sh) runs a tiny random Llama twice, each in a subprocess: once
streaming the weights from the weightstream server of the `server` fixture, from a folder with only
config.json and a tokenizer (fetched with `fetch --metadata-only`), and once with
load_format="safetensors" from the folder with the weights. The tests fail, never skip, when the
vLLM environment cannot be built.

At tensor-parallel size 2 (two CPU workers, one core each), two more models, stored in bfloat16 and
run in float32 with a vocabulary vLLM pads: one with grouped-query attention, one with a single
key/value head (so fewer than the ranks: replicated) and tied embeddings. Each rank must receive
only its own bytes (the server's /status counts them), and the tokens must be those of
load_format="safetensors" at the same size (splitting the matrix products changes the order of
float additions, so TP=2 is compared with TP=2).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.servers import Running, running
from tests.support.vllm_runs import (
    ENGINE_TIMEOUT_S,
    LOADER_CHECKS_SCRIPT,
    ROOT,
    VLLM_PYTHON,
    ensure_vllm_venv,
    run_engine,
    vllm_llama_config,
    write_vllm_llama,
)
from weightstream.client import WeightStreamClient

# vLLM in its own environment: builds .venv-vllm when missing, then runs engines for minutes.
pytestmark = pytest.mark.slow

MODEL = "vllm-llama"


@pytest.fixture(scope="module")
def vllm_llama(model_root: Path) -> tuple[Path, int]:
    """model_root/vllm-llama: a tiny float32 Llama in 2 shards with config and tokenizer; its folder and bytes."""
    ensure_vllm_venv()
    folder = model_root / MODEL
    return folder, write_vllm_llama(folder, vllm_llama_config())


def test_vllm_weightstream_loader_generates_what_the_safetensors_loader_does(
    vllm_llama: tuple[Path, int], target: str, tmp_path: Path
) -> None:
    weights_folder, nbytes = vllm_llama
    # The folder vLLM gets for weightstream is named like the model id, which the loader then defaults to;
    # it is prepared the way a deployment would, with `weightstream fetch --metadata-only`.
    config_folder = tmp_path / MODEL
    with WeightStreamClient(target, progress=False) as client:
        client.fetch(MODEL, config_folder, metadata_only=True)
    assert (config_folder / "config.json").exists() and (config_folder / "tokenizer.json").exists()

    streamed = run_engine(config_folder, "weightstream", {"target": target})
    local = run_engine(weights_folder, "safetensors")

    assert not list(config_folder.rglob("*.safetensors")), "the weightstream run must not need weight files"
    assert streamed.weightstream_line is not None, "the loader's log line is missing: did the worker use it?"
    assert f"{nbytes} bytes" in streamed.weightstream_line, streamed.weightstream_line
    assert len(streamed.token_ids) == 3 and all(len(ids) == 8 for ids in streamed.token_ids)
    assert streamed.token_ids == local.token_ids
    print(
        f"\nvLLM load_weights of {nbytes / 1e6:.1f} MB: weightstream {streamed.load_seconds} s, "
        f"safetensors {local.load_seconds} s; LLM() {streamed.init_seconds:.1f} s vs {local.init_seconds:.1f} s"
    )


def test_vllm_loader_registers_resolves_settings_and_refuses_unloaded_parameters(
    vllm_llama: tuple[Path, int], target: str
) -> None:
    result = subprocess.run(
        [str(VLLM_PYTHON), str(LOADER_CHECKS_SCRIPT), target, MODEL],
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}"
    )


# Both ranks together may receive at most this much of the model (replicated norms and key/value
# heads are all that is sent twice).
TP2_BYTES_BOUND = 1.15
# Stored in bfloat16, run in float32; 500 tokens, padded by vLLM to 512.
TP_MODELS = {
    "gqa-llama": {"hidden": 256, "kv_heads": 2, "tied": False},
    "tied-llama": {"hidden": 128, "kv_heads": 1, "tied": True},
}


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Running, dict[str, tuple[Path, int]]]]:
    """A server with REST (for /status) over the TP_MODELS, each with its folder and checkpoint bytes."""
    ensure_vllm_venv()
    root = tmp_path_factory.mktemp("tp-models")
    models: dict[str, tuple[Path, int]] = {}
    for name, shape in TP_MODELS.items():
        config = vllm_llama_config(
            hidden=int(shape["hidden"]), vocab=500, kv_heads=int(shape["kv_heads"]), tied=bool(shape["tied"])
        )
        models[name] = (root / name, write_vllm_llama(root / name, config, dtype=torch.bfloat16))
    with running(root) as served:
        yield served, models


def _served_bytes(served: Running) -> int:
    return int(served.get("/status").json()["bytes_served_total"])


@pytest.mark.parametrize(
    ("model", "tp"), [("gqa-llama", 1), ("gqa-llama", 2), ("tied-llama", 2)], ids=["gqa-tp1", "gqa-tp2", "tied-tp2"]
)
def test_vllm_ranks_receive_only_their_bytes_and_generate_what_safetensors_does(
    tp_server: tuple[Running, dict[str, tuple[Path, int]]], model: str, tp: int, tmp_path: Path
) -> None:
    served, models = tp_server
    weights_folder, nbytes = models[model]
    config_folder = tmp_path / model
    with WeightStreamClient(served.target, progress=False) as client:
        client.fetch(model, config_folder, metadata_only=True)
    before = _served_bytes(served)
    streamed = run_engine(config_folder, "weightstream", {"target": served.target}, tp=tp)
    received = _served_bytes(served) - before
    local = run_engine(weights_folder, "safetensors", tp=tp)

    lines = streamed.weightstream_lines
    assert len(lines) == tp, f"one loader line per rank expected:\n{lines}"
    # Every Llama tensor is a view-and-copy for vLLM's loaders: none falls back to whole tensors.
    assert all(" 0 streamed whole" in line for line in lines), lines
    assert streamed.token_ids == local.token_ids
    bound = nbytes if tp == 1 else TP2_BYTES_BOUND * nbytes
    assert received <= bound, f"the ranks received {received} bytes of a {nbytes}-byte model ({received / nbytes:.2f}x)"
    if tp == 1:
        assert received == nbytes
    print(f"\n{model} TP={tp}: ranks received {received / nbytes:.3f}x the model; {lines}")
