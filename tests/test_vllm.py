"""vLLM with load_format="weightstream" against its own safetensors loader: the same tokens, no weight files.

A real vLLM (the CPU build, in its own environment .venv-vllm, which `make test` and these tests
build with scripts/vllm_venv.sh) runs a tiny random Llama twice, each in a subprocess: once
streaming the weights from the weightstream server of the `server` fixture, from a folder with only
config.json and a tokenizer (fetched with `fetch --metadata-only`), and once with
load_format="safetensors" from the folder with the weights. The tests fail, never skip, when the
vLLM environment cannot be built.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

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
