"""The gRPC servicer: translates between protobuf messages and the server's domain objects.

Errors leave here and only here as gRPC status codes (errors.status_code chooses them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from weightstream import framing, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.cache import UnitCache
from weightstream_server.catalog import Catalog, Manifest
from weightstream_server.chunks import serve_chunks
from weightstream_server.errors import (
    Draining,
    InvalidRequest,
    RevisionMismatch,
    ServerError,
    SharedMemoryUnavailable,
    status_code,
)
from weightstream_server.files import FileKind, FileListing, list_files, read_file
from weightstream_server.health import Readiness
from weightstream_server.plan import MAX_REQUESTED_TENSORS, ReadPlan, Requested, SliceRequest, plan_reads
from weightstream_server.reader import PooledStreamer, StreamerPool
from weightstream_server.settings import ServerSettings
from weightstream_server.stats import ServerStats

logger = logging.getLogger(__name__)


@dataclass
class Tally:
    """The bytes of one stream: read from storage, and handed to the transport to send."""

    read: int = 0
    sent: int = 0

    def count_read(self, nbytes: int) -> None:
        self.read += nbytes


class Handlers:
    """What every RPC handler of a server serves from (the gRPC and the shared-memory servicers alike)."""

    def __init__(
        self,
        settings: ServerSettings,
        catalog: Catalog,
        pool: StreamerPool,
        stats: ServerStats,
        readiness: Readiness,
        cache: UnitCache | None = None,
    ) -> None:
        self._settings = settings
        self._catalog = catalog
        self._pool = pool
        self._stats = stats
        self._readiness = readiness
        self._cache = cache

    def _abort(self, context: grpc.ServicerContext, method: str, model: str, exc: Exception) -> None:
        abort(context, self._stats, method, model, exc)

    def _stream_ended(
        self,
        kind: str,
        model_id: str,
        model: str | None,
        peer: str,
        tensors: int,
        tally: Tally,
        started: float,
        code: grpc.StatusCode,
    ) -> None:
        """Count a tensor stream that ended, however it ended, and log it in one line."""
        seconds = time.monotonic() - started
        self._stats.stream_ended(model, sent=tally.sent, read=tally.read, seconds=seconds)
        logger.info(
            "%s end: model=%r peer=%s tensors=%d bytes=%d seconds=%.3f gbps=%.2f code=%s",
            kind,
            model_id,
            peer,
            tensors,
            tally.sent,
            seconds,
            tally.sent / seconds / 1e9 if seconds else 0.0,
            code.name,
        )


class WeightStreamServicer(Handlers, pb_grpc.WeightStreamServiceServicer):
    def GetManifest(self, request: pb.GetManifestRequest, context: grpc.ServicerContext) -> pb.GetManifestResponse:
        try:
            return manifest_to_proto(self._catalog.manifest(request.model))
        except Exception as exc:
            self._abort(context, "GetManifest", request.model, exc)
            raise  # unreachable: abort raises

    def StreamTensors(self, request: pb.StreamTensorsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialized StreamTensorsResponse messages (see add_to_server: no serializer runs on them).

        Every stream, however it ends, is counted in the stats and logged in one line at its end.
        """
        started = time.monotonic()
        # Asked now: once a call is cancelled, context.peer() is empty.
        peer = context.peer()
        tally = Tally()
        model: str | None = None
        tensors = 0
        code = grpc.StatusCode.OK
        self._stats.stream_started()
        try:
            manifest, chunk_bytes = start_stream(request, self._catalog, self._readiness, self._settings.chunk_bytes)
            model = manifest.model
            requested = requested_tensors(request)
            plan = plan_reads(manifest, requested, chunk_bytes)
            tensors = len(requested) or len(manifest.tensors)
            logger.debug(
                "stream %r from %s: %d tensors, %d bytes in %d reads from %d files",
                request.model,
                peer,
                tensors,
                plan.total_bytes,
                plan.num_reads,
                len(plan.files),
            )
            with self._pool.checkout() as streamer:
                for message, payload_bytes in _batch(
                    manifest, plan, streamer, self._settings.read_ahead_bytes, chunk_bytes, tally, self._cache
                ):
                    yield message
                    tally.sent += payload_bytes
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code = status_code(exc)
            self._abort(context, "StreamTensors", request.model, exc)
        finally:
            self._stream_ended("stream", request.model, model, peer, tensors, tally, started, code)

    def ListModelFiles(
        self, request: pb.ListModelFilesRequest, context: grpc.ServicerContext
    ) -> pb.ListModelFilesResponse:
        try:
            return listing_to_proto(list_files(self._catalog, request.model))
        except Exception as exc:
            self._abort(context, "ListModelFiles", request.model, exc)
            raise  # unreachable: abort raises

    def ReadModelFile(
        self, request: pb.ReadModelFileRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ReadModelFileResponse]:
        """One file's bytes from request.offset; counted as a stream, so that drain waits for it."""
        started = time.monotonic()
        peer = context.peer()
        sent = 0
        # Bytes before the request's offset are read too (for the whole-file CRC32C), not sent.
        prefix_read = 0
        code = grpc.StatusCode.OK
        self._stats.stream_started()
        try:
            if self._readiness.draining:
                raise Draining("the server is shutting down and takes no new streams; retry on another server")
            check_chunk_bytes(request.max_chunk_bytes)
            chunk_bytes = wire.clamp_chunk_bytes(request.max_chunk_bytes or self._settings.chunk_bytes)
            pieces = read_file(
                self._catalog, request.model, request.file, request.offset, request.revision, chunk_bytes
            )
            for piece in pieces:
                prefix_read = request.offset
                yield pb.ReadModelFileResponse(
                    offset=piece.offset, crc32c=piece.crc32c, file_crc32c=piece.file_crc32c, data=piece.data
                )
                sent += len(piece.data)
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code = status_code(exc)
            self._abort(context, "ReadModelFile", request.model, exc)
        finally:
            seconds = time.monotonic() - started
            self._stats.stream_ended(request.model, sent=sent, read=prefix_read + sent, seconds=seconds)
            logger.info(
                "file read end: model=%r file=%r peer=%s offset=%d bytes=%d seconds=%.3f code=%s",
                request.model,
                request.file,
                peer,
                request.offset,
                sent,
                seconds,
                code.name,
            )


