"""Publishing: a trainer's tensors received over PublishTensors, checked, and held in memory as a revision.

One publish is one call per part: a PublishStart that announces the part's tensors (name, dtype,
shape), then their chunks, each with its CRC32C and in order within its tensor, then commit. The
server allocates the part's memory from the announcement (within --publish-max-bytes, counting the
revisions it keeps and the publish in flight), checks every chunk as it lands (a known tensor, the
next offset, within the announced size, its CRC32C), and takes the part only once every byte of every
tensor arrived. A revision published in several parts (trainer ranks, each its own tensors) is
complete when its last part is; each part's call answers then, so that every rank returns with the
revision current. Until then the model's current revision is untouched: a publisher that dies or
fails midway leaves nothing behind (its part, and the revision's other parts, are dropped).

One revision of a model is published at a time: a second publisher of another revision while one
is in flight is refused ABORTED, naming the one in flight. Unless the publisher says it is a new
layout, the tensors must be those of the model's current revision, with the same dtypes and shapes:
the first one that differs is named.

The revision, once complete, is served like any other (every transport, pinned by its id) from a
PublishedSource: the parts' buffers stand for its files.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightstream.allocator import PopulateAhead
from weightstream.protocol import deltas as delta_forms
from weightstream.protocol import dtypes, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import (
    AccessDenied,
    ClientGone,
    CorruptCheckpoint,
    InvalidRequest,
    ModelNotFound,
    PublishConflict,
    PublishTooLarge,
    RangeOutOfBounds,
    RequestTimeout,
    RevisionNotKept,
    ServerError,
)
from weightstream_server.revisions.persist import upload_in_background, write_in_background
from weightstream_server.revisions.store import PUBLISHED, Blocks, Revision, RevisionStore
from weightstream_server.serving.catalog import Catalog, Manifest, TensorEntry
from weightstream_server.serving.read_plan import ReadPlan
from weightstream_server.storage.model_ids import ObjectLocation, check_model_id
from weightstream_server.storage.sources import ModelFiles, SourceFile

logger = logging.getLogger(__name__)

# Block CRC32Cs are kept per this many bytes of each tensor (what GetChanges compares).
BLOCK_BYTES = 1024 * 1024
# Tensors of a part start on this boundary in its buffer.
ALIGN = 64
# How long the parts of a revision published in several parts may take to all arrive.
ASSEMBLY_TIMEOUT_S = 300.0
PUBLISHED_SCHEME = "published://"
MAX_PARTS = 1024
# What a revision may be named: it is a folder name under --publish-dir, a label in the metrics.
_REVISION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def block_crcs(data: np.ndarray) -> Blocks:
    """The CRC32C of each BLOCK_BYTES of data (flat uint8), the last block shorter."""
    address = int(data.ctypes.data)
    return tuple(
        wire.crc32c_at(address + start, min(BLOCK_BYTES, data.size - start))
        for start in range(0, data.size, BLOCK_BYTES)
    )


@dataclass(frozen=True)
class _Announced:
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # in the part's buffer


@dataclass
class _Part:
    index: int
    tensors: dict[str, _Announced]
    buffer: torch.Tensor
    received: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, Blocks] = field(default_factory=dict)
    # Tensors that start as the delta base's bytes (PublishStart.delta_base), and where each one's
    # chunks have reached: they come in order but may skip what did not change.
    based: dict[str, int] = field(default_factory=dict)


@dataclass
class _Pending:
    """A revision whose parts are arriving."""

    model: str
    name: str
    parts: int
    new_layout: bool
    peer: str
    started: float = field(default_factory=time.monotonic)
    taken: dict[int, _Part] = field(default_factory=dict)
    # Parts whose calls are still receiving.
    receiving: set[int] = field(default_factory=set)
    reserved_bytes: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    revision: Revision | None = None
    failure: str = ""
    # A relayed revision's tensors that lie in a kept revision's memory, shared, not copied.
    shared: dict[str, Shared] = field(default_factory=dict)
    # The revision's tensor order, when the parts do not give it (a relay).
    order: list[str] | None = None


@dataclass(frozen=True)
class Shared:
    """A tensor of a kept published revision that a new one holds too: its buffer, where it lies
    there, and its block CRC32Cs."""

    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    nbytes: int
    buffer: torch.Tensor
    offset: int
    blocks: Blocks


class PublishedSource:
    """The parts' buffers of one published revision, standing for its files: each part is one file."""

    # Its bytes are in memory: streams read them from there, not through the cache.
    in_memory = True

    def __init__(self, model: str, buffers: Sequence[torch.Tensor]) -> None:
        self.model = model
        self._buffers = tuple(buffers)
        # The CRC32C of each chunk served, by (part, offset, length): its bytes never change, and every
        # load and update of the revision sends the same chunks. At most _max_crcs of them.
        self._crcs: dict[tuple[int, int, int], int] = {}
        self._max_crcs = 4 * sum(b.numel() for b in self._buffers) // wire.DEFAULT_CHUNK_BYTES + 1024

    def chunk_crc32c(self, file: SourceFile, offset: int, data: np.ndarray) -> int:
        """The CRC32C of data, the bytes at offset of file (computed once)."""
        key = (_part_of(file), offset, data.size)
        crc = self._crcs.get(key)
        if crc is None:
            crc = wire.crc32c_at(data.ctypes.data, data.size)
            if len(self._crcs) < self._max_crcs:
                self._crcs[key] = crc
        return crc

    def claims(self, model: str) -> bool:
        return False  # reached through the revision store, never by model id

    def describe(self) -> str:
        return "published revisions"

    def public_name(self) -> str:
        return "published"

    def reachable(self) -> bool:
        return True

    def resolve(self, model: str) -> ModelFiles:
        raise ModelNotFound(f"model {model!r}: a published revision has no storage files")

    def companion_files(self, model: str) -> tuple[SourceFile, ...]:
        return ()

    def part_buffer(self, part: int) -> torch.Tensor:
        """The buffer of part (uint8): what --publish-dir writes from."""
        return self._buffers[part]

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        buffer = self._buffers[_part_of(file)]
        return bytes(buffer[start : start + length].numpy())

    def read_units(self, files: Sequence[SourceFile], plan: ReadPlan) -> Iterator[tuple[int, int, torch.Tensor]]:
        for file_id, file_plan in enumerate(plan.files):
            buffer = self._buffers[_part_of(files[file_plan.file_index])]
            for index, (offset, size) in enumerate(zip(file_plan.offsets, file_plan.sizes, strict=True)):
                yield file_id, index, buffer[offset : offset + size]


