"""Fleet fan-out, what a server hands peers: the blocks of published revisions it keeps or is pulling.

A revision's blocks are the DIGEST_BLOCK_BYTES blocks of each tensor (weightstream.protocol.digests),
numbered across the tensors a request names, in its order. A block is served from a revision this
server keeps (published, in memory), or from one it is still pulling (Pull) once that block arrived
and was checked against the upstream's hashes; and, where Holdings has StoredBlocks, from a model's
current storage revision (revisions.stored_blocks says from which files). Nothing else is ever served:
no files, no revision not named exactly, and never a byte outside the tensor's own bytes.

Blocks wanted: a request may name the blocks it wants (a bitmap over its numbering, wanted_at); the
others are skipped. A puller that holds a revision whose block has the upstream's hash copies that
block from it and asks only for the others.

Deltas: a request may name a revision it holds (since). Where this server keeps since too (a
published revision in memory) and since's tensor has the block's dtype and shape, a block may be
sent as an XOR delta against since's block (weightstream.protocol.deltas), when that saves at least
a quarter of the block's bytes. Each block is encoded at most once per since here: the result (a
payload, or "send it raw") is kept in Encoded within the --delta-cache-bytes budget, and a pull
keeps there the deltas it received and checked, so a relay forwards them unchanged to pullers that
name the same since. The puller decodes a delta against its own copy of since and checks the result
against the upstream's hash; nothing here is taken on a peer's word.

Keep-alives: a request may ask for a word while it waits here for a block (Holdings.blocks with
keepalive_s): at once, then every keepalive_s, so that its puller can tell a peer still setting up
from a cut link. They change no rule for how long a request waits; a kept revision serves at once
and never needs them.

Memory: Encoded holds at most its budget of payload bytes (and MAX_ENCODED entries), oldest out
first; a request costs one block of scratch (its Codec) while it encodes. A Pull's views belong to
the publisher's part being filled. Blocks are copied out of them under the Pull's lock, and a
failed pull is closed (under the same lock) before the publisher frees its part, so a peer never
reads memory that was given back.

Concurrency: every method may be called from any thread.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from weightstream.client.peers import Block
from weightstream.protocol import deltas
from weightstream.protocol.digests import DIGEST_BLOCK_BYTES
from weightstream_server.errors import InvalidRequest, ModelNotFound, SourceStalled
from weightstream_server.revisions.published_source import PublishedSource
from weightstream_server.revisions.store import PUBLISHED, RevisionStore
from weightstream_server.revisions.stored_blocks import StoredBlocks
from weightstream_server.serving.catalog import Manifest
from weightstream_server.storage.model_ids import check_revision_name

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
# A wanted bitmap longer than this (bytes: 32 Mi blocks, 32 TiB of tensors) is no revision's.
MAX_WANTED_BYTES = 1 << 22
# Blocks whose encoding is remembered (Encoded), whatever their bytes.
MAX_ENCODED = 1 << 16
# Where an Encoded block stands for "send it raw" (no delta saves enough).
RAW = (0, b"")
# Layout of a tensor: its dtype and shape.
Layout = tuple[torch.dtype, tuple[int, ...]]


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


def wanted_at(wanted: bytes, index: int) -> bool:
    """Whether block index is in the wanted bitmap (bit index % 8 of byte index // 8; empty: every block)."""
    if not wanted:
        return True
    byte = index >> 3
    return byte < len(wanted) and bool((wanted[byte] >> (index & 7)) & 1)


def wanted_bitmap(flags: Sequence[bool]) -> bytes:
    """The wanted bitmap of flags (flags[i]: block i is wanted)."""
    bits = np.packbits(np.asarray(flags, dtype=bool), bitorder="little")
    return bits.tobytes()


class Encoded:
    """How blocks of revisions travel as deltas against a since: (encoding, payload) per (model, revision,
    since, tensor, block), RAW where no delta was worth it. At most budget payload bytes and
    MAX_ENCODED entries, oldest out first. Safe to use from many threads."""

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str, str, str, int], tuple[int, bytes]] = OrderedDict()
        self._bytes = 0
        # The blocks being encoded now, one lock each: requests for the same one wait for its result.
        self._flights: dict[tuple[str, str, str, str, int], threading.Lock] = {}

    @property
    def budget(self) -> int:
        return self._budget

    def get(self, key: tuple[str, str, str, str, int]) -> tuple[int, bytes] | None:
        with self._lock:
            return self._kept.get(key)

    @contextlib.contextmanager
    def flight(self, key: tuple[str, str, str, str, int]) -> Iterator[None]:
        """Held while key is encoded: one request at a time encodes a block (the others then find it here)."""
        with self._lock:
            flight = self._flights.setdefault(key, threading.Lock())
        with flight:
            try:
                yield
            finally:
                with self._lock:
                    if self._flights.get(key) is flight:
                        del self._flights[key]

    def put(self, key: tuple[str, str, str, str, int], value: tuple[int, bytes]) -> None:
        if len(value[1]) > self._budget:
            return
        with self._lock:
            old = self._kept.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._kept[key] = value
            self._bytes += len(value[1])
            while self._bytes > self._budget or len(self._kept) > MAX_ENCODED:
                _, dropped = self._kept.popitem(last=False)
                self._bytes -= len(dropped[1])


