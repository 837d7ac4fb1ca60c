"""Reads of object stores that stop answering: given up on after --storage-timeout, and counted until the
store's backend lets go of them, so that stuck streamers (each holding its ring) stay bounded.

The store here is a generator that blocks where a backend retrying a dead store would; the streamers
are the Run:ai streamer's own, out of a real StreamerPool. tests/server/test_object_stores.py stops a
real emulator under a real server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import generate_latest

from weightstream_server.errors import StorageUnavailable
from weightstream_server.ops.metrics import create_registry
from weightstream_server.ops.stats import ServerStats
from weightstream_server.serving.reader import StreamerPool, _within

TIMEOUT_S = 0.2
WAIT_S = 10.0


def _store(answer: threading.Event) -> Iterator[tuple[int, int, torch.Tensor]]:
    """One read, then none until answer is set (a store that stopped answering), then the last."""
    yield 0, 0, torch.zeros(4, dtype=torch.uint8)
    answer.wait(WAIT_S)
    yield 0, 1, torch.ones(4, dtype=torch.uint8)


def _wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_read_given_up_on_is_counted_until_its_store_lets_go() -> None:
    pool = StreamerPool(1, None, TIMEOUT_S)
    answer = threading.Event()
    try:
        with pool.checkout() as streamer:
            reads = _within(_store(answer), streamer, "gs://bucket/model")
            assert next(reads)[1] == 0
            with pytest.raises(StorageUnavailable, match=r"gs://bucket/model.*no bytes from the store for 0.2 s"):
                next(reads)
            assert streamer.stuck
        assert (pool.stuck, pool.in_use) == (1, 0)
        metrics = create_registry(ServerStats(), 1, pool=pool)
        assert "weightstream_store_reads_stuck 1.0" in generate_latest(metrics).decode()
        # The pool's one streamer is stuck: reads of stores are refused at once, naming the model.
        with pytest.raises(StorageUnavailable, match=r"gs://bucket/other.*1 reads of object stores still wait"):
            pool.refuse_stuck("gs://bucket/other")
        answer.set()
        _wait_for(lambda: pool.stuck == 0, "the streamer is parked once the store answers")
        pool.refuse_stuck("gs://bucket/other")
        assert "weightstream_store_reads_stuck 0.0" in generate_latest(metrics).decode()
    finally:
        answer.set()
        pool.close()
