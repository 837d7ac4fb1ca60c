"""The revisions this server keeps of each model, which one is current, and who waits for the next.

A model's revision identifies its content. Two origins make them: storage (the catalog builds a
manifest of files whose names, sizes and versions give a new revision) and publishes (a trainer's
tensors, held in this server's memory: revisions.published). Each model keeps a bounded history,
newest last (--keep-revisions, default 2: the current and the previous one); the newest is the
model's current revision. A storage revision superseded by another is kept as a record only (its
files are gone or rewritten: it can no longer be served, but its block CRCs still say what changed
since); a published one is served from memory until it leaves the history.

Watchers wait on the store's condition for a model's current revision to change.

Concurrency: every method may be called from any thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from weightstream.protocol import digests
from weightstream_server.serving.catalog import Manifest

logger = logging.getLogger(__name__)

PUBLISHED, STORAGE = "published", "storage"
# Names of evicted published revisions remembered per model.
MAX_EVICTED = 64
# Publishes remembered per model for /status (what each step of a training loop cost).
MAX_PUBLISH_RECORDS = 16
# Block CRC32Cs of one tensor: one per BLOCK_BYTES of its bytes, the last block shorter.
Blocks = tuple[int, ...]
# The BLAKE3 hashes of the same blocks (weightstream.protocol.digests.block_hash).
BlockHashes = tuple[bytes, ...]


@dataclass
class Revision:
    """One revision of a model: its manifest, where it came from, and its tensors' block CRC32Cs once known.

    blocks is filled once (a publish computes it as its bytes arrive; a storage revision when its
    files are first digested, revisions.changes) and never changed after.
    """

    model: str
    id: str
    origin: str
    manifest: Manifest
    created: float = field(default_factory=time.time)
    blocks: dict[str, Blocks] | None = None
    # Each tensor's block BLAKE3 hashes, known with blocks (None for a revision digested before they
    # were kept): what says that a block did not change (a CRC32C can be made to match).
    block_hashes: dict[str, BlockHashes] | None = field(default=None, repr=False)
    # Each tensor's BLAKE3 hash over its block hashes, and the revision's digest over them
    # (weightstream.protocol.digests), set together with blocks by set_hashes; "" until then.
    tensor_hashes: dict[str, bytes] | None = field(default=None, repr=False)
    digest: str = ""
    # The memory this revision's tensors lie in, (address, bytes) per buffer (published ones);
    # empty for storage. A relayed revision may share buffers with an older one.
    memory: tuple[tuple[int, int], ...] = ()
    # False once a newer storage revision replaced this storage one: its files are gone.
    servable: bool = True
    # Called when the revision leaves the history (frees a published revision's memory).
    on_evict: Callable[[], None] | None = field(default=None, repr=False)

    def set_hashes(self, hashes: dict[str, bytes]) -> None:
        """Record each tensor's hash (every tensor of the manifest's) and the revision's digest over them."""
        tensors = self.manifest.tensors
        self.digest = digests.revision_digest((t.name, t.dtype.safetensors, t.shape, hashes[t.name]) for t in tensors)
        self.tensor_hashes = hashes


@dataclass
class PublishRecord:
    """What one publish of a model cost here, and what the updates to its revision asked for since.

    bytes: the revision's tensor bytes; received_bytes: the payload bytes its parts sent (a delta
    publish: what changed); seconds: from its first part's start to complete; updates: GetChanges
    answered to this revision (one per engine rank that updated to it), update_bytes: the changed
    bytes they named (what those updates then fetched).
    """

    revision: str
    parts: int
    bytes: int
    received_bytes: int
    seconds: float
    updates: int = 0
    update_bytes: int = 0


@dataclass
class _History:
    revisions: list[Revision] = field(default_factory=list)
    # The storage revision last seen, current or not: a storage change is one that differs from it.
    storage: str = ""
    # Published revisions no longer kept, newest last (bounded): named, they are NOT_FOUND.
    evicted: list[str] = field(default_factory=list)
    # The last publishes, newest last (bounded).
    publishes: list[PublishRecord] = field(default_factory=list)

    @property
    def current(self) -> Revision | None:
        return self.revisions[-1] if self.revisions else None


