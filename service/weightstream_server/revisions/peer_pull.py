"""Fleet fan-out, the puller's side: a published revision's blocks from the peer the upstream planned, checked.

The upstream's block hashes of the revision (GetBlockHashes, themselves checked against the digest
of the upstream's manifest) are the only thing a block is checked against: each block from a peer
must have the expected index and length and the expected BLAKE3 hash, or it is refused, counted,
logged with the peer's address, and the rest of the revision is taken from the upstream (whose
next request names the peer as refused, so that the upstream plans no one else below it). A peer that
errs, ends early, sends no block for stall_s (killed, cut off, stalled), or forwards slower than
min_rate (a slow peer would slow its whole chain) is left the same way, without the refusal. Each
checked block is written into its place and made available to this server's own peers at once
(peer_blocks.Pull), so a chain forwards each block while it still receives.

A peer's first block may wait on the peer's own pull (its manifest, hashes and memory, its own
source): a peer is asked for keep-alives (a word every quarter stall time while it waits itself).
Before its first block, one that sent a keep-alive is left after one stall time without a word (a
cut link), and may take up to KEEPALIVE_FIRST_BLOCK_STALLS stall times while the words come; one that
sends none (a server that predates them) is given FIRST_BLOCK_STALLS stall times. After the first
block keep-alives change nothing: the stall rule and the rate floor count blocks only.

Concurrency: one pull runs on its caller's thread, with one watchdog thread for the stall rule.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from weightstream.client import WeightStreamClient
from weightstream.client.errors import WeightStreamError
from weightstream.client.manifest import Manifest
from weightstream.client.peers import BlockStream
from weightstream.protocol import digests, dtypes, wire
from weightstream.protocol.digests import DIGEST_BLOCK_BYTES
from weightstream_server.errors import UpstreamError
from weightstream_server.revisions.peer_blocks import KEEPALIVE_MAX_S, KEEPALIVE_MIN_S, Holdings, Pull, blocks_of

logger = logging.getLogger(__name__)

# What an upstream whose hashes or blocks do not add up is answered with.
LIED = grpc.StatusCode.DATA_LOSS
# A peer that sends no keep-alive may take this many stall times for its first block.
FIRST_BLOCK_STALLS = 10
# A peer that keeps sending keep-alives may take this many stall times for its first block, no more: a
# live peer whose own pull starts late is not left, and a hostile one cannot hold its puller for ever.
KEEPALIVE_FIRST_BLOCK_STALLS = 60
# Seconds without a block from the upstream itself before its pull fails.
UPSTREAM_STALL_S = 60.0
# A peer's rate is judged over at least this many stall times from its first block.
RATE_WINDOW_STALLS = 2


class BadBlock(Exception):
    """A block that is not the one asked for, or whose bytes do not hash to the upstream's hash."""


class EndedEarly(Exception):
    """A stream of blocks that ended before the last block."""


@dataclass
class PullReport:
    peer_bytes: int = 0
    upstream_bytes: int = 0
    refused: str = ""  # the peer whose block failed its hash, if one did
    # The pull, still serving this server's peers: ended by the caller once the revision is kept.
    pull: Pull | None = None
    # Each tensor's (CRC32C, BLAKE3) per block as written and checked: not computed again.
    known: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)


def checked_hashes(upstream: Manifest, hashes: dict[str, tuple[bytes, ...]]) -> None:
    """Raise UpstreamError unless hashes are a whole set for upstream's tensors and give its digest."""
    tensors = []
    for info in upstream.tensors:
        blocks = hashes.get(info.name)
        if blocks is None or len(blocks) != blocks_of(info.nbytes) or any(len(h) != 32 for h in blocks):
            raise UpstreamError(f"the upstream's block hashes of tensor {info.name!r} are not whole", LIED)
        tensors.append((info.name, dtypes.BY_TORCH[info.dtype].safetensors, info.shape, digests.hash_of_blocks(blocks)))
    if not upstream.digest or digests.revision_digest(tensors) != upstream.digest:
        raise UpstreamError(f"the upstream's block hashes do not give its digest of revision {upstream.revision}", LIED)


