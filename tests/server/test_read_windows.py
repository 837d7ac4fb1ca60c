"""Slow start of a stream's reads: its first window is small, each next one twice the last, and every
unit of the plan is read once, in order (serving/reader.read_windows). The end-to-end effect, on a
real server under open/cancel churn, is in tests/e2e/test_load.py and benchmarks/churn_memory.py."""

from __future__ import annotations

import itertools

from weightstream_server.serving.reader import SLOW_START_BYTES, read_windows
from weightstream_server.storage.reads import ChunkPlace, FilePlan, ReadPlan, UnitPlace

MIB = 1024 * 1024


def plan_of(*files: list[int]) -> ReadPlan:
    plans = []
    for index, sizes in enumerate(files):
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        places = [UnitPlace(ChunkPlace(f"t{index}.{i}", 0, size)) for i, size in enumerate(sizes)]
        plans.append(FilePlan(index, offsets, sizes, places))
    total = sum(sum(sizes) for sizes in files)
    return ReadPlan(tuple(plans), total, sum(len(sizes) for sizes in files), 4 * MIB)


def test_windows_start_small_double_and_cover_every_unit_once_in_order() -> None:
    plan = plan_of([4 * MIB] * 40, [16 * MIB] * 20)  # 480 MiB in two files
    windows = list(read_windows(plan, read_ahead_bytes=256 * MIB))
    assert windows[0].nbytes == SLOW_START_BYTES
    for before, after in itertools.pairwise(windows[:4]):
        assert after.nbytes >= 2 * before.nbytes - 16 * MIB, (before.nbytes, after.nbytes)
    # The rest once the read-ahead is reached: one window, whose ring recycles.
    assert len(windows) <= 6
    units = [(f, i) for w in windows for f, start, end in w.spans for i in range(start, end)]
    assert units == [(0, i) for i in range(40)] + [(1, i) for i in range(20)]
    assert sum(w.nbytes for w in windows) == plan.total_bytes
    assert all(w.largest == max(plan.files[f].sizes[s:e][0] for f, s, e in w.spans) for w in windows)


def test_a_small_read_ahead_or_plan_is_one_window() -> None:
    assert len(list(read_windows(plan_of([4 * MIB] * 3), read_ahead_bytes=256 * MIB))) == 1
    windows = list(read_windows(plan_of([4 * MIB] * 30), read_ahead_bytes=16 * MIB))
    assert [w.nbytes for w in windows] == [120 * MIB]
