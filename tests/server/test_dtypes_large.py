"""A checkpoint of over 300 MB with thousands of tensors of every dtype, 0-dim and zero-size ones included."""

from __future__ import annotations

import pytest
import torch

from tests.support.checkpoints import DTYPES, assert_bytes_identical
from weightstream.client import WeightStreamClient

# The many_dtypes checkpoint: over 300 MB written, then streamed whole several times.
pytestmark = pytest.mark.slow

MODEL = "many-dtypes"


def test_manifest_describes_every_tensor(many_dtypes: dict[str, torch.Tensor], client: WeightStreamClient) -> None:
    manifest = client.manifest(MODEL)
    assert len(manifest) == len(many_dtypes) > 3000
    for name, tensor in many_dtypes.items():
        info = manifest[name]
        assert (info.dtype, info.shape, info.nbytes) == (
            tensor.dtype,
            tuple(tensor.shape),
            tensor.numel() * tensor.element_size(),
        )
    assert {manifest[n].dtype for n in many_dtypes} == set(DTYPES)


def test_load_state_dict_is_bit_identical(many_dtypes: dict[str, torch.Tensor], client: WeightStreamClient) -> None:
    assert_bytes_identical(many_dtypes, client.load_state_dict(MODEL))


def test_iter_tensors_is_bit_identical(many_dtypes: dict[str, torch.Tensor], client: WeightStreamClient) -> None:
    got = {}
    for name, tensor in client.iter_tensors(MODEL):
        assert name not in got, f"{name} yielded twice"
        got[name] = tensor
    assert_bytes_identical(many_dtypes, got)


def test_subset_with_small_chunks(many_dtypes: dict[str, torch.Tensor], target: str) -> None:
    names = [n for n in many_dtypes if n.startswith("big.1.") or n.startswith("layers.3.")]
    with WeightStreamClient(target, chunk_bytes=64 * 1024, progress=False) as client:
        got = dict(client.iter_tensors(MODEL, names=names))
    assert_bytes_identical({n: many_dtypes[n] for n in names}, got)
