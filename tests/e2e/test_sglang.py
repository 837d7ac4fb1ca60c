"""SGLang with load_format="weightstream", updated in place, against SGLang's own loader on the same files.

A real SGLang 0.5.23 (CPU, float32, in its own environment .venv-sglang, which `make test` and these
tests build with scripts/sglang_venv.sh) runs a tiny random Llama. Revision A is in the origin
server's model root; B changes two of its 21 tensors (about a tenth of the bytes) and is published
by a trainer; C replaces the files under the model root (a storage revision). The references come
from SGLang's own safetensors loader: a fresh engine on A's files, then on B's, and SGLang's own
update_weights_from_disk to C's files. The engine under test reads through a sidecar tier (a server
with a disk cache in front of the origin), loads A through weightstream's data port, and pulls B
and C in place with sync_weights; its tokens must equal the references' and the sidecar must have
sent it only the changed tensors. Failures: a server not there, a model not there and a checkpoint
that does not fit the model stop the start with an error naming them; an update to a revision that
does not exist fails and the engine keeps serving what it held. Last, `launch_server` is updated
over HTTP by `weightstream update --sglang --follow`. With deltas: an engine keeping a host copy
takes D (2% of B's two tensors' elements changed, published on a server of its own) as XOR deltas
and generates what a fresh engine on D's files does.

Engine starts dominate (importing SGLang alone takes about 30 s here), so the reference engines and
the deltas engine share one process; an engine that fails to start ends its process, so each failed
start has its own, all three at once.
The tests fail, never skip, when the SGLang environment cannot be built.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.support.commands import clean_env, weightstream_cmd
from tests.support.ports import free_ports
from tests.support.servers import Running, running
from tests.support.sglang_runs import (
    Session,
    engine_session,
    engine_sessions,
    ensure_sglang_venv,
    failed_start,
    served_tokens,
    serving_sglang,
    sglang_llama_config,
    write_sglang_llama,
)
from tests.support.vllm_runs import write_config_folder
from weightstream.client import WeightStreamClient
from weightstream.samples import save_sharded

pytestmark = pytest.mark.slow

MODEL = "sglang-llama"
# Its intermediate size differs from MODEL's config: the checkpoint does not fit the model.
WIDE = "wide-llama"
# B: an RL step's worth of change, two of the 21 tensors, neither fused with another.
CHANGED_B = ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
# C: a storage revision that also changes a part of a fused parameter (q of qkv_proj).
CHANGED_C = ["model.layers.1.self_attn.q_proj.weight"]
# D: B's tensors with this fraction of their elements changed (a sparse step, for deltas).
SPARSE = 0.02


FOLLOW_TWO = ("--follow", "--count", "2")
# The loader's line for each pull of its host copy (engine_updates.HostCopy.pull).
_HOST_COPY = re.compile(
    r"host copy of \S+ at \S+: (?P<tensors>\d+) tensors, (?P<changed>\d+) bytes changed, (?P<chunks>\d+) chunks "
    r"as deltas \((?P<delta_bytes>\d+) bytes\), (?P<fell_back>\d+) fell back"
)


@dataclass(frozen=True)
class Checkpoints:
    """The origin's model root (A under MODEL, a misfit under WIDE), A's, B's and C's folders, MODEL's
    config folder. The storage revision replaces the root's files: A's folder keeps them."""

    root: Path
    a: Path
    b: Path
    c: Path
    d: Path
    config: Path


def _state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def _changed(state: dict[str, torch.Tensor], names: list[str], folder: Path, seed: int, fraction: float = 1.0) -> None:
    """state with names' elements (fraction of them, at random places) drawn anew, saved under folder."""
    generator = torch.Generator().manual_seed(seed)
    changed = dict(state)
    for name in names:
        fresh = torch.randn(state[name].shape, generator=generator) * 0.2
        if fraction < 1.0:
            places = torch.rand(state[name].shape, generator=generator) < fraction
            fresh = torch.where(places, fresh * 10, state[name])
        changed[name] = fresh
    save_sharded(changed, folder, shards=2)


