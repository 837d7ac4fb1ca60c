"""Fleet fan-out, what a server hands peers: the blocks of published revisions it keeps or is pulling.

A revision's blocks are the DIGEST_BLOCK_BYTES blocks of each tensor (weightstream.protocol.digests),
numbered across the tensors a request names, in its order. A block is served from a revision this
server keeps (published, in memory), or from one it is still pulling (Pull) once that block arrived
and was checked against the upstream's hashes; and, where Holdings has StoredBlocks, from a model's
current storage revision (revisions.stored_blocks says from which files). Nothing else is ever served:
no files, no revision not named exactly, and never a byte outside the tensor's own bytes.

Keep-alives: a request may ask for a word while it waits here for a block (Holdings.blocks with
keepalive_s): at once, then every keepalive_s, so that its puller can tell a peer still setting up
from a cut link. They change no rule for how long a request waits; a kept revision serves at once
and never needs them.

Memory: a Pull's views belong to the publisher's part being filled. Blocks are copied out of them
under the Pull's lock, and a failed pull is closed (under the same lock) before the publisher frees
its part, so a peer never reads memory that was given back.

Concurrency: every method may be called from any thread.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from weightstream.protocol.digests import DIGEST_BLOCK_BYTES
from weightstream_server.errors import InvalidRequest, ModelNotFound, SourceStalled
from weightstream_server.revisions.published_source import PublishedSource
from weightstream_server.revisions.store import PUBLISHED, RevisionStore
from weightstream_server.revisions.stored_blocks import StoredBlocks
from weightstream_server.serving.catalog import Manifest

# Tensors one request may name.
MAX_TENSORS = 1 << 20
POLL_S = 0.05
# How long a peer's request waits for a revision this server has begun to take to start being pulled
# (its manifest, hashes and memory come first), and how many such revisions are remembered; then, by
# default, for the pull's first block (Holdings' first_block_s).
ARRIVAL_S = 30.0
MAX_EXPECTED = 64
# While a request waits for a block, how often it looks whether its caller is still there.
CALLER_CHECK_S = 0.25
# The keep-alive periods honoured, whatever a request asks: a puller cannot make a server flood it.
KEEPALIVE_MIN_S = 0.05
KEEPALIVE_MAX_S = 5.0


class CallerLeft(Exception):
    """The peer that asked for the blocks is gone (its call ended): stop waiting for them."""


class Wake(enum.Enum):
    """What a wait for a block returns when its wake-up time came first (a keep-alive is due)."""

    NOT_YET = "not yet"


def _always() -> bool:
    return True


def blocks_of(nbytes: int) -> int:
    """A tensor's DIGEST_BLOCK_BYTES blocks: none for an empty one, as weightstream.protocol.digests counts."""
    return -(-nbytes // DIGEST_BLOCK_BYTES)


@dataclass
class PeerCounts:
    """What fan-out did here, for /metrics: blocks and bytes from peers and the upstream, refusals, fallbacks.

    Written from many threads (each pull, each peer served): through add() and refused(), under a lock."""

    peer_bytes: int = 0
    upstream_bytes: int = 0
    refused_blocks: int = 0
    fallbacks: int = 0
    served_bytes: int = 0
    refused_peers: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, peer_bytes: int = 0, upstream_bytes: int = 0, served_bytes: int = 0, fallbacks: int = 0) -> None:
        with self._lock:
            self.peer_bytes += peer_bytes
            self.upstream_bytes += upstream_bytes
            self.served_bytes += served_bytes
            self.fallbacks += fallbacks

    def refused(self, peer: str) -> None:
        """One block of peer failed its hash here (the last 16 such peers are kept)."""
        with self._lock:
            self.refused_blocks += 1
            self.refused_peers = [*self.refused_peers[-15:], peer]


