"""Tensor-parallel shards: which slice of each tensor one rank of a tensor-parallel load receives.

A ShardSpec names the rank, the world size and the rules that map tensor names to the dimension
they are split along (column-parallel weights along dim 0, row-parallel ones along dim 1) or to
None (replicated: every rank receives the whole tensor). The first rule whose pattern matches a
name (re.search) decides; a name no rule matches is replicated. LLAMA_RULES follows vLLM's Llama:
q/k/v/gate/up projections and their biases column-parallel, o/down projections row-parallel (their
biases replicated), embeddings and the LM head split along the vocabulary, norms replicated.

The server sends only each rank's bytes: for dim 0 a contiguous range, for other dimensions a
gather. A split that does not divide evenly raises ValueError naming the tensor: padding (as vLLM
does for vocabularies) is the engine's business, not the loader's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightstream.client.manifest import Manifest, TensorInfo, TensorSlice


@dataclass(frozen=True)
class ShardRule:
    """Tensors whose name matches pattern (a regular expression, searched) are split along dim (None: whole)."""

    pattern: str
    dim: int | None


LLAMA_RULES: tuple[ShardRule, ...] = (
    ShardRule(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", 0),
    ShardRule(r"\.(o_proj|down_proj)\.weight$", 1),
    ShardRule(r"(^|\.)embed_tokens\.weight$", 0),
    ShardRule(r"(^|\.)lm_head\.weight$", 0),
)


@dataclass(frozen=True)
class ShardSpec:
    """Rank `rank` of a tensor-parallel group of world_size ranks, split by rules (first match wins)."""

    rank: int
    world_size: int
    rules: Sequence[ShardRule] = LLAMA_RULES
    _compiled: tuple[tuple[re.Pattern[str], int | None], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not within a world of {self.world_size}")
        object.__setattr__(self, "_compiled", tuple((re.compile(r.pattern), r.dim) for r in self.rules))

    def dim_for(self, name: str) -> int | None:
        """The dimension name is split along, or None when every rank receives all of it."""
        for pattern, dim in self._compiled:
            if pattern.search(name):
                return dim
        return None

    def slice_for(self, info: TensorInfo) -> TensorSlice | None:
        """This rank's slice of info, or None for a replicated tensor (or a world of one)."""
        dim = self.dim_for(info.name)
        if dim is None or self.world_size == 1:
            return None
        if dim >= len(info.shape):
            raise ValueError(f"tensor {info.name!r} of shape {list(info.shape)} has no dimension {dim} to split")
        size = info.shape[dim]
        if size % self.world_size:
            raise ValueError(
                f"tensor {info.name!r}: dimension {dim} of size {size} does not split evenly "
                f"into {self.world_size} ranks"
            )
        part = size // self.world_size
        return TensorSlice(dim, self.rank * part, (self.rank + 1) * part)

    def slices(self, manifest: Manifest) -> dict[str, TensorSlice]:
        """This rank's slice of every split tensor of manifest."""
        found = {}
        for info in manifest.tensors:
            piece = self.slice_for(info)
            if piece is not None:
                found[info.name] = piece
        return found


def sliced_info(info: TensorInfo, piece: TensorSlice) -> TensorInfo:
    """info as received when only piece of it is asked for: the slice's shape and size."""
    if not 0 <= piece.dim < len(info.shape) or not 0 <= piece.start < piece.stop <= info.shape[piece.dim]:
        raise ValueError(
            f"tensor {info.name!r} of shape {list(info.shape)}: slice [{piece.start}, {piece.stop}) of "
            f"dimension {piece.dim} is empty or out of bounds"
        )
    shape = list(info.shape)
    shape[piece.dim] = piece.stop - piece.start
    nbytes = info.nbytes // info.shape[piece.dim] * shape[piece.dim]
    return TensorInfo(info.name, info.dtype, tuple(shape), nbytes, info.file, piece)


def sliced_manifest(manifest: Manifest, slices: Mapping[str, TensorSlice] | ShardSpec) -> Manifest:
    """manifest with the sliced tensors described as received (slice shapes and sizes)."""
    if isinstance(slices, ShardSpec):
        slices = slices.slices(manifest)
    for name in slices:
        if name not in manifest:
            raise ValueError(f"model {manifest.model!r} has no tensor {name!r} to slice")
    tensors = tuple(sliced_info(t, slices[t.name]) if t.name in slices else t for t in manifest.tensors)
    by_name = {t.name: t for t in tensors}
    total = sum(t.nbytes for t in tensors)
    return Manifest(manifest.model, manifest.revision, total, tensors, manifest.files, by_name)
