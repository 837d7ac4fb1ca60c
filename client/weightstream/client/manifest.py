"""What a model holds, as the client sees it: its tensors (names, dtypes, shapes, sizes) and its files."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from weightstream.client.errors import IntegrityError
from weightstream.protocol import digests, dtypes, wire
from weightstream.protocol.names import FILE_KINDS_BY_WIRE, FileKind
from weightstream.protocol.wire import TensorSlice
from weightstream.v1 import weightstream_pb2 as pb


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as the client receives it; with slice set, shape and nbytes are the slice's."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: str
    slice: TensorSlice | None = None


@dataclass(frozen=True)
class Manifest:
    model: str
    revision: str
    total_bytes: int
    tensors: tuple[TensorInfo, ...]
    files: tuple[str, ...]
    by_name: dict[str, TensorInfo] = field(repr=False, compare=False)
    # The revision's BLAKE3 digest (weightstream.protocol.digests); "" where the server has none yet.
    digest: str = ""

    def digest_of(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """The digest of the bytes tensors hold (by name, every tensor of this manifest, on any device):
        equal to digest only if they are exactly this revision's bytes. Device tensors are copied to
        host memory one at a time to be hashed."""
        hashes = []
        for info in self.tensors:
            tensor = tensors[info.name]
            if tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
                raise ValueError(
                    f"tensor {info.name!r} is {tensor.dtype} {list(tensor.shape)}, not as the manifest says"
                )
            flat = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
            hashes.append(
                (info.name, dtypes.BY_TORCH[info.dtype].safetensors, info.shape, digests.tensor_hash(flat.data))
            )
        return digests.revision_digest(hashes)

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
        dtype = dtypes.BY_WIRE.get(t.dtype)
        if dtype is None:
            raise IntegrityError(f"model {response.model!r}: tensor {t.name!r} has unknown wire dtype {t.dtype}")
        shape = tuple(int(d) for d in t.shape)
        if wire.numel(shape) * dtype.itemsize != t.nbytes or t.file_index >= len(files):
            raise IntegrityError(f"model {response.model!r}: manifest entry of tensor {t.name!r} is inconsistent")
        tensors.append(TensorInfo(t.name, dtype.torch, shape, t.nbytes, files[t.file_index]))
    by_name = {t.name: t for t in tensors}
    if len(by_name) != len(tensors) or sum(t.nbytes for t in tensors) != response.total_bytes:
        raise IntegrityError(f"model {response.model!r}: manifest is inconsistent (duplicate names or total)")
    return Manifest(
        response.model, response.revision, response.total_bytes, tuple(tensors), files, by_name, response.digest
    )


@dataclass(frozen=True)
class ModelFile:
    """One file the server lets a client read whole: a weight file or a companion (config, tokenizer)."""

    name: str
    size: int
    kind: FileKind
    # Changes whenever the content may have (a modification time, an ETag); "" from older servers.
    version: str = ""


@dataclass(frozen=True)
class ModelFileList:
    """The readable files of a model; revision changes when any of them does."""

    model: str
    revision: str
    files: tuple[ModelFile, ...]


def files_from_proto(response: pb.ListModelFilesResponse) -> ModelFileList:
    """A ModelFileList from the wire; a name that is not one plain file name is refused, never written."""
    files = []
    for f in response.files:
        kind = FILE_KINDS_BY_WIRE.get(f.kind)
        if kind is None or not wire.is_plain_file_name(f.name):
            raise IntegrityError(f"model {response.model!r}: the server listed file {f.name[:80]!r} of kind {f.kind}")
        files.append(ModelFile(f.name, f.size_bytes, kind, f.version))
    if len({f.name for f in files}) != len(files):
        raise IntegrityError(f"model {response.model!r}: the server listed a file twice")
    return ModelFileList(response.model, response.revision, tuple(files))
