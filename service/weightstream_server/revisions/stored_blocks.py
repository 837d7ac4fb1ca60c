"""Fleet fan-out, what a server hands peers of a storage revision: its tensors' blocks, read from its files.

A storage revision's blocks are served only while it is the model's current revision here (a
superseded one's files are gone or rewritten), for the tensors it has, named exactly, block by block
within each tensor's own bytes: never a file, a header, a path, a bucket, nor a byte between tensors.
Where they are read from depends on the server:

- an upstream (--fanout) reads them from its own source: the model root or bucket the revision was
  listed from (the roots of a chain pull from it);
- a sidecar (--peers) only from the copies in its disk cache of the files of a model it follows
  from its upstream (revisions.relay): never its model root, its buckets, a file not in the disk
  cache, nor a model it does not follow; anything else is not served here.

Each read opens the file as the revision's manifest lists it (storage.open_files: the same file, not
rewritten since), so a file rewritten or evicted meanwhile fails the read (the peer then takes the
rest from the upstream); what a peer gets is checked there against the upstream's BLAKE3 hashes anyway.

Concurrency: every method may be called from any thread; each read opens and closes its own descriptor.
"""

from __future__ import annotations

from collections.abc import Callable

from weightstream.protocol.digests import DIGEST_BLOCK_BYTES
from weightstream_server.errors import ModelNotFound
from weightstream_server.revisions.store import STORAGE, RevisionStore
from weightstream_server.serving.catalog import Manifest, TensorEntry
from weightstream_server.storage.open_files import OpenFiles
from weightstream_server.storage.tiers import TieredSource


class StoredBlocks:
    """The blocks of each model's current storage revision, for revisions.peer_blocks.Holdings.

    follows: None on an upstream (every model, read from its source); on a sidecar, whether it follows a
    model from its upstream (only such a model's disk-cache copies are served)."""

    def __init__(self, store: RevisionStore, follows: Callable[[str], bool] | None = None) -> None:
        self._store = store
        self._follows = follows

    def size(self, model: str, revision: str, tensor: str) -> int | None:
        """The bytes of tensor of revision, if revision is model's current storage revision served here; None
        if it is not; ModelNotFound if it is and has no such tensor."""
        manifest = self._manifest(model, revision)
        if manifest is None:
            return None
        entry = manifest.by_name.get(tensor)
        if entry is None or not self._readable(manifest, entry):
            raise ModelNotFound(
                f"model {model[:200]!r}: storage revision {revision} has no tensor {tensor[:200]!r} served here"
            )
        return int(entry.nbytes)

    def block(self, model: str, revision: str, tensor: str, index: int) -> bytes | None:
        """Block index of tensor of revision, read from its file; None once revision is not served here."""
        manifest = self._manifest(model, revision)
        if manifest is None:
            return None
        entry = manifest.by_name.get(tensor)
        if entry is None or not self._readable(manifest, entry):
            return None
        start = index * DIGEST_BLOCK_BYTES
        if not 0 <= start < entry.nbytes:
            return None
        length = min(DIGEST_BLOCK_BYTES, entry.nbytes - start)
        file = manifest.files[entry.file_index]
        with OpenFiles(manifest.source, model, {entry.file_index: file}) as opened:
            data = opened.read_range(entry.file_index, entry.file_offset + start, length)
            opened.check_unchanged(entry.file_index)
        if len(data) != length:
            raise ModelNotFound(f"model {model[:200]!r}: file {file.name!r} ended before tensor {tensor[:200]!r}")
        return data

    def _manifest(self, model: str, revision: str) -> Manifest | None:
        current = self._store.current(model)
        if current is None or current.origin != STORAGE or current.id != revision or not current.servable:
            return None
        if self._follows is not None and not self._follows(model):
            return None
        return current.manifest

    def _readable(self, manifest: Manifest, entry: TensorEntry) -> bool:
        """Whether entry's bytes may be read here: on a sidecar only from a disk-cache copy."""
        if self._follows is None:
            return True
        return isinstance(manifest.source, TieredSource) and manifest.files[entry.file_index].local is not None
