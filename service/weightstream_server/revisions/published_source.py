"""A published revision's bytes, served: the memory of its parts standing for its files.

A published revision (revisions.published) lies in its parts' buffers; PublishedSource serves them to
every transport as if each part were one file, and keeps the CRC32C of each chunk it served (the
bytes never change). Shared is a tensor of one kept revision that a newer one holds by reference.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from weightstream.protocol import digests, dtypes, wire
from weightstream_server.errors import ModelNotFound
from weightstream_server.revisions.store import BlockHashes, Blocks
from weightstream_server.storage.reads import ReadPlan
from weightstream_server.storage.sources import ModelFiles, SourceFile

# Block CRC32Cs are kept per this many bytes of each tensor (what GetChanges compares).
BLOCK_BYTES = 1024 * 1024
assert BLOCK_BYTES == digests.DIGEST_BLOCK_BYTES  # one pass over a block checks and hashes it
PUBLISHED_SCHEME = "published://"


# Threads that checksum and hash blocks (CRC32C and BLAKE3 both release the GIL).
_CHECK_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))
_checking = ThreadPoolExecutor(_CHECK_THREADS, thread_name_prefix="weightstream-blocks")
# Below this many blocks a tensor is checked on the caller's thread (a handoff costs more).
_SPLIT_BLOCKS = 8


def block_checks(data: np.ndarray) -> tuple[list[int], list[bytes]]:
    """The CRC32C and the BLAKE3 hash (weightstream.protocol.digests) of each BLOCK_BYTES block of data
    (flat uint8, the last block shorter): one pass over each block while it is in the core's cache, the
    blocks shared out among the checking threads."""
    address, size = int(data.ctypes.data), data.size
    view = wire.memory_at(address, size)
    starts = range(0, size, BLOCK_BYTES)

    def check(part: range) -> tuple[list[int], list[bytes]]:
        crcs, hashes = [], []
        for start in part:
            length = min(BLOCK_BYTES, size - start)
            crcs.append(wire.crc32c_at(address + start, length))
            hashes.append(digests.block_hash(view[start : start + length]))
        return crcs, hashes

    if len(starts) < _SPLIT_BLOCKS or _CHECK_THREADS == 1:
        return check(starts)
    step = -(-len(starts) // _CHECK_THREADS)
    crcs, hashes = [], []
    for part_crcs, part_hashes in _checking.map(check, [starts[i : i + step] for i in range(0, len(starts), step)]):
        crcs.extend(part_crcs)
        hashes.extend(part_hashes)
    return crcs, hashes


def check_blocks(buffer: torch.Tensor, start: int, size: int, indices: Sequence[int]) -> list[tuple[int, bytes]]:
    """The (CRC32C, BLAKE3 hash) of the BLOCK_BYTES blocks `indices` of the size bytes of buffer (a flat
    uint8 host tensor, held meanwhile) from start; on the checking threads when there are many."""
    check = functools.partial(_one, buffer, start, size)
    if len(indices) < _SPLIT_BLOCKS or _CHECK_THREADS == 1:
        return [check(i) for i in indices]
    return list(_checking.map(check, indices))


def check_blocks_later(
    buffer: torch.Tensor, start: int, size: int, indices: Sequence[int]
) -> Future[list[tuple[int, bytes]]]:
    """check_blocks on one checking thread, buffer held until it is done."""
    return _checking.submit(lambda: [_one(buffer, start, size, i) for i in indices])


def _one(buffer: torch.Tensor, start: int, size: int, index: int) -> tuple[int, bytes]:
    address = int(buffer.data_ptr()) + start + index * BLOCK_BYTES
    length = min(BLOCK_BYTES, size - index * BLOCK_BYTES)
    return wire.crc32c_at(address, length), digests.block_hash(wire.memory_at(address, length))


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
    # Its BLAKE3 hash (weightstream.protocol.digests.tensor_hash), and its blocks' (None: not known).
    hashed: bytes
    block_hashes: BlockHashes | None = None


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
        key = (part_of(file), offset, data.size)
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
        buffer = self._buffers[part_of(file)]
        return bytes(buffer[start : start + length].numpy())

    def read_units(self, files: Sequence[SourceFile], plan: ReadPlan) -> Iterator[tuple[int, int, torch.Tensor]]:
        for file_id, file_plan in enumerate(plan.files):
            buffer = self._buffers[part_of(files[file_plan.file_index])]
            for index, (offset, size) in enumerate(zip(file_plan.offsets, file_plan.sizes, strict=True)):
                yield file_id, index, buffer[offset : offset + size]


def part_of(file: SourceFile) -> int:
    return int(file.path.rpartition("/")[2])
