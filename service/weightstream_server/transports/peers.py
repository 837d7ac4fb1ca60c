"""The fleet fan-out RPCs: GetBlockHashes and StreamRevisionBlocks, translated to revisions.peer_blocks.

StreamRevisionBlocks is a stream like the others: a stream slot, the per-client share, the stall rule
on each message; it serves only blocks of a published revision kept here or being pulled here
(revisions.peer_blocks), never files. A request that names a refused_peer is a puller's report that
that peer's blocks failed their hashes: the peer is left out of that revision's plans here.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import InvalidRequest, ModelNotFound
from weightstream_server.revisions.fanout import Fanout, parse_peer
from weightstream_server.revisions.peer_blocks import Holdings
from weightstream_server.revisions.store import RevisionStore
from weightstream_server.serving.stream_session import Streams
from weightstream_server.storage.model_ids import check_revision_name
from weightstream_server.transports import rpc

# A tensor name longer than this is no tensor's.
MAX_NAME_CHARS = 4096
# A refused_peer longer than this is no "HOST:PORT".
MAX_ADDRESS_CHARS = 300


class PeersServicer:
    """GetBlockHashes and StreamRevisionBlocks. Safe to call from many threads."""

    def __init__(
        self, streams: Streams, revisions: RevisionStore, holdings: Holdings, fanout: Fanout, stall_s: float
    ) -> None:
        self._streams = streams
        self._revisions = revisions
        self._holdings = holdings
        self._fanout = fanout
        self._stall_s = stall_s

    def GetBlockHashes(
        self, request: pb.GetBlockHashesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetBlockHashesResponse]:
        try:
            check_revision_name(request.model, request.revision, "GetBlockHashes")
            kept = self._revisions.find(request.model, request.revision)
            if kept is None or kept.block_hashes is None:
                raise ModelNotFound(
                    f"model {request.model[:200]!r}: revision {request.revision} is not kept or not hashed here"
                )
            hashes = kept.block_hashes
            tensors = [t.name for t in kept.manifest.tensors]
        except Exception as exc:
            rpc.abort(context, self._streams.stats, "GetBlockHashes", request.model, exc)
        for name in tensors:
            yield pb.GetBlockHashesResponse(tensor=name, hashes=list(hashes.get(name, ())))

    def StreamRevisionBlocks(
        self, request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        streams = self._streams
        with streams.session(context, method="StreamRevisionBlocks", kind="peer", model=request.model) as session:
            check_revision_name(request.model, request.revision, "StreamRevisionBlocks")
            if any(len(name) > MAX_NAME_CHARS for name in request.tensors):
                raise InvalidRequest("StreamRevisionBlocks: a tensor name is too long")
            if request.refused_peer:
                refused = parse_peer(request.refused_peer[:MAX_ADDRESS_CHARS])
                if refused is None:
                    raise InvalidRequest("StreamRevisionBlocks: refused_peer is no IP:PORT")
                self._fanout.refuse(request.model, request.revision, refused)
            blocks = self._holdings.blocks(
                request.model, request.revision, list(request.tensors), request.first_block, self._stall_s
            )
            counts = self._holdings.counts
            for index, data in blocks:
                message = _block_message(index, data)
                with session.waiting_on_client():
                    yield message
                session.count_sent(len(data))
                counts.served_bytes += len(data)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _block_message(index: int, data: bytes) -> bytes:
    """StreamRevisionBlocksResponse(index, data) serialized, with one copy of data (protobuf's own takes two)."""
    # Field 1 (index, varint) and field 15 (data, length-delimited), as protobuf writes them.
    return b"".join((b"\x08", _varint(index), b"\x7a", _varint(len(data)), data))


def add_to_server(servicer: PeersServicer, server: grpc.Server) -> None:
    rpc.register(
        server,
        rpc.handler(servicer.GetBlockHashes),
        rpc.handler(servicer.StreamRevisionBlocks, serialized=True),
    )