def first_block_wait(stall_s: float) -> float:
    """The longest a pull may wait for its first block (_Watchdog's rules): a peer's keep-alive allowance,
    then the upstream's first-block allowance once that peer is left. A peer asking this server for a
    pull's blocks may wait as long, so the serving side never cuts a chain whose upper nodes start late
    before its pullers' own rules would."""
    return KEEPALIVE_FIRST_BLOCK_STALLS * stall_s + FIRST_BLOCK_STALLS * max(stall_s, UPSTREAM_STALL_S)


def keepalive_ms(stall_s: float) -> int:
    """The keep-alive period to ask a peer for: a quarter of the stall time, within what servers honour."""
    return round(1000 * min(max(stall_s / 4, KEEPALIVE_MIN_S), KEEPALIVE_MAX_S))


class _Watchdog:
    """Cancels a stream that brings no block for stall_s, or (min_rate > 0) whose bytes since its first
    block came slower than min_rate bytes/s over at least RATE_WINDOW_STALLS stall times.

    Before the first block: first_stalls stall times; once a keep-alive came, a stall time without a
    keep-alive or a block, and keepalive_stalls stall times in all. `why` says why it fired."""

    def __init__(
        self,
        stream: BlockStream,
        stall_s: float,
        first_stalls: int = 1,
        min_rate: float = 0.0,
        keepalive_stalls: int = KEEPALIVE_FIRST_BLOCK_STALLS,
    ) -> None:
        self._stream = stream
        self._stall_s = stall_s
        self._min_rate = min_rate
        self._first_stalls = first_stalls
        self._keepalive_stalls = max(keepalive_stalls, first_stalls)
        self._started = time.monotonic()
        self.last = self._started  # the last block, or before the first one the last keep-alive
        self.first: float | None = None
        self.kept_alive = False  # a keep-alive came before the first block
        self.received = 0  # bytes after the first block
        self.fired = False
        self.slow = False
        self.why = ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightstream-peer-stall", daemon=True)
        self._thread.start()

    def keepalive(self) -> None:
        """A keep-alive came now: before the first block, the peer is still there (after it, nothing)."""
        if self.first is None:
            self.last = time.monotonic()
            self.kept_alive = True

    def block(self, nbytes: int) -> None:
        """A block of nbytes came now."""
        now = time.monotonic()
        self.last = now
        if self.first is None:
            self.first = now
        else:
            self.received += nbytes

    def rate(self) -> float:
        """Bytes per second since the first block."""
        first = self.first
        return self.received / max(time.monotonic() - first, 1e-9) if first is not None else 0.0

    def _run(self) -> None:
        while not self._done.wait(min(0.1, self._stall_s / 4)):
            now = time.monotonic()
            why = self._stalled(now)
            if why:
                self.why = why
                self.fired = True
                self._stream.cancel()
                return
            first = self.first
            if (
                self._min_rate > 0
                and first is not None
                and now - first >= RATE_WINDOW_STALLS * self._stall_s
                and self.rate() < self._min_rate
            ):
                self.slow = True
                self._stream.cancel()
                return

    def _stalled(self, now: float) -> str:
        """Why the stream is stalled at now, or ""."""
        stall = self._stall_s
        if self.first is not None:
            return f"sent no block for {stall:.1f} s" if now - self.last > stall else ""
        waited = now - self._started
        if self.kept_alive:
            if now - self.last > stall:
                return f"sent no block and no keep-alive for {stall:.1f} s after its keep-alives (cut off or stalled)"
            if waited > self._keepalive_stalls * stall:
                return f"sent keep-alives but no first block for {waited:.1f} s"
            return ""
        if waited > self._first_stalls * stall:
            return f"sent no first block and no keep-alive for {waited:.1f} s"
        return ""

    def close(self) -> None:
        self._done.set()