class Pull:
    """A revision being pulled here: its tensors' views and how many leading blocks of each are checked."""

    def __init__(
        self, model: str, revision: str, views: dict[str, torch.Tensor], first_block_s: float = ARRIVAL_S
    ) -> None:
        self.model = model
        self.revision = revision
        self._views = {name: view.view(-1).view(torch.uint8) for name, view in views.items()}
        self._done = dict.fromkeys(views, 0)
        self._closed = False
        # Until its first block, a pull waits on its own source (a peer still setting up, then the
        # upstream): a request's wait then lasts as long as this pull may itself wait, first_block_s.
        self._begun = time.monotonic()
        self._first_block_s = first_block_s
        self._flowing = False
        self._changed = threading.Condition()

    def size(self, tensor: str) -> int | None:
        """The bytes of tensor in this pull; None if it does not have it."""
        view = self._views.get(tensor)
        return None if view is None else int(view.numel())

    def advance(self, tensor: str, blocks: int) -> None:
        """The first `blocks` blocks of tensor are written and checked."""
        with self._changed:
            self._done[tensor] = blocks
            self._flowing = True
            self._changed.notify_all()

    def close(self) -> None:
        """No block of this pull is read from now on (its memory is about to go, or it is kept)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def block(
        self,
        tensor: str,
        index: int,
        deadline: float,
        alive: Callable[[], bool] = _always,
        wake: float | None = None,
    ) -> bytes | Wake | None:
        """A copy of block index of tensor once checked here; None if this pull does not have the tensor
        or ended. SourceStalled at deadline; CallerLeft once alive() is False; Wake.NOT_YET at wake
        (if given) while the block is still awaited (ask again with the same deadline to go on)."""
        with self._changed:
            view = self._views.get(tensor)
            if view is None:
                return None
            while not self._closed and self._done[tensor] <= index:
                now = time.monotonic()
                until = deadline if self._flowing else max(deadline, self._begun + self._first_block_s)
                left = until - now
                if left <= 0:
                    raise SourceStalled(f"block {index} of tensor {tensor!r} did not arrive here in time")
                if not alive():
                    raise CallerLeft
                if wake is not None:
                    if now >= wake:
                        return Wake.NOT_YET
                    left = min(left, wake - now)
                self._changed.wait(min(left, CALLER_CHECK_S))
            if self._closed:
                return None
            start = index * DIGEST_BLOCK_BYTES
            return bytes(view[start : start + DIGEST_BLOCK_BYTES].numpy().data)


class Holdings:
    """The pulls in progress here and the kept revisions: where a peer's block request is answered from."""

    def __init__(
        self, store: RevisionStore, first_block_s: float = ARRIVAL_S, stored: StoredBlocks | None = None
    ) -> None:
        """first_block_s: how long a peer's request may wait for the first block of a pull here (the
        longest this server's own pull may wait for it: peer_pull.first_block_wait)."""
        self._store = store
        self._first_block_s = first_block_s
        # The current storage revisions' blocks (fleet fan-out of storage revisions); None: not served.
        self.stored = stored
        self._lock = threading.Lock()
        self._pulls: dict[tuple[str, str], Pull] = {}
        # Revisions this server has begun to take (a watch reported them) but not yet pulling: a
        # peer's request for one waits up to ARRIVAL_S for its pull, not only its stall time.
        self._expected: dict[tuple[str, str], float] = {}
        self.counts = PeerCounts()

    def expect(self, model: str, revision: str) -> None:
        with self._lock:
            self._expected[(model, revision)] = time.monotonic()
            while len(self._expected) > MAX_EXPECTED:
                self._expected.pop(next(iter(self._expected)))

    def forget(self, model: str, revision: str) -> None:
        with self._lock:
            self._expected.pop((model, revision), None)

    def begin(self, model: str, revision: str, views: dict[str, torch.Tensor]) -> Pull:
        pull = Pull(model, revision, views, self._first_block_s)
        with self._lock:
            self._pulls[(model, revision)] = pull
        return pull

    def end(self, pull: Pull) -> None:
        pull.close()
        with self._lock:
            if self._pulls.get((pull.model, pull.revision)) is pull:
                del self._pulls[(pull.model, pull.revision)]

    def blocks(
        self,
        model: str,
        revision: str,
        tensors: Sequence[str],
        first: int,
        stall_s: float,
        alive: Callable[[], bool] = _always,
        keepalive_s: float = 0.0,
    ) -> Iterator[tuple[int, bytes] | None]:
        """(index, bytes) of each block of tensors of revision from block first, each as soon as it is
        here; a wait longer than stall_s for one block ends it (SourceStalled); a revision neither kept
        nor being pulled here within stall_s is ModelNotFound. A wait ends with CallerLeft once alive()
        is False (the asking peer's call ended), not at its deadline.

        keepalive_s > 0 (held to KEEPALIVE_MIN_S..KEEPALIVE_MAX_S): None (a keep-alive to send) while
        the next block is awaited, as soon as the stream's first wait begins and every keepalive_s
        after; the deadlines stay those of the block awaited."""
        if not tensors or len(tensors) > MAX_TENSORS or len(set(tensors)) != len(tensors):
            raise InvalidRequest("StreamRevisionBlocks needs distinct tensor names, at least one")
        period = min(max(keepalive_s, KEEPALIVE_MIN_S), KEEPALIVE_MAX_S) if keepalive_s > 0 else None
        # The first keep-alive at once: a cut link is told from a live peer from the start.
        wake = time.monotonic() if period is not None else None
        index = 0
        for tensor in tensors:
            deadline = time.monotonic() + stall_s
            while (size := self._size(model, revision, tensor, deadline, alive, wake)) is Wake.NOT_YET:
                yield None
                wake = _next_wake(period)
            count = blocks_of(size)
            if index + count <= first:
                index += count
                continue
            for block in range(max(0, first - index), count):
                deadline = time.monotonic() + stall_s
                while (data := self._block(model, revision, tensor, block, deadline, alive, wake)) is Wake.NOT_YET:
                    yield None
                    wake = _next_wake(period)
                yield index + block, data
                wake = _next_wake(period)
            index += count
        if first > index:
            raise InvalidRequest(f"first_block {first} is past the {index} blocks of the tensors named")

    def _size(
        self, model: str, revision: str, tensor: str, deadline: float, alive: Callable[[], bool], wake: float | None
    ) -> int | Wake:
        while True:
            with self._lock:
                pull = self._pulls.get((model, revision))
                if (model, revision) in self._expected:
                    deadline = max(deadline, self._expected[(model, revision)] + ARRIVAL_S)
            size = pull.size(tensor) if pull is not None else None
            if size is not None:
                return size
            kept = self._kept(model, revision)
            if kept is not None:
                entry = kept.by_name.get(tensor)
                if entry is None:
                    raise ModelNotFound(f"model {model[:200]!r}: revision {revision} has no tensor {tensor[:200]!r}")
                return int(entry.nbytes)
            stored = self.stored.size(model, revision, tensor) if self.stored is not None else None
            if stored is not None:
                return stored
            if time.monotonic() > deadline:
                raise ModelNotFound(
                    f"model {model[:200]!r}: published revision {revision} is neither kept nor arriving here"
                )
            if not alive():
                raise CallerLeft
            if _woken(wake):
                return Wake.NOT_YET
            time.sleep(POLL_S)

    def _block(
        self,
        model: str,
        revision: str,
        tensor: str,
        index: int,
        deadline: float,
        alive: Callable[[], bool],
        wake: float | None,
    ) -> bytes | Wake:
        while True:
            with self._lock:
                pull = self._pulls.get((model, revision))
            if pull is not None:
                data = pull.block(tensor, index, deadline, alive, wake)
                if data is not None:
                    return data
            kept = self._kept(model, revision)
            if kept is not None:
                entry = kept.by_name[tensor]
                assert isinstance(kept.source, PublishedSource)
                part = kept.source.part_buffer(entry.file_index)
                start = entry.file_offset + index * DIGEST_BLOCK_BYTES
                end = min(entry.file_offset + entry.nbytes, start + DIGEST_BLOCK_BYTES)
                return bytes(part[start:end].numpy().data)
            stored = self.stored.block(model, revision, tensor, index) if self.stored is not None else None
            if stored is not None:
                return stored
            if time.monotonic() > deadline:
                raise SourceStalled(f"block {index} of tensor {tensor!r} did not arrive here in time")
            if not alive():
                raise CallerLeft
            if _woken(wake):
                return Wake.NOT_YET
            time.sleep(POLL_S)

    def _kept(self, model: str, revision: str) -> Manifest | None:
        kept = self._store.find(model, revision)
        if kept is None or kept.origin != PUBLISHED or not isinstance(kept.manifest.source, PublishedSource):
            return None
        return kept.manifest


def _next_wake(period: float | None) -> float | None:
    """When the next keep-alive is due (None: none asked for)."""
    return None if period is None else time.monotonic() + period


def _woken(wake: float | None) -> bool:
    return wake is not None and time.monotonic() >= wake
