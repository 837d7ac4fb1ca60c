"""CRC32Cs the server keeps, so that bytes it sends again need not be read to be checksummed.

Keys name a file version (path, size, fingerprint: see source.SourceFile.fingerprint) and, for a
chunk, its range in the file: a file whose content may have changed has another fingerprint, so a
kept CRC32C never vouches for bytes it was not computed on. What is sent is still checked by the
client against the CRC32C, so a file changed behind the fingerprint's back fails the check rather
than reach a tensor.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)


class KeptChecksums(Generic[Key]):
    """Up to `kept` CRC32Cs by key, least recently used dropped first. Every method may be called from any thread."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._crcs: OrderedDict[Key, int] = OrderedDict()

    def get(self, key: Key) -> int | None:
        with self._lock:
            crc = self._crcs.get(key)
            if crc is not None:
                self._crcs.move_to_end(key)
            return crc

    def put(self, key: Key, crc: int) -> None:
        with self._lock:
            self._crcs[key] = crc
            self._crcs.move_to_end(key)
            while len(self._crcs) > self._kept:
                self._crcs.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._crcs)
