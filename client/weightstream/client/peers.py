"""A stream of a revision's blocks from a server or a peer (StreamRevisionBlocks), cancellable from any thread.

The blocks are the sender's word: a caller checks each against block hashes it got from a server it
trusts (weightstream.protocol.digests), never against anything the sender says; a block sent as a
delta (encoding) is checked once decoded against the caller's own copy of the request's since.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from weightstream.client.errors import translated


class Block(NamedTuple):
    """One block as sent: its number in the request's numbering, its payload, and how the payload stands
    for the block (0: its bytes; else a weightstream.v1 ChunkEncoding delta against the request's since)."""

    number: int
    data: bytes
    encoding: int


class BlockStream:
    """Each Block as it arrives; cancel() ends it (the iteration then raises).

    keepalives (the request asked for them): None for each keep-alive the sender sends while it
    waits for the next block itself; otherwise keep-alives are dropped. A keep-alive carries nothing."""

    def __init__(self, target: str, call: Any, *, keepalives: bool = False) -> None:
        self.target = target
        self._call = call
        self._keepalives = keepalives

    def __iter__(self) -> Iterator[Block | None]:
        with translated(self.target):
            try:
                for response in self._call:
                    if response.waiting:
                        if self._keepalives:
                            yield None
                        continue
                    yield Block(response.index, response.data, response.encoding)
            finally:
                self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()
