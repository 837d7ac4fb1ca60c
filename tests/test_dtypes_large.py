"""A checkpoint of over 300 MB with thousands of tensors of every dtype, 0-dim and zero-size ones included."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightstream.client import WeightStreamClient

MODEL = "many-dtypes"
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


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns of dtype (NaNs and all), so comparisons are of bytes, not values."""
    count = 1
    for d in shape:
        count *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=generator, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (count * itemsize,), generator=generator, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.fixture(scope="module")
def checkpoint(model_root: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    state: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(DTYPES * 2):
        itemsize = torch.empty((), dtype=dtype).element_size()
        rows = BIG_BYTES // itemsize // 1024 - i  # uneven sizes, so chunk boundaries vary
        state[f"big.{i}.{str(dtype).removeprefix('torch.')}"] = _random((rows, 1024), dtype, generator)
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
        state[f"layers.{i // 10}.t{i % 10}"] = _random(shape, dtype, generator)
    folder = model_root / MODEL
    folder.mkdir()
    names = list(state)
    rng.shuffle(names)
    for part in range(3):
        subset = names[part::3]
        save_file({n: state[n] for n in subset}, str(folder / f"part-{part}.safetensors"))
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert total > 300 * 1000 * 1000
    return state


def _assert_identical(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        other = got[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert torch.equal(other.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_manifest_describes_every_tensor(checkpoint: dict[str, torch.Tensor], client: WeightStreamClient) -> None:
    manifest = client.manifest(MODEL)
    assert len(manifest) == len(checkpoint) > 3000
    for name, tensor in checkpoint.items():
        info = manifest[name]
        assert (info.dtype, info.shape, info.nbytes) == (
            tensor.dtype,
            tuple(tensor.shape),
            tensor.numel() * tensor.element_size(),
        )
    assert {manifest[n].dtype for n in checkpoint} == set(DTYPES)


def test_load_state_dict_is_bit_identical(checkpoint: dict[str, torch.Tensor], client: WeightStreamClient) -> None:
    _assert_identical(checkpoint, client.load_state_dict(MODEL))


def test_iter_tensors_is_bit_identical(checkpoint: dict[str, torch.Tensor], client: WeightStreamClient) -> None:
    got = {}
    for name, tensor in client.iter_tensors(MODEL):
        assert name not in got, f"{name} yielded twice"
        got[name] = tensor
    _assert_identical(checkpoint, got)


def test_subset_with_small_chunks(checkpoint: dict[str, torch.Tensor], target: str) -> None:
    names = [n for n in checkpoint if n.startswith("big.1.") or n.startswith("layers.3.")]
    with WeightStreamClient(target, chunk_bytes=64 * 1024, progress=False) as client:
        got = dict(client.iter_tensors(MODEL, names=names))
    _assert_identical({n: checkpoint[n] for n in names}, got)
