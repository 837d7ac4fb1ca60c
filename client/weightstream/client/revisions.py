"""Revisions from the client's side: publishing a trainer's tensors, asking what changed, watching a model.

publish_requests turns (name, tensor) pairs into the PublishTensors messages: the announcement,
then each tensor's bytes in chunks of chunk_bytes with their CRC32C, then commit. Tensors on a
device are copied to host memory one at a time, as they are sent, so a publish holds one tensor's
host copy at most. update_ranges turns a GetChanges answer into what an update asks for: the
tensors that changed and, for those written straight into their targets, the ranges that did not
(already landed: the load asks only for the rest).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from weightstream.client.manifest import TensorInfo
from weightstream.protocol import dtypes, wire
from weightstream.v1 import weightstream_pb2 as pb


@dataclass(frozen=True)
class RevisionEvent:
    """A model's revision as a watch reports it: the current one, then each new one."""

    model: str
    revision: str
    origin: str  # "published" or "storage"
    total_bytes: int
    kept: tuple[str, ...]


@dataclass(frozen=True)
class Changes:
    """What changed between two revisions: per tensor, None for all of it, else its changed byte ranges."""

    model: str
    since: str
    revision: str
    tensors: dict[str, list[tuple[int, int]] | None]
    changed_bytes: int
    removed: tuple[str, ...]


def changes_from_proto(response: pb.GetChangesResponse) -> Changes:
    tensors: dict[str, list[tuple[int, int]] | None] = {}
    for t in response.tensors:
        tensors[t.name] = None if t.whole else [(r.start, r.end) for r in t.ranges]
    return Changes(
        response.model, response.since, response.revision, tensors, response.changed_bytes, tuple(response.removed)
    )


def event_from_proto(response: pb.WatchModelResponse) -> RevisionEvent:
    return RevisionEvent(response.model, response.revision, response.origin, response.total_bytes, tuple(response.kept))


def publish_requests(
    model: str,
    tensors: list[tuple[str, torch.Tensor]],
    *,
    revision: str,
    part: int,
    parts: int,
    new_layout: bool,
    chunk_bytes: int,
) -> Iterator[pb.PublishRequest]:
    """The messages of one publish of tensors (one part of parts), ending with commit."""
    start = pb.PublishStart(model=model, revision=revision, part=part, parts=parts, new_layout=new_layout)
    for name, tensor in tensors:
        start.tensors.append(pb.PublishedTensor(name=name, dtype=wire_dtype(name, tensor), shape=list(tensor.shape)))
    yield pb.PublishRequest(start=start)
    for name, tensor in tensors:
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")
        data = host.contiguous().view(-1).view(torch.uint8).numpy() if host.numel() else None
        if data is None:
            continue
        for offset in range(0, data.size, chunk_bytes):
            piece = data[offset : offset + chunk_bytes].tobytes()
            chunk = pb.TensorChunk(tensor=name, offset=offset, length=len(piece), crc32c=wire.crc32c(piece), data=piece)
            yield pb.PublishRequest(chunks=[chunk])
    yield pb.PublishRequest(commit=True)


def wire_dtype(name: str, tensor: torch.Tensor) -> pb.DataType:
    dtype = dtypes.BY_TORCH.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors equivalent")
    return dtype.wire


def named_list(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """named_tensors as a list of (name, tensor), each name once (references only, no copies)."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    seen: set[str] = set()
    for name, tensor in items:
        if name in seen:
            raise ValueError(f"tensor {name!r} is given twice")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        seen.add(name)
    if not items:
        raise ValueError("nothing to publish: no tensors")
    return items


def unchanged_ranges(
    info: TensorInfo, full: TensorInfo, changed: list[tuple[int, int]] | None
) -> list[tuple[int, int]] | None:
    """The byte ranges of info (a tensor, or the slice of full a rank holds) that did not change; None
    when none is known to be unchanged (all of it is read again).

    changed is in full's bytes. A slice along dim 0 is one run of full's bytes, so its ranges follow;
    other slices are read whole when anything changed.
    """
    if changed is None:
        return None
    if info.slice is None:
        start, length = 0, info.nbytes
    elif info.slice.dim == 0 and full.shape:
        row = full.nbytes // full.shape[0] if full.shape[0] else 0
        start, length = info.slice.start * row, info.nbytes
    else:
        return None if changed else [(0, info.nbytes)]
    end = start + length
    kept: list[tuple[int, int]] = []
    position = start
    for s, e in changed:
        s, e = max(s, start), min(e, end)
        if s >= e:
            continue
        if s > position:
            kept.append((position - start, s - start))
        position = max(position, e)
    if position < end:
        kept.append((position - start, end - start))
    return kept


def changed_bytes(info: TensorInfo, unchanged: list[tuple[int, int]] | None) -> int:
    return info.nbytes - sum(e - s for s, e in unchanged or [])
