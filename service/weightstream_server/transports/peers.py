"""The fleet fan-out RPCs: GetBlockHashes and StreamRevisionBlocks, translated to revisions.peer_blocks.

Both are streams like the others: a stream slot, the per-client share, the stall rule on each
message. An upstream serves them with --fanout (GetBlockHashes to every peer, StreamRevisionBlocks
to the peers it plans at the root); a sidecar serves StreamRevisionBlocks with --peers (to the peers
planned below it). StreamRevisionBlocks serves only blocks of a published revision kept here or being
pulled here, or of a model's current storage revision (revisions.peer_blocks, revisions.stored_blocks),
never files. GetBlockHashes of a storage revision not digested yet digests it first (revisions.changes:
each file version once, single flight), so that its manifest then carries the digest. A request that
names a refused_peer is a puller's report that that peer's blocks failed their hashes: with --fanout,
and when the caller is the puller this server planned directly below that peer, the peer is left out
of that revision's plans here; otherwise the report is ignored. A request with keepalive_ms gets a
waiting message while its next block is awaited here (revisions.peer_blocks says when, and the
periods honoured). A request's wanted bitmap picks the blocks sent; its since lets this server send
blocks as deltas against a revision it keeps too (revisions.peer_blocks).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from weightstream.protocol.framing import varint
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import InvalidRequest, ModelNotFound
from weightstream_server.revisions.changes import Changes
from weightstream_server.revisions.fanout import Fanout, parse_peer, reporter_host
from weightstream_server.revisions.peer_blocks import CallerLeft, Holdings
from weightstream_server.revisions.store import STORAGE, RevisionStore
from weightstream_server.serving.stream_session import Streams
from weightstream_server.storage.model_ids import check_revision_name
from weightstream_server.transports import rpc

# A tensor name longer than this is no tensor's.
MAX_NAME_CHARS = 4096
# A refused_peer longer than this is no "HOST:PORT".
MAX_ADDRESS_CHARS = 300
# StreamRevisionBlocksResponse(waiting=True) serialized: a keep-alive.
WAITING_MESSAGE = pb.StreamRevisionBlocksResponse(waiting=True).SerializeToString()


class PeersServicer:
    """GetBlockHashes and StreamRevisionBlocks. Safe to call from many threads.

    fanout: this server's plan (--fanout), or None: refused_peer reports are ignored."""

    def __init__(
        self,
        streams: Streams,
        revisions: RevisionStore,
        holdings: Holdings,
        fanout: Fanout | None,
        stall_s: float,
        changes: Changes | None = None,
    ) -> None:
        self._streams = streams
        # Digests storage revisions asked for (GetBlockHashes); None: only revisions digested already.
        self._changes = changes
        self._revisions = revisions
        self._holdings = holdings
        self._fanout = fanout
        self._stall_s = stall_s

    def GetBlockHashes(
        self, request: pb.GetBlockHashesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetBlockHashesResponse]:
        with self._streams.session(context, method="GetBlockHashes", kind="hashes", model=request.model) as session:
            check_revision_name(request.model, request.revision, "GetBlockHashes")
            kept = self._revisions.find(request.model, request.revision)
            if kept is not None and kept.origin == STORAGE and kept.block_hashes is None and self._changes is not None:
                self._changes.blocks(kept)  # a superseded storage revision is not digested (its files are gone)
            if kept is None or kept.block_hashes is None:
                raise ModelNotFound(
                    f"model {request.model[:200]!r}: revision {request.revision} is not kept or not hashed here"
                )
            hashes = kept.block_hashes
            for info in kept.manifest.tensors:
                message = pb.GetBlockHashesResponse(tensor=info.name, hashes=list(hashes.get(info.name, ())))
                with session.waiting_on_client():
                    yield message

    def StreamRevisionBlocks(
        self, request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        streams = self._streams
        with streams.session(context, method="StreamRevisionBlocks", kind="peer", model=request.model) as session:
            check_revision_name(request.model, request.revision, "StreamRevisionBlocks")
            if any(len(name) > MAX_NAME_CHARS for name in request.tensors):
                raise InvalidRequest("StreamRevisionBlocks: a tensor name is too long")
            refused = None
            if request.refused_peer:
                refused = parse_peer(request.refused_peer[:MAX_ADDRESS_CHARS])
                if refused is None:
                    raise InvalidRequest("StreamRevisionBlocks: refused_peer is no IP:PORT")
            blocks = self._holdings.blocks(
                request.model,
                request.revision,
                list(request.tensors),
                request.first_block,
                self._stall_s,
                context.is_active,
                request.keepalive_ms / 1000,
                request.wanted,
                request.since,
            )
            # Only for a revision this server keeps (nothing is stored for names a reader made up), and
            # only from the puller planned below the peer (Fanout.refuse).
            fanout = self._fanout
            if refused and fanout is not None and self._revisions.find(request.model, request.revision):
                fanout.refuse(request.model, request.revision, refused, reporter_host(session.peer))
            counts = self._holdings.counts
            try:
                for block in blocks:
                    if block is None:
                        with session.waiting_on_client():
                            yield WAITING_MESSAGE
                        continue
                    message = _block_message(block.number, block.data, block.encoding)
                    with session.waiting_on_client():
                        yield message
                    session.count_sent(len(block.data))
                    counts.add(served_bytes=len(block.data), served_deltas=1 if block.encoding else 0)
            except CallerLeft:
                return  # the peer left while its next block was awaited here: its slot is free now


def _block_message(index: int, data: bytes, encoding: int = 0) -> bytes:
    """StreamRevisionBlocksResponse(index, encoding, data) serialized, with one copy of data (protobuf's own
    takes two)."""
    # Field 1 (index, varint), field 3 (encoding, varint; left out when 0) and field 15 (data,
    # length-delimited), as protobuf writes them.
    coded = (b"\x18", varint(encoding)) if encoding else ()
    return b"".join((b"\x08", varint(index), *coded, b"\x7a", varint(len(data)), data))


def add_to_server(servicer: PeersServicer, server: grpc.Server, *, hashes: bool, blocks: bool) -> None:
    """Add GetBlockHashes if hashes (an upstream with --fanout) and StreamRevisionBlocks if blocks (--fanout or
    --peers); a method not added answers UNIMPLEMENTED."""
    handlers = []
    if hashes:
        handlers.append(rpc.handler(servicer.GetBlockHashes))
    if blocks:
        handlers.append(rpc.handler(servicer.StreamRevisionBlocks, serialized=True))
    if handlers:
        rpc.register(server, *handlers)
