"""The gRPC servicer: translates between protobuf messages and the server's domain objects.

Streams run in a StreamSession (serving/stream_session.py), which does their checks, counting and
end-of-stream line; errors become gRPC status codes in rpc.abort only.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import grpc

from weightstream.protocol.names import FILE_KINDS
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.errors import TcpUnavailable
from weightstream_server.serving.catalog import Manifest
from weightstream_server.serving.files import FileListing, list_files
from weightstream_server.serving.packing import pack_chunks
from weightstream_server.serving.stream_session import Streams, StreamSession
from weightstream_server.transports import rpc
from weightstream_server.transports.tcp.listener import DataPort
from weightstream_server.transports.tcp.servicer import CallConnection, FrameSender, accept, issue

logger = logging.getLogger(__name__)


class WeightStreamServicer(pb_grpc.WeightStreamServiceServicer):
    """GetManifest, StreamTensors, ListModelFiles and ReadModelFile. Safe to call from many threads."""

    def __init__(
        self, streams: Streams, data_port: DataPort | None = None, advertise: tuple[str, int] = ("", 0)
    ) -> None:
        self._streams = streams
        # Where file reads that ask for it send their bytes (tiers); None: over gRPC only.
        self._data_port = data_port
        self._advertise = advertise

    def GetManifest(self, request: pb.GetManifestRequest, context: grpc.ServicerContext) -> pb.GetManifestResponse:
        try:
            manifest = self._streams.catalog.manifest(request.model, request.revision)
            store = self._streams.catalog.revisions
            kept = store.find(manifest.model, manifest.revision) if store is not None else None
            return manifest_to_proto(manifest, kept.digest if kept is not None else "")
        except Exception as exc:
            rpc.abort(context, self._streams.stats, "GetManifest", request.model, exc)

    def StreamTensors(self, request: pb.StreamTensorsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialized StreamTensorsResponse messages (see add_to_server: no serializer runs on them)."""
        with self._streams.session(context, method="StreamTensors", kind="stream", model=request.model) as session:
            plan = session.plan_reads(session.start(request))
            logger.debug(
                "stream %r from %s: %d tensors, %d bytes in %d reads from %d files",
                request.model,
                session.peer,
                session.tensors,
                plan.total_bytes,
                plan.num_reads,
                len(plan.files),
            )
            with session.streamer() as streamer:
                yield from session.send(pack_chunks(session.chunks(streamer), plan.chunk_bytes))

    def ListModelFiles(
        self, request: pb.ListModelFilesRequest, context: grpc.ServicerContext
    ) -> pb.ListModelFilesResponse:
        try:
            return listing_to_proto(list_files(self._streams.catalog, request.model))
        except Exception as exc:
            rpc.abort(context, self._streams.stats, "ListModelFiles", request.model, exc)

    def ReadModelFile(
        self, request: pb.ReadModelFileRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ReadModelFileResponse]:
        """One file's bytes from request.offset; a stream like the others, so that drain waits for it."""
        with self._streams.session(context, method="ReadModelFile", kind="file read", model=request.model) as session:
            if request.data_port:
                session.transport = "tcp"
                yield from self._read_over_data_port(request, context, session)
                return
            responses = (
                (
                    pb.ReadModelFileResponse(
                        offset=piece.offset, crc32c=piece.crc32c, file_crc32c=piece.file_crc32c, data=piece.data
                    ),
                    len(piece.data),
                )
                for piece in session.read_file(request)
            )
            yield from session.send(responses)

    def _read_over_data_port(
        self, request: pb.ReadModelFileRequest, context: grpc.ServicerContext, session: StreamSession
    ) -> Iterator[pb.ReadModelFileResponse]:
        """The file's pieces as frames on the data port, after the announcement (transports.tcp)."""
        port = self._data_port
        if port is None:
            raise TcpUnavailable("this server has no data port (--data-port 0); use ReadModelFile without data_port")
        pieces = session.read_file(request)  # its checks first, before a ticket is issued
        first = next(pieces, None)
        connection = CallConnection()
        context.add_callback(connection.close)
        pending = issue(port, context, session.peer)
        try:
            host, announced = self._advertise
            yield pb.ReadModelFileResponse(data_host=host, data_port=announced, ticket=pending.ticket)
        except BaseException:
            port.tickets.withdraw(pending)
            raise
        conn = accept(port, pending, context)
        connection.set(conn)
        sender = FrameSender(
            conn, session.peer, self._streams.settings.stall_timeout, self._streams.stats.stream_stalled
        )
        name = request.file.encode()
        whole = 0
        for piece in itertools.chain((first,) if first is not None else (), pieces):
            sender.raw(name, piece.offset, piece.crc32c, piece.data)
            session.count_sent(len(piece.data))
            if piece.file_crc32c is not None:
                whole = piece.file_crc32c
        sender.end(whole)


def add_to_server(servicer: WeightStreamServicer, server: grpc.Server) -> None:
    """Register servicer; requests are parsed by rpc.parsing(), and StreamTensors yields serialized messages."""
    rpc.register(
        server,
        rpc.handler(servicer.GetManifest),
        rpc.handler(servicer.StreamTensors, serialized=True),
        rpc.handler(servicer.ListModelFiles),
        rpc.handler(servicer.ReadModelFile),
    )


def manifest_to_proto(manifest: Manifest, digest: str = "") -> pb.GetManifestResponse:
    return pb.GetManifestResponse(
        model=manifest.model,
        digest=digest,
        revision=manifest.revision,
        total_bytes=manifest.total_bytes,
        files=[pb.FileInfo(name=f.name, size_bytes=f.size) for f in manifest.files],
        tensors=[
            pb.TensorInfo(
                name=t.name,
                dtype=t.dtype.wire,
                shape=list(t.shape),
                nbytes=t.nbytes,
                file_index=t.file_index,
            )
            for t in manifest.tensors
        ],
    )


def listing_to_proto(listing: FileListing) -> pb.ListModelFilesResponse:
    return pb.ListModelFilesResponse(
        model=listing.model,
        revision=listing.revision,
        files=[
            pb.ModelFile(name=f.file.name, size_bytes=f.file.size, kind=FILE_KINDS[f.kind], version=f.file.version)
            for f in listing.files
        ],
    )
