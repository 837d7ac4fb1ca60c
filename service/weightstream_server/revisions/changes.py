"""What changed between two revisions of a model: per-block checks compared, tensor by tensor.

Every revision's tensors get a CRC32C and a BLAKE3 hash per BLOCK_BYTES (1 MiB) of their bytes,
computed once and kept with the revision. A published revision computes them as its parts arrive. A storage revision is
digested by reading its files: only files of a version (path, size, modification time, identity)
not digested before are read, and each once (digests are kept per file version, the same for every
revision that has that file), so an update from storage costs the server a read of the files that
changed. Since a storage revision's files are gone once they are rewritten, the server digests the
new storage revisions of the models clients follow (that asked for changes or watch) as soon as it
sees them, in the background, and a GetChanges whose since is the current revision digests it at
once (an updater saying which revision it holds: the baseline of its next update). A storage
revision that streams read whole (a full load) needs neither: the block CRC32Cs they computed on
its bytes, recorded as they went (serving.checksums.ReadBlocks), stand for the digest of a revision
whose files are gone. A revision neither digested nor read is compared per file: tensors of a file
whose version did not change are unchanged, the others changed whole.

A tensor changed when it is new, has another dtype or shape, or a block's CRC32C or BLAKE3 hash
differs: its changed ranges are the differing blocks, merged where adjacent. A block is unchanged
only when its BLAKE3 hashes match where both revisions know them (a CRC32C can be made to match by
whoever chooses the bytes: a publisher must not make engines keep a block it did not send); the
CRC32Cs alone decide only against a revision whose block hashes are not known. Concurrency: every method may be
called from any thread; digests of one file version are computed once (single flight).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from weightstream.protocol import digests
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import RevisionNotKept
from weightstream_server.revisions.published_source import BLOCK_BYTES, block_checks
from weightstream_server.revisions.store import STORAGE, BlockHashes, Blocks, Revision, RevisionStore
from weightstream_server.serving.catalog import Manifest, TensorEntry
from weightstream_server.serving.checksums import ReadBlocks
from weightstream_server.storage.open_files import OpenFiles

logger = logging.getLogger(__name__)

# File versions whose digests are kept.
MAX_DIGESTED_FILES = 4096
# Bytes read at a time while digesting.
READ_BYTES = 16 * BLOCK_BYTES
# A tensor's block CRC32Cs, block BLAKE3 hashes and BLAKE3 hash.
_Digested = tuple[Blocks, BlockHashes, bytes]


class Changes:
    """Digests revisions and compares them."""

    def __init__(self, store: RevisionStore, read_blocks: ReadBlocks | None = None) -> None:
        self._store = store
        self._read_blocks = read_blocks
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[str, str], dict[str, _Digested]] = OrderedDict()
        self._flights: dict[tuple[str, str], threading.Lock] = {}
        self._followed: set[str] = set()
        self.bytes_digested = 0  # what the tests and the benchmark count
        # GetChanges answered, and the changed bytes they named (what updates then fetch).
        self.asked = 0
        self.changed_bytes = 0
        store.listeners.append(self._new_storage_revision)
        store.refreshed.append(self._refreshed)

    def follow(self, model: str) -> None:
        """Digest the model's storage revisions as they appear (and its current one, now, in the background)."""
        with self._lock:
            if model in self._followed:
                return
            self._followed.add(model)
        current = self._store.current(model)
        if current is not None and current.origin == STORAGE:
            self._in_background(current)

    def changes(self, model: str, since: str, revision: Revision) -> pb.GetChangesResponse:
        """What changed from since to revision (both of model); RevisionNotKept for a since never seen or gone."""
        self.follow(model)
        old = self._store.find(model, since)
        if old is None:
            kept = ", ".join(self._store.kept(model)) or "none"
            raise RevisionNotKept(
                f"model {model!r}: revision {since[:200]!r} is not kept by this server (it keeps {kept}); "
                "load the model whole instead"
            )
        response = pb.GetChangesResponse(model=model, since=since, revision=revision.id, block_bytes=BLOCK_BYTES)
        # Nothing changed when old is revision: the caller says it holds this revision and will update
        # from it, so its block CRC32Cs are the baseline, taken now (once), before its files can be
        # rewritten; they also let the caller check that it holds it.
        new_blocks = self.blocks(revision)
        old_blocks = (
            new_blocks if old.id == revision.id else self.blocks(old) if old.servable else self._gone_blocks(old)
        )
        new_hashes, old_hashes = revision.block_hashes or {}, old.block_hashes or {}
        for entry in revision.manifest.tensors:
            was = entry if old.id == revision.id else old.manifest.by_name.get(entry.name)
            ranges = _changed(entry, was, new_blocks, old_blocks, revision.manifest, old.manifest)
            if ranges is not None and old.id != revision.id:
                ranges = _hashes_differ(entry, ranges, new_hashes.get(entry.name), old_hashes.get(entry.name))
            if ranges is None:
                response.tensors.append(pb.TensorChanges(name=entry.name, whole=True))
                response.changed_bytes += entry.nbytes
                continue
            if ranges:
                response.tensors.append(
                    pb.TensorChanges(name=entry.name, ranges=[pb.ByteRange(start=s, end=e) for s, e in ranges])
                )
                response.changed_bytes += sum(e - s for s, e in ranges)
            crcs = new_blocks.get(entry.name) if new_blocks is not None else None
            if crcs:
                response.blocks.append(pb.TensorBlocks(name=entry.name, crc32c=crcs))
        response.removed.extend(t.name for t in old.manifest.tensors if t.name not in revision.manifest.by_name)
        with self._lock:
            self.asked += 1
            self.changed_bytes += response.changed_bytes
        self._store.count_update(model, revision.id, response.changed_bytes)
        logger.info(
            "model %r: changes from %s to %s: %d tensors, %d bytes",
            model,
            since,
            revision.id,
            len(response.tensors),
            response.changed_bytes,
        )
        return response

    def _gone_blocks(self, revision: Revision) -> dict[str, Blocks] | None:
        """The block CRC32Cs of a storage revision whose files are gone: digested, else as streams read them."""
        if revision.blocks is not None or self._read_blocks is None:
            return revision.blocks
        return self._read_blocks.blocks(revision.manifest)

    def blocks(self, revision: Revision) -> dict[str, Blocks] | None:
        """revision's block CRC32Cs, digesting its files (those not digested before) if they are not known yet."""
        if revision.blocks is not None or not revision.servable:
            return revision.blocks
        manifest = revision.manifest
        digested: dict[str, _Digested] = {}
        for file_index in range(len(manifest.files)):
            tensors = [t for t in manifest.tensors if t.file_index == file_index]
            digested.update(self._file_blocks(manifest, file_index, tensors))
        revision.set_hashes({name: hashed for name, (_, _, hashed) in digested.items()})
        revision.block_hashes = {name: block_hashes for name, (_, block_hashes, _) in digested.items()}
        revision.blocks = {name: crcs for name, (crcs, _, _) in digested.items()}
        return revision.blocks

    def _file_blocks(self, manifest: Manifest, file_index: int, tensors: Sequence[TensorEntry]) -> dict[str, _Digested]:
        """Each tensor's block CRC32Cs, block BLAKE3 hashes and BLAKE3 hash (weightstream.protocol.digests)
        in one read of its bytes."""
        file = manifest.files[file_index]
        key = (file.path, file.fingerprint)
        with self._lock:
            kept = self._files.get(key)
            if kept is not None:
                self._files.move_to_end(key)
                return kept
            flight = self._flights.setdefault(key, threading.Lock())
        with flight:
            with self._lock:
                kept = self._files.get(key)
            if kept is not None:
                return kept
            digested: dict[str, _Digested] = {}
            with OpenFiles(manifest.source, manifest.model, {file_index: file}) as opened:
                for tensor in tensors:
                    crcs: list[int] = []
                    hashes: list[bytes] = []
                    for start in range(0, tensor.nbytes, READ_BYTES):  # READ_BYTES: whole blocks
                        length = min(READ_BYTES, tensor.nbytes - start)
                        data = opened.read_range(file_index, tensor.file_offset + start, length)
                        more_crcs, more_hashes = block_checks(np.frombuffer(data, dtype=np.uint8))
                        crcs.extend(more_crcs)
                        hashes.extend(more_hashes)
                        self.bytes_digested += len(data)
                    digested[tensor.name] = (tuple(crcs), tuple(hashes), digests.hash_of_blocks(hashes))
                opened.check_unchanged(file_index)
            with self._lock:
                self._files[key] = digested
                self._flights.pop(key, None)
                while len(self._files) > MAX_DIGESTED_FILES:
                    self._files.popitem(last=False)
            return digested

    def _refreshed(self, revision: Revision, previous: Manifest) -> None:
        """A storage revision's files seen anew (a tier's copies now in its disk cache): what streams
        learned of them stays known."""
        if self._read_blocks is not None:
            self._read_blocks.carry(previous, revision.manifest)

    def _new_storage_revision(self, revision: Revision) -> None:
        with self._lock:
            followed = revision.model in self._followed
        if followed:
            self._in_background(revision)

    def _in_background(self, revision: Revision) -> None:
        def digest() -> None:
            try:
                self.blocks(revision)
            except Exception as exc:  # the next GetChanges tries again and reports it
                logger.warning("model %r: revision %s could not be digested: %s", revision.model, revision.id, exc)

        threading.Thread(target=digest, name="weightstream-digest", daemon=True).start()


