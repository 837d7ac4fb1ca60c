"""What a model holds, as the client sees it: names, dtypes, shapes and sizes of its tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weightstream import wire
from weightstream.client.errors import IntegrityError
from weightstream.v1 import weightstream_pb2 as pb


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: str


@dataclass(frozen=True)
class Manifest:
    model: str
    revision: str
    total_bytes: int
    tensors: tuple[TensorInfo, ...]
    files: tuple[str, ...]
    by_name: dict[str, TensorInfo] = field(repr=False, compare=False)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.tensors)


def manifest_from_proto(response: pb.GetManifestResponse) -> Manifest:
    """A Manifest from the wire, checked for consistency so later placement can trust it."""
    files = tuple(f.name for f in response.files)
    tensors = []
    for t in response.tensors:
        dtype = wire.BY_WIRE.get(t.dtype)
        if dtype is None:
            raise IntegrityError(f"model {response.model!r}: tensor {t.name!r} has unknown wire dtype {t.dtype}")
        shape = tuple(int(d) for d in t.shape)
        if wire.numel(shape) * dtype.itemsize != t.nbytes or t.file_index >= len(files):
            raise IntegrityError(f"model {response.model!r}: manifest entry of tensor {t.name!r} is inconsistent")
        tensors.append(TensorInfo(t.name, dtype.torch, shape, t.nbytes, files[t.file_index]))
    by_name = {t.name: t for t in tensors}
    if len(by_name) != len(tensors) or sum(t.nbytes for t in tensors) != response.total_bytes:
        raise IntegrityError(f"model {response.model!r}: manifest is inconsistent (duplicate names or total)")
    return Manifest(response.model, response.revision, response.total_bytes, tuple(tensors), files, by_name)
