"""plan_loads() and load_targets(): an engine's own loader, dry-run over placeholders, then only its bytes streamed.

The module here is tests.support.rank_model.RankModel, a plain torch module whose load_weights
does what vLLM's weight loaders do, plus loaders that do more than that, which must fall back. The
real vLLM engine runs in test_vllm.py; this checks the planner against every kind of loader, and the bytes against the
loader's own result on real tensors, over a real server on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.rank_model import FALLBACK, HIDDEN, RankModel, rank_checkpoint
from tests.support.servers import loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream.client.loader_plan import plan_loads
from weightstream.client.manifest import Manifest
from weightstream.protocol.wire import TensorSlice
from weightstream_server import WeightStreamServer


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WeightStreamServer, Path]]:
    root = tmp_path_factory.mktemp("plan-models")
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        (root / name).mkdir()
        save_file(rank_checkpoint(dtype), str(root / name / "model.safetensors"))
    with serving(loopback_settings(model_root=root)) as server:
        yield server, root


def _load(server: WeightStreamServer, model: str, module: RankModel) -> tuple[set[str], int]:
    """Plan, stream the targets, hand the fallbacks to the loader: the loaded names and bytes sent."""
    with WeightStreamClient(f"127.0.0.1:{server.port}", progress=False) as client:
        manifest = client.manifest(model)
        plan = plan_loads(module.load_weights, module, manifest)
        before = server.stats.snapshot().bytes_served_total
        report = client.load_targets(model, plan.targets, manifest=manifest)
        loaded = plan.loaded | module.load_weights(client.iter_tensors(model, names=plan.fallback))
        sent = server.stats.snapshot().bytes_served_total - before
    # The server sent the targets' slices and the whole fallback tensors, nothing else.
    assert sent == report.bytes + sum(manifest[name].nbytes for name in plan.fallback)
    return loaded, sent


@pytest.mark.parametrize("model", ["f32", "bf16"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_planned_load_writes_what_the_loader_itself_writes(
    served: tuple[WeightStreamServer, Path], model: str, ranks: int
) -> None:
    server, _ = served
    state = rank_checkpoint(torch.float32 if model == "f32" else torch.bfloat16)
    for rank in range(ranks):
        expected = RankModel(rank, ranks)
        assert expected.load_weights(state.items()) == {n for n, _ in expected.named_parameters()}
        got = RankModel(rank, ranks)
        loaded, _ = _load(server, model, got)
        assert loaded == {n for n, _ in got.named_parameters()}
        for name, param in expected.named_parameters():
            assert torch.equal(param, dict(got.named_parameters())[name]), (model, ranks, rank, name)


def test_the_plan_names_slices_views_fallbacks_and_unused_tensors(served: tuple[WeightStreamServer, Path]) -> None:
    server, _ = served
    module = RankModel(1, 2)
    replaced_at = module.replaced.data_ptr()
    with WeightStreamClient(f"127.0.0.1:{server.port}", progress=False) as client:
        plan = plan_loads(module.load_weights, module, client.manifest("bf16"))
    assert plan.unused == ["lm_head"]
    assert set(plan.fallback) == FALLBACK | {"halves"}
    assert "raised RuntimeError" in plan.fallback["scalar"]  # .item() of a placeholder
    assert "computed tensor" in plan.fallback["scaled"]
    assert "strides" in plan.fallback["mixed"]
    assert "not one of the model's parameters" in plan.fallback["replaced"]
    assert "2 different parts" in plan.fallback["halves"]
    assert plan.targets["embed"].slice == TensorSlice(dim=0, start=6, stop=10)
    assert plan.targets["k"].slice == TensorSlice(dim=0, start=4, stop=8)
    assert plan.targets["down"].slice == TensorSlice(dim=1, start=4, stop=8)
    assert plan.targets["norm"].slice is None
    (view,) = plan.targets["k"].views
    assert view.data_ptr() == module.qkv.data_ptr() + 4 * HIDDEN * 4  # the k block of the fused parameter
    # The dry run wrote nothing but the padding's zeros, and replaced no parameter.
    assert torch.equal(module.embed[4:], torch.zeros(2, HIDDEN)) and bool((module.embed[:4] == -1).all())
    # (the replaced parameter is put back: the same memory, still unwritten).
    assert bool((module.qkv == -1).all()) and bool((module.replaced == -1).all())
    assert module.replaced.data_ptr() == replaced_at


def test_each_rank_receives_only_its_part(served: tuple[WeightStreamServer, Path]) -> None:
    """Two ranks together receive the split tensors once and only the fallbacks and replicated ones twice."""
    server, _ = served
    state = rank_checkpoint(torch.float32)
    size = {name: t.numel() * 4 for name, t in state.items()}
    sent = [_load(server, "f32", RankModel(rank, 2))[1] for rank in range(2)]
    twice = sum(size[n] for n in (*FALLBACK, "halves", "norm"))
    once = sum(size[n] for n in ("embed", "q", "k", "v", "down"))
    assert sum(sent) == once + 2 * twice
    assert size["lm_head"] > 0 and sum(sent) < 2 * (sum(size.values()) - size["lm_head"])


def test_a_loader_that_only_narrows_and_copies_is_planned_in_one_call(served: tuple[WeightStreamServer, Path]) -> None:
    """Where no loader raises on a placeholder or copies a computed tensor, one call plans them all; only the
    tensor it gave no copy (unused) is tried alone."""
    server, _ = served
    clean = ("embed", "lm_head", "q", "k", "v", "down", "norm", "halves", "mixed")
    module = RankModel(1, 2)
    calls: list[list[str]] = []

    def counted(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        items = list(weights)
        calls.append([name for name, _ in items])
        return module.load_weights(items)

    with WeightStreamClient(f"127.0.0.1:{server.port}", progress=False) as client:
        full = client.manifest("bf16")
        tensors = tuple(t for t in full.tensors if t.name in clean)
        manifest = Manifest(
            full.model, full.revision, sum(t.nbytes for t in tensors), tensors, full.files, {t.name: t for t in tensors}
        )
        plan = plan_loads(counted, module, manifest)
        assert calls == [[t.name for t in tensors], ["lm_head"]]
        assert plan.unused == ["lm_head"] and set(plan.fallback) == {"halves", "mixed"}
        assert set(plan.targets) == {"embed", "q", "k", "v", "down", "norm"}
        assert plan.targets["down"].slice == TensorSlice(dim=1, start=4, stop=8)
        client.load_targets("bf16", plan.targets)
        module.load_weights(client.iter_tensors("bf16", names=plan.fallback))
    expected = RankModel(1, 2)
    expected.load_weights((n, t) for n, t in rank_checkpoint(torch.bfloat16).items() if n in clean)
    for name, param in expected.named_parameters():
        assert torch.equal(param, dict(module.named_parameters())[name]), name
