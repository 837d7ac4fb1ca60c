"""An RL loop as users write it, synced through vLLM's trainer API with the `weightstream` backend.

A real `vllm serve` (the CPU build in .venv-vllm) loads revision A of a tiny Llama with
--load-format weightstream and --weight-transfer-config '{"backend": "weightstream"}'. A trainer
process (tests/support/vllm_scripts/trainer.py, also in .venv-vllm) builds the same Llama with
transformers, takes real AdamW steps, and after each calls send_weights() of the engine that vLLM's
WeightTransferTrainerFactory makes from WeightStreamTrainerInitInfo, with vLLM's own
HTTPVLLMWeightSyncClient and ModuleSource. After the last step the served greedy tokens must be
those of a fresh engine loaded from the trained weights with load_format="safetensors" (at the
same tensor-parallel size). The same with a two-rank trainer (gloo), each rank publishing half the
names as its part of the revision, and with a send cut midway by a proxy that resets the trainer's
connection: the engine must go on serving the previous revision, and the next send must complete.
The trainer also drives engines of its own process: an offline LLM through our OfflineLLMClient, and
an LLM Ray actor through vLLM's RayVLLMWeightSyncClient. Nothing the trainer starts may outlive it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.support.commands import clean_env
from tests.support.faults import CuttingProxy
from tests.support.ports import free_ports
from tests.support.servers import Running, running
from tests.support.vllm_runs import (
    ENGINE_TIMEOUT_S,
    SCRIPTS,
    VLLM_PYTHON,
    end_session,
    ensure_vllm_venv,
    run_engine,
    served_completions,
    serving_vllm,
    vllm_llama_config,
    write_vllm_llama,
)
from weightstream.client import WeightStreamClient

pytestmark = pytest.mark.slow

MODEL = "trained-llama"
STEPS = 3


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Running, int]]:
    """A server whose root holds revision A of a tiny vLLM Llama, taking publishes; and A's bytes."""
    ensure_vllm_venv()
    nbytes = write_vllm_llama(tmp_path / "root" / MODEL, vllm_llama_config())
    with running(tmp_path / "root", allow_publish=True) as r:
        yield r, nbytes


def config_folder(server: Running, tmp_path: Path) -> Path:
    """What vLLM is started on: the model's config and tokenizer, fetched from the server (no weights)."""
    folder = tmp_path / "config" / MODEL
    with WeightStreamClient(server.target, progress=False) as client:
        client.fetch(MODEL, folder, metadata_only=True)
    return folder


