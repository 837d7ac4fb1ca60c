"""Block CRC32Cs learned from what a stream reads (serving.checksums): each 1 MiB block's CRC32C, also
where chunks cut blocks; nothing from a stream whose file was rewritten while it read, nor from one
that never committed; a bounded number of file versions kept. Real files, read by reader.DirectReader
(the shared-memory transport's reads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import write_pattern_file
from weightstream.protocol import wire
from weightstream_server.errors import ServerError
from weightstream_server.serving.catalog import Catalog, Manifest
from weightstream_server.serving.checksums import BLOCK_BYTES, ReadBlocks
from weightstream_server.serving.read_plan import plan_reads
from weightstream_server.serving.reader import DirectReader
from weightstream_server.storage.local import LocalSource

MIB = 1024 * 1024
# Three tensors of 3 MiB + 100 KiB: blocks that end short, and chunks of 768 KiB cut most blocks.
FILE_BYTES = 3 * (3 * MIB + 100 * 1024)
CHUNK_BYTES = 768 * 1024


def manifest_of(root: Path, model: str, pattern: bytes) -> Manifest:
    write_pattern_file(root / model / "model.safetensors", pattern, FILE_BYTES, tensors=3)
    return Catalog([LocalSource(root)]).manifest(model)


def read_all(manifest: Manifest, read_blocks: ReadBlocks, between: int = -1, change: object = None) -> None:
    """Every chunk of manifest read by DirectReader with a recorder of read_blocks; change() after chunk between."""
    plan = plan_reads(manifest, [], CHUNK_BYTES)
    buffer = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
    with DirectReader(manifest, plan, lambda n: None, threads=2, record=read_blocks.recorder(manifest)) as reader:
        for index, read in enumerate(reader.reads()):
            crc = read.start(buffer.data_ptr())
            crc = crc if isinstance(crc, int) else crc.result()
            assert crc == wire.crc32c_at(buffer.data_ptr(), read.place.length)
            if index == between and callable(change):
                change()


def true_blocks(path: Path, manifest: Manifest) -> dict[str, tuple[int, ...]]:
    data = path.read_bytes()
    blocks = {}
    for entry in manifest.tensors:
        start = entry.file_offset
        tensor = data[start : start + entry.nbytes]
        blocks[entry.name] = tuple(
            wire.crc32c(tensor[i : i + BLOCK_BYTES]) for i in range(0, entry.nbytes, BLOCK_BYTES)
        )
    return blocks


def test_a_whole_read_teaches_every_blocks_crc32c_where_chunks_cut_blocks_too(tmp_path: Path) -> None:
    manifest = manifest_of(tmp_path, "whole", b"0123456789abcdefghij")
    read_blocks = ReadBlocks()
    assert read_blocks.blocks(manifest) is None
    read_all(manifest, read_blocks)
    assert read_blocks.blocks(manifest) == true_blocks(tmp_path / "whole" / "model.safetensors", manifest)


def test_a_file_rewritten_in_place_while_it_is_read_teaches_nothing(tmp_path: Path) -> None:
    manifest = manifest_of(tmp_path, "changed", b"old-version-")
    path = tmp_path / "changed" / "model.safetensors"

    def rewrite() -> None:
        other = tmp_path / "other.safetensors"
        write_pattern_file(other, b"NEW-VERSION-", FILE_BYTES, tensors=3)
        path.write_bytes(other.read_bytes())

    read_blocks = ReadBlocks()
    with pytest.raises(ServerError, match="changed"):
        read_all(manifest, read_blocks, between=2, change=rewrite)
    assert read_blocks.blocks(manifest) is None
    assert len(read_blocks) == 0


def test_a_recorder_never_committed_teaches_nothing_and_few_file_versions_are_kept(tmp_path: Path) -> None:
    manifests = [manifest_of(tmp_path, f"m{i}", b"pattern-%d" % i) for i in range(3)]
    read_blocks = ReadBlocks(kept_files=2)
    uncommitted = read_blocks.recorder(manifests[0])
    entry = manifests[0].tensors[0]
    uncommitted.record(entry.name, [(0, BLOCK_BYTES, 1234)])
    assert read_blocks.blocks(manifests[0]) is None
    for manifest in manifests:
        read_all(manifest, read_blocks)
    assert len(read_blocks) == 2
    assert read_blocks.blocks(manifests[0]) is None  # the least recently learned went first
    assert read_blocks.blocks(manifests[2]) is not None
