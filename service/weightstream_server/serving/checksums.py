"""CRC32Cs the server keeps, so that bytes it sends again need not be read to be checksummed.

Keys name a file version (path, size, fingerprint: see source.SourceFile.fingerprint) and, for a
chunk, its range in the file: a file whose content may have changed has another fingerprint, so a
kept CRC32C never vouches for bytes it was not computed on. What is sent is still checked by the
client against the CRC32C, so a file changed behind the fingerprint's back fails the check rather
than reach a tensor.

A storage revision's block CRC32Cs (the per-BLOCK_BYTES checksums GetChanges compares, see
revisions.changes) are learned the same way, from the chunks' CRC32Cs as a stream computes them:
each chunk's bytes are checksummed in pieces cut at its tensor's block boundaries, and the chunk's
CRC32C is combined from the pieces' (no byte is checksummed twice). A stream's BlockRecorder keeps
what it learns apart until the stream has read every byte and found its files as listed at its end
(the same check that keeps a changed file from ending a stream OK), then hands it to ReadBlocks,
which keeps it per file version. Only bytes this server read go in: a client chooses what is
read, never a checksum. Chunks whose CRC32C was kept from an earlier stream (the tcp transport's,
the RAM cache's) teach nothing: the stream that computed it taught it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

import numpy as np

from weightstream.protocol import digests, wire
from weightstream_server.serving.catalog import Manifest
from weightstream_server.storage.reads import ChunkPlace

Key = TypeVar("Key", bound=Hashable)
# The blocks of a tensor that GetChanges compares (revisions.published_source.BLOCK_BYTES).
BLOCK_BYTES = digests.DIGEST_BLOCK_BYTES
# File versions whose learned block CRC32Cs are kept (as many as revisions.changes keeps digests of).
MAX_LEARNED_FILES = 4096
# (path, size, fingerprint) of a file version.
FileVersion = tuple[str, int, str]
# (offset in the tensor, length, CRC32C) of a piece of a tensor's bytes within one block.
Piece = tuple[int, int, int]


class KeptChecksums(Generic[Key]):
    """Up to `kept` CRC32Cs by key, least recently used dropped first. Every method may be called from any thread."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._crcs: OrderedDict[Key, int] = OrderedDict()

    def get(self, key: Key) -> int | None:
        with self._lock:
            crc = self._crcs.get(key)
            if crc is not None:
                self._crcs.move_to_end(key)
            return crc

    def put(self, key: Key, crc: int) -> None:
        with self._lock:
            self._crcs[key] = crc
            self._crcs.move_to_end(key)
            while len(self._crcs) > self._kept:
                self._crcs.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._crcs)


class BlockCrc32c:
    """The CRC32C of a chunk's bytes, fed in order, and of each piece of them between the block
    boundaries of their tensor (offset: where the chunk starts in it). Use from one thread at a time."""

    def __init__(self, offset: int) -> None:
        self.pieces: list[Piece] = []
        self._crc = 0
        self._at = self._start = offset
        self._piece = 0

    def feed(self, address: int, length: int) -> None:
        """The next length bytes of the chunk, at address."""
        while length:
            n = min(length, BLOCK_BYTES - self._at % BLOCK_BYTES)
            self._piece = wire.crc32c_at(address, n, self._piece)
            self._at += n
            address += n
            length -= n
            if self._at % BLOCK_BYTES == 0:
                self._close_piece()

    def finish(self) -> int:
        """The CRC32C of every byte fed."""
        self._close_piece()
        return self._crc

    def _close_piece(self) -> None:
        length = self._at - self._start
        if length:
            self.pieces.append((self._start, length, self._piece))
            self._crc = wire.crc32c_combine(self._crc, self._piece, length)
        self._start, self._piece = self._at, 0


class _Learned:
    """One tensor's block CRC32Cs, and which of them are known."""

    __slots__ = ("crcs", "known")

    def __init__(self, count: int) -> None:
        self.crcs = np.zeros(count, dtype=np.uint32)
        self.known = np.zeros(count, dtype=bool)


