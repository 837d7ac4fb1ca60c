"""Tensor-parallel slices: each rank receives only its bytes, straight from the original checkpoint."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.support.checkpoints import expected_piece, llama_config, load_folder, skeleton
from weightstream.client import WeightStreamClient
from weightstream.client.manifest import TensorSlice
from weightstream.client.sharding import LLAMA_RULES, ShardRule, ShardSpec
from weightstream.protocol import framing
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

MODEL = "tiny-llama"


def test_llama_rules_follow_vllm() -> None:
    spec = ShardSpec(0, 2)
    assert spec.dim_for("model.layers.0.self_attn.q_proj.weight") == 0
    assert spec.dim_for("model.layers.0.self_attn.v_proj.bias") == 0
    assert spec.dim_for("model.layers.3.mlp.up_proj.weight") == 0
    assert spec.dim_for("model.layers.0.self_attn.o_proj.weight") == 1
    assert spec.dim_for("model.layers.0.mlp.down_proj.weight") == 1
    assert spec.dim_for("model.layers.0.mlp.down_proj.bias") is None
    assert spec.dim_for("model.embed_tokens.weight") == 0
    assert spec.dim_for("lm_head.weight") == 0
    assert spec.dim_for("model.norm.weight") is None
    assert spec.dim_for("model.layers.0.input_layernorm.weight") is None
    custom = ShardSpec(1, 2, rules=(ShardRule(r"\.experts\.", 1), *LLAMA_RULES))
    assert custom.dim_for("model.layers.0.mlp.experts.w1") == 1
    with pytest.raises(ValueError, match="rank 2"):
        ShardSpec(2, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_receives_exactly_its_slices(tiny_llama_folder: Path, client: WeightStreamClient, world: int) -> None:
    reference = load_folder(tiny_llama_folder)
    whole = sum(t.numel() * t.element_size() for t in reference.values())
    for rank in range(world):
        spec = ShardSpec(rank, world)
        pieces = {name: expected_piece(t, spec, name) for name, t in reference.items()}
        module = skeleton({name: (p.shape, p.dtype) for name, p in pieces.items()})
        report = client.load_into(module, MODEL, shard=spec)
        got = dict(module.named_parameters())
        assert set(got) == set(pieces)
        for name, piece in pieces.items():
            assert torch.equal(got[name], piece), name
        assert report.bytes == sum(p.numel() * p.element_size() for p in pieces.values())
        if world == 4:
            assert report.bytes <= 0.3 * whole, (report.bytes, whole)


def test_rank_of_a_transformers_model_built_for_tp2(tiny_llama_folder: Path, client: WeightStreamClient) -> None:
    """A real LlamaForCausalLM configured as one TP=2 rank (half the heads, MLP and vocabulary) loads in place."""
    config = llama_config()
    config.num_attention_heads //= 2
    config.num_key_value_heads //= 2
    config.intermediate_size //= 2
    config.vocab_size //= 2
    config.head_dim = llama_config().hidden_size // llama_config().num_attention_heads
    model = transformers.LlamaForCausalLM(config).eval()
    reference = load_folder(tiny_llama_folder)
    spec = ShardSpec(1, 2)
    client.load_into(model, MODEL, shard=spec)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected_piece(reference[name], spec, name)), name


def test_uneven_split_names_the_tensor(client: WeightStreamClient, tiny_llama_folder: Path) -> None:
    module = skeleton({"x": (torch.Size([1]), torch.float32)})
    with pytest.raises(ValueError, match=r"does not split evenly into 3 ranks") as caught:
        client.load_into(module, MODEL, shard=ShardSpec(0, 3))
    assert "'model." in str(caught.value) or "'lm_head" in str(caught.value)


@pytest.fixture(scope="module")
def cube(model_root: Path) -> torch.Tensor:
    """model_root/cube: one float32 tensor of shape (6, 40, 4096) (rows of 16 KiB)."""
    tensor = torch.arange(6 * 40 * 4096, dtype=torch.float32).reshape(6, 40, 4096)
    (model_root / "cube").mkdir(exist_ok=True)
    save_file({"cube": tensor, "small": torch.ones(3)}, str(model_root / "cube" / "model.safetensors"))
    return tensor


@pytest.mark.parametrize(
    ("dim", "start", "stop"),
    [(0, 2, 5), (1, 10, 30), (2, 1024, 3072), (2, 0, 1), (1, 39, 40)],
)
def test_iter_tensors_slices_any_dimension(
    client: WeightStreamClient, cube: torch.Tensor, dim: int, start: int, stop: int
) -> None:
    got = dict(client.iter_tensors("cube", slices={"cube": TensorSlice(dim, start, stop)}))
    assert torch.equal(got["cube"], cube.narrow(dim, start, stop - start))
    assert torch.equal(got["small"], torch.ones(3))


def _stream(target: str, request: pb.StreamTensorsRequest) -> bytes:
    with grpc.insecure_channel(target) as channel:
        method = channel.unary_stream(
            "/weightstream.v1.WeightStreamService/StreamTensors",
            request_serializer=pb.StreamTensorsRequest.SerializeToString,
            response_deserializer=None,
        )
        out = bytearray()
        for message in method(request, timeout=30):
            for chunk in framing.decode_response(message):
                assert chunk.offset == len(out)
                out += message[chunk.data_start : chunk.data_start + chunk.data_length]
        return bytes(out)


def test_byte_ranges_count_bytes_of_the_slice(target: str, cube: torch.Tensor) -> None:
    """A resumed slice asks for ranges of the slice's own bytes; a gathered slice may resend whole rows."""
    piece = cube[:, 10:30, :].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    request = pb.StreamTensorsRequest(
        model="cube",
        tensors=[
            pb.TensorRequest(
                name="cube",
                slice=pb.TensorSlice(dim=1, start=10, stop=30),
                ranges=[pb.ByteRange(start=1000, end=len(piece))],
            )
        ],
    )
    got = _stream(target, pb.StreamTensorsRequest(model="cube", tensors=[pb.TensorRequest(name="cube")]))
    assert got == cube.view(torch.uint8).reshape(-1).numpy().tobytes()
    with grpc.insecure_channel(target) as channel:
        method = channel.unary_stream(
            "/weightstream.v1.WeightStreamService/StreamTensors",
            request_serializer=pb.StreamTensorsRequest.SerializeToString,
            response_deserializer=None,
        )
        covered = bytearray(len(piece))
        for message in method(request, timeout=30):
            for chunk in framing.decode_response(message):
                data = message[chunk.data_start : chunk.data_start + chunk.data_length]
                assert data == piece[chunk.offset : chunk.offset + len(data)]
                covered[chunk.offset : chunk.offset + len(data)] = b"\1" * len(data)
        assert all(covered[1000:])


@pytest.mark.parametrize(
    ("slice_", "code", "words"),
    [
        (pb.TensorSlice(dim=3, start=0, stop=1), grpc.StatusCode.INVALID_ARGUMENT, "dimension 3 does not exist"),
        (pb.TensorSlice(dim=1, start=30, stop=41), grpc.StatusCode.OUT_OF_RANGE, "outside 0..40"),
        (pb.TensorSlice(dim=0, start=3, stop=3), grpc.StatusCode.OUT_OF_RANGE, "empty"),
    ],
)
def test_bad_slices_are_refused_with_the_tensor_named(
    target: str, cube: torch.Tensor, slice_: pb.TensorSlice, code: grpc.StatusCode, words: str
) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        request = pb.StreamTensorsRequest(model="cube", tensors=[pb.TensorRequest(name="cube", slice=slice_)])
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.StreamTensors(request, timeout=30))
    assert caught.value.code() == code
    assert "cube" in caught.value.details() and words in caught.value.details()
