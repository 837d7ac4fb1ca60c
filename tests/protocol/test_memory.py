"""Region: every write by address is checked against the buffer it belongs to."""

from __future__ import annotations

import numpy as np
import pytest

from weightstream.protocol import wire
from weightstream.protocol.memory import OutsideRegion, Region


def region_of(buffer: np.ndarray) -> Region:
    return Region(int(buffer.ctypes.data), buffer.size, "a test buffer")


@pytest.mark.parametrize(("offset", "length"), [(-1, 4), (0, 17), (16, 1), (10, 7), (0, -1), (1 << 62, 1)])
def test_a_range_outside_the_buffer_is_refused_and_nothing_is_written(offset: int, length: int) -> None:
    buffer = np.zeros(32, dtype=np.uint8)
    region = Region(int(buffer.ctypes.data), 16, "a test buffer")  # the first half only
    with pytest.raises(OutsideRegion, match=r"a test buffer: bytes .* outside its 16 bytes"):
        region.at(offset, length)
    source = np.full(max(length, 0), 7, dtype=np.uint8)
    with pytest.raises(OutsideRegion):
        region.copy_crc32c(offset, int(source.ctypes.data), length)
    if length > 0:
        with pytest.raises(OutsideRegion):
            region.put(offset, bytes(length))
    assert not buffer.any()


def test_writes_inside_land_where_asked_with_their_crc() -> None:
    buffer = np.zeros(16, dtype=np.uint8)
    region = region_of(buffer)
    source = np.arange(1, 9, dtype=np.uint8)
    assert region.copy_crc32c(8, int(source.ctypes.data), 8) == wire.crc32c(source.tobytes())
    region.put(0, b"\x05\x06")
    assert buffer.tolist() == [5, 6, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert region.at(16, 0) == region.address + 16  # an empty range at the end is inside