def train(
    tmp_path: Path, server: Running, base: str, config: Path, logs: list[str] | None = None, **settings: Any
) -> list[dict[str, Any]]:
    """Run the trainer script; the steps it reports (and "before": an offline engine's tokens before the first).
    logs: where the script's output and standard error (its engines' log lines among them) are appended."""
    (master_port,) = free_ports(1)
    full = {
        "target": server.target,
        "model": MODEL,
        "vllm": base,
        "served_model": str(config),
        "weights": str(tmp_path / "root" / MODEL),
        "config": str(config),
        "out": str(tmp_path / "trained"),
        "steps": STEPS,
        "world_size": 1,
        "master_port": master_port,
        **settings,
    }
    env = clean_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    # In a session of its own, so that whatever it starts (engine processes, a Ray) can be found after it.
    with subprocess.Popen(
        [str(VLLM_PYTHON), str(SCRIPTS / "trainer.py"), json.dumps(full)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    ) as trainer:
        try:
            stdout, stderr = trainer.communicate(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            end_session(trainer.pid, grace=0)
            stdout, stderr = trainer.communicate()
        left = end_session(trainer.pid)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if trainer.returncode != 0 or not lines or left:
        raise AssertionError(
            f"the trainer failed (exit {trainer.returncode}; still running after it, killed now: {left})\n"
            f"--- stdout\n{stdout[-6000:]}\n--- stderr\n{stderr[-8000:]}"
        )
    if logs is not None:
        logs.append(stdout + stderr)
    printed = json.loads(lines[-1].removeprefix("RESULT "))
    steps: list[dict[str, Any]] = printed["steps"]
    if printed.get("before") is not None:
        steps.insert(0, {"before": printed["before"]})
    return steps


def trained_folder(tmp_path: Path, config: Path) -> Path:
    """The trained weights beside A's config and tokenizer: what the fresh engine loads."""
    folder = tmp_path / "trained"
    for item in config.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy(item, folder / item.name)
    return folder


@pytest.mark.parametrize("tp", [1, 2])
def test_an_rl_loop_synced_with_send_weights_serves_what_a_fresh_engine_on_the_trained_weights_does(
    server: tuple[Running, int], tmp_path: Path, tp: int
) -> None:
    running_server, nbytes = server
    config = config_folder(running_server, tmp_path)
    with (
        serving_vllm(config, running_server.target, MODEL, tmp_path / "vllm-serve.log", tp=tp) as base,
        httpx.Client(trust_env=False) as http,
    ):
        before = served_completions(http, base, str(config))
        steps = train(tmp_path, running_server, base, config)
        version = http.get(f"{base}/weight_info", timeout=10.0).json()["weight_version"]
    status = running_server.get("/status").json()
    assert [s.get("error") for s in steps] == [None] * STEPS, steps
    assert [s["revision"] for s in steps] == [f"step-{i}" for i in range(1, STEPS + 1)]
    assert version == f"step-{STEPS}"
    assert all(s["publish_bytes"] == nbytes == s["publish_sent_bytes"] for s in steps), (steps, nbytes)
    assert all(s["update_seconds"] > 0 for s in steps)
    # /status says what each step cost on the server: its publish, and the engine ranks' updates to it.
    published = {r["revision"]: r for r in status["revisions"]["models"][MODEL]["publishes"]}
    assert set(published) == {f"step-{i}" for i in range(1, STEPS + 1)}, published
    for step in steps:
        record = published[step["revision"]]
        assert (record["bytes"], record["received_bytes"], record["parts"]) == (nbytes, nbytes, 1), record
        assert record["updates"] == tp and 0 < record["update_bytes"] <= tp * nbytes, record
    fresh = run_engine(trained_folder(tmp_path, config), "safetensors", tp=tp)
    assert steps[-1]["tokens"] == fresh.token_ids, "the engine synced by send_weights must serve the trained weights"
    assert steps[-1]["tokens"] != before, "the steps change the tokens: the sync did something"


def test_a_two_rank_trainer_publishes_one_part_per_rank_and_the_engine_serves_the_trained_weights(
    server: tuple[Running, int], tmp_path: Path
) -> None:
    running_server, nbytes = server
    config = config_folder(running_server, tmp_path)
    with (
        serving_vllm(config, running_server.target, MODEL, tmp_path / "vllm-serve.log") as base,
        httpx.Client(trust_env=False) as http,
    ):
        before = served_completions(http, base, str(config))
        steps = train(tmp_path, running_server, base, config, world_size=2)
    assert [s.get("error") for s in steps] == [None] * STEPS, steps
    # Rank 0 published its half only: no gather of the whole model on one rank.
    assert all(0 < s["publish_bytes"] < nbytes for s in steps), (steps, nbytes)
    published = running_server.get("/status").json()["revisions"]["models"][MODEL]["publishes"]
    assert {r["revision"]: (r["parts"], r["received_bytes"]) for r in published} == {
        f"step-{i}": (2, nbytes) for i in range(1, STEPS + 1)
    }
    fresh = run_engine(trained_folder(tmp_path, config), "safetensors")
    assert steps[-1]["tokens"] == fresh.token_ids
    assert steps[-1]["tokens"] != before


def test_a_send_cut_midway_leaves_the_engine_serving_the_previous_revision_and_the_next_send_completes(
    server: tuple[Running, int], tmp_path: Path
) -> None:
    running_server, nbytes = server
    config = config_folder(running_server, tmp_path)
    port = int(running_server.target.rsplit(":", 1)[1])
    # The trainer's one connection is reset halfway through its second publish (it has sent the first
    # whole by then); the engine pulls from the server directly.
    with (
        CuttingProxy(port, [(int(1.5 * nbytes), "reset")], from_client=True) as proxy,
        serving_vllm(config, running_server.target, MODEL, tmp_path / "vllm-serve.log") as base,
    ):
        steps = train(
            tmp_path,
            running_server,
            base,
            config,
            target=proxy.target,
            engine_target=running_server.target,
            transport="grpc",
        )
        assert proxy.cuts == 1
    assert [s.get("phase") for s in steps] == [None, "publish", None], steps
    assert "the engine are as they were" in steps[1]["error"]
    assert steps[1]["tokens"] == steps[0]["tokens"], "after the cut the engine must serve step 1's revision"
    assert steps[2]["revision"] == "step-3"
    assert steps[2]["tokens"] != steps[0]["tokens"]
    fresh = run_engine(trained_folder(tmp_path, config), "safetensors")
    assert steps[2]["tokens"] == fresh.token_ids


def test_an_offline_llm_is_synced_with_deltas_through_the_four_method_client_of_ours(
    server: tuple[Running, int], tmp_path: Path
) -> None:
    """vLLM ships clients for HTTP servers and Ray actors; an offline LLM in the trainer's process is
    driven through OfflineLLMClient. With deltas, the trainer sends only what changed after its first
    publish and the engine pulls deltas into its host copy."""
    running_server, nbytes = server
    config = config_folder(running_server, tmp_path)
    # A name the trainer would take first is taken (another trainer's step-1 is kept): it goes on to
    # the next, and so does every later send.
    weights: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "root" / MODEL).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    with WeightStreamClient(running_server.target, progress=False) as other:
        other.publish(MODEL, weights, revision="step-1")
        other.publish(MODEL, weights, revision="warm")
    # Two sends with nothing changed after the first step: the engine's host copy must still follow
    # them, or the next update would ask for deltas since a revision the server no longer keeps (it
    # keeps two).
    sends = STEPS + 2
    logs: list[str] = []
    first, *steps = train(tmp_path, running_server, "offline", config, logs, deltas=True, steps=sends, unchanged=[1, 2])
    assert [s.get("error") for s in steps] == [None] * sends, steps
    assert [s["revision"] for s in steps] == [f"step-{i}" for i in range(2, sends + 2)]
    # The first publish has no base and goes whole; nothing travels for the unchanged ones; AdamW moves
    # every element, so the later ones go as XOR deltas of about the same size (never more than whole).
    assert steps[0]["publish_sent_bytes"] == nbytes
    assert [s["publish_sent_bytes"] for s in steps[1:3]] == [0, 0], steps
    assert all(0 < s["publish_sent_bytes"] <= nbytes for s in steps[3:]), steps
    # The engine's host copy followed every revision, so it never had to be pulled whole again.
    copies = re.findall(r"weightstream: host copy of \S+ at (\S+):", logs[0])
    assert copies[-sends:] == [s["revision"] for s in steps], copies
    assert "no deltas since" not in logs[0]
    fresh = run_engine(trained_folder(tmp_path, config), "safetensors")
    assert steps[-1]["tokens"] == fresh.token_ids
    assert steps[-1]["tokens"] != first["before"]


def test_an_offline_llm_synced_with_auto_deltas_takes_what_went_whole_straight_in(
    server: tuple[Running, int], tmp_path: Path
) -> None:
    """deltas="auto": the first send has no base, the second measures deltas, the third whole (every
    chunk against the base, nothing compared); later ones go the way that was faster. A send that went
    whole against its base, with the next one whole too (the trainer kept no host copy), says so
    (update_info "whole"): the engine streams it straight into the model, not through its host copy,
    which follows every other send (refilled whole at the first after one that skipped it). Which
    sends those are depends on the times measured; the engine ends on the trained weights either way."""
    running_server, nbytes = server
    config = config_folder(running_server, tmp_path)
    logs: list[str] = []
    sends = STEPS + 1
    first, *steps = train(tmp_path, running_server, "offline", config, logs, deltas="auto", steps=sends)
    assert [s.get("error") for s in steps] == [None] * sends, steps
    encoded = [s["encoded"] for s in steps]
    assert encoded[:3] == [False, True, False], steps
    assert all(s["publish_sent_bytes"] == nbytes for s in steps if not s["encoded"]), steps
    assert all(0 < s["publish_sent_bytes"] <= nbytes for s in steps if s["encoded"]), steps
    whole = [s["revision"] for s in steps if s["delta_base"] and not s["encoded"] and not s["host_copy"]]
    # The trainer kept a host copy exactly before the sends that encode.
    assert [s["host_copy"] for s in steps[:-1]] == [s["encoded"] for s in steps[1:]], steps
    straight = re.findall(r"weightstream: (\S+) was published whole: streamed straight", logs[0])
    assert straight == whole, straight
    sent = {s["revision"] for s in steps}  # not the host copy's first fill, of the revision the engine loaded
    copies = [r for r in re.findall(r"weightstream: host copy of \S+ at (\S+):", logs[0]) if r in sent]
    assert copies == [s["revision"] for s in steps if s["revision"] not in whole], copies
    fresh = run_engine(trained_folder(tmp_path, config), "safetensors")
    assert steps[-1]["tokens"] == fresh.token_ids
    assert steps[-1]["tokens"] != first["before"]


def test_an_llm_ray_actor_synced_through_vllms_ray_client_serves_what_a_fresh_engine_on_the_trained_weights_does(
    server: tuple[Running, int], tmp_path: Path
) -> None:
    """The trainer starts a local Ray (one CPU, its servers on loopback) and vLLM's LLM in it as an actor,
    as vLLM's RL examples do, and drives it through vLLM's own RayVLLMWeightSyncClient. Ray and the
    engine end with the trainer (train() fails on any process of its session left after it)."""
    running_server, nbytes = server
    config = config_folder(running_server, tmp_path)
    # Ray's sockets live in its session folder: a path under tmp_path (named after this test) is too
    # long for a Unix socket's.
    ray_dir = Path(tempfile.mkdtemp(prefix="ray-"))
    try:
        first, *steps = train(tmp_path, running_server, "ray", config, ray_temp_dir=str(ray_dir))
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert [s.get("error") for s in steps] == [None] * STEPS, steps
    assert [s["revision"] for s in steps] == [f"step-{i}" for i in range(1, STEPS + 1)]
    # The client's finish_weight_update sets each revision as the actor's weight version.
    assert [s["weight_version"] for s in steps] == [s["revision"] for s in steps]
    assert all(s["publish_bytes"] == nbytes and s["update_seconds"] > 0 for s in steps), (steps, nbytes)
    published = running_server.get("/status").json()["revisions"]["models"][MODEL]["publishes"]
    assert {r["revision"]: r["updates"] for r in published} == {f"step-{i}": 1 for i in range(1, STEPS + 1)}
    fresh = run_engine(trained_folder(tmp_path, config), "safetensors")
    assert steps[-1]["tokens"] == fresh.token_ids, "the actor synced by send_weights must serve the trained weights"
    assert steps[-1]["tokens"] != first["before"], "the steps change the tokens: the sync did something"


def test_the_trainer_side_backend_is_registered_by_importing_the_module_and_by_the_plugin() -> None:
    """A trainer process may never load vLLM's plugins: importing vllm_transfer registers the trainer
    engine; the plugin's register() does too, and again without complaint."""
    ensure_vllm_venv()
    check = """
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as F
assert 'weightstream' not in F._registry, list(F._registry)
from weightstream.client.vllm_transfer import WeightStreamTrainerInitInfo as I
assert F._registry['weightstream']().init_info_cls is I
import weightstream.client.vllm_loader as plugin
del F._registry['weightstream']
plugin.register()
plugin.register()
assert F._registry['weightstream']().init_info_cls is I
for bad in ({'target': ''}, {'transport': 'carrier-pigeon'}, {'world_size': 2, 'rank': 2}, {'revision_prefix': '../x'}):
    try:
        I(**{'target': 't:1', 'model': 'm', 'rank': 0, **bad})
    except ValueError as exc:
        print('refused:', exc)
    else:
        raise AssertionError(bad)
# What an HTTP caller of /update_weights may send: "whole" only as a bool, never "yes" or 1.
from weightstream.client.vllm_transfer import WeightStreamUpdateInfo as U
assert U(revision='r', whole=True).whole is True and U(revision='r').whole is False
for bad in ({'whole': 'yes'}, {'whole': 1}, {'revision': ''}):
    try:
        U(**{'revision': 'r', **bad})
    except ValueError as exc:
        print('refused update_info:', exc)
    else:
        raise AssertionError(bad)
"""
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", check], capture_output=True, text=True, timeout=300, env=clean_env(), check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("refused:") == 4, result.stdout
    assert "WeightStreamTrainerInitInfo.transport must be one of" in result.stdout
    assert "WeightStreamTrainerInitInfo.revision_prefix must be" in result.stdout
    assert result.stdout.count("refused update_info:") == 3, result.stdout
    assert "update_info[\"whole\"] must be true or false, not 'yes'" in result.stdout