def _part_of(file: SourceFile) -> int:
    return int(file.path.rpartition("/")[2])


class Publisher:
    """Receives publishes into the revision store. Safe to use from many threads."""

    def __init__(
        self,
        store: RevisionStore,
        catalog: Catalog,
        max_bytes: int,
        message_timeout: float,
        publish_dir: Path | None = None,
        upload: tuple[Any, ObjectLocation] | None = None,
    ) -> None:
        self._store = store
        # Where complete revisions are uploaded (an S3 client and prefix, revisions.persist); None: not.
        self._upload = upload
        # Where complete revisions are written (revisions.persist); None: they live in memory only.
        self._publish_dir = publish_dir
        self._catalog = catalog
        self._max_bytes = max_bytes
        self._message_timeout = message_timeout
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        # Payload bytes publishers sent for the parts taken (what changed only, for a delta publish).
        self.received_bytes = 0

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(p.reserved_bytes for p in self._pending.values())

    def publish(self, start: pb.PublishStart, messages: Iterator[pb.PublishRequest], peer: str) -> pb.PublishResponse:
        """Take one part: announced by start, its chunks from messages; the answer once its revision is complete."""
        part = self.begin(start, peer)
        with part.failing():
            part.receive(messages)
        return part.finish()

    def begin(self, start: pb.PublishStart, peer: str) -> PartInFlight:
        """A part announced by start, checked and its memory held: its bytes are landed next (PartInFlight)."""
        check_model_id(start.model)
        parts = start.parts or 1
        if not 1 <= parts <= MAX_PARTS or start.part >= parts:
            raise InvalidRequest(f"publish of model {start.model!r}: part {start.part} of {parts} is not a part")
        if parts > 1 and not start.revision:
            raise InvalidRequest(
                f"publish of model {start.model!r} in {parts} parts: every part must name the revision"
            )
        if start.revision and not _REVISION_NAME.fullmatch(start.revision):
            raise InvalidRequest(
                f"publish of model {start.model!r}: revision name {start.revision[:200]!r} is not 1 to 128 letters, "
                "digits, '.', '_' and '-', starting with a letter or digit"
            )
        announced = _announced(start)
        total = sum(t.nbytes for t in announced.values())
        total += -total % ALIGN
        self._check_layout(start, announced)
        base = self._delta_base(start)
        pending = self._join(start, parts, total, peer)
        try:
            part = _Part(start.part, announced, torch.empty(max(total, 1), dtype=torch.uint8))
            if base is not None:
                _start_from(part, base)
        except BaseException:
            self._fail(pending, start.part, "")
            raise
        return PartInFlight(self, pending, part, self._message_timeout)

    def _delta_base(self, start: pb.PublishStart) -> Manifest | None:
        """The published revision a part names as its delta base; RevisionNotKept when it is not kept here."""
        if not start.delta_base:
            return None
        kept = self._store.find(start.model, start.delta_base)
        if kept is None or kept.origin != PUBLISHED or not kept.servable:
            names = ", ".join(self._store.kept(start.model)) or "none"
            raise RevisionNotKept(
                f"publish of model {start.model!r}: delta base {start.delta_base[:200]!r} is not a published revision "
                f"this server keeps (it keeps {names}); publish whole instead"
            )
        return kept.manifest

    def relay(
        self,
        start: pb.PublishStart,
        fill: Callable[[dict[str, torch.Tensor]], None],
        peer: str,
        shared: Sequence[Shared] = (),
        order: list[str] | None = None,
    ) -> Revision:
        """Take a revision another server holds: start names it and the tensors to receive (one part),
        whose bytes fill writes into the views it is given, by name; shared are its tensors already
        in the memory of a revision kept here (held by reference, never copied); order is every
        tensor's name in the revision's order. Current once fill returned.

        Held like a publish: within --publish-max-bytes (the new bytes; shared memory is counted
        once), one revision of a model at a time, nothing left behind if fill fails. The layout is
        not checked: the other server checked it.
        """
        announced = _announced(start) if start.tensors else {}
        total = sum(t.nbytes for t in announced.values())
        total += -total % ALIGN
        pending = self._join(start, 1, total, peer)
        pending.shared = {s.name: s for s in shared}
        pending.order = order
        try:
            part = _Part(0, announced, torch.empty(max(total, 1), dtype=torch.uint8))
            with contextlib.closing(_populate_ahead(part.buffer)):
                fill({t.name: _view(part.buffer, t) for t in announced.values()})
            view = part.buffer.numpy()
            for t in announced.values():
                part.blocks[t.name] = block_crcs(view[t.offset : t.offset + t.nbytes])
        except BaseException as exc:
            self._fail(pending, 0, f"the relay from {peer} failed: {exc}")
            raise
        self._take(pending, part)
        if pending.revision is None:
            raise PublishConflict(f"model {start.model!r}: revision {pending.name!r} was not taken: {pending.failure}")
        return pending.revision

    def _check_layout(self, start: pb.PublishStart, announced: dict[str, _Announced]) -> None:
        if start.new_layout:
            return
        current = self._current_manifest(start.model)
        if current is None:
            return  # a new model: any layout
        for name, tensor in announced.items():
            entry = current.by_name.get(name)
            if entry is None:
                raise InvalidRequest(
                    f"publish of model {start.model!r}: tensor {name!r} is not in revision {current.revision}; "
                    "publish with new_layout for another layout"
                )
            if entry.dtype != tensor.dtype or entry.shape != tensor.shape:
                raise InvalidRequest(
                    f"publish of model {start.model!r}: tensor {name!r} is {tensor.dtype.safetensors} "
                    f"{list(tensor.shape)}, revision {current.revision} has {entry.dtype.safetensors} "
                    f"{list(entry.shape)}; publish with new_layout for another layout"
                )
        if (start.parts or 1) == 1 and len(announced) != len(current.tensors):
            missing = next(t.name for t in current.tensors if t.name not in announced)
            raise InvalidRequest(
                f"publish of model {start.model!r}: tensor {missing!r} of revision {current.revision} is missing; "
                "publish every tensor, or with new_layout for another layout"
            )

    def _current_manifest(self, model: str) -> Manifest | None:
        current = self._store.current(model)
        if current is not None:
            return current.manifest
        try:
            return self._catalog.manifest(model)
        except (ModelNotFound, AccessDenied):
            return None  # a model only published here

    def _join(self, start: pb.PublishStart, parts: int, nbytes: int, peer: str) -> _Pending:
        model = start.model
        with self._lock:
            pending = self._pending.get(model)
            if pending is not None and (not start.revision or pending.name != start.revision or pending.parts != parts):
                raise PublishConflict(
                    f"model {model!r}: revision {pending.name or '(unnamed)'!r} is being published by {pending.peer}, "
                    f"started {time.monotonic() - pending.started:.0f} s ago; one publish of a model at a time"
                )
            if pending is not None and (start.part in pending.taken or start.part in pending.receiving):
                raise PublishConflict(f"model {model!r}: part {start.part} of revision {pending.name!r} is being sent")
            if start.revision and self._store.find(model, start.revision) is not None:
                raise PublishConflict(f"model {model!r} has a revision {start.revision!r} already; name another")
            held = self._store.held_bytes() + sum(p.reserved_bytes for p in self._pending.values())
            if held + nbytes > self._max_bytes:
                raise PublishTooLarge(
                    f"publish of model {model!r}: {nbytes} bytes would hold {held + nbytes} bytes of published "
                    f"revisions, over --publish-max-bytes ({self._max_bytes})"
                )
            if pending is None:
                pending = _Pending(model, start.revision, parts, start.new_layout, peer)
                self._pending[model] = pending
            pending.receiving.add(start.part)
            pending.reserved_bytes += nbytes
            return pending

    def _take(self, pending: _Pending, part: _Part) -> None:
        with self._lock:
            pending.receiving.discard(part.index)
            if pending.done.is_set():
                return
            pending.taken[part.index] = part
            if len(pending.taken) < pending.parts:
                return
            try:
                revision = self._assemble(pending)
            except ServerError as exc:
                pending.failure = str(exc)
                self._pending.pop(pending.model, None)
                pending.done.set()
                return
            self._pending.pop(pending.model, None)
            self._store.add_published(revision, time.monotonic() - pending.started)
            pending.revision = revision
            pending.done.set()
        if self._publish_dir is not None:
            write_in_background(self._publish_dir, revision)
        if self._upload is not None:
            upload_in_background(*self._upload, revision)
        logger.info(
            "model %r: published revision %s is current: %d tensors, %d bytes in %d parts, %.3f s, from %s",
            revision.model,
            revision.id,
            len(revision.manifest.tensors),
            revision.manifest.total_bytes,
            pending.parts,
            time.monotonic() - pending.started,
            pending.peer,
        )

    def _fail(self, pending: _Pending, index: int, reason: str) -> None:
        with self._lock:
            pending.receiving.discard(index)
            if pending.done.is_set():
                return
            pending.failure = reason or f"part {index}'s publisher went away"
            self._pending.pop(pending.model, None)
            pending.taken.clear()
            pending.done.set()
        logger.warning("model %r: publish of revision %r dropped: %s", pending.model, pending.name, pending.failure)

    def _assemble(self, pending: _Pending) -> Revision:
        parts = [pending.taken[i] for i in range(pending.parts)]
        by_name: dict[str, tuple[int, _Announced]] = {}
        for part in parts:
            for name, tensor in part.tensors.items():
                if name in by_name:
                    raise PublishConflict(f"tensor {name!r} is in parts {by_name[name][0]} and {part.index}")
                by_name[name] = (part.index, tensor)
        current = None if pending.new_layout else self._current_manifest(pending.model)
        if current is not None and pending.parts > 1:
            missing = [t.name for t in current.tensors if t.name not in by_name]
            if missing:
                raise InvalidRequest(f"tensor {missing[0]!r} of revision {current.revision} is in no part")
        blocks = {name: parts[i].blocks[name] for name, (i, _) in by_name.items()}
        buffers = [p.buffer for p in parts]
        where: dict[int, int] = {}
        for shared in pending.shared.values():
            index = where.setdefault(shared.buffer.data_ptr(), len(buffers))
            if index == len(buffers):
                buffers.append(shared.buffer)
            announced = _Announced(shared.name, shared.dtype, shared.shape, shared.nbytes, shared.offset)
            by_name[shared.name] = (index, announced)
            blocks[shared.name] = shared.blocks
        if pending.order is not None:
            order = pending.order
        else:
            order = [t.name for t in current.tensors] if current is not None else list(by_name)
        name = pending.name or _content_name(order, by_name, blocks)
        files = tuple(
            SourceFile(
                f"published-{name}-part-{index}",
                f"{PUBLISHED_SCHEME}{pending.model}/{name}/{index}",
                buffer.numel(),
                name,
            )
            for index, buffer in enumerate(buffers)
        )
        tensors = tuple(
            TensorEntry(
                n, by_name[n][1].dtype, by_name[n][1].shape, by_name[n][1].nbytes, by_name[n][0], by_name[n][1].offset
            )
            for n in order
        )
        source = PublishedSource(pending.model, buffers)
        manifest = Manifest(pending.model, name, files, tensors, {t.name: t for t in tensors}, source)
        memory = tuple((int(b.data_ptr()), b.numel()) for b in buffers)
        return Revision(pending.model, name, PUBLISHED, manifest, blocks=blocks, memory=memory)