def _bytes(state: dict[str, torch.Tensor], names: list[str]) -> int:
    return sum(state[n].numel() * state[n].element_size() for n in names)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    ensure_sglang_venv()
    base = tmp_path_factory.mktemp("sglang")
    root = base / "root"
    config = sglang_llama_config()
    write_sglang_llama(root / MODEL, config)
    write_sglang_llama(root / WIDE, sglang_llama_config(intermediate=384))
    shutil.copytree(root / MODEL, base / "A" / MODEL)
    a = _state(root / MODEL)
    _changed(a, CHANGED_B, base / "B" / MODEL, seed=7)
    _changed(_state(base / "B" / MODEL), CHANGED_C, base / "C" / MODEL, seed=8)
    _changed(a, CHANGED_B, base / "D" / MODEL, seed=9, fraction=SPARSE)
    for folder in (base / "B" / MODEL, base / "C" / MODEL, base / "D" / MODEL):
        write_config_folder(folder, config)
    # The folder SGLang gets for weightstream: config.json and the tokenizer only.
    config_dir = base / "config" / MODEL
    write_config_folder(config_dir, config)
    return Checkpoints(root, base / "A" / MODEL, base / "B" / MODEL, base / "C" / MODEL, base / "D" / MODEL, config_dir)


@pytest.fixture(scope="module")
def origin(checkpoints: Checkpoints) -> Iterator[Running]:
    """The origin server over the model root, publishing allowed, with its data port."""
    (data_port,) = free_ports(1)
    with running(checkpoints.root, allow_publish=True, watch_interval=0.5, data_port=data_port) as served:
        yield served


@pytest.fixture(scope="module")
def references(checkpoints: Checkpoints) -> tuple[Session, Session, Session, Session]:
    """In one process, SGLang's own loader: on A's files (then its update_weights_from_disk to C's
    files), and a fresh engine on B's files; then an engine keeping a host copy ("deltas": true) on a
    server of its own that holds A published, synced to D published (the deltas session), and a fresh
    engine on D's files."""
    generate = [{"do": "generate"}]
    (data_port,) = free_ports(1)
    with running(checkpoints.a.parent, allow_publish=True, data_port=data_port) as served:
        with WeightStreamClient(served.target, progress=False) as client:
            client.publish(MODEL, _state(checkpoints.a))  # A in the server's memory: the deltas' base
        deltas_engine = {
            "model_path": str(checkpoints.config),
            "load_format": "weightstream",
            "model_loader_extra_config": {"target": served.target, "model": MODEL, "deltas": True},
        }
        publish_d = {"do": "publish", "target": served.target, "model": MODEL, "dir": str(checkpoints.d), "name": "$D"}
        specs = [
            {
                "engine": {"model_path": str(checkpoints.a)},
                "steps": [*generate, {"do": "from_disk", "path": str(checkpoints.c)}, *generate],
            },
            {"engine": {"model_path": str(checkpoints.b)}, "steps": generate},
            {"engine": deltas_engine, "steps": [*generate, publish_d, {"do": "sync", "revision": "$D"}, *generate]},
            {"engine": {"model_path": str(checkpoints.d)}, "steps": generate},
        ]
        own_a, fresh_b, deltas, fresh_d = engine_sessions(specs, checkpoints.root.parent)
    return own_a, fresh_b, deltas, fresh_d


