"""publish_chunks' encoder pool ends cleanly however its generator is closed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from weightstream.client import revisions


def test_a_delta_publish_abandoned_and_closed_on_an_encoder_thread_ends_without_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publish that failed leaves its generator to the garbage collector, which may close it on one of
    the generator's own encoder threads: that close must not wait for its own thread (RuntimeError)."""
    pools: list[ThreadPoolExecutor] = []

    class Recorded(ThreadPoolExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(revisions, "ThreadPoolExecutor", Recorded)
    generator = torch.Generator().manual_seed(3)
    new = torch.randn(64 * 1024, generator=generator)
    base = {"w": new.clone()}
    base["w"][::7] += 1
    chunks = revisions.publish_chunks([("w", new)], 4096, base)
    assert next(chunks).tensor == "w"
    (pool,) = pools
    pool.submit(chunks.close).result(timeout=30)  # on one of its own threads, as the collector may
    pool.shutdown(wait=True)
