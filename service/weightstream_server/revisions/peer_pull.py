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

Changed blocks only: where this server holds a revision of the model in memory (Held: a kept
published revision), a block whose upstream hash equals the held block's hash at the same index (same
dtype and shape) is copied from it here, not asked for; the request's wanted bitmap names the
others. Copied blocks count as checked once copied (their CRC32C is the held block's) and become
available to this server's peers in order with the received ones. A block sent that is not the next
one wanted is refused like a wrong one, but for a block taken here already on the way to it: a peer
or upstream that predates the bitmap sends every block from first_block, and those are dropped unread
(they cost the link, not the pull).

Deltas: the request names the held revision (since); a block may come as an XOR delta against the
held copy of it. It is decoded into place from that copy and its result checked against the
upstream's hash like any block; a delta that cannot apply (no held block of that tensor, another
size, a payload that does not decode) is refused like a wrong block. A checked delta is kept
(Holdings.encoded) so that this server forwards it unchanged to its own peers asking with the same since.

Concurrency: one pull runs on its caller's thread, with one watchdog thread for the stall rule.
Memory: the held revision's tensors are views of its memory, only read, which they keep alive while the pull runs.
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
from weightstream.client.peers import Block, BlockStream
from weightstream.protocol import deltas, digests, dtypes, wire
from weightstream.protocol.digests import DIGEST_BLOCK_BYTES
from weightstream_server.errors import UpstreamError
from weightstream_server.revisions.peer_blocks import (
    KEEPALIVE_MAX_S,
    KEEPALIVE_MIN_S,
    Holdings,
    Pull,
    blocks_of,
    wanted_bitmap,
)

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


@dataclass(frozen=True)
class HeldTensor:
    """A tensor of a held revision: its bytes (flat uint8, read only) and its blocks' CRC32Cs and BLAKE3 hashes."""

    flat: torch.Tensor
    crcs: Sequence[int]
    hashes: Sequence[bytes]


@dataclass(frozen=True)
class Held:
    """A revision this server holds in memory: its name, and its tensors that have the dtype and shape of
    the same tensor in the revision pulled."""

    revision: str
    tensors: dict[str, HeldTensor]


@dataclass
class PullReport:
    # Block bytes taken from a peer and from the upstream, and copied from the held revision.
    peer_bytes: int = 0
    upstream_bytes: int = 0
    copied_bytes: int = 0
    # What the blocks taken cost on the wire (a delta's payload, else the block), and blocks taken as deltas.
    peer_wire_bytes: int = 0
    upstream_wire_bytes: int = 0
    delta_blocks: int = 0
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
    held: Held | None = None,
    use_deltas: bool = True,
) -> PullReport:
    """Fill views (tensors names of the revision manifest describes, in that order) from parent's blocks
    (or the upstream's, parent ""), each checked; the rest from the upstream where parent fails, stalls
    or (min_rate > 0) forwards slower than min_rate bytes/s (a slow peer would slow its whole chain).
    Blocks that held has unchanged are copied from it, not asked for; use_deltas: blocks may come as
    deltas against held.

    Raises where the upstream itself fails or lies (the caller's pull then fails whole)."""
    model, revision = manifest.model, manifest.revision
    hashes = upstream.block_hashes(model, revision)
    checked_hashes(manifest, hashes)
    sizes = {info.name: info.nbytes for info in manifest.tensors}
    order = [(name, j) for name in names for j in range(blocks_of(sizes[name]))]
    flats = {name: views[name].view(-1).view(torch.uint8) for name in names}
    held_tensors = {
        name: tensor
        for name, tensor in (held.tensors.items() if held is not None else ())
        if name in flats
        and tensor.flat.numel() == flats[name].numel()
        and len(tensor.hashes) == len(tensor.crcs) == len(hashes[name])
    }
    copies = [name in held_tensors and held_tensors[name].hashes[j] == hashes[name][j] for name, j in order]
    wanted = wanted_bitmap([not copy for copy in copies]) if any(copies) else b""
    since = held.revision if held is not None and held_tensors and use_deltas else ""
    receiving = _Receiving(manifest, order, hashes, flats, held_tensors, copies, holdings, since)
    counts = holdings.counts
    report = PullReport()
    pull = holdings.begin(model, revision, {name: views[name] for name in names})
    try:
        source = parent
        receiving.copy_from(0, pull, report)
        next_block = receiving.position
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
                    since=since,
                    wanted=wanted,
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
                try:
                    receiving.receive(stream, watchdog, pull, report, source)
                finally:
                    next_block = receiving.position  # a fallback goes on from the first block not taken
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


