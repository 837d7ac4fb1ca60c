"""The check of the bytes an update keeps as unchanged (weightstream.client.unchanged), on host tensors:
which blocks it looks at (whole blocks only, a dim-0 slice's edges left alone) and which it finds stale.
The CUDA path (a pinned copy first) needs a GPU and is not run here."""

from __future__ import annotations

import pytest
import torch

from weightstream.client import IntegrityError
from weightstream.client.unchanged import Kept, blocks, check_crcs, stale, without
from weightstream.protocol import wire

BLOCK = 4096


def crcs_of(data: torch.Tensor) -> tuple[int, ...]:
    return tuple(wire.crc32c(data[i : i + BLOCK].numpy().tobytes()) for i in range(0, data.numel(), BLOCK))


def test_only_whole_blocks_inside_the_kept_ranges_are_checked() -> None:
    full = torch.arange(10 * BLOCK + 100, dtype=torch.int64).to(torch.uint8)
    # A dim-0 slice from 1.5 blocks to 8.25 blocks; it keeps all of its bytes.
    start, end = BLOCK + BLOCK // 2, 8 * BLOCK + BLOCK // 4
    kept = Kept("t", full[start:end], [(0, end - start)], start, full.numel(), crcs_of(full))
    assert [index for index, _, _ in blocks(kept, BLOCK)] == [2, 3, 4, 5, 6, 7]
    # The last, shorter block of a whole tensor is checked too.
    whole = Kept("t", full, [(0, full.numel())], 0, full.numel(), crcs_of(full))
    assert [index for index, _, _ in blocks(whole, BLOCK)] == list(range(11))


def test_blocks_that_differ_are_named_and_the_rest_kept() -> None:
    full = torch.randint(0, 255, (16 * BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    held = full.clone()
    held[3 * BLOCK + 7] ^= 1
    held[9 * BLOCK : 11 * BLOCK] = 0
    kept = Kept("t", held, [(0, 8 * BLOCK), (9 * BLOCK, 16 * BLOCK)], 0, full.numel(), crcs_of(full))
    found = stale([kept], BLOCK, threads=2)
    assert found == {"t": [(3 * BLOCK, 4 * BLOCK), (9 * BLOCK, 10 * BLOCK), (10 * BLOCK, 11 * BLOCK)]}
    assert without(kept.ranges, found["t"]) == [(0, 3 * BLOCK), (4 * BLOCK, 8 * BLOCK), (11 * BLOCK, 16 * BLOCK)]
    assert stale([Kept("t", full, kept.ranges, 0, full.numel(), kept.crcs)], BLOCK, threads=2) == {}


def test_a_count_of_block_crcs_that_does_not_fit_the_tensor_is_refused() -> None:
    check_crcs("m", "t", 3 * BLOCK + 1, BLOCK, (1, 2, 3, 4))
    with pytest.raises(IntegrityError, match=r"tensor 't'.*3 block CRC32Cs"):
        check_crcs("m", "t", 3 * BLOCK + 1, BLOCK, (1, 2, 3))
    with pytest.raises(IntegrityError, match="blocks of 0"):
        check_crcs("m", "t", 3 * BLOCK, 0, (1, 2, 3))