@dataclass
class PeerCounts:
    """What fan-out did here, for /metrics: blocks and bytes from peers and the upstream, refusals, fallbacks.

    Written from many threads (each pull, each peer served): through add() and refused(), under a lock."""

    peer_bytes: int = 0
    upstream_bytes: int = 0
    refused_blocks: int = 0
    fallbacks: int = 0
    served_bytes: int = 0
    # Bytes of pulled revisions' blocks copied from a revision held here (their hash unchanged).
    copied_bytes: int = 0
    # What the pulled blocks cost on the wire (payloads: a delta's, else the block's), by source.
    peer_wire_bytes: int = 0
    upstream_wire_bytes: int = 0
    # Blocks served as deltas (served_bytes counts what was sent: a delta's payload, else the block).
    served_deltas: int = 0
    # Blocks encoded here (a delta tried against a since; at most once per block and since while kept).
    encoded_blocks: int = 0
    refused_peers: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self,
        *,
        peer_bytes: int = 0,
        upstream_bytes: int = 0,
        served_bytes: int = 0,
        fallbacks: int = 0,
        copied_bytes: int = 0,
        peer_wire_bytes: int = 0,
        upstream_wire_bytes: int = 0,
        served_deltas: int = 0,
        encoded_blocks: int = 0,
    ) -> None:
        with self._lock:
            self.peer_bytes += peer_bytes
            self.upstream_bytes += upstream_bytes
            self.served_bytes += served_bytes
            self.fallbacks += fallbacks
            self.copied_bytes += copied_bytes
            self.peer_wire_bytes += peer_wire_bytes
            self.upstream_wire_bytes += upstream_wire_bytes
            self.served_deltas += served_deltas
            self.encoded_blocks += encoded_blocks

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
        self._layouts: dict[str, Layout] = {name: (view.dtype, tuple(view.shape)) for name, view in views.items()}
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

    def layout(self, tensor: str) -> Layout | None:
        """The dtype and shape of tensor in this pull; None if it does not have it."""
        return self._layouts.get(tensor)

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
        self,
        store: RevisionStore,
        first_block_s: float = ARRIVAL_S,
        encoded_budget: int = 0,
        stored: StoredBlocks | None = None,
    ) -> None:
        """first_block_s: how long a peer's request may wait for the first block of a pull here (the
        longest this server's own pull may wait for it: peer_pull.first_block_wait)."""
        self._store = store
        self._first_block_s = first_block_s
        # Blocks as deltas against a since, encoded here or received and checked (within encoded_budget).
        self.encoded = Encoded(encoded_budget)
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
        wanted: bytes = b"",
        since: str = "",
    ) -> Iterator[Block | None]:
        """Each Block of tensors of revision from block first that wanted names (empty: all), each as soon
        as it is here, as a delta against since where this server keeps since and one saves enough. A
        wait longer than stall_s for one block ends it (SourceStalled); a revision neither kept nor
        being pulled here within stall_s is ModelNotFound. A wait ends with CallerLeft once alive()
        is False (the asking peer's call ended), not at its deadline.

        keepalive_s > 0 (held to KEEPALIVE_MIN_S..KEEPALIVE_MAX_S): None (a keep-alive to send) while
        the next block is awaited, as soon as the stream's first wait begins and every keepalive_s
        after; the deadlines stay those of the block awaited."""
        if not tensors or len(tensors) > MAX_TENSORS or len(set(tensors)) != len(tensors):
            raise InvalidRequest("StreamRevisionBlocks needs distinct tensor names, at least one")
        if len(wanted) > MAX_WANTED_BYTES:
            raise InvalidRequest(f"StreamRevisionBlocks: a wanted bitmap of {len(wanted)} bytes is no revision's")
        if since:
            check_revision_name(model, since, "StreamRevisionBlocks (since)")
        # --delta-cache-bytes 0: no deltas here, as for updating clients.
        encoder = (
            _Encoder(self, model, revision, since) if since and since != revision and self.encoded.budget else None
        )
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
                if not wanted_at(wanted, index + block):
                    continue
                deadline = time.monotonic() + stall_s
                while (data := self._block(model, revision, tensor, block, deadline, alive, wake)) is Wake.NOT_YET:
                    yield None
                    wake = _next_wake(period)
                encoding, payload = encoder.encode(tensor, block, data) if encoder is not None else RAW
                yield Block(index + block, payload if encoding else data, encoding)
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

    def layout(self, model: str, revision: str, tensor: str) -> Layout | None:
        """The dtype and shape of tensor in revision as pulled or kept here; None if neither has it."""
        with self._lock:
            pull = self._pulls.get((model, revision))
        layout = pull.layout(tensor) if pull is not None else None
        if layout is not None:
            return layout
        kept = self._kept(model, revision)
        entry = kept.by_name.get(tensor) if kept is not None else None
        return (entry.dtype.torch, tuple(entry.shape)) if entry is not None else None

    def kept_block(self, model: str, revision: str, tensor: str, index: int, layout: Layout) -> torch.Tensor | None:
        """Block index of tensor of a published revision kept here (a view of its memory, valid while the
        revision is kept), if it has that tensor with layout; None otherwise."""
        kept = self._kept(model, revision)
        entry = kept.by_name.get(tensor) if kept is not None else None
        if kept is None or entry is None or (entry.dtype.torch, tuple(entry.shape)) != layout:
            return None
        assert isinstance(kept.source, PublishedSource)
        part = kept.source.part_buffer(entry.file_index)
        start = entry.file_offset + index * DIGEST_BLOCK_BYTES
        end = min(entry.file_offset + entry.nbytes, start + DIGEST_BLOCK_BYTES)
        return part[start:end] if start < end else None


