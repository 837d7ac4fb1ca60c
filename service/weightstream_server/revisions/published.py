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
PublishedSource: the parts' buffers stand for its files. A part published with a delta base (only
what changed since a revision kept here) leaves what it sent for the base's tensors as the server's
deltas from the base to the new revision (serving.deltas.Deltas.keep_published): while a part
receives, it keeps at most its share of --delta-cache-bytes of payloads, and once taken they are
kept within that budget like the deltas the server computes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from weightstream.allocator import PopulateAhead
from weightstream.protocol import dtypes
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import (
    AccessDenied,
    CorruptCheckpoint,
    InvalidRequest,
    ModelNotFound,
    PublishConflict,
    PublishTooLarge,
    RevisionNotKept,
    ServerError,
)
from weightstream_server.revisions.layout import Placed, lay_out
from weightstream_server.revisions.parts import Part, PartInFlight
from weightstream_server.revisions.persist import PublishDir, load_revision_files, upload_in_background
from weightstream_server.revisions.published_source import PUBLISHED_SCHEME, PublishedSource, Shared
from weightstream_server.revisions.store import PUBLISHED, Blocks, Revision, RevisionStore
from weightstream_server.serving.catalog import Catalog, Manifest, TensorEntry
from weightstream_server.serving.deltas import ChunkKey, Delta, Deltas
from weightstream_server.storage.model_ids import ObjectLocation, check_model_id, check_revision_name
from weightstream_server.storage.sources import SourceFile

logger = logging.getLogger(__name__)

# Per tensor, the (CRC32C, BLAKE3 hash) of each of its blocks, in order, as a relay's fill checked them.
Known = dict[str, list[tuple[int, bytes]]]

# How long the parts of a revision published in several parts may take to all arrive (the default
# of --publish-assembly-timeout).
ASSEMBLY_TIMEOUT_S = 30.0
MAX_PARTS = 1024
# How often a part waiting for the others looks whether its call is still there.
_ALIVE_POLL_S = 0.25


@dataclass(eq=False)
class _Pending:
    """A revision whose parts are arriving."""

    model: str
    name: str
    parts: int
    new_layout: bool
    peer: str
    started: float = field(default_factory=time.monotonic)
    # When the first part was complete (the assembly timeout counts from there); 0 until then.
    first_taken: float = 0.0
    taken: dict[int, Part] = field(default_factory=dict)
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
    # Read back from --publish-dir at start-up: not written there again.
    persisted: bool = False
    # Payload bytes the parts sent.
    received_bytes: int = 0