class RevisionStore:
    """Each model's kept revisions, newest last, at most keep of them."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.keep = keep
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._models: dict[str, _History] = {}
        self.publishes = 0
        self.published_bytes = 0
        # Seconds the last publish of each model took, from its first part's start to complete.
        self.publish_seconds: dict[str, float] = {}
        # Called (outside the lock) with each new storage revision.
        self.listeners: list[Callable[[Revision], None]] = []
        # Called (outside the lock) with each revision that leaves a history: what is kept by its
        # name elsewhere (deltas from or to it) goes with it, since a name may come back with other bytes.
        self.on_evicted: list[Callable[[Revision], None]] = []
        # Called (outside the lock) with a storage revision whose files were seen anew (a tier's remote
        # files now in its disk cache), and the manifest it had before.
        self.refreshed: list[Callable[[Revision, Manifest], None]] = []
        # Called with each model (and revision named, or "") a request asks for, before its revision
        # is looked up (revisions.relay).
        self.on_asked: list[Callable[[str, str], None]] = []

    def asked(self, model: str, revision: str = "") -> None:
        """A request asks for model (and names revision, or ""): what follows revisions elsewhere may
        bring them first."""
        for call in self.on_asked:
            call(model, revision)

    def wait_for(self, model: str, revision: str, timeout: float) -> bool:
        """Whether revision of model is kept here, waiting up to timeout s for it to arrive."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                history = self._models.get(model)
                if history is not None and any(r.id == revision for r in history.revisions):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)

    def observe_storage(self, model: str, manifest: Manifest) -> Revision:
        """Record manifest, built from storage, as the model's storage revision; a new one becomes current."""
        evicted: list[Revision] = []
        previous: Manifest | None = None
        with self._lock:
            history = self._models.setdefault(model, _History())
            if history.storage == manifest.revision:
                # Storage has not changed: its revision stays where it is (current or not, kept or not).
                seen = next((kept for kept in reversed(history.revisions) if kept.id == manifest.revision), None)
                if seen is None:
                    return Revision(model, manifest.revision, STORAGE, manifest)
                previous, seen.manifest = seen.manifest, manifest  # the same content, its files seen anew
            else:
                for kept in history.revisions:
                    if kept.origin == STORAGE:
                        kept.servable = False
                history.storage = manifest.revision
                seen = Revision(model, manifest.revision, STORAGE, manifest)
                evicted = self._append(history, seen)
        if previous is not None:
            if previous.files != manifest.files:
                for refreshed in self.refreshed:
                    refreshed(seen, previous)
            return seen
        self._evicted(evicted)
        logger.info("model %r: storage revision %s is current", model, seen.id)
        for listener in self.listeners:
            listener(seen)
        return seen

    def add_published(self, revision: Revision, seconds: float = 0.0, parts: int = 1, received_bytes: int = 0) -> None:
        """Make a complete published revision the model's current one (seconds: what its publish took, in
        parts sending received_bytes)."""
        record = PublishRecord(revision.id, parts, revision.manifest.total_bytes, received_bytes, seconds)
        with self._lock:
            history = self._models.setdefault(revision.model, _History())
            evicted = self._append(history, revision)
            history.publishes = [*history.publishes[-(MAX_PUBLISH_RECORDS - 1) :], record]
            self.publishes += 1
            self.published_bytes += revision.manifest.total_bytes
            self.publish_seconds[revision.model] = seconds
        self._evicted(evicted)

    def count_update(self, model: str, revision: str, changed_bytes: int) -> None:
        """An update to model's published revision asked what changed: changed_bytes."""
        with self._lock:
            history = self._models.get(model)
            for record in history.publishes if history is not None else ():
                if record.revision == revision:
                    record.updates += 1
                    record.update_bytes += changed_bytes

    def publish_records(self, model: str) -> list[PublishRecord]:
        """model's last publishes, oldest first (copies)."""
        with self._lock:
            history = self._models.get(model)
            return [dataclasses.replace(r) for r in history.publishes] if history is not None else []

    def current(self, model: str) -> Revision | None:
        with self._lock:
            history = self._models.get(model)
            return history.current if history else None

    def find(self, model: str, revision: str) -> Revision | None:
        with self._lock:
            history = self._models.get(model)
            if history is None:
                return None
            return next((r for r in reversed(history.revisions) if r.id == revision), None)

    def was_evicted(self, model: str, revision: str) -> bool:
        """Whether revision was a published revision of model that is no longer kept."""
        with self._lock:
            history = self._models.get(model)
            return history is not None and revision in history.evicted

    def kept(self, model: str) -> list[str]:
        """The revisions of model this server can serve, oldest first."""
        with self._lock:
            history = self._models.get(model)
            return [r.id for r in history.revisions if r.servable] if history else []

    def models(self) -> dict[str, Revision]:
        """Each model's current revision."""
        with self._lock:
            return {m: h.revisions[-1] for m, h in self._models.items() if h.revisions}

    def snapshot(self) -> dict[str, tuple[Revision, list[str]]]:
        """Each model's current revision and the revisions it keeps (servable), oldest first."""
        with self._lock:
            return {
                m: (h.revisions[-1], [r.id for r in h.revisions if r.servable])
                for m, h in sorted(self._models.items())
                if h.revisions
            }

    def held_bytes(self) -> int:
        """Memory the kept revisions hold, each buffer counted once."""
        with self._lock:
            spans = {address: size for h in self._models.values() for r in h.revisions for address, size in r.memory}
            return sum(spans.values())

    def wait_for_change(self, model: str, after: str, timeout: float) -> Revision | None:
        """The model's current revision once it is not after (at once if it is not now); None after timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                history = self._models.get(model)
                current = history.current if history else None
                if current is not None and current.id != after:
                    return current
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def _append(self, history: _History, revision: Revision) -> list[Revision]:
        # Under the lock. A revision published again (the same content) replaces the one kept.
        replaced = [r for r in history.revisions if r.id == revision.id]
        history.revisions = [r for r in history.revisions if r.id != revision.id]
        history.revisions.append(revision)
        evicted = replaced + history.revisions[: -self.keep]
        history.revisions = history.revisions[-self.keep :]
        gone = [r.id for r in evicted if r.origin == PUBLISHED and r.id != revision.id]
        history.evicted = (history.evicted + gone)[-MAX_EVICTED:]
        self._changed.notify_all()
        return evicted

    def _evicted(self, evicted: list[Revision]) -> None:
        for revision in evicted:
            logger.info("model %r: revision %s (%s) is no longer kept", revision.model, revision.id, revision.origin)
            if revision.on_evict is not None:
                revision.on_evict()
            for listener in self.on_evicted:
                listener(revision)
