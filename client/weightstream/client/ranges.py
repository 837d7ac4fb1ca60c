"""Which byte ranges of a tensor have landed, so that a tensor is complete only when all of it is."""

from __future__ import annotations

import bisect


class RangeSet:
    """Disjoint [start, end) intervals within [0, size), merged as they are added.

    Chunks of one tensor usually arrive in order, so the set stays one interval long and each add
    costs O(1); out-of-order chunks cost O(number of gaps).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.covered = 0
        self._starts: list[int] = []
        self._ends: list[int] = []

    @property
    def complete(self) -> bool:
        return self.covered == self.size

    def add(self, start: int, end: int) -> int:
        """Add [start, end); returns how many of its bytes were new (re-sent bytes are harmless)."""
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"range [{start}, {end}) is outside [0, {self.size})")
        if start == end:
            return 0
        # Every interval that touches or overlaps [start, end) is merged into one.
        lo = bisect.bisect_left(self._ends, start)
        hi = bisect.bisect_right(self._starts, end)
        merged_start, merged_end = start, end
        already = 0
        for i in range(lo, hi):
            s, e = self._starts[i], self._ends[i]
            already += max(0, min(e, end) - max(s, start))
            merged_start = min(merged_start, s)
            merged_end = max(merged_end, e)
        self._starts[lo:hi] = [merged_start]
        self._ends[lo:hi] = [merged_end]
        new = (end - start) - already
        self.covered += new
        return new

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any byte of [start, end) has landed."""
        i = bisect.bisect_right(self._ends, start)
        return i < len(self._starts) and self._starts[i] < end

    def missing(self) -> list[tuple[int, int]]:
        """The ranges not yet landed, in order."""
        gaps = []
        position = 0
        for s, e in zip(self._starts, self._ends, strict=True):
            if s > position:
                gaps.append((position, s))
            position = e
        if position < self.size:
            gaps.append((position, self.size))
        return gaps