@dataclass(frozen=True)
class _Assembly:
    """One pending revision as its parts in flight see it (revisions.parts.Assembly)."""

    publisher: Publisher
    pending: _Pending

    def drop(self, index: int, reason: str) -> None:
        self.publisher._fail(self.pending, index, reason)

    def check_open(self) -> None:
        pending = self.pending
        if pending.done.is_set():
            raise PublishConflict(f"model {pending.model!r}: revision {pending.name!r} was dropped: {pending.failure}")

    def hand_over(self, part: Part, payload_bytes: int, alive: Callable[[], bool]) -> pb.PublishResponse:
        return self.publisher._finish(self.pending, part, payload_bytes, alive)


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
        assembly_timeout: float = ASSEMBLY_TIMEOUT_S,
        deltas: Deltas | None = None,
    ) -> None:
        self._store = store
        # Where a delta publish's payloads are kept as the server's deltas; None: not kept.
        self._deltas = deltas
        # Where complete revisions are uploaded (an S3 client and prefix, revisions.persist); None: not.
        self._upload = upload
        # Where complete revisions are written (revisions.persist); None: they live in memory only.
        self._publish_dir = PublishDir(publish_dir) if publish_dir is not None else None
        self._catalog = catalog
        self._max_bytes = max_bytes
        self._message_timeout = message_timeout
        self._assembly_timeout = assembly_timeout
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        # Dropped revisions whose parts are still receiving: their memory is held until those calls end.
        self._dropped: list[_Pending] = []
        # Payload bytes publishers sent for the parts taken (what changed only, for a delta publish).
        self.received_bytes = 0

    def wait_written(self, timeout: float) -> bool:
        """Wait up to timeout s for published revisions still being written to --publish-dir; whether
        all were (True without one)."""
        return self._publish_dir is None or self._publish_dir.wait_written(timeout)

    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes()

    def _pending_bytes(self) -> int:
        # Under the lock: revisions arriving, and dropped ones whose parts still hold their buffers.
        return sum(p.reserved_bytes for p in (*self._pending.values(), *self._dropped))

    def publish(
        self,
        start: pb.PublishStart,
        messages: Iterator[pb.PublishRequest],
        peer: str,
        alive: Callable[[], bool] = lambda: True,
    ) -> pb.PublishResponse:
        """Take one part: announced by start, its chunks from messages; the answer once its revision is
        complete. alive says whether the part's call is still there (a cancelled one drops the revision)."""
        part = self.begin(start, peer)
        with part.failing():
            part.receive(messages)
        return part.finish(alive)

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
        if start.revision:
            check_revision_name(start.model, start.revision)
        if not start.tensors:
            raise InvalidRequest(f"publish of model {start.model!r}: the part announces no tensor")
        layout = lay_out(start.model, start.tensors)
        self._check_layout(start, layout.tensors)
        base = self._delta_base(start)
        pending = self._join(start, parts, layout.accounted_bytes, peer)
        try:
            part = Part.allocate(start.part, layout)
            if base is not None:
                assert isinstance(base.manifest.source, PublishedSource)
                part.start_from(base, base.manifest.source.part_buffer)
        except BaseException:
            self._fail(pending, start.part, "")
            raise
        keep_bytes = self._deltas.budget_bytes // parts if base is not None and self._deltas is not None else 0
        return PartInFlight(_Assembly(self, pending), start.model, part, self._message_timeout, keep_bytes)

    def _delta_base(self, start: pb.PublishStart) -> Revision | None:
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
        return kept

    def relay(
        self,
        start: pb.PublishStart,
        fill: Callable[[dict[str, torch.Tensor]], Known | None],
        peer: str,
        shared: Sequence[Shared] = (),
        order: list[str] | None = None,
    ) -> Revision:
        """Take a revision another server holds: start names it and the tensors to receive (one part),
        whose bytes fill writes into the views it is given, by name (and may return the (CRC32C, BLAKE3)
        of each block it wrote and checked, which are then not computed again); shared are its tensors already
        in the memory of a revision kept here (held by reference, never copied); order is every
        tensor's name in the revision's order. Current once fill returned.

        Held like a publish: within --publish-max-bytes (the new bytes; shared memory is counted
        once), one revision of a model at a time, nothing left behind if fill fails. The layout is
        not checked: the other server checked it.
        """
        check_revision_name(start.model, start.revision, "relay")
        layout = lay_out(start.model, start.tensors)
        pending = self._join(start, 1, layout.accounted_bytes, peer)
        pending.shared = {s.name: s for s in shared}
        pending.order = order
        try:
            part = Part.allocate(0, layout)
            ahead = PopulateAhead(int(part.buffer.data_ptr()), part.buffer.numel())
            try:
                known = fill({t.name: part.view(t) for t in layout.tensors.values()})
            finally:
                ahead.close()
            if known:
                part.known.update({name: list(blocks) for name, blocks in known.items() if name in layout.tensors})
            part.compute_blocks()
        except BaseException as exc:
            self._fail(pending, 0, f"the relay from {peer} failed: {exc}")
            raise
        self._take(pending, part)
        if pending.revision is None:
            raise PublishConflict(f"model {start.model!r}: revision {pending.name!r} was not taken: {pending.failure}")
        return pending.revision

    @property
    def deltas_budget(self) -> int:
        """The payload bytes of deltas kept here at most (--delta-cache-bytes; 0: none)."""
        return self._deltas.budget_bytes if self._deltas is not None else 0

    def keep_deltas(self, model: str, base: str, revision: str, chunks: Mapping[ChunkKey, Delta]) -> None:
        """Keep the deltas from base to revision of model that another server sent for chunks (a relay's
        pull), as the ones a delta publish leaves."""
        if self._deltas is not None and chunks:
            self._deltas.keep_published(model, base, revision, chunks)

    def _check_layout(self, start: pb.PublishStart, announced: dict[str, Placed]) -> None:
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

    def _join(self, start: pb.PublishStart, parts: int, nbytes: int, peer: str, from_disk: bool = False) -> _Pending:
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
            if start.revision and not from_disk and self._store.was_evicted(model, start.revision):
                raise PublishConflict(
                    f"model {model!r} had a revision {start.revision!r}, no longer kept; a name is not used again "
                    "(engines may hold it): name another"
                )
            if (
                start.revision
                and self._publish_dir is not None
                and not from_disk
                and (pending is None or pending.name != start.revision)
                and self._publish_dir.holds(model, start.revision)
            ):
                raise PublishConflict(
                    f"model {model!r} has a revision {start.revision!r} in the publish dir already; name another"
                )
            held = self._store.held_bytes() + self._pending_bytes()
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

    def _kept(self, model: str) -> tuple[list[str], str]:
        """The revisions of model kept here, and its current one ("" if none)."""
        current = self._store.current(model)
        return self._store.kept(model), current.id if current is not None else ""

    def restore(self) -> int:
        """Take again the revisions --publish-dir holds from before a restart (each model's newest
        --keep-revisions, its current one last, so that it is current again); how many were taken.
        A revision that cannot be read back is logged and skipped."""
        if self._publish_dir is None:
            return 0
        taken = 0
        for persisted in self._publish_dir.recover():
            older = [r for r in persisted.revisions if r != persisted.current]
            for name in [*older[max(0, len(older) - self._store.keep + 1) :], persisted.current]:
                try:
                    self._restore(persisted.model, name)
                    taken += 1
                except Exception as exc:  # a file that cannot be read back (SafetensorError too): logged
                    log = logger.error if name == persisted.current else logger.warning
                    log(
                        "model %r: revision %s in the publish dir is not taken again%s: %s",
                        persisted.model,
                        name,
                        " (it was the current one: the model's current revision is now an older one, if any)"
                        if name == persisted.current
                        else "",
                        exc,
                    )
        return taken

    def _restore(self, model: str, name: str) -> None:
        assert self._publish_dir is not None
        folder = self._publish_dir.revision_dir(model, name)
        files = load_revision_files(folder)
        if not files:
            raise CorruptCheckpoint(f"{folder} holds no model-*-of-*.safetensors file")
        try:
            for index, path in enumerate(files):
                self._take(*self._restored_part(model, name, index, len(files), path))
        except BaseException:
            with self._lock:
                pending = self._pending.get(model)
            if pending is not None and pending.persisted:  # the parts taken before one failed
                self._fail(pending, 0, f"{folder} could not be read back")
            raise
        if self._store.find(model, name) is None:
            raise PublishConflict(f"model {model!r}: revision {name!r} was not taken")

    def _restored_part(self, model: str, name: str, index: int, parts: int, path: Path) -> tuple[_Pending, Part]:
        """Part index of revision name of model, read back from its file at path (checked, its memory held)."""
        with safe_open(str(path), framework="pt") as opened:
            metadata = opened.metadata() or {}
            if metadata.get("model") != model or metadata.get("revision") != name:
                raise CorruptCheckpoint(f"{path} says it is {metadata.get('model')!r} {metadata.get('revision')!r}")
            start = pb.PublishStart(model=model, revision=name, part=index, parts=parts, new_layout=True)
            for key in opened.keys():
                sliced = opened.get_slice(key)
                dtype = dtypes.BY_SAFETENSORS.get(sliced.get_dtype())
                if dtype is None:
                    raise CorruptCheckpoint(f"{path}: tensor {key!r} of dtype {sliced.get_dtype()}")
                start.tensors.append(pb.PublishedTensor(name=key, dtype=dtype.wire, shape=sliced.get_shape()))
            layout = lay_out(model, start.tensors)
            pending = self._join(start, parts, layout.accounted_bytes, f"the publish dir ({path.parent})", True)
            pending.persisted = True
            part = Part.allocate(index, layout)
            for tensor in layout.tensors.values():
                part.view(tensor).copy_(opened.get_tensor(tensor.name))
            part.compute_blocks()
            return pending, part

    def _finish(
        self, pending: _Pending, part: Part, payload_bytes: int, alive: Callable[[], bool]
    ) -> pb.PublishResponse:
        """Take a complete part; the answer once its revision is complete.

        The revision is dropped when a part has not even begun arriving within the assembly timeout of
        the first part's completion (parts still receiving are bounded by --stall-timeout per message
        instead), or when this part's call goes away first; every other part's call is then told
        (PublishConflict)."""
        with self._lock:
            self.received_bytes += payload_bytes
            pending.received_bytes += payload_bytes
        self._take(pending, part)
        while not pending.done.wait(_ALIVE_POLL_S):
            with self._lock:
                absent = pending.parts - len(pending.taken) - len(pending.receiving)
            if absent > 0 and time.monotonic() >= pending.first_taken + self._assembly_timeout:
                self._fail(
                    pending,
                    part.index,
                    f"{absent} of its {pending.parts} parts did not begin to arrive within "
                    f"{self._assembly_timeout:.0f} s of the first one's completion (--publish-assembly-timeout)",
                )
            elif not alive():
                self._fail(pending, part.index, f"part {part.index}'s call ended while it waited for the other parts")
        if pending.revision is None:
            raise PublishConflict(
                f"model {pending.model!r}: revision {pending.name!r} was not published: {pending.failure}"
            )
        revision = pending.revision
        return pb.PublishResponse(
            model=revision.model,
            revision=revision.id,
            complete=True,
            bytes=sum(t.nbytes for t in part.tensors.values()),
        )

    def _ended(self, pending: _Pending, index: int) -> None:
        # Under the lock: part index's call stopped receiving (a dropped revision frees its memory's count
        # once the last one did).
        pending.receiving.discard(index)
        if not pending.receiving and pending in self._dropped:
            self._dropped.remove(pending)

    def _take(self, pending: _Pending, part: Part) -> None:
        try:
            # Read before the lock: it may list storage or ask the upstream.
            current = None if pending.new_layout else self._current_manifest(pending.model)
        except ServerError as exc:
            self._fail(pending, part.index, f"the model's current revision could not be read: {exc}")
            return
        with self._lock:
            self._ended(pending, part.index)
            if pending.done.is_set():
                return
            pending.taken[part.index] = part
            pending.first_taken = pending.first_taken or time.monotonic()
            if len(pending.taken) < pending.parts:
                return
            try:
                revision = self._assemble(pending, current)
            except Exception as exc:  # whatever went wrong, the model takes publishes again
                pending.failure = str(exc) if isinstance(exc, ServerError) else f"it could not be assembled ({exc!r})"
                self._pending.pop(pending.model, None)
                pending.done.set()
                return
            self._pending.pop(pending.model, None)
            self._store.add_published(
                revision, time.monotonic() - pending.started, pending.parts, pending.received_bytes
            )
            pending.revision = revision
            pending.done.set()
        if self._deltas is not None:
            for taken in pending.taken.values():
                if taken.base and taken.sent:
                    self._deltas.keep_published(revision.model, taken.base, revision.id, taken.sent)
                taken.sent = {}
        if self._publish_dir is not None and not pending.persisted:
            self._publish_dir.write_in_background(revision, functools.partial(self._kept, revision.model))
        if self._upload is not None and not pending.persisted:
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
            self._ended(pending, index)
            if pending.done.is_set():
                return
            pending.failure = reason or f"part {index}'s publisher went away"
            self._pending.pop(pending.model, None)
            pending.taken.clear()
            pending.done.set()
            if pending.receiving:
                self._dropped.append(pending)
        logger.warning("model %r: publish of revision %r dropped: %s", pending.model, pending.name, pending.failure)

    def _assemble(self, pending: _Pending, current: Manifest | None) -> Revision:
        parts = [pending.taken[i] for i in range(pending.parts)]
        by_name: dict[str, tuple[int, Placed]] = {}
        for part in parts:
            for name, tensor in part.tensors.items():
                if name in by_name:
                    raise PublishConflict(f"tensor {name!r} is in parts {by_name[name][0]} and {part.index}")
                by_name[name] = (part.index, tensor)
        if current is not None and pending.parts > 1:
            missing = [t.name for t in current.tensors if t.name not in by_name]
            if missing:
                raise InvalidRequest(f"tensor {missing[0]!r} of revision {current.revision} is in no part")
        blocks = {name: parts[i].blocks[name] for name, (i, _) in by_name.items()}
        hashes = {name: parts[i].hashes[name] for name, (i, _) in by_name.items()}
        block_hashes = {name: parts[i].block_hashes[name] for name, (i, _) in by_name.items()}
        buffers = [p.buffer for p in parts]
        where: dict[int, int] = {}
        for shared in pending.shared.values():
            index = where.setdefault(shared.buffer.data_ptr(), len(buffers))
            if index == len(buffers):
                buffers.append(shared.buffer)
            announced = Placed(shared.name, shared.dtype, shared.shape, shared.nbytes, shared.offset)
            by_name[shared.name] = (index, announced)
            blocks[shared.name] = shared.blocks
            hashes[shared.name] = shared.hashed
            if shared.block_hashes is not None:
                block_hashes[shared.name] = shared.block_hashes
        if pending.order is not None:
            order = pending.order
        else:
            # The current revision's order for the tensors it has (its files may have changed since the
            # layout was checked: only the tensors that arrived count), then the others as they came.
            known = [t.name for t in current.tensors if t.name in by_name] if current is not None else []
            seen = set(known)
            order = known + [n for n in by_name if n not in seen]
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
        revision = Revision(
            pending.model, name, PUBLISHED, manifest, blocks=blocks, block_hashes=block_hashes, memory=memory
        )
        revision.set_hashes(hashes)
        return revision


def _content_name(order: list[str], by_name: dict[str, tuple[int, Placed]], blocks: dict[str, Blocks]) -> str:
    digest = hashlib.sha256()
    for name in order:
        tensor = by_name[name][1]
        digest.update(f"{name}\0{tensor.dtype.safetensors}\0{tensor.shape}\0".encode())
        digest.update(np.asarray(blocks[name], dtype=np.uint32).tobytes())
    return "pub-" + digest.hexdigest()[:20]