def _start_from(part: _Part, base: Manifest) -> None:
    """Fill the part's tensors that base holds with the same dtype and shape with base's bytes."""
    assert isinstance(base.source, PublishedSource)
    for tensor in part.tensors.values():
        entry = base.by_name.get(tensor.name)
        if entry is None or entry.dtype != tensor.dtype or entry.shape != tensor.shape:
            continue
        held = base.source.part_buffer(entry.file_index)[entry.file_offset : entry.file_offset + entry.nbytes]
        part.buffer[tensor.offset : tensor.offset + tensor.nbytes].copy_(held)
        part.received[tensor.name] = tensor.nbytes
        part.based[tensor.name] = 0


class PartInFlight:
    """One part of a publish whose bytes are landing in its buffer: from PublishRequest chunks
    (receive) or frames on the data port (land, one chunk at a time), then finish (or fail).

    Every chunk is checked as it lands: a tensor announced, the next offset of it (a tensor's chunks
    come in order), within its size, its CRC32C computed where its bytes landed. A mismatch drops
    the whole part (and revision), so bytes written before a check never count.
    """

    def __init__(self, publisher: Publisher, pending: _Pending, part: _Part, message_timeout: float) -> None:
        self._publisher = publisher
        self._pending = pending
        self.part = part
        self.model = pending.model
        self._message_timeout = message_timeout
        self._base = int(part.buffer.numpy().ctypes.data)
        self._codec = delta_forms.Codec()
        self.chunks = 0
        self.bytes = 0
        # Fresh memory: its pages faulted in on a helper thread ahead of the bytes (a trap per 4 KiB
        # page inside every receive otherwise).
        self._ahead = _populate_ahead(part.buffer)

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Drop the part (and its revision) if the block raises."""
        try:
            yield
        except BaseException as exc:
            self.fail(exc)
            raise

    def fail(self, exc: BaseException) -> None:
        self._ahead.close()
        index = self.part.index
        reason = f"part {index} failed: {exc}" if isinstance(exc, ServerError) else ""
        self._publisher._fail(self._pending, index, reason)

    def receive(self, messages: Iterator[pb.PublishRequest]) -> None:
        """Land the chunks of messages up to commit; ClientGone when they end without one."""
        for message in _bounded(messages, self._message_timeout, self.model):
            if message.HasField("start"):
                raise InvalidRequest(f"publish of model {self.model!r}: a second PublishStart")
            for chunk in message.chunks:
                data = chunk.data  # each read of the field is a copy of its bytes: read once
                length = len(data)
                source = int(np.frombuffer(data, dtype=np.uint8).ctypes.data) if length else 0
                if chunk.encoding:
                    self.land_delta(
                        chunk.tensor, chunk.offset, chunk.length, chunk.crc32c, chunk.encoding, source, length
                    )
                    continue
                # One pass: copied into the part and checksummed where it landed.
                self.land(chunk.tensor, chunk.offset, length, chunk.crc32c, functools.partial(_copy, source, length))
            if message.commit:
                break
        else:
            raise ClientGone()  # the stream ended without commit: the publisher went away
        self.check_complete()

    def land(self, name: str, offset: int, length: int, crc32c: int, write: Callable[[int], int]) -> None:
        """One chunk: checked, then written by write(address), which returns the CRC32C of what it wrote."""
        tensor = self._placed(name, offset, length)
        self._check(tensor, offset, length, crc32c, write)
        if tensor.name in self.part.based:
            self.part.based[tensor.name] = offset + length
        else:
            self.part.received[tensor.name] = offset + length
        self.chunks += 1
        self.bytes += length

    def land_delta(
        self, name: str, offset: int, length: int, crc32c: int, encoding: int, address: int, payload_bytes: int
    ) -> None:
        """One chunk as a delta against the part's base (payload_bytes at address): XORed into the base's
        bytes and checked against crc32c (the new bytes')."""
        if name not in self.part.based:
            raise InvalidRequest(
                f"publish of model {self.model!r}: tensor {name[:200]!r}: a delta, but the tensor is not in the "
                "delta base with this dtype and shape"
            )
        tensor = self._placed(name, offset, length)

        def apply(at: int) -> int:
            view = self.part.buffer[at - self._base : at - self._base + length]
            try:
                return self._codec.xor_into(view, offset, address, payload_bytes, encoding)
            except delta_forms.DeltaUnusable as exc:
                raise CorruptCheckpoint(
                    f"publish of model {self.model!r}: tensor {tensor.name!r}: the delta at byte {offset}: {exc}"
                ) from None

        self._check(tensor, offset, length, crc32c, apply)
        self.part.based[tensor.name] = offset + length
        self.chunks += 1
        self.bytes += payload_bytes

    def _placed(self, name: str, offset: int, length: int) -> _Announced:
        """The announced tensor of a chunk at offset of length bytes, checked to come next and to fit."""
        part, model = self.part, self.model
        tensor = part.tensors.get(name)
        if tensor is None:
            raise InvalidRequest(f"publish of model {model!r}: chunk of tensor {name[:200]!r}, not announced")
        based = part.based.get(tensor.name)
        expected = part.received.get(tensor.name, 0) if based is None else based
        # A tensor starting as the base's bytes may skip ranges (unchanged); others come whole, in order.
        out_of_order = offset < expected if based is not None else offset != expected
        if out_of_order:
            raise InvalidRequest(
                f"publish of model {model!r}: tensor {tensor.name!r}: chunk at byte {offset}, expected "
                f"{'at least ' if based is not None else ''}{expected} (a tensor's chunks come in order)"
            )
        if offset + length > tensor.nbytes:
            raise RangeOutOfBounds(
                f"publish of model {model!r}: tensor {tensor.name!r}: chunk ends at byte {offset + length}, the "
                f"tensor has {tensor.nbytes} ({tensor.dtype.safetensors} {list(tensor.shape)})"
            )
        return tensor

    def _check(self, tensor: _Announced, offset: int, length: int, crc32c: int, write: Callable[[int], int]) -> None:
        if not length:
            if crc32c != 0:
                raise CorruptCheckpoint(
                    f"publish of model {self.model!r}: tensor {tensor.name!r}: an empty chunk with a CRC32C"
                )
        elif write(self._base + tensor.offset + offset) != crc32c:
            raise CorruptCheckpoint(
                f"publish of model {self.model!r}: tensor {tensor.name!r}: the chunk at byte {offset} does not match "
                "its CRC32C"
            )

    def check_complete(self) -> None:
        """Every announced byte arrived: compute the block CRC32Cs (InvalidRequest names a tensor short)."""
        part = self.part
        view = part.buffer.numpy()
        for tensor in part.tensors.values():
            got = part.received.get(tensor.name, 0)
            if got != tensor.nbytes:
                raise InvalidRequest(
                    f"publish of model {self.model!r}: tensor {tensor.name!r}: {got} of {tensor.nbytes} bytes arrived "
                    "before commit"
                )
            part.blocks[tensor.name] = block_crcs(view[tensor.offset : tensor.offset + tensor.nbytes])

    def finish(self) -> pb.PublishResponse:
        """Hand the complete part over; the answer once its revision is complete (PublishConflict if it failed)."""
        publisher, pending, part = self._publisher, self._pending, self.part
        self._ahead.close()
        with publisher._lock:
            publisher.received_bytes += self.bytes
        publisher._take(pending, part)
        if not pending.done.wait(max(0.0, ASSEMBLY_TIMEOUT_S - (time.monotonic() - pending.started))):
            publisher._fail(
                pending, part.index, f"its {pending.parts} parts did not all arrive within {ASSEMBLY_TIMEOUT_S:.0f} s"
            )
        if pending.revision is None:
            raise PublishConflict(
                f"model {self.model!r}: revision {pending.name!r} was not published: {pending.failure}"
            )
        revision = pending.revision
        return pb.PublishResponse(
            model=revision.model,
            revision=revision.id,
            complete=True,
            bytes=sum(t.nbytes for t in part.tensors.values()),
        )


def _populate_ahead(buffer: torch.Tensor) -> PopulateAhead:
    return PopulateAhead(int(buffer.data_ptr()), buffer.numel())


def _copy(source: int, length: int, address: int) -> int:
    return wire.copy_crc32c(address, source, length)


def _view(buffer: torch.Tensor, tensor: _Announced) -> torch.Tensor:
    """tensor's bytes in its part's buffer, as a tensor of its dtype and shape."""
    flat = buffer[tensor.offset : tensor.offset + tensor.nbytes]
    return flat.view(tensor.dtype.torch).view(tensor.shape)


def _announced(start: pb.PublishStart) -> dict[str, _Announced]:
    """The part's tensors laid out in its buffer; InvalidRequest for a bad name, dtype or shape."""
    announced: dict[str, _Announced] = {}
    offset = 0
    if not start.tensors:
        raise InvalidRequest(f"publish of model {start.model!r}: the part announces no tensor")
    for tensor in start.tensors:
        if not tensor.name or len(tensor.name) > 1024:
            raise InvalidRequest(f"publish of model {start.model!r}: a tensor name is 1 to 1024 characters")
        if tensor.name in announced:
            raise InvalidRequest(f"publish of model {start.model!r}: tensor {tensor.name[:200]!r} announced twice")
        dtype = dtypes.BY_WIRE.get(tensor.dtype)
        if dtype is None:
            raise InvalidRequest(
                f"publish of model {start.model!r}: tensor {tensor.name!r}: unknown dtype {tensor.dtype}"
            )
        shape = tuple(int(d) for d in tensor.shape)
        if len(shape) > 16 or any(d > 1 << 40 for d in shape):
            raise InvalidRequest(f"publish of model {start.model!r}: tensor {tensor.name!r}: shape {list(shape)[:20]}")
        nbytes = math.prod(shape) * dtype.itemsize
        announced[tensor.name] = _Announced(tensor.name, dtype, shape, nbytes, offset)
        offset += nbytes + (-nbytes % ALIGN)
    return announced


def _content_name(order: list[str], by_name: dict[str, tuple[int, _Announced]], blocks: dict[str, Blocks]) -> str:
    digest = hashlib.sha256()
    for name in order:
        tensor = by_name[name][1]
        digest.update(f"{name}\0{tensor.dtype.safetensors}\0{tensor.shape}\0".encode())
        digest.update(np.asarray(blocks[name], dtype=np.uint32).tobytes())
    return "pub-" + digest.hexdigest()[:20]


def _bounded(messages: Iterator[pb.PublishRequest], timeout: float, model: str) -> Iterator[pb.PublishRequest]:
    """messages, each of which must come within timeout of the last (a publisher that stalls is ended).

    They are read on a thread of their own, which stops once this generator is closed.
    """
    arrived: queue.Queue[tuple[pb.PublishRequest | None, BaseException | None]] = queue.Queue(maxsize=2)
    stop = threading.Event()

    def hand_over(item: tuple[pb.PublishRequest | None, BaseException | None]) -> bool:
        while not stop.is_set():
            try:
                arrived.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for message in messages:
                if not hand_over((message, None)):
                    return
            hand_over((None, None))
        except BaseException as exc:  # handed to the caller
            hand_over((None, exc))

    threading.Thread(target=read, name="weightstream-publish-reader", daemon=True).start()
    try:
        while True:
            try:
                message, error = arrived.get(timeout=timeout)
            except queue.Empty:
                raise RequestTimeout(
                    f"publish of model {model!r}: no message for {timeout:.0f} s (--stall-timeout); "
                    "the publish is dropped"
                ) from None
            if error is not None:
                raise error
            if message is None:
                return
            yield message
    finally:
        stop.set()
