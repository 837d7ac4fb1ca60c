"""Revisions from the client's side: publishing a trainer's tensors, asking what changed, watching a model.

publish_start and publish_chunks turn (name, tensor) pairs into a publish: the announcement, then
each tensor's bytes in chunks of chunk_bytes with their CRC32C (publish_requests frames them for
gRPC, transports/tcp_publish for the data port). Tensors on a device are copied to host memory one
at a time, as they are sent, so a publish holds one tensor's host copy at most. Against a delta
base (a publish's host copies of what it published last), a chunk that did not change is not sent
and one that did goes as an XOR delta where that is smaller (weightstream.protocol.deltas).
unchanged_ranges turns a GetChanges answer into what an update asks for: the
tensors that changed and, for those written straight into their targets, the ranges that did not
(already landed: the load asks only for the rest, once unchanged.py checked them).
"""

from __future__ import annotations

import os
import statistics
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from weightstream.client.manifest import TensorInfo
from weightstream.protocol import deltas as delta_forms
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
    # Fleet fan-out (a watch with peer_port): "HOST:PORT" of the peer to take this published revision's
    # blocks from; "": from the server watched.
    peer: str = ""


@dataclass(frozen=True)
class Changes:
    """What changed between two revisions: per tensor, None for all of it, else its changed byte ranges.

    blocks: the new revision's CRC32C of each block_bytes block of the tensors not changed whole, by
    name (as the server sent them: unchecked until a tensor's size is known, unchanged.check_crcs).
    """

    model: str
    since: str
    revision: str
    tensors: dict[str, list[tuple[int, int]] | None]
    changed_bytes: int
    removed: tuple[str, ...]
    block_bytes: int = 0
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)


def changes_from_proto(response: pb.GetChangesResponse) -> Changes:
    tensors: dict[str, list[tuple[int, int]] | None] = {}
    for t in response.tensors:
        tensors[t.name] = None if t.whole else [(r.start, r.end) for r in t.ranges]
    return Changes(
        response.model,
        response.since,
        response.revision,
        tensors,
        response.changed_bytes,
        tuple(response.removed),
        response.block_bytes,
        {b.name: tuple(b.crc32c) for b in response.blocks},
    )


def event_from_proto(response: pb.WatchModelResponse) -> RevisionEvent:
    return RevisionEvent(
        response.model, response.revision, response.origin, response.total_bytes, tuple(response.kept), response.peer
    )


@dataclass(frozen=True)
class OutChunk:
    """A chunk of a publish: length bytes of tensor from offset with their CRC32C, and what carries them:
    the bytes themselves (encoding 0) or a delta against the publish's base."""

    tensor: str
    offset: int
    length: int
    crc32c: int
    encoding: int
    payload: memoryview


def publish_start(
    model: str,
    tensors: list[tuple[str, torch.Tensor]],
    *,
    revision: str,
    part: int,
    parts: int,
    new_layout: bool,
    delta_base: str = "",
) -> pb.PublishStart:
    """The announcement of one publish of tensors (one part of parts)."""
    start = pb.PublishStart(
        model=model, revision=revision, part=part, parts=parts, new_layout=new_layout, delta_base=delta_base
    )
    for name, tensor in tensors:
        start.tensors.append(pb.PublishedTensor(name=name, dtype=wire_dtype(name, tensor), shape=list(tensor.shape)))
    return start