def test_sglang_start_fails_with_an_error_naming_what_is_wrong(
    checkpoints: Checkpoints, origin: Running, tmp_path: Path
) -> None:
    (nobody,) = free_ports(1)
    stream = {"model_path": str(checkpoints.config), "load_format": "weightstream"}
    extras = [
        {"target": f"127.0.0.1:{nobody}", "retry_deadline": 2},
        {"target": origin.target, "model": "no-such-llama"},
        {"target": origin.target, "model": WIDE},
    ]
    # Three processes at once (most of each is importing SGLang), each with a port of its own for
    # its process group, which SGLang would otherwise draw at random.
    specs = [
        stream | {"model_loader_extra_config": extra, "nccl_port": port}
        for extra, port in zip(extras, free_ports(len(extras)), strict=True)
    ]
    with ThreadPoolExecutor(len(specs)) as pool:
        unreachable, missing, misfit = pool.map(lambda spec: failed_start(spec, tmp_path), specs)
    assert f"UnavailableError: UNAVAILABLE from 127.0.0.1:{nobody}" in unreachable, unreachable[-4000:]
    assert "NotFoundError: NOT_FOUND" in missing and "no-such-llama" in missing, missing[-4000:]
    # SGLang's own weight loaders would narrow the wider tensors to the model's and load them silently.
    assert f"weightstream model {WIDE!r} does not fit the engine's model: 6 tensors are larger" in misfit, misfit[
        -4000:
    ]
    assert "model.layers.0.mlp.down_proj.weight [128, 384]" in misfit, misfit[-4000:]
    assert all("weightstream: loaded" not in log for log in (unreachable, missing, misfit))


def test_sglang_loads_through_weightstream_and_pulls_published_and_storage_revisions_in_place(
    references: tuple[Session, Session, Session, Session], checkpoints: Checkpoints, origin: Running, tmp_path: Path
) -> None:
    own_a, fresh_b, _, _ = references
    tokens_a, tokens_c = own_a.tokens(0), own_a.tokens(2)
    tokens_b = fresh_b.tokens(0)
    assert tokens_a != tokens_b and tokens_b != tokens_c, "B and C change the tokens"
    state_b = _state(checkpoints.b)
    total = sum(t.numel() * t.element_size() for t in state_b.values())

    (data_port,) = free_ports(1)
    tier = {"upstream": origin.target, "disk_cache": tmp_path / "cache", "watch_interval": 0.5, "data_port": data_port}
    with running(None, **tier) as sidecar:
        steps = [
            {"do": "generate"},
            {"do": "publish", "target": origin.target, "model": MODEL, "dir": str(checkpoints.b), "name": "$B"},
            {"do": "sync", "revision": "$B"},
            {"do": "generate"},
            {"do": "sync", "revision": "no-such-revision"},
            {"do": "generate"},
            {
                "do": "replace",
                "target": sidecar.target,
                "model": MODEL,
                "dir": str(checkpoints.c),
                "storage": str(checkpoints.root / MODEL),
                "name": "$C",
            },
            {"do": "sync", "revision": "$C"},
            {"do": "generate"},
        ]
        extra = {"target": sidecar.target, "model": MODEL}
        engine = {"model_path": str(checkpoints.config), "load_format": "weightstream"}
        session = engine_session(engine | {"model_loader_extra_config": extra}, steps, tmp_path)
        served = int(sidecar.get("/status").json()["bytes_served_total"])

    assert session.tokens(0) == tokens_a, "load_format=weightstream must generate what SGLang's own loader does"
    assert len(session.loaded_lines) == 1 and f"{total} bytes" in session.loaded_lines[0], session.loaded_lines
    assert "transport tcp" in session.loaded_lines[0], "the first load goes over the data port"
    assert session.tokens(3) == tokens_b, "after sync_weights to B: a fresh engine on B's files"
    failed = session.steps[4]
    assert not failed["ok"] and "no-such-revision" in failed["error"], failed
    assert "still serves" in failed["error"], failed
    assert session.tokens(5) == tokens_b, "a failed update leaves the engine serving what it held"
    assert session.tokens(8) == tokens_c, "after the storage revision: SGLang's own update to C's files"
    updates = session.updated_lines
    assert len(updates) == 2, updates
    assert f"{len(CHANGED_B)} tensors" in updates[0], updates
    # C changed q_proj, fused with k_proj and v_proj into qkv_proj, which SGLang's loader writes part
    # by part and does not process after loading (float32, no quantization): q_proj travels alone, and
    # the tokens above show the fused parameter holds C.
    assert f"{len(CHANGED_C)} tensors" in updates[1], updates
    # The sidecar sent the engine the whole model once, then only the changed tensors: within 10%.
    changed = _bytes(state_b, CHANGED_B) + _bytes(state_b, CHANGED_C)
    update_sent = served - total
    assert changed <= update_sent <= 1.1 * changed, (update_sent, changed, total)