class BlockRecorder:
    """The block CRC32Cs one stream of a storage revision learns, held apart until commit().

    record may be called from any thread (the shared-memory transport's reads finish on threads of
    their own); commit once every read is done.
    """

    def __init__(self, blocks: ReadBlocks, manifest: Manifest) -> None:
        self._blocks = blocks
        self._manifest = manifest
        self._lock = threading.Lock()
        self._tensors: dict[str, _Learned] = {}
        # Pieces of blocks that a chunk's edge cut: (tensor, block) -> {start in the block: (length, CRC32C)}.
        self._cut: dict[tuple[str, int], dict[int, tuple[int, int]]] = {}

    def checksum(self, place: ChunkPlace, address: int) -> int:
        """The CRC32C of place's bytes at address, each block's recorded on the way."""
        crcs = BlockCrc32c(place.offset)
        crcs.feed(address, place.length)
        crc = crcs.finish()
        self.record(place.tensor, crcs.pieces)
        return crc

    def record(self, tensor: str, pieces: Iterable[Piece]) -> None:
        """Pieces of tensor's bytes, each within one block, checksummed as this server read them."""
        entry = self._manifest.by_name.get(tensor)
        if entry is None:
            return
        with self._lock:
            learned = self._tensors.get(tensor)
            if learned is None:
                learned = self._tensors[tensor] = _Learned(-(-entry.nbytes // BLOCK_BYTES))
            for offset, length, crc in pieces:
                block, start = divmod(offset, BLOCK_BYTES)
                whole = min(BLOCK_BYTES, entry.nbytes - block * BLOCK_BYTES)
                if start == 0 and length == whole:
                    learned.crcs[block], learned.known[block] = crc, True
                    continue
                cut = self._cut.setdefault((tensor, block), {})
                cut[start] = (length, crc)
                at = combined = 0
                while at in cut:
                    size, part = cut[at]
                    combined = wire.crc32c_combine(combined, part, size)
                    at += size
                if at == whole:
                    learned.crcs[block], learned.known[block] = combined, True
                    del self._cut[(tensor, block)]

    def commit(self) -> None:
        """The stream read every byte it recorded and found its files as listed at its end: what it learned holds."""
        with self._lock:
            tensors, self._tensors, self._cut = self._tensors, {}, {}
        self._blocks.learn(self._manifest, tensors)


class ReadBlocks:
    """Block CRC32Cs of storage file versions, learned from what streams read (BlockRecorder), at most
    kept_files file versions, least recently used dropped first. Every method may be called from any thread."""

    def __init__(self, kept_files: int = MAX_LEARNED_FILES) -> None:
        self._kept_files = kept_files
        self._lock = threading.Lock()
        self._files: OrderedDict[FileVersion, dict[str, _Learned]] = OrderedDict()

    def recorder(self, manifest: Manifest) -> BlockRecorder:
        """A recorder for one stream of manifest (a storage revision: its files never change unnoticed)."""
        return BlockRecorder(self, manifest)

    def learn(self, manifest: Manifest, tensors: dict[str, _Learned]) -> None:
        with self._lock:
            for name, learned in tensors.items():
                file = manifest.files[manifest.by_name[name].file_index]
                key = (file.path, file.size, file.fingerprint)
                kept = self._files.get(key)
                if kept is None:
                    kept = self._files[key] = {}
                self._files.move_to_end(key)
                have = kept.get(name)
                if have is None or have.crcs.size != learned.crcs.size:
                    kept[name] = learned
                    continue
                have.crcs[learned.known] = learned.crcs[learned.known]
                have.known |= learned.known
            while len(self._files) > self._kept_files:
                self._files.popitem(last=False)

    def carry(self, old: Manifest, new: Manifest) -> None:
        """What was learned of old's files, kept for new's files that are the same versions with the same
        bytes: a remote file and this node's checked copy of it (a disk cache's), either way round.

        A local file of the same version is not the same bytes for certain (a rewrite within the
        modification time's granularity keeps it): only a copy of a remote version carries."""
        if len(old.files) != len(new.files):
            return
        with self._lock:
            for was, now in zip(old.files, new.files, strict=True):
                same = (was.name, was.size, was.version) == (now.name, now.size, now.version)
                if not same or (was.local is not None and now.local is not None):
                    continue
                kept = self._files.get((was.path, was.size, was.fingerprint))
                if kept is not None and (now.path, now.size, now.fingerprint) not in self._files:
                    self._files[(now.path, now.size, now.fingerprint)] = kept

    def blocks(self, manifest: Manifest) -> dict[str, tuple[int, ...]] | None:
        """The block CRC32Cs of manifest's tensors whose every block was learned (None: of none)."""
        found: dict[str, tuple[int, ...]] = {}
        with self._lock:
            for entry in manifest.tensors:
                file = manifest.files[entry.file_index]
                kept = self._files.get((file.path, file.size, file.fingerprint))
                learned = kept.get(entry.name) if kept is not None else None
                if learned is not None and learned.known.all():
                    found[entry.name] = tuple(int(crc) for crc in learned.crcs)
        return found or None

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)