def pull_blocks(
    holdings: Holdings,
    upstream: WeightStreamClient,
    connect: Callable[[str], WeightStreamClient],
    manifest: Manifest,
    views: dict[str, torch.Tensor],
    names: Sequence[str],
    parent: str,
    stall_s: float,
    min_rate: float = 0.0,
) -> PullReport:
    """Fill views (tensors names of the revision manifest describes, in that order) from parent's blocks
    (or the upstream's, parent ""), each checked; the rest from the upstream where parent fails, stalls
    or (min_rate > 0) forwards slower than min_rate bytes/s (a slow peer would slow its whole chain).

    Raises where the upstream itself fails or lies (the caller's pull then fails whole)."""
    model, revision = manifest.model, manifest.revision
    hashes = upstream.block_hashes(model, revision)
    checked_hashes(manifest, hashes)
    sizes = {info.name: info.nbytes for info in manifest.tensors}
    order = [(name, j) for name in names for j in range(blocks_of(sizes[name]))]
    flats = {name: views[name].view(-1).view(torch.uint8) for name in names}
    counts = holdings.counts
    report = PullReport()
    pull = holdings.begin(model, revision, {name: views[name] for name in names})
    try:
        source = parent
        next_block = 0
        while next_block < len(order):
            # A peer's own client, closed whatever happens to its stream (the upstream's is the caller's).
            peer = connect(source) if source else None
            client = peer if peer is not None else upstream
            try:
                stream = client.revision_blocks(
                    model,
                    revision,
                    names,
                    first_block=next_block,
                    refused_peer="" if source else report.refused,
                    keepalive_ms=keepalive_ms(stall_s) if source else 0,
                )
            except BaseException:
                if peer is not None:
                    peer.close()
                raise
            # The upstream is held to the server-wide stall rule, not to a peer's.
            # The first block of a peer may wait for the peer's own pull to start (its manifest,
            # hashes and memory): see the module's docstring; a dead peer is refused at once.
            watchdog = _Watchdog(
                stream,
                stall_s if source else max(stall_s, UPSTREAM_STALL_S),
                FIRST_BLOCK_STALLS,
                min_rate if source else 0.0,
            )
            try:
                next_block = _receive(stream, watchdog, order, hashes, flats, pull, next_block, report, source)
                if next_block < len(order):
                    raise EndedEarly(f"the stream ended at block {next_block} of {len(order)}")
            except (WeightStreamError, BadBlock, EndedEarly) as exc:
                if not source:
                    code = exc.code if isinstance(exc, WeightStreamError) and exc.code is not None else LIED
                    raise UpstreamError(f"the upstream's blocks of revision {revision}: {exc}", code) from exc
                if watchdog.slow:
                    why = f"sent {watchdog.rate():.0f} bytes/s, under --peer-min-rate {min_rate:.0f}"
                elif watchdog.fired:
                    why = watchdog.why
                else:
                    why = str(exc)[:300]
                if isinstance(exc, BadBlock) and not (watchdog.fired or watchdog.slow):
                    counts.refused(source)
                    report.refused = source
                    logger.warning("model %r: revision %s: peer %s refused: %s", model, revision, source, why)
                else:
                    logger.warning("model %r: revision %s: peer %s left: %s", model, revision, source, why)
                counts.add(fallbacks=1)
                source = ""
            finally:
                watchdog.close()
                if peer is not None:
                    peer.close()
    except BaseException:
        holdings.end(pull)
        raise
    report.pull = pull
    return report


def _receive(
    stream: BlockStream,
    watchdog: _Watchdog,
    order: Sequence[tuple[str, int]],
    hashes: dict[str, tuple[bytes, ...]],
    flats: dict[str, torch.Tensor],
    pull: Pull,
    next_block: int,
    report: PullReport,
    source: str,
) -> int:
    for block in stream:
        if block is None:
            watchdog.keepalive()  # never counted as bytes
            continue
        index, data = block
        watchdog.block(len(data))
        if index != next_block or next_block >= len(order):
            raise BadBlock(f"block {index} came where block {next_block} was due")
        name, j = order[next_block]
        flat = flats[name]
        start = j * DIGEST_BLOCK_BYTES
        length = min(DIGEST_BLOCK_BYTES, flat.numel() - start)
        expected = hashes[name][j]
        if len(data) != length or digests.block_hash(memoryview(data)) != expected:
            raise BadBlock(f"block {j} of tensor {name!r} does not match the upstream's hash")
        flat[start : start + length].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        known = report.known.setdefault(name, [])
        del known[j:]  # a block taken again after a fallback
        known.append((wire.crc32c_at(flat.data_ptr() + start, length), expected))
        pull.advance(name, j + 1)
        if source:
            report.peer_bytes += length
        else:
            report.upstream_bytes += length
        next_block += 1
    return next_block