class _Receiving:
    """How one pull places its blocks: which are copied from the held revision, and how each one received
    is checked and written (decoded first when it came as a delta against since)."""

    def __init__(
        self,
        manifest: Manifest,
        order: Sequence[tuple[str, int]],
        hashes: dict[str, tuple[bytes, ...]],
        flats: dict[str, torch.Tensor],
        held: dict[str, HeldTensor],
        copies: Sequence[bool],
        holdings: Holdings,
        since: str,
    ) -> None:
        self._model = manifest.model
        self._revision = manifest.revision
        self._order = order
        self._hashes = hashes
        self._flats = flats
        self._held = held
        self._copies = copies
        self._holdings = holdings
        self._since = since  # "" : no delta was asked for, none may come
        self._codec: deltas.Codec | None = None
        # The first block not yet taken (written, checked and advanced in the Pull).
        self.position = 0

    def copy_from(self, position: int, pull: Pull, report: PullReport) -> None:
        """Copy the blocks from position on that the held revision has unchanged, up to the next wanted one
        (or the end), which becomes self.position."""
        order = self._order
        while position < len(order) and self._copies[position]:
            name, j = order[position]
            view = self._block_view(name, j)
            held = self._held[name]
            start = j * DIGEST_BLOCK_BYTES
            view.copy_(held.flat[start : start + view.numel()])
            self._record(report, name, j, held.crcs[j])
            pull.advance(name, j + 1)
            report.copied_bytes += view.numel()
            position += 1
        self.position = position

    def receive(
        self,
        stream: BlockStream,
        watchdog: _Watchdog,
        pull: Pull,
        report: PullReport,
        source: str,
    ) -> None:
        """Take stream's blocks from self.position on, each the next wanted one, checked; blocks taken
        already (copied here) that a sender predating wanted sends on the way are dropped unread."""
        order = self._order
        last = -1  # the number of the stream's last block: numbers only grow
        for block in stream:
            if block is None:
                watchdog.keepalive()  # never counted as bytes
                continue
            watchdog.block(len(block.data))
            next_block = self.position
            if last < block.number < next_block and len(block.data) <= DIGEST_BLOCK_BYTES:
                # Not wanted, and taken here: an older sender's (it sends every block from first_block).
                last = block.number
                if source:
                    report.peer_wire_bytes += len(block.data)
                else:
                    report.upstream_wire_bytes += len(block.data)
                continue
            if block.number != next_block or next_block >= len(order):
                raise BadBlock(f"block {block.number} came where block {next_block} was due")
            last = block.number
            name, j = order[next_block]
            view = self._block_view(name, j)
            crc = self._place(block, name, j, view)
            self._record(report, name, j, crc)
            pull.advance(name, j + 1)
            if source:
                report.peer_bytes += view.numel()
                report.peer_wire_bytes += len(block.data)
            else:
                report.upstream_bytes += view.numel()
                report.upstream_wire_bytes += len(block.data)
            report.delta_blocks += 1 if block.encoding else 0
            self.copy_from(next_block + 1, pull, report)

    def _block_view(self, name: str, j: int) -> torch.Tensor:
        flat = self._flats[name]
        start = j * DIGEST_BLOCK_BYTES
        return flat[start : min(flat.numel(), start + DIGEST_BLOCK_BYTES)]

    def _place(self, block: Block, name: str, j: int, view: torch.Tensor) -> int:
        """Write block (block j of tensor name) into view, checked against the upstream's hash; its CRC32C.
        BadBlock where it does not check (view may then hold anything: it is not advanced)."""
        expected = self._hashes[name][j]
        length = view.numel()
        if not block.encoding:
            if len(block.data) != length or digests.block_hash(memoryview(block.data)) != expected:
                raise BadBlock(f"block {j} of tensor {name!r} does not match the upstream's hash")
            view.numpy()[:] = np.frombuffer(block.data, dtype=np.uint8)
            return wire.crc32c_at(view.data_ptr(), length)
        base = self._held.get(name) if self._since else None
        if base is None:
            raise BadBlock(f"block {j} of tensor {name!r} came as a delta, and none can apply here")
        if len(block.data) > deltas.WORTH * length:
            # No server sends a delta that saves less (deltas.WORTH); a larger one (padding after its frame
            # decodes to nothing) would be kept and forwarded as it came to the peers below.
            raise BadBlock(f"block {j} of tensor {name!r} came as a delta of {len(block.data)} bytes: not worth it")
        if self._codec is None:
            self._codec = deltas.Codec()
        start = j * DIGEST_BLOCK_BYTES
        payload = np.frombuffer(block.data, dtype=np.uint8)
        try:
            decoded = self._codec.decode(length, start, payload.ctypes.data, payload.size, block.encoding)
        except deltas.DeltaUnusable as exc:
            raise BadBlock(f"block {j} of tensor {name!r} came as a delta that does not decode: {exc}") from None
        view.copy_(base.flat[start : start + length])
        crc = decoded.xor_into(view)
        if digests.block_hash(view.numpy().data) != expected:
            raise BadBlock(
                f"block {j} of tensor {name!r}, a delta against {self._since}, does not match the upstream's hash"
            )
        # Checked: forwarded as it came to this server's peers that name the same since.
        key = (self._model, self._revision, self._since, name, j)
        self._holdings.encoded.put(key, (block.encoding, block.data))
        return crc

    def _record(self, report: PullReport, name: str, j: int, crc: int) -> None:
        known = report.known.setdefault(name, [])
        del known[j:]  # a block taken again after a fallback
        known.append((crc, self._hashes[name][j]))