def abort(context: grpc.ServicerContext, stats: ServerStats, method: str, model: str, exc: Exception) -> None:
    """End the RPC with exc's status code and message (internal errors: logged whole, sent as their type only)."""
    code = status_code(exc)
    stats.error(code.name)
    if isinstance(exc, ServerError):
        # A client that falls back from shared memory to gRPC is no warning.
        level = logging.INFO if isinstance(exc, SharedMemoryUnavailable) else logging.WARNING
        logger.log(level, "%s %r: %s: %s", method, model, code.name, exc)
        context.abort(code, str(exc))
    logger.exception("%s %r: internal error", method, model)
    context.abort(code, f"internal error while serving model {model!r}: {type(exc).__name__}")


def start_stream(
    request: pb.StreamTensorsRequest, catalog: Catalog, readiness: Readiness, default_chunk_bytes: int
) -> tuple[Manifest, int]:
    """What every tensor stream starts with, whatever its transport: the checks, its manifest and chunk size."""
    # Manifests are still served while draining: a load in flight may ask for one again.
    if readiness.draining:
        raise Draining("the server is shutting down and takes no new streams; retry on another server")
    check_stream_request(request)
    manifest = catalog.manifest(request.model)
    if request.revision and request.revision != manifest.revision:
        raise RevisionMismatch(
            f"model {request.model!r} changed: revision {manifest.revision}, the request expects {request.revision}"
        )
    return manifest, wire.clamp_chunk_bytes(request.max_chunk_bytes or default_chunk_bytes)


def check_stream_request(request: pb.StreamTensorsRequest) -> None:
    """Refuse a request whose sizes are out of bounds, before any work is done for it."""
    check_chunk_bytes(request.max_chunk_bytes)
    if len(request.tensors) > MAX_REQUESTED_TENSORS:
        raise InvalidRequest(f"request names {len(request.tensors)} tensors, more than {MAX_REQUESTED_TENSORS}")


def requested_tensors(request: pb.StreamTensorsRequest) -> list[Requested]:
    """The request's tensors as (name, byte ranges, slice or None), for plan_reads."""
    return [
        (
            t.name,
            [(r.start, r.end) for r in t.ranges],
            SliceRequest(t.slice.dim, t.slice.start, t.slice.stop) if t.HasField("slice") else None,
        )
        for t in request.tensors
    ]


def check_chunk_bytes(max_chunk_bytes: int) -> None:
    """Refuse a requested chunk size out of bounds (0, the server's default, is always fine)."""
    if max_chunk_bytes and not wire.MIN_CHUNK_BYTES <= max_chunk_bytes <= wire.MAX_CHUNK_BYTES:
        raise InvalidRequest(
            f"max_chunk_bytes {max_chunk_bytes} is outside {wire.MIN_CHUNK_BYTES}..{wire.MAX_CHUNK_BYTES}"
            " (0 means the server's default)"
        )


