"""Figures read from a running server: the samples of its Prometheus exposition, and its process's memory."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import rss


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, by (name, sorted labels)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@contextlib.contextmanager
def rss_sampler(pid: int, period: float = 0.02) -> Iterator[list[int]]:
    """Sample the RSS of process pid every period seconds while the block runs; yields the samples list."""
    taken: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            value = rss(pid)
            if value:
                taken.append(value)
            done.wait(period)

    thread = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    thread.start()
    try:
        yield taken
    finally:
        done.set()
        thread.join(timeout=5)