# The encoder threads' name prefix (a generator closed on one of them does not wait for it).
ENCODER_PREFIX = "weightstream-publish"
# Threads that find and encode a delta publish's changed chunks (XOR, scan, zstd: each releases the
# interpreter's lock for most of its work), and the chunks they may work ahead of the sender.
ENCODER_THREADS = max(2, min(4, (os.cpu_count() or 2) // 2))
ENCODE_AHEAD = 2 * ENCODER_THREADS


def publish_chunks(
    tensors: list[tuple[str, torch.Tensor]],
    chunk_bytes: int,
    base: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[OutChunk]:
    """The chunks of tensors, in order, each payload valid until the next chunk is taken. With base (host
    copies of the delta base's tensors, by name), a tensor base holds with the same dtype and shape goes
    as what changed: chunks equal to the base's are skipped, the others sent as deltas where that is
    smaller, found on ENCODER_THREADS threads up to ENCODE_AHEAD chunks ahead;
    and base's copies are brought up to the chunks' bytes as they go (once the chunks are all taken,
    base's copies of those tensors hold tensors; taken in part, they hold some of each: HeldPublish.after)."""
    pieces = _pieces(tensors, chunk_bytes, base)
    if base is None:
        for name, offset, piece, _ in pieces:
            length = piece.numel()
            yield OutChunk(name, offset, length, wire.crc32c_at(piece.data_ptr(), length), 0, _bytes_view(piece))
        return
    local = threading.local()

    def encoded(job: _Piece) -> OutChunk | None:
        codec = getattr(local, "codec", None)
        if codec is None:
            codec = local.codec = delta_forms.Codec()
            local.scratch = np.empty(chunk_bytes, dtype=np.uint8)
        return _delta_chunk(job, codec, local.scratch)

    pool = ThreadPoolExecutor(ENCODER_THREADS, thread_name_prefix=ENCODER_PREFIX)
    ahead: deque[Future[OutChunk | None]] = deque()
    try:
        for job in pieces:
            ahead.append(pool.submit(encoded, job))
            if len(ahead) >= ENCODE_AHEAD and (chunk := ahead.popleft().result()) is not None:
                yield chunk
        while ahead:
            if (chunk := ahead.popleft().result()) is not None:
                yield chunk
    finally:
        # An abandoned generator may be closed by the garbage collector on one of the pool's own
        # threads, which cannot wait for itself: the encodes still running then end on their own.
        own = threading.current_thread().name.startswith(ENCODER_PREFIX)
        pool.shutdown(wait=not own, cancel_futures=True)


# A chunk to publish: its tensor, offset, bytes (a flat uint8 host view) and the base's bytes there (or None).
_Piece = tuple[str, int, torch.Tensor, "torch.Tensor | None"]


def _pieces(
    tensors: list[tuple[str, torch.Tensor]], chunk_bytes: int, base: Mapping[str, torch.Tensor] | None
) -> Iterator[_Piece]:
    for name, tensor in tensors:
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")
        if not host.numel():
            continue
        data = host.contiguous().view(-1).view(torch.uint8)
        held = base.get(name) if base is not None else None
        old = held.view(-1).view(torch.uint8) if held is not None and _same_layout(held, tensor) else None
        for offset in range(0, data.numel(), chunk_bytes):
            piece = data[offset : offset + chunk_bytes]
            yield name, offset, piece, old[offset : offset + chunk_bytes] if old is not None else None


def _delta_chunk(job: _Piece, codec: delta_forms.Codec, scratch: np.ndarray) -> OutChunk | None:
    """The chunk as what changed against the base (None: unchanged), or whole where that is cheaper; the
    base's copy then holds the chunk's bytes. numpy, not torch: torch's thread pool, woken per chunk,
    costs more than the work here. scratch: this thread's buffer of a chunk's size."""
    name, offset, piece, was = job
    length = piece.numel()
    if was is None:
        return OutChunk(name, offset, length, wire.crc32c_at(piece.data_ptr(), length), 0, _bytes_view(piece))
    new, old = piece.numpy(), was.numpy()
    delta = None
    if not delta_forms.dense(piece, was):
        where = delta_forms.changed_words(new, old, offset)
        if not where.size:
            return None  # unchanged: the server keeps the base's bytes
        delta = codec.encode_between(new, old, where, offset, scratch)
    # The base's copy takes the chunk's bytes, checksummed as they land: one pass for both.
    crc = wire.copy_crc32c(was.data_ptr(), piece.data_ptr(), length)
    if delta is not None:
        return OutChunk(name, offset, length, crc, delta[0], memoryview(delta[1]))
    return OutChunk(name, offset, length, crc, 0, _bytes_view(piece))


# deltas="auto": the slower way of sending a publish's changed chunks is measured again after this many
# publishes the faster way, times how many times slower it was (at most SEND_RETRY_MOST times). The
# faster way is judged by the median of its last SEND_SAMPLES times per byte (one publish slowed by a
# busy host does not turn the choice), the slower by its last measurement.
SEND_RETRY = 8
SEND_RETRY_MOST = 8
SEND_SAMPLES = 5


@dataclass
class SendChoice:
    """deltas="auto": whether a publish against a delta base sends what changed as XOR deltas or
    every chunk whole, whichever took less time per byte: the way in use by the median of its last
    SEND_SAMPLES publishes, the other by its last measurement. Which is faster depends on the link
    and the cores: on a fast link with few cores, sending everything costs less than finding and
    encoding what changed; on a slow link, deltas win by far. The first publish against a base
    encodes, the next sends whole, then the faster goes on; the slower is measured again now and
    then (the more it lost by, the less often). A publish sent whole needs no host copy: the
    publisher keeps one only for a publish that encodes next (HeldPublish.current)."""

    # Each way's last SEND_SAMPLES times per byte, oldest first.
    samples: dict[bool, deque[float]] = field(default_factory=dict)
    # Publishes the faster way since the slower one was last measured.
    since_other: int = 0

    @property
    def seconds_per_byte(self) -> dict[bool, float]:
        """Each measured way's median time per byte."""
        return {way: statistics.median(times) for way, times in self.samples.items()}

    def encode(self) -> bool:
        """Whether the next publish encodes its changed chunks as deltas."""
        known = self.seconds_per_byte
        if True not in known or False not in known:
            return True not in known
        faster = known[True] <= known[False]
        slower_by = known[not faster] / max(known[faster], 1e-12)
        if self.since_other >= SEND_RETRY * min(slower_by, SEND_RETRY_MOST):
            return not faster
        return faster

    def record(self, encoded: bool, seconds: float, nbytes: int) -> None:
        """A publish against a base took seconds for nbytes, encoding its changed chunks or not."""
        known = self.seconds_per_byte
        usual = True not in known or False not in known or (known[True] <= known[False]) == encoded
        self.since_other = self.since_other + 1 if usual and len(known) == 2 else 0
        samples = self.samples.setdefault(encoded, deque(maxlen=SEND_SAMPLES))
        if not usual:
            samples.clear()  # the slower way measured again: its older times say nothing of it now
        samples.append(seconds / max(nbytes, 1))


def publish_requests(start: pb.PublishStart, chunks: Iterator[OutChunk]) -> Iterator[pb.PublishRequest]:
    """The messages of one publish over gRPC: start, each chunk, then commit."""
    yield pb.PublishRequest(start=start)
    for c in chunks:
        yield pb.PublishRequest(chunks=[chunk_message(c)])
    yield pb.PublishRequest(commit=True)


def chunk_message(c: OutChunk) -> pb.TensorChunk:
    """The PublishRequest chunk that carries c."""
    return pb.TensorChunk(
        tensor=c.tensor,
        offset=c.offset,
        length=c.length,
        crc32c=c.crc32c,
        encoding=c.encoding,  # type: ignore[arg-type]
        encoded_length=len(c.payload) if c.encoding else 0,
        data=bytes(c.payload),
    )


@dataclass(frozen=True)
class HeldPublish:
    """What a client published last of a model (one part): the revision, and host copies of its tensors.

    current: the copies hold revision's bytes. Not current after a publish deltas="auto" sent whole
    with no encoding publish next: the next publish goes whole against revision (the server starts
    it from there, and keeps its chunks as sent whole); the copies' memory is reused by after()."""

    revision: str
    tensors: dict[str, torch.Tensor]
    current: bool = True

    @classmethod
    def after(
        cls, held: HeldPublish | None, revision: str, tensors: list[tuple[str, torch.Tensor]], *, synced: bool = False
    ) -> HeldPublish:
        """The copies once revision (tensors) is published: held's updated in place where the layout is the
        same. synced: the publish sent what changed against held, whose copies publish_chunks brought up
        to date already (those of the same layout are not copied again)."""
        copies = held.tensors if held is not None else {}
        synced = synced and held is not None and held.current
        kept: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            copy = copies.get(name)
            if copy is None or not _same_layout(copy, tensor):
                copy = torch.empty(tensor.shape, dtype=tensor.dtype)
            elif synced:
                kept[name] = copy
                continue
            copy.copy_(tensor.detach())
            kept[name] = copy
        return cls(revision, kept)


def _same_layout(held: torch.Tensor, tensor: torch.Tensor) -> bool:
    return held.dtype == tensor.dtype and held.shape == tensor.shape and held.is_contiguous()


def _bytes_view(piece: torch.Tensor) -> memoryview:
    """A contiguous uint8 host tensor's bytes, without a copy (valid while the tensor is)."""
    return wire.memory_at(piece.data_ptr(), piece.numel())


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
    start = run_start(info, full)
    if start is None:
        return None if changed else [(0, info.nbytes)]
    end = start + info.nbytes
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


def run_start(info: TensorInfo, full: TensorInfo) -> int | None:
    """Where info's bytes (a tensor, or the slice of full a rank holds) begin in full's, when they are one
    run of them (the whole tensor, or a slice along dim 0); None for a slice along another dimension."""
    if info.slice is None:
        return 0
    if info.slice.dim == 0 and full.shape:
        row = full.nbytes // full.shape[0] if full.shape[0] else 0
        return info.slice.start * row
    return None


def changed_bytes(info: TensorInfo, unchanged: list[tuple[int, int]] | None) -> int:
    return info.nbytes - sum(e - s for s, e in unchanged or [])
