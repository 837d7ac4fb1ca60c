"""Bytes forged to keep a CRC32C: what a hostile publisher can send, since CRC32C is affine in the bytes."""

from __future__ import annotations

import numpy as np

from weightstream.protocol import wire


def crc32c(data: np.ndarray) -> int:
    return wire.crc32c_at(data.ctypes.data, data.size)


def match_crc32c(block: np.ndarray, target: int, at: int) -> None:
    """Set the 4 bytes of block (flat uint8, in place) at `at` so that the CRC32C of block is target.

    Flipping a bit of a fixed-length message flips a fixed set of bits of its CRC32C, so the flips of
    the 32 bits at `at` that turn the CRC32C into target solve a linear system over GF(2).
    """
    block[at : at + 4] = 0
    base = crc32c(block)
    # Pivot bit -> (the CRC32C bits it flips, the bits of block[at:at+4] that flip them).
    basis: dict[int, tuple[int, int]] = {}
    for bit in range(32):
        block[at + bit // 8] ^= 1 << (bit % 8)
        effect, combo = crc32c(block) ^ base, 1 << bit
        block[at + bit // 8] ^= 1 << (bit % 8)
        for pivot in reversed(range(32)):
            if not effect >> pivot & 1:
                continue
            if pivot not in basis:
                basis[pivot] = (effect, combo)
                break
            effect, combo = effect ^ basis[pivot][0], combo ^ basis[pivot][1]
    want, flips = base ^ target, 0
    for pivot in reversed(range(32)):
        if want >> pivot & 1:
            want, flips = want ^ basis[pivot][0], flips ^ basis[pivot][1]
    assert want == 0, "the 32 bits do not reach every CRC32C"
    for bit in range(32):
        if flips >> bit & 1:
            block[at + bit // 8] ^= 1 << (bit % 8)