class _Encoder:
    """One request's deltas against its since: each block encoded at most once here (Holdings.encoded).
    Belongs to the request's thread (its Codec and scratch)."""

    def __init__(self, holdings: Holdings, model: str, revision: str, since: str) -> None:
        self._holdings = holdings
        self._model = model
        self._revision = revision
        self._since = since
        self._codec = deltas.Codec()
        self._scratch: np.ndarray | None = None

    def encode(self, tensor: str, index: int, data: bytes) -> tuple[int, bytes]:
        """(encoding, payload) of block index of tensor whose bytes are data; RAW: send data itself."""
        holdings = self._holdings
        key = (self._model, self._revision, self._since, tensor, index)
        known = holdings.encoded.get(key)
        if known is not None:
            return known
        with holdings.encoded.flight(key):
            known = holdings.encoded.get(key)  # encoded by another request meanwhile
            return known if known is not None else self._encode(key, tensor, index, data)

    def _encode(self, key: tuple[str, str, str, str, int], tensor: str, index: int, data: bytes) -> tuple[int, bytes]:
        holdings = self._holdings
        layout = holdings.layout(self._model, self._revision, tensor)
        base = holdings.kept_block(self._model, self._since, tensor, index, layout) if layout is not None else None
        if base is None or base.numel() != len(data):
            return RAW  # since is not here (or has no such block): nothing to remember
        new = np.frombuffer(data, dtype=np.uint8)
        old = base.numpy()
        offset = index * DIGEST_BLOCK_BYTES
        result: tuple[int, bytes] | None = None
        if not deltas.dense_between(new, old):
            if self._scratch is None:
                self._scratch = np.empty(DIGEST_BLOCK_BYTES, dtype=np.uint8)
            where = deltas.changed_words(new, old, offset)
            result = self._codec.encode_between(new, old, where, offset, self._scratch)
        encoded = result if result is not None else RAW
        holdings.counts.add(encoded_blocks=1)
        holdings.encoded.put(key, encoded)
        return encoded


def _next_wake(period: float | None) -> float | None:
    """When the next keep-alive is due (None: none asked for)."""
    return None if period is None else time.monotonic() + period


def _woken(wake: float | None) -> bool:
    return wake is not None and time.monotonic() >= wake
