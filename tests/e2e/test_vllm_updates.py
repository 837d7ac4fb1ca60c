"""A running vLLM engine updated in place through its weight-transfer API with the `weightstream` backend.

A real vLLM (the CPU build in .venv-vllm) loads revision A of a tiny Llama with
load_format="weightstream", generates, then B becomes the model's next revision (published by a
trainer, or written over the files in the model root) and the engine pulls it (start, update,
finish) and generates again, from the server itself or through a sidecar tier in front of it. Its
tokens must be those of a fresh engine loaded from B's files with load_format="safetensors" at the
same tensor-parallel size, and the server it pulls from must have sent only the changed tensors (per
rank: that rank's slices of them). The same through `vllm serve`'s weight-transfer HTTP routes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from tests.support.commands import clean_env, weightstream_cmd
from tests.support.servers import Running, running
from tests.support.vllm_runs import (
    ENGINE_TIMEOUT_S,
    SCRIPTS,
    VLLM_PYTHON,
    ensure_vllm_venv,
    run_engine,
    served_completions,
    serving_vllm,
    vllm_llama_config,
    write_config_folder,
    write_vllm_llama,
)
from weightstream.client import WeightStreamClient
from weightstream.samples import save_sharded

pytestmark = pytest.mark.slow

MODEL = "updated-llama"
# An RL step's worth of change: two of the 21 tensors, neither fused with another in vLLM.
CHANGED = ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"]


def revision_a(tmp_path: Path) -> tuple[Path, LlamaConfig, dict[str, torch.Tensor]]:
    """(the server's root holding revision A of a tiny vLLM Llama, its config, A's tensors)."""
    ensure_vllm_venv()
    root = tmp_path / "root"
    config = vllm_llama_config()
    write_vllm_llama(root / MODEL, config)
    state: dict[str, torch.Tensor] = {}
    for file in sorted((root / MODEL).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return root, config, state


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """(the server's root holding revision A, a folder holding B with its config)."""
    root, config, state = revision_a(tmp_path)
    generator = torch.Generator().manual_seed(7)
    for name in CHANGED:
        state[name] = torch.randn(state[name].shape, generator=generator) * 0.2
    new = tmp_path / "B" / MODEL
    save_sharded(state, new, shards=2)
    write_config_folder(new, config)
    return root, new


@pytest.fixture
def server(folders: tuple[Path, Path]) -> Iterator[Running]:
    with running(folders[0], allow_publish=True, watch_interval=0.5) as r:
        yield r


@contextlib.contextmanager
def tier(server: Running, name: str, cache: Path) -> Iterator[Running]:
    """The server itself ("direct"), or a sidecar in front of it with a disk cache ("sidecar")."""
    if name == "direct":
        yield server
        return
    with running(None, upstream=server.target, disk_cache=cache, watch_interval=0.5) as sidecar:
        yield sidecar


def changed_bytes(folder: Path) -> int:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return sum(state[n].numel() * state[n].element_size() for n in CHANGED)


def run_update(
    server: Running,
    config_dir: Path,
    new: Path,
    mode: str,
    tp: int,
    model_dir: Path,
    publish_to: str,
    deltas: bool = False,
) -> tuple[dict[str, object], str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    args = [
        str(VLLM_PYTHON),
        str(SCRIPTS / "update.py"),
        str(config_dir),
        server.target,
        MODEL,
        str(new),
        mode,
        str(tp),
        str(model_dir),
        publish_to,
        *(["deltas"] if deltas else []),
    ]
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, env=env, cwd=config_dir.parent, check=False
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise AssertionError(
            f"the vLLM update run failed (exit {result.returncode})\n--- stdout\n{result.stdout[-6000:]}\n"
            f"--- stderr\n{result.stderr[-8000:]}"
        )
    return json.loads(lines[-1].removeprefix("RESULT ")), result.stdout + result.stderr


@pytest.mark.parametrize(
    ("mode", "tp", "through"), [("publish", 1, "direct"), ("publish", 2, "sidecar"), ("storage", 2, "sidecar")]
)
def test_a_running_vllm_pulls_only_what_changed_and_generates_what_a_fresh_engine_on_the_new_files_does(
    mode: str, tp: int, through: str, folders: tuple[Path, Path], server: Running, tmp_path: Path
) -> None:
    root, new = folders
    config_dir = tmp_path / "config" / MODEL
    with tier(server, through, tmp_path / "cache") as target:
        with WeightStreamClient(target.target, progress=False) as client:
            client.fetch(MODEL, config_dir, metadata_only=True)
            total = client.manifest(MODEL).total_bytes
        before = int(target.get("/status").json()["bytes_served_total"])  # the config and tokenizer files
        result, logs = run_update(target, config_dir, new, mode, tp, root / MODEL, server.target)
        served = int(target.get("/status").json()["bytes_served_total"]) - before
    fresh = run_engine(new, "safetensors", tp=tp)

    assert result["after"] == fresh.token_ids, "the updated engine must generate what one loaded from B does"
    assert result["before"] != result["after"], "B changes the tokens: the update did something"
    updates = [line for line in logs.splitlines() if "weightstream: updated" in line]
    assert len(updates) == tp, updates
    assert all(f"{len(CHANGED)} tensors" in line for line in updates), updates
    # The initial load sent the whole model once (each rank its slices); the update, the changed
    # tensors once (each rank its own slices of them): within 10%.
    changed = changed_bytes(new)
    update_sent = served - total
    assert changed <= update_sent <= 1.1 * changed, (update_sent, changed)
    print(
        f"\nvLLM update ({mode}, TP={tp}, {through}): {update_sent} bytes sent for {changed} changed, "
        f"{result['update_seconds']:.3f} s in the engine; a fresh engine on B: {fresh.init_seconds:.1f} s"
    )


def test_a_sparse_step_reaches_vllm_as_deltas_at_tp2(tmp_path: Path) -> None:
    """init_info deltas: each rank keeps a host copy of its slices and updates it with XOR deltas
    against the revision it holds (published, so in the server's memory). B changes 2% of the
    elements of every tensor: every block changed, a few percent of the bytes travel."""
    root, config, a = revision_a(tmp_path)
    generator = torch.Generator().manual_seed(11)
    b = {}
    for name, tensor in a.items():
        flat = tensor.clone().view(-1)
        places = torch.randperm(flat.numel(), generator=generator)[: max(1, flat.numel() // 50)]
        flat[places] = flat[places] * 1.5 + 0.01
        b[name] = flat.view(tensor.shape)
    new = tmp_path / "B" / MODEL
    save_sharded(b, new, shards=2)
    write_config_folder(new, config)
    total = sum(t.numel() * t.element_size() for t in a.values())
    config_dir = tmp_path / "config" / MODEL
    with running(root, allow_publish=True) as server:
        with WeightStreamClient(server.target, progress=False) as client:
            client.fetch(MODEL, config_dir, metadata_only=True)
            client.publish(MODEL, a)  # the engine loads A from the server's memory, as in an RL loop
        before = int(server.get("/status").json()["bytes_served_total"])
        result, logs = run_update(server, config_dir, new, "publish", 2, root / MODEL, server.target, deltas=True)
        served = int(server.get("/status").json()["bytes_served_total"]) - before
        deltas = server.get("/status").json()["revisions"]["deltas"]
    fresh = run_engine(new, "safetensors", tp=2)

    assert result["after"] == fresh.token_ids, "the updated engine must generate what one loaded from B does"
    assert result["before"] != result["after"], "B changes the tokens: the update did something"
    copies = [line for line in logs.splitlines() if "weightstream: host copy" in line]
    assert len(copies) == 4, copies  # per rank: filled at init, then updated
    # The first load and the host copies each took the whole model once (every rank its slices).
    update_sent = served - 2 * total
    assert deltas["delta_chunks_total"] > 0
    assert 0 < update_sent <= 0.2 * total, (update_sent, total)
    print(
        f"\nvLLM update with deltas (TP=2): {update_sent} bytes sent for a {total}-byte model, "
        f"{deltas['delta_chunks_total']} chunks as deltas, {deltas['whole_chunks_total']} whole; "
        f"{result['update_seconds']:.3f} s in the engine"
    )


def test_vllm_serve_pulls_a_published_revision_through_its_weight_transfer_http_routes(
    folders: tuple[Path, Path], server: Running, tmp_path: Path
) -> None:
    _, new = folders
    config_dir = tmp_path / "config" / MODEL
    with WeightStreamClient(server.target, progress=False) as client:
        client.fetch(MODEL, config_dir, metadata_only=True)
    with (
        serving_vllm(config_dir, server.target, MODEL, tmp_path / "vllm-serve.log") as base,
        httpx.Client(trust_env=False) as http,
    ):
        before = served_completions(http, base, str(config_dir))
        held = json.loads(http.get(f"{base}/weight_info", timeout=10.0).text or "{}").get("weight_version")
        sent_before = int(server.get("/status").json()["bytes_served_total"])
        # The deployment loop: `weightstream update --follow` watches the model and has the engine
        # pull each revision through its HTTP routes; the first is the one it holds already.
        follow = subprocess.Popen(
            [
                *weightstream_cmd(),
                *("update", MODEL, "--target", server.target, "--vllm", base, "--follow", "--count", "2"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        try:
            assert follow.stdout is not None
            first = json.loads(follow.stdout.readline() or "null")
            assert first is not None, follow.stderr.read() if follow.stderr else ""
            state: dict[str, torch.Tensor] = {}
            for file in sorted(new.glob("*.safetensors")):
                state.update(load_file(str(file)))
            with WeightStreamClient(server.target, progress=False) as trainer:
                revision = trainer.publish(MODEL, state)
            second = json.loads(follow.stdout.readline() or "null")
            assert follow.wait(timeout=120) == 0, follow.stderr.read() if follow.stderr else ""
        finally:
            follow.kill()
        assert (first["since"], second["since"], second["revision"]) == (held, first["revision"], revision)
        sent = int(server.get("/status").json()["bytes_served_total"]) - sent_before
        assert http.get(f"{base}/weight_info", timeout=10.0).json()["weight_version"] == revision
        after = served_completions(http, base, str(config_dir))
    fresh = run_engine(new, "safetensors")
    assert after == fresh.token_ids, "the engine updated over HTTP must generate what one loaded from B does"
    assert before != after
    changed = changed_bytes(new)
    assert changed <= sent <= 1.1 * changed, (sent, changed)