def _changed(
    entry: TensorEntry,
    was: TensorEntry | None,
    new_blocks: dict[str, Blocks] | None,
    old_blocks: dict[str, Blocks] | None,
    new: Manifest,
    old: Manifest,
) -> list[tuple[int, int]] | None:
    """The changed byte ranges of entry since was ([] none); None: the whole tensor."""
    if was is None or was.dtype != entry.dtype or was.shape != entry.shape:
        return None
    after = new_blocks.get(entry.name) if new_blocks is not None else None
    before = old_blocks.get(entry.name) if old_blocks is not None else None
    if after is None or before is None:
        # No block CRCs of one side: unchanged only if it is the same file version, same place.
        new_file, old_file = new.files[entry.file_index], old.files[was.file_index]
        same = new_file.path == old_file.path and new_file.fingerprint == old_file.fingerprint
        return [] if same and entry.file_offset == was.file_offset else None
    ranges: list[tuple[int, int]] = []
    for index, (a, b) in enumerate(zip(after, before, strict=True)):
        if a == b:
            continue
        start, end = index * BLOCK_BYTES, min(entry.nbytes, (index + 1) * BLOCK_BYTES)
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
    return ranges


def _hashes_differ(
    entry: TensorEntry, ranges: list[tuple[int, int]], after: BlockHashes | None, before: BlockHashes | None
) -> list[tuple[int, int]] | None:
    """ranges (entry's changed ranges by CRC32C) with the blocks whose BLAKE3 hashes differ added, where
    both sides' are known; None (the whole tensor) when they do not cover the same blocks."""
    if after is None or before is None:
        return ranges
    if len(after) != len(before):
        return None
    changed = {offset // BLOCK_BYTES for start, end in ranges for offset in range(start, end, BLOCK_BYTES)}
    changed.update(index for index, (a, b) in enumerate(zip(after, before, strict=True)) if a != b)
    merged: list[tuple[int, int]] = []
    for index in sorted(changed):
        start, end = index * BLOCK_BYTES, min(entry.nbytes, (index + 1) * BLOCK_BYTES)
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged
