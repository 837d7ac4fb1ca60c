"""The engine-neutral pieces of the vLLM and SGLang integrations, without an engine: the loader settings,
the layout and slice checks that stop a misfit checkpoint, SGLang's update format, and the HTTP client of
an SGLang server that is not there."""

from __future__ import annotations

import pytest
import torch

from tests.support.ports import free_ports
from weightstream.client.engine_loads import check_slices
from weightstream.client.engine_updates import LATEST, check_layout, fused_with
from weightstream.client.errors import IncompatibleModuleError
from weightstream.client.loader_plan import LoadPlan, WriteTarget
from weightstream.client.loader_settings import LoaderSettings
from weightstream.client.manifest import Manifest, TensorInfo
from weightstream.client.sglang import SglangServer, SglangUpdateError, revision_of_format, update_format
from weightstream.protocol.wire import TensorSlice


def _manifest(shapes: dict[str, tuple[int, ...]]) -> Manifest:
    tensors = tuple(
        TensorInfo(name, torch.float32, shape, 4 * int(torch.Size(shape).numel()), "m.safetensors")
        for name, shape in shapes.items()
    )
    return Manifest(
        "m", "r1", sum(t.nbytes for t in tensors), tensors, ("m.safetensors",), {t.name: t for t in tensors}
    )


def test_retry_deadline_is_read_and_checked() -> None:
    assert LoaderSettings.resolve({"target": "a:1"}, "/x", environ={}).retry_deadline == 300.0
    assert LoaderSettings.resolve({"target": "a:1", "retry_deadline": 2}, "/x", environ={}).retry_deadline == 2.0
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match=r"retry_deadline'\] must be a positive number"):
            LoaderSettings.resolve({"target": "a:1", "retry_deadline": bad}, "/x", environ={})


def test_a_revision_whose_layout_differs_is_refused_naming_each_tensor() -> None:
    manifest = _manifest({"a": (4, 4), "b": (2,), "new": (1,)})
    layout = {"a": (torch.float32, (4, 8)), "b": (torch.float32, (2,)), "gone": (torch.float32, (3,))}
    with pytest.raises(IncompatibleModuleError) as raised:
        check_layout(manifest.tensors, layout, "m", "r2")
    message = str(raised.value)
    assert "revision r2 of m does not fit the engine's model: 3 tensors differ" in message, message
    assert "a is torch.float32 [4, 4], the engine's is torch.float32 [4, 8]" in message
    assert "new is new" in message and "gone is gone" in message
    check_layout(manifest.tensors, {t.name: (t.dtype, t.shape) for t in manifest.tensors}, "m", "r2")


def test_a_checkpoint_wider_than_the_parameters_is_refused_at_each_tensor_parallel_size() -> None:
    manifest = _manifest({"down": (8, 12), "kv": (4, 8), "embed": (10, 8)})
    view = torch.empty(1)
    plan = LoadPlan(
        targets={
            "down": WriteTarget(TensorSlice(dim=1, start=0, stop=4), (view,)),  # rank 0 of 2 takes 4 of 12
            "kv": WriteTarget(TensorSlice(dim=0, start=0, stop=4), (view,)),  # replicated: all of it
            "embed": WriteTarget(TensorSlice(dim=0, start=0, stop=6), (view,)),  # padded vocabulary: 6 + 6 >= 10
        }
    )
    with pytest.raises(IncompatibleModuleError, match=r"1 tensors are larger than its parameters at tensor-parallel"):
        check_slices(manifest, plan, 2)
    check_slices(manifest, plan, 3)  # 3 ranks of 4 columns cover all 12


def test_fused_parts_travel_together() -> None:
    names = [f"l.0.attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert fused_with(["l.0.attn.k_proj.weight"], names, packed) == names[:3]
    assert fused_with(["l.0.attn.o_proj.weight"], names, packed) == names[3:]


def test_sglang_update_format_carries_the_revision() -> None:
    assert update_format("r-7") == "weightstream:r-7"
    assert revision_of_format("weightstream:r-7") == "r-7"
    assert revision_of_format("WeightStream") == LATEST
    assert revision_of_format("safetensors") is None and revision_of_format("auto") is None
    for bad in ("", "a b", None):
        with pytest.raises(ValueError, match="revision must be a revision name"):
            update_format(bad)  # type: ignore[arg-type]


def test_an_sglang_server_that_is_not_there_is_named_in_the_error() -> None:
    (port,) = free_ports(1)
    server = SglangServer(f"http://127.0.0.1:{port}/", timeout=5.0)
    with pytest.raises(SglangUpdateError, match=rf"http://127.0.0.1:{port}/model_info: .*launch_server"):
        server.pull("r1")
