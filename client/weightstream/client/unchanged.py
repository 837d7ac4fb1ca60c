"""The bytes an update keeps as unchanged, checked: does the target hold the new revision there?

update_into asks only for what GetChanges says changed since the revision the module holds, and
keeps the rest as it is. GetChanges also carries the new revision's CRC32C of each block
(block_bytes, 1 MiB) of every tensor it did not change whole; stale() checksums the target's bytes
of every such block the update keeps and names those that differ, which the update then asks for
like changed ones. So a module that did not hold since there (zeroed, written into, holding another
revision) ends holding the revision the update reports, not one it merely names.

What is checked: every whole block the update keeps, in the tensor's own bytes. What is kept
unchecked (trusted to hold since): the part of a block that a tensor-parallel slice along dim 0
holds only in part (the block's CRC32C covers bytes the rank does not hold), slices along another
dimension, and targets written through staging (another dtype, a strided view, several views),
whose bytes are not the checkpoint's.

Cost: one read of the kept bytes. Host memory is checksummed where it lies, on threads of its own
(awscrt releases the GIL); device memory is copied into a pinned host buffer piece by piece and
checksummed there.

Concurrency: stale() reads the targets on the caller's thread and its pool's; nothing may write into
them meanwhile (the update's streams start after it returns).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from weightstream.client.errors import IntegrityError
from weightstream.protocol import wire

# Blocks checksummed per task on the host pool: few enough tasks that their overhead stays small.
BLOCKS_PER_TASK = 16
# The pinned host buffer device bytes are copied through, in blocks.
DEVICE_STAGING_BLOCKS = 64


@dataclass(frozen=True)
class Kept:
    """The byte ranges of one target an update keeps, and the new revision's block CRC32Cs to check them by.

    buffer: the target's bytes (flat uint8, host or device), numbered as the ranges are. start: where
    buffer's first byte lies in the full tensor's bytes (a dim-0 slice's offset; 0 for a whole
    tensor). crcs: one per block_bytes block of the full tensor, full_nbytes long.
    """

    name: str
    buffer: torch.Tensor
    ranges: list[tuple[int, int]]
    start: int
    full_nbytes: int
    crcs: tuple[int, ...]


def check_crcs(model: str, name: str, full_nbytes: int, block_bytes: int, crcs: tuple[int, ...]) -> None:
    """IntegrityError when a GetChanges answer's block CRC32Cs cannot be those of a tensor of full_nbytes."""
    want = -(-full_nbytes // block_bytes) if block_bytes > 0 else -1
    if len(crcs) != want:
        raise IntegrityError(
            f"model {model!r}: tensor {name!r}: the server sent {len(crcs)} block CRC32Cs for {full_nbytes} bytes "
            f"in blocks of {block_bytes} (expected {max(want, 0)})"
        )


def blocks(kept: Kept, block_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(block index, start, end in buffer's bytes) of each whole block of the full tensor that lies in kept's ranges."""
    for s, e in kept.ranges:
        low, high = s + kept.start, e + kept.start
        index = -(-low // block_bytes)
        while True:
            begin = index * block_bytes
            end = min(begin + block_bytes, kept.full_nbytes)
            if begin >= high or end > high:
                break
            yield index, begin - kept.start, end - kept.start
            index += 1


def stale(targets: list[Kept], block_bytes: int, threads: int) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges (in each buffer's bytes) of targets' checked blocks whose CRC32C is not the new
    revision's, per target name (those with none left out)."""
    found: dict[str, list[tuple[int, int]]] = {}
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="weightstream-unchanged") as pool:
        host = [kept for kept in targets if kept.buffer.device.type == "cpu"]
        work = [(kept, batch) for kept in host for batch in _batched(blocks(kept, block_bytes), BLOCKS_PER_TASK)]
        for name, differing in pool.map(lambda job: (job[0].name, _differing(*job)), work):
            if differing:
                found.setdefault(name, []).extend(differing)
        device = [kept for kept in targets if kept.buffer.device.type != "cpu"]
        if device:
            staging = torch.empty(DEVICE_STAGING_BLOCKS * block_bytes, dtype=torch.uint8, pin_memory=True)
            for kept in device:
                for batch in _batched(blocks(kept, block_bytes), DEVICE_STAGING_BLOCKS):
                    differing = _differing_on_device(kept, batch, staging, pool)
                    if differing:
                        found.setdefault(kept.name, []).extend(differing)
    for ranges in found.values():
        ranges.sort()
    return found


def _batched(items: Iterator[tuple[int, int, int]], size: int) -> Iterator[list[tuple[int, int, int]]]:
    while batch := list(itertools.islice(items, size)):
        yield batch


def _differing(kept: Kept, batch: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    address = kept.buffer.data_ptr()
    return [(s, e) for index, s, e in batch if wire.crc32c_at(address + s, e - s) != kept.crcs[index]]


def _differing_on_device(
    kept: Kept, batch: list[tuple[int, int, int]], staging: torch.Tensor, pool: ThreadPoolExecutor
) -> list[tuple[int, int]]:
    """_differing for a device buffer: batch's bytes copied into staging (pinned) first, in runs of adjacent blocks."""
    first, last = batch[0][1], batch[-1][2]
    if last - first == sum(e - s for _, s, e in batch):  # adjacent: one copy
        staging[: last - first].copy_(kept.buffer[first:last])
        places = [(index, s - first) for index, s, _ in batch]
    else:
        places, at = [], 0
        for index, s, e in batch:
            staging[at : at + e - s].copy_(kept.buffer[s:e])
            places.append((index, at))
            at += e - s
    address = staging.data_ptr()

    def differs(item: tuple[tuple[int, int], tuple[int, int, int]]) -> bool:
        (index, at), (_, s, e) = item
        return wire.crc32c_at(address + at, e - s) != kept.crcs[index]

    pairs = list(zip(places, batch, strict=True))
    return [(s, e) for ((_, _), (_, s, e)), bad in zip(pairs, pool.map(differs, pairs), strict=True) if bad]


def without(ranges: list[tuple[int, int]], removed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """ranges (sorted, disjoint) less removed (sorted, disjoint)."""
    out: list[tuple[int, int]] = []
    cuts = iter(removed)
    cut = next(cuts, None)
    for s, e in ranges:
        while s < e:
            while cut is not None and cut[1] <= s:
                cut = next(cuts, None)
            if cut is None or cut[0] >= e:
                out.append((s, e))
                break
            if cut[0] > s:
                out.append((s, cut[0]))
            s = cut[1]
    return out
