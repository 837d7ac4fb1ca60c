"""Checkpoints the tests write (shared ones, small ones, broken ones) and the checks of what was read back.

Files are real safetensors files, written with safetensors or, for broken ones, byte by byte;
comparisons are of bytes (or SHA-256 digests of them), never of values.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from collections.abc import Callable, Iterable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from weightstream.client.sharding import ShardSpec
from weightstream.samples import save_sharded

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
SMALL_TENSORS = 3000
BIG_BYTES = 25 * 1024 * 1024


def write_raw_safetensors(path: Path, header: dict[str, object], data: bytes) -> None:
    """Write a safetensors file with exactly this header and data section, valid or not."""
    encoded = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def llama_config() -> transformers.LlamaConfig:
    """A tiny Llama (head size 16), built offline from this config with random weights."""
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def write_tiny_llama(folder: Path, seed: int = 1234) -> None:
    """A random tiny Llama saved as 3 safetensors shards with an index."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    save_sharded({k: v.contiguous() for k, v in model.state_dict().items()}, folder, shards=3)


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in folder, read locally with safetensors."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns of dtype (NaNs and all), so comparisons are of bytes, not values."""
    count = 1
    for d in shape:
        count *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=generator, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (count * itemsize,), generator=generator, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def write_many_dtypes(folder: Path) -> dict[str, torch.Tensor]:
    """Over 300 MB in 3 files: 20 big tensors and 3000 small ones of every dtype, 0-dim and zero-size included."""
    generator = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    state: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(DTYPES * 2):
        itemsize = torch.empty((), dtype=dtype).element_size()
        rows = BIG_BYTES // itemsize // 1024 - i  # uneven sizes, so chunk boundaries vary
        state[f"big.{i}.{str(dtype).removeprefix('torch.')}"] = random_tensor((rows, 1024), dtype, generator)
    for i in range(SMALL_TENSORS):
        dtype = DTYPES[i % len(DTYPES)]
        kind = i % 7
        shape: tuple[int, ...]
        if kind == 0:
            shape = ()
        elif kind == 1:
            shape = (0,)
        elif kind == 2:
            shape = (3, 0, 2)
        else:
            shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        state[f"layers.{i // 10}.t{i % 10}"] = random_tensor(shape, dtype, generator)
    folder.mkdir(parents=True)
    names = list(state)
    rng.shuffle(names)
    for part in range(3):
        subset = names[part::3]
        save_file({n: state[n] for n in subset}, str(folder / f"part-{part}.safetensors"))
    return state


def assert_bytes_identical(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        other = got[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert torch.equal(other.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def expected_piece(full: torch.Tensor, spec: ShardSpec, name: str) -> torch.Tensor:
    dim = spec.dim_for(name)
    if dim is None:
        return full
    part = full.shape[dim] // spec.world_size
    return full.narrow(dim, spec.rank * part, part)


def skeleton(shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> torch.nn.Module:
    """A module tree with a zeroed parameter of each given name and shape (a rank's empty model)."""
    root = torch.nn.Module()
    for name, (shape, dtype) in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
    return root


def write_model(root: Path, name: str, tensors: int, numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A one-file float32 model of tensors tensors of numel elements each, under root/name."""
    generator = torch.Generator().manual_seed(seed)
    state = {f"layer.{i}.weight": torch.randn(numel, generator=generator) for i in range(tensors)}
    (root / name).mkdir(parents=True, exist_ok=True)
    save_file(state, str(root / name / "model.safetensors"))
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (a CPU tensor; made contiguous first)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(flat.numpy())).hexdigest()


def digests(tensors: dict[str, torch.Tensor], threads: int = 2) -> dict[str, str]:
    """tensor_digest of every tensor, on a few threads (hashlib lets go of the GIL on large buffers)."""
    with futures.ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(zip(tensors, pool.map(tensor_digest, tensors.values()), strict=True))


def file_digests(folder: Path) -> dict[str, str]:
    """tensor_digest of every tensor in folder's safetensors files, read from disk."""
    found: dict[str, str] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                found[name] = tensor_digest(f.get_tensor(name))
    return found


def write_pattern_file(path: Path, pattern: bytes, nbytes: int, *, tensors: int = 1, prefix: str = "t") -> None:
    """A safetensors file of `tensors` U8 tensors "{prefix}.{i}" sharing nbytes, every byte from pattern repeated.

    Files written with the same tensors, nbytes and length of prefix have headers of the same length and
    the same data offsets, so that one can stand in for another on disk byte for byte.
    """
    each = nbytes // tensors
    header: dict[str, object] = {}
    for i in range(tensors):
        header[f"{prefix}.{i}"] = {"dtype": "U8", "shape": [each], "data_offsets": [i * each, (i + 1) * each]}
    data = (pattern * (each * tensors // len(pattern) + 1))[: each * tensors]
    write_raw_safetensors(path, header, data)


def received(
    responses: Iterable[Any], between: Callable[[], None] | None = None
) -> tuple[grpc.StatusCode, dict[str, bytes]]:
    """How a StreamTensors or ReadModelFile response stream ended, and the bytes it sent, placed by offset.

    Bytes are keyed by tensor name ("" for a file read). between, if given, runs once the first
    message has arrived, while the rest is still to come (a client that reads slowly holds the
    server back by flow control).
    """
    placed: dict[str, bytearray] = {}
    code = grpc.StatusCode.OK
    try:
        for index, response in enumerate(responses):
            for chunk in response.chunks if hasattr(response, "chunks") else [response]:
                buffer = placed.setdefault(getattr(chunk, "tensor", ""), bytearray())
                end = chunk.offset + len(chunk.data)
                if len(buffer) < end:
                    buffer.extend(bytes(end - len(buffer)))
                buffer[chunk.offset : end] = chunk.data
            if index == 0 and between is not None:
                between()
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    return code, {name: bytes(data) for name, data in placed.items()}


def pattern_tensors(path: Path) -> dict[str, bytes]:
    """The bytes of each tensor of a file written by write_pattern_file, by name, read from disk."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    return {name: data[entry["data_offsets"][0] : entry["data_offsets"][1]] for name, entry in header.items()}