def _batch(
    manifest: Manifest,
    plan: ReadPlan,
    streamer: PooledStreamer,
    read_ahead_bytes: int,
    chunk_bytes: int,
    tally: Tally,
    cache: UnitCache | None,
) -> Iterator[tuple[bytes, int]]:
    """Pack the chunks served into (serialized StreamTensorsResponse, payload bytes) of about chunk_bytes each.

    Copies per byte on this side: file -> streamer ring (the read), ring -> message (encode_chunk;
    the CRC is taken from the ring in place), then gRPC's own buffer to the socket. With a cache,
    a unit is copied once more, from the ring into the cache, and chunks are framed from there.
    Chunks smaller than half a message are packed together, which copies their few bytes once more.
    """
    pending: list[bytes] = []
    pending_bytes = 0
    pending_payload = 0

    for chunk in serve_chunks(manifest, plan, streamer, read_ahead_bytes, cache, tally.count_read):
        place = chunk.place
        length = place.length
        # The ring slot is reused once the next chunk is taken, so the chunk is framed (copied) now.
        entry = framing.encode_chunk(place.tensor, place.offset, chunk.crc32c, chunk.data.data)
        if pending and pending_bytes + len(entry) > chunk_bytes:
            yield b"".join(pending), pending_payload
            pending, pending_bytes, pending_payload = [], 0, 0
        if len(entry) >= chunk_bytes // 2:
            yield entry, length
            continue
        pending.append(entry)
        pending_bytes += len(entry)
        pending_payload += length
    if pending:
        yield b"".join(pending), pending_payload


def parsing(
    message_type: type[Message], method: Callable[[Any, grpc.ServicerContext], Any]
) -> Callable[[bytes, grpc.ServicerContext], Any]:
    """method on the request's raw bytes, parsed here: gRPC's own deserializer would end bad bytes INTERNAL."""

    def handler(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = message_type.FromString(raw)
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _not_valid(message_type, exc))
        return method(request, context)

    return handler


def parsing_stream(
    message_type: type[Message], method: Callable[[Iterator[Any], grpc.ServicerContext], Any]
) -> Callable[[Iterator[bytes], grpc.ServicerContext], Any]:
    """parsing for a client stream: each message is parsed as it is read; a bad one raises InvalidRequest."""

    def messages(raw: Iterator[bytes]) -> Iterator[Any]:
        for item in raw:
            try:
                yield message_type.FromString(item)
            except DecodeError as exc:
                raise InvalidRequest(_not_valid(message_type, exc)) from None

    return lambda raw, context: method(messages(raw), context)


def _not_valid(message_type: type[Message], exc: DecodeError) -> str:
    return f"request is not a valid {message_type.DESCRIPTOR.full_name}: {exc}"


def add_to_server(servicer: WeightStreamServicer, server: grpc.Server) -> None:
    """Register servicer; requests are parsed by parsing(), and StreamTensors yields serialized messages."""
    handlers = {
        "GetManifest": grpc.unary_unary_rpc_method_handler(
            parsing(pb.GetManifestRequest, servicer.GetManifest),
            request_deserializer=None,
            response_serializer=pb.GetManifestResponse.SerializeToString,
        ),
        "StreamTensors": grpc.unary_stream_rpc_method_handler(
            parsing(pb.StreamTensorsRequest, servicer.StreamTensors),
            request_deserializer=None,
            response_serializer=None,
        ),
        "ListModelFiles": grpc.unary_unary_rpc_method_handler(
            parsing(pb.ListModelFilesRequest, servicer.ListModelFiles),
            request_deserializer=None,
            response_serializer=pb.ListModelFilesResponse.SerializeToString,
        ),
        "ReadModelFile": grpc.unary_stream_rpc_method_handler(
            parsing(pb.ReadModelFileRequest, servicer.ReadModelFile),
            request_deserializer=None,
            response_serializer=pb.ReadModelFileResponse.SerializeToString,
        ),
    }
    register(server, handlers)


def register(server: grpc.Server, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Add handlers for methods of WeightStreamService; several such groups may be added to one server."""
    service = pb.DESCRIPTOR.services_by_name["WeightStreamService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


def manifest_to_proto(manifest: Manifest) -> pb.GetManifestResponse:
    return pb.GetManifestResponse(
        model=manifest.model,
        revision=manifest.revision,
        total_bytes=manifest.total_bytes,
        files=[pb.FileInfo(name=f.name, size_bytes=f.size) for f in manifest.files],
        tensors=[
            pb.TensorInfo(
                name=t.name, dtype=t.dtype.wire, shape=list(t.shape), nbytes=t.nbytes, file_index=t.file_index
            )
            for t in manifest.tensors
        ],
    )


_KINDS = {FileKind.WEIGHTS: pb.MODEL_FILE_KIND_WEIGHTS, FileKind.COMPANION: pb.MODEL_FILE_KIND_COMPANION}


def listing_to_proto(listing: FileListing) -> pb.ListModelFilesResponse:
    return pb.ListModelFilesResponse(
        model=listing.model,
        revision=listing.revision,
        files=[pb.ModelFile(name=f.file.name, size_bytes=f.file.size, kind=_KINDS[f.kind]) for f in listing.files],
    )
