"""Reads of object stores that stop answering: given up on after --storage-timeout, and counted until the
store's backend lets go of them, so that stuck streamers (each holding its ring) stay bounded; and the
listings and small reads of a bucket that stopped answering, failed at once for a while (objects.Breaker,
here on a clock the test moves).

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
from weightstream_server.storage.objects import COOLDOWN_S, STALLED_S, Breaker

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


def test_a_bucket_that_stalled_fails_at_once_until_one_call_finds_it_answering() -> None:
    now = [100.0]
    breaker = Breaker("gs://b", clock=lambda: now[0])
    calls: list[str] = []

    def fails(after: float) -> str:
        calls.append("fails")
        now[0] += after
        raise StorageUnavailable(
            "gs://b/m/: Google Cloud Storage failed for 15 s of retries (ConnectionError); try again"
        )

    def answers() -> str:
        calls.append("answers")
        return "listed"

    # Failing quickly (the store answered, with an error) leaves the bucket's calls alone.
    with pytest.raises(StorageUnavailable):
        breaker.call("gs://b/m/", lambda: fails(0.1))
    assert breaker.call("gs://b/m/", answers) == "listed"
    # Failing after stalling: the next calls fail at once, naming the object asked for and the failure.
    with pytest.raises(StorageUnavailable):
        breaker.call("gs://b/m/", lambda: fails(STALLED_S))
    calls.clear()
    now[0] += COOLDOWN_S - 1
    with pytest.raises(StorageUnavailable, match=r"gs://b/other/: gs://b did not answer 14 s ago .*ConnectionError"):
        breaker.call("gs://b/other/", answers)
    assert calls == []
    # Then one call tries the store again; others meanwhile still fail at once.
    now[0] += 1

    def tried_while_another_call_tries() -> str:
        with pytest.raises(StorageUnavailable, match="being tried again by another call"):
            breaker.call("gs://b/other/", answers)
        return answers()

    assert breaker.call("gs://b/m/", tried_while_another_call_tries) == "listed"
    assert calls == ["answers"]
    assert breaker.call("gs://b/other/", answers) == "listed"
    # A trial that stalls again starts another wait.
    with pytest.raises(StorageUnavailable):
        breaker.call("gs://b/m/", lambda: fails(STALLED_S))
    now[0] += COOLDOWN_S
    with pytest.raises(StorageUnavailable):
        breaker.call("gs://b/m/", lambda: fails(STALLED_S))
    with pytest.raises(StorageUnavailable, match="did not answer 0 s ago"):
        breaker.call("gs://b/m/", answers)
