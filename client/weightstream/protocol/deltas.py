"""The delta encodings' layout, written once for both sides (weightstream.v1 ChunkEncoding).

CHUNK_ENCODING_XOR_ZSTD: a zstd frame (its content size written) of the XOR of a chunk's bytes with
the base revision's bytes at the same place. CHUNK_ENCODING_SPARSE_XOR_ZSTD: a zstd frame of the
same XOR's nonzero words only: COUNT (how many), then that many gaps (uint32, little-endian: the
first word's index, then each one's distance from the one before, never 0), then the words
(little-endian). A word is word_bytes(offset, length) bytes, and the whole is never longer than the
chunk (else the dense form is smaller). The sparse form costs the client work only where the chunk
changed; the dense one compresses better where changes are close together.
"""

from __future__ import annotations

import struct

COUNT = struct.Struct("<I")
GAP_BYTES = 4


def word_bytes(offset: int, length: int) -> int:
    """The sparse form's word size for a chunk at offset of length bytes: 2 when both are even, else 1."""
    return 2 if offset % 2 == 0 and length % 2 == 0 else 1


def sparse_bytes(count: int, word: int) -> int:
    """The decoded size of a sparse delta of count words of word bytes."""
    return COUNT.size + count * (GAP_BYTES + word)
