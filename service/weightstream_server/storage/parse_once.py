"""Parsing a file once per version: one parse in flight per file, failures remembered, results kept if asked.

A header or index is parsed from a file version (its path and the version a listing gave it: a
modification time and identity, an ETag). Requests for the same version share one parse (single
flight), so concurrent requests of a huge header hold it once; a parse that failed on the file's
content (CorruptCheckpoint, UnsupportedCheckpoint) is remembered for that version and raised again
without reading the file, until the file changes. Errors that say nothing about the content
(storage unavailable, the file changed meanwhile) are not remembered: the next caller parses
again. Only the latest version of each path is kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from weightstream_server.errors import CorruptCheckpoint, ServerError, UnsupportedCheckpoint

T = TypeVar("T")
# Errors a file's bytes decide: the same version always fails the same way.
CONTENT_ERRORS = (CorruptCheckpoint, UnsupportedCheckpoint)


@dataclass
class _Flight(Generic[T]):
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: ServerError | None = None
    ok: bool = False


@dataclass(frozen=True)
class _Kept(Generic[T]):
    version: str
    result: T | None
    error: ServerError | None
    weight: int


class ParseOnce(Generic[T]):
    """Results of parse() by (path, version): shared while in flight, failures kept, results kept when keep_results.

    Kept entries are bounded by max_weight (a failure weighs 1, a result weight(result)); the least
    recently used go first, but the newest entry always stays. Results are shared between callers:
    never modify one. Concurrency: get() may be called from any thread.
    """

    def __init__(self, *, max_weight: int, keep_results: bool, weight: Callable[[T], int] = lambda _: 1) -> None:
        self._max_weight = max_weight
        self._keep_results = keep_results
        self._weight = weight
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, _Kept[T]] = OrderedDict()
        self._total = 0
        self._flights: dict[tuple[str, str], _Flight[T]] = {}
        self.parses = 0  # parse() calls made: what the tests and the benchmark count

    def get(self, path: str, version: str, parse: Callable[[], T]) -> T:
        """parse()'s result for this version of path, parsing only if no caller has (or is doing so now)."""
        while True:
            with self._lock:
                kept = self._kept.get(path)
                if kept is not None and kept.version == version:
                    self._kept.move_to_end(path)
                    if kept.error is not None:
                        raise type(kept.error)(str(kept.error))
                    return kept.result  # type: ignore[return-value]
                flight = self._flights.get((path, version))
                leader = flight is None
                if flight is None:
                    flight = self._flights[(path, version)] = _Flight()
                    self.parses += 1
            if leader:
                return self._lead(path, version, parse, flight)
            flight.done.wait()
            if flight.ok:
                return flight.result  # type: ignore[return-value]
            if flight.error is not None:
                raise type(flight.error)(str(flight.error))
            # The leader failed in a way that says nothing of the file: try again, perhaps as leader.

    def _lead(self, path: str, version: str, parse: Callable[[], T], flight: _Flight[T]) -> T:
        try:
            result = parse()
        except CONTENT_ERRORS as exc:
            # A copy without the traceback: the parse's frames (the file's bytes among their locals)
            # must not live as long as the remembered failure.
            error = type(exc)(str(exc))
            flight.error = error
            self._keep(path, _Kept(version, None, error, 1))
            raise
        else:
            flight.result, flight.ok = result, True
            if self._keep_results:
                self._keep(path, _Kept(version, result, None, self._weight(result)))
            return result
        finally:
            with self._lock:
                del self._flights[(path, version)]
            flight.done.set()

    def _keep(self, path: str, kept: _Kept[T]) -> None:
        with self._lock:
            old = self._kept.pop(path, None)
            if old is not None:
                self._total -= old.weight
            self._kept[path] = kept
            self._total += kept.weight
            while self._total > self._max_weight and len(self._kept) > 1:
                _, dropped = self._kept.popitem(last=False)
                self._total -= dropped.weight