def test_launch_server_pulls_each_revision_told_by_weightstream_update_sglang(
    references: tuple[Session, Session, Session, Session], checkpoints: Checkpoints, tmp_path: Path
) -> None:
    own_a, fresh_b, _, _ = references
    root = tmp_path / "root"
    shutil.copytree(checkpoints.a, root / MODEL)
    with (
        running(root, allow_publish=True, watch_interval=0.5) as server,
        serving_sglang(checkpoints.config, server.target, MODEL, tmp_path / "launch_server.log") as base,
        httpx.Client(trust_env=False) as http,
    ):
        before = served_tokens(http, base)
        sent_before = int(server.get("/status").json()["bytes_served_total"])
        follow = subprocess.Popen(
            [*weightstream_cmd(), "update", MODEL, "--target", server.target, "--sglang", base, *FOLLOW_TWO],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        try:
            assert follow.stdout is not None
            first = json.loads(follow.stdout.readline() or "null")
            assert first is not None, follow.stderr.read() if follow.stderr else ""
            with WeightStreamClient(server.target, progress=False) as trainer:
                revision = trainer.publish(MODEL, _state(checkpoints.b))
            second = json.loads(follow.stdout.readline() or "null")
            assert second is not None, follow.stderr.read() if follow.stderr else ""
            assert follow.wait(timeout=120) == 0, follow.stderr.read() if follow.stderr else ""
        finally:
            follow.kill()
        sent = int(server.get("/status").json()["bytes_served_total"]) - sent_before
        info = http.get(f"{base}/model_info", timeout=10.0).json()
        after = served_tokens(http, base)
    assert before == own_a.tokens(0)
    assert (second["revision"], second["since"], second["sglang"]) == (revision, first["revision"], base)
    assert info["weight_version"] == revision and info["model_path"] == str(checkpoints.config), info
    assert after == fresh_b.tokens(0), "launch_server updated over HTTP must generate what a fresh engine on B does"
    changed = _bytes(_state(checkpoints.b), CHANGED_B)
    assert changed <= sent <= 1.1 * changed, (sent, changed)


def test_an_engine_keeping_a_host_copy_takes_a_published_revision_as_deltas(
    references: tuple[Session, Session, Session, Session], checkpoints: Checkpoints
) -> None:
    own_a, _, deltas, fresh_d = references
    assert deltas.tokens(0) == own_a.tokens(0), "deltas: the first load generates what SGLang's own loader does"
    assert fresh_d.tokens(0) != own_a.tokens(0), "D changes the tokens"
    assert deltas.tokens(3) == fresh_d.tokens(0), "deltas: after sync_weights to D, a fresh engine on D's files"
    # The host copy's second pull is the update: D's changed chunks as XOR deltas against A, none whole.
    copies = [m.groupdict() for m in _HOST_COPY.finditer(deltas.log)]
    assert len(copies) == 2, copies
    update = copies[1]
    changed = _bytes(_state(checkpoints.d), CHANGED_B)
    assert int(update["chunks"]) > 0 and int(update["fell_back"]) == 0, update
    assert 0 < int(update["changed"]) <= changed, (update, changed)
    assert 0 < int(update["delta_bytes"]) < changed / 2, (update, changed)
    assert [line for line in deltas.updated_lines if f"{len(CHANGED_B)} tensors" in line], deltas.updated_lines
