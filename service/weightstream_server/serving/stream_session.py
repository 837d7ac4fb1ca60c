"""One streaming RPC on the server, whatever its transport: StreamTensors, StreamTensorsShared, ReadModelFile.

A servicer opens a StreamSession around the whole of a streaming RPC (`with streams.session(...)`).
Every streaming RPC of WeightStreamService is served in a session. The session
- counts the stream in the stats from its start to its end, so that a drain waits for it;
- holds one of the server's --max-streams slots from its start to its end: before it waits for
  anything (a client's message, a manifest, a read), a stream that comes while every slot is
  taken ends RESOURCE_EXHAUSTED and one that comes while the server drains ends UNAVAILABLE, so
  neither holds a gRPC worker;
- runs the checks every stream starts with: the server is not draining, sizes are in bounds, the
  model's revision is the one the client expects;
- holds a tensor stream's manifest and read plan, and gives its chunks (chunks.serve_chunks);
- counts the bytes read from storage and the bytes the transport took;
- gives a stream of a storage revision's whole tensors (or byte ranges of them) a recorder of the
  block CRC32Cs it computes (checksums.BlockRecorder), so that a load teaches the server the revision;
- at its end, however it ends, chooses the status code (OK; CANCELLED when the client went away;
  otherwise the error's, sent to the client through rpc.abort), records the stream in the stats
  and logs one line.

Threading: a session belongs to the thread that serves its RPC; count_read and count_sent are
called from that thread only. Streams, from which sessions are opened, is shared by every RPC of
the server and holds only parts that are safe to use from many threads (StreamSlots among them).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import grpc

from weightstream.allocator import release_free_memory
from weightstream.protocol.wire import TensorSlice
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import ClientGone, Draining, TooManyStreams, status_code
from weightstream_server.ops.health import Readiness
from weightstream_server.ops.stats import ServerStats
from weightstream_server.serving import validation
from weightstream_server.serving.base_files import may_hold
from weightstream_server.serving.cache import UnitCache
from weightstream_server.serving.catalog import Catalog, Manifest
from weightstream_server.serving.checksums import BlockRecorder, ReadBlocks
from weightstream_server.serving.chunks import ServedChunk, serve_chunks
from weightstream_server.serving.deltas import Deltas
from weightstream_server.serving.files import FilePiece, read_file
from weightstream_server.serving.read_plan import plan_reads
from weightstream_server.serving.reader import PooledStreamer, StreamerPool
from weightstream_server.serving.stalls import StallWatch
from weightstream_server.settings import ServerSettings
from weightstream_server.storage.reads import ReadPlan
from weightstream_server.transports import rpc

logger = logging.getLogger(__name__)
M = TypeVar("M")


# The transport of each streaming method's bytes, unless the call moves them to the data port.
TRANSPORTS = {"StreamTensorsShared": "shm", "StreamTensorsBulk": "tcp"}


class StreamSlots:
    """The --max-streams limit: size slots, each held by one stream from its start to its end, at most
    per_client of them by one client (a bearer token, else a peer host), so that no client can take
    every slot and others keep being served. Thread-safe."""

    def __init__(
        self,
        size: int,
        per_client: int | None = None,
        *,
        what: str = "stream",
        flag: str = "--max-streams",
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.size = size
        self.per_client = per_client or size
        self._what = what
        self._flag = flag
        # Told "slots" or "share" for each refusal (ServerStats.stream_refused), outside the lock.
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._taken = 0
        self._by_client: dict[str, int] = {}

    def take(self, client: str = "") -> None:
        """Take a slot for client; TooManyStreams when none is free, or client holds its share (nothing waits)."""
        with self._lock:
            held = self._by_client.get(client, 0)
            if self._taken >= self.size:
                refused = "slots"
                message = f"{self.size} {self._what}s are already running ({self._flag}); try again later"
            elif held >= self.per_client:
                refused = "share"
                share = f"{self._flag}-per-client" if self._flag == "--max-streams" else f"half of {self._flag}"
                message = (
                    f"this client already holds {held} of the {self.size} {self._what} slots ({share}); try again later"
                )
            else:
                self._taken += 1
                self._by_client[client] = held + 1
                return
        if self._on_refused is not None:
            self._on_refused(refused)
        raise TooManyStreams(message)

    def give_back(self, client: str = "") -> None:
        with self._lock:
            self._taken -= 1
            held = self._by_client.pop(client, 0) - 1
            if held > 0:
                self._by_client[client] = held


def client_of(context: grpc.ServicerContext, peer: str) -> str:
    """Who a call comes from, for the per-client share: its bearer token's digest, else its peer's host."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return "token:" + hashlib.sha256(value.strip().encode()).hexdigest()[:16]
    # "ipv4:10.0.0.7:51234", "ipv6:[::1]:51234", "unix:/path": the address without its port.
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return "host:" + address.rpartition(":")[0]
    return "host:" + peer


@dataclass(frozen=True, kw_only=True)
class Streams:
    """What every stream of a server is served from; the servicers open their sessions from it."""

    settings: ServerSettings
    catalog: Catalog
    pool: StreamerPool
    stats: ServerStats
    readiness: Readiness
    slots: StreamSlots
    stalls: StallWatch
    # Shared by every stream; None when --cache-bytes is 0.
    cache: UnitCache | None = None
    # Deltas against a revision clients hold (serving.deltas); None when --delta-cache-bytes is 0.
    deltas: Deltas | None = None
    # Block CRC32Cs of storage revisions learned from what streams read (revisions.changes compares them).
    read_blocks: ReadBlocks | None = None

    def session(self, context: grpc.ServicerContext, *, method: str, kind: str, model: str = "") -> StreamSession:
        """A session for one call of method; kind names it in the end-of-stream line ("stream", ...)."""
        return StreamSession(self, context, method, kind, model)


class StreamSession:
    """One streaming RPC, from its checks to its end-of-stream line; a context manager around the RPC."""

    def __init__(self, streams: Streams, context: grpc.ServicerContext, method: str, kind: str, model_id: str) -> None:
        self._streams = streams
        self._context = context
        self._method = method
        self._kind = kind
        # What the stream's bytes travel on, for the per-transport counts; a servicer that moves them to
        # the data port says so (tcp).
        self.transport = TRANSPORTS.get(method, "grpc")
        # The model as the client named it, and as the catalog found it (None until then: the stats
        # count streams of models that exist).
        self.model_id = model_id
        self.model: str | None = None
        self.tensors = 0
        self.read = 0
        self.sent = 0
        self._request: pb.StreamTensorsRequest | None = None
        self._manifest: Manifest | None = None
        self._plan: ReadPlan | None = None
        # The revision the client holds, as kept in memory here, and the tensors it may get deltas of.
        self._delta_base: Manifest | None = None
        self._delta_tensors: dict[str, TensorSlice | None] = {}
        # (file name, offset) of a file read.
        self._file: tuple[str, int] | None = None
        self._started = 0.0
        self._holds_slot = False
        self.peer = ""
        self._client = ""

    def __enter__(self) -> StreamSession:
        self._started = time.monotonic()
        # Asked now: once a call is cancelled, context.peer() is empty.
        self.peer = self._context.peer()
        self._streams.stats.stream_started()
        try:
            self._check_open()
            self._client = client_of(self._context, self.peer)
            self._streams.slots.take(self._client)
            self._holds_slot = True
        except Exception as exc:
            # Ends the call as __exit__ would have: counted, logged, the status sent (rpc.abort raises).
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        code = grpc.StatusCode.OK
        try:
            if isinstance(exc, GeneratorExit | ClientGone):
                # Nobody is left to tell. GeneratorExit goes on: gRPC is closing the response generator.
                code = grpc.StatusCode.CANCELLED
                return isinstance(exc, ClientGone)
            if isinstance(exc, Exception):
                code = status_code(exc)
                rpc.abort(self._context, self._streams.stats, self._method, self.model_id, exc)
            return False
        finally:
            self._end(code)

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            raise RuntimeError("start() comes first")
        return self._manifest

    @property
    def plan(self) -> ReadPlan:
        if self._plan is None:
            raise RuntimeError("plan_reads() comes first")
        return self._plan

    def start(self, request: pb.StreamTensorsRequest) -> int:
        """The checks a tensor stream starts with, then its manifest; the chunk size the request gets."""
        self.model_id = request.model
        self._check_open()
        validation.check_stream_request(request)
        # A named revision is served as it is kept (a published one from memory), or refused.
        manifest = self._streams.catalog.manifest(request.model, request.revision)
        self.model = manifest.model
        self._manifest = manifest
        self._request = request
        self._find_delta_base(request)
        return validation.chunk_bytes(request.max_chunk_bytes, self._streams.settings.chunk_bytes)

    @property
    def sends_deltas(self) -> bool:
        """Whether some chunks may go as deltas (then they come through chunks(), never straight from files)."""
        return self._delta_base is not None

    def _find_delta_base(self, request: pb.StreamTensorsRequest) -> None:
        """The delta base the request names, if this server may hold its bytes; else every chunk goes whole."""
        lookup = self._streams.catalog.revisions
        if not request.delta_base or self._streams.deltas is None or lookup is None:
            return
        wanted = {
            t.name: TensorSlice(t.slice.dim, t.slice.start, t.slice.stop) if t.HasField("slice") else None
            for t in request.tensors
            if t.delta
        }
        kept = lookup.find(self.manifest.model, request.delta_base) if wanted else None
        in_memory = kept is not None and getattr(kept.manifest.source, "in_memory", False)
        # A storage revision's bytes may lie in the RAM cache, or in its files still on this node's disk
        # (a tier's disk cache keeps each version's copy), even once its files were rewritten at the source.
        if kept is None or (not in_memory and self._streams.cache is None and not may_hold(kept.manifest, wanted)):
            logger.debug(
                "model %r: no deltas against %s: this server does not hold its bytes",
                self.model_id,
                request.delta_base[:200],
            )
            return
        self._delta_base = kept.manifest
        self._delta_tensors = wanted

    def plan_reads(self, chunk_bytes: int) -> ReadPlan:
        """The reads of the started stream, sent in chunks of at most chunk_bytes."""
        manifest = self.manifest
        assert self._request is not None
        requested = validation.requested_tensors(self._request)
        self._plan = plan_reads(manifest, requested, chunk_bytes)
        self.tensors = len(requested) or len(manifest.tensors)
        return self._plan

    def streamer(self) -> contextlib.AbstractContextManager[PooledStreamer]:
        """A streamer of the server's pool for this stream's reads; TooManyStreams when none is free."""
        return self._streams.pool.checkout()

    def chunks(self, streamer: PooledStreamer) -> Iterator[ServedChunk]:
        """The plan's chunks, through the cache if there is one; each is valid until the next is taken."""
        settings = self._streams.settings
        # A published revision is in memory already (revisions.published): the cache would hold its
        # bytes twice, and they are not read from storage.
        if getattr(self.manifest.source, "in_memory", False):
            chunks = serve_chunks(self.manifest, self.plan, streamer, settings.read_ahead_bytes, None, lambda _: None)
        else:
            chunks = serve_chunks(
                self.manifest,
                self.plan,
                streamer,
                settings.read_ahead_bytes,
                self._streams.cache,
                self.count_read,
                self.block_recorder(),
            )
        deltas = self._streams.deltas
        if self._delta_base is None or deltas is None:
            return chunks
        return deltas.encode(
            chunks, self.manifest, self._delta_base, self._delta_tensors, self._streams.cache, self.plan.chunk_bytes
        )

    def block_recorder(self) -> BlockRecorder | None:
        """A recorder of the block CRC32Cs this stream computes; None when it teaches nothing: a published
        revision (its blocks are known), or slices (their chunks are not ranges of the tensors' bytes)."""
        read_blocks = self._streams.read_blocks
        if read_blocks is None or self._request is None or getattr(self.manifest.source, "in_memory", False):
            return None
        if any(t.HasField("slice") for t in self._request.tensors):
            return None
        return read_blocks.recorder(self.manifest)

    def read_file(self, request: pb.ReadModelFileRequest) -> Iterator[FilePiece]:
        """The checks a file read starts with, then the pieces of the file from request.offset.

        A file read counts under the model asked for, found or not. The bytes before the offset
        may be read too (for the whole-file CRC32C, when the server has none kept), not sent; a
        piece's own bytes count as read once the caller asks for the next piece, so read and sent
        agree however the stream ends.
        """
        self.model = request.model
        self._file = (request.file, request.offset)
        self._check_open()
        validation.check_chunk_bytes(request.max_chunk_bytes)
        chunk_bytes = validation.chunk_bytes(request.max_chunk_bytes, self._streams.settings.chunk_bytes)
        catalog = self._streams.catalog
        pieces = read_file(
            catalog,
            request.model,
            request.file,
            request.offset,
            request.revision,
            chunk_bytes,
            length=request.length,
            cache=self._streams.cache,
        )
        for piece in pieces:
            self.read += piece.read_before
            yield piece
            self.read += piece.read

    def waiting_on_client(self) -> contextlib.AbstractContextManager[None]:
        """Around a wait on the client (a send it must take, a slot it must return): --stall-timeout bounds it."""
        return self._streams.stalls.waiting(self._context, self._describe)

    def send(self, messages: Iterable[tuple[M, int]]) -> Iterator[M]:
        """Each (message, payload bytes) handed to gRPC, counted once gRPC took it; each send bounded by the stall rule.

        gRPC resumes the generator only once the message was sent, so the time in `yield` is the
        time the client's flow control held the send.
        """
        for message, nbytes in messages:
            with self.waiting_on_client():
                yield message
            self.count_sent(nbytes)

    def count_read(self, nbytes: int) -> None:
        """Count bytes read from storage for this stream."""
        self.read += nbytes

    def count_sent(self, nbytes: int) -> None:
        """Count payload bytes the transport took."""
        self.sent += nbytes

    def _describe(self) -> str:
        return f"{self._kind} of model {self.model_id[:200]!r} from {self.peer}"

    def _check_open(self) -> None:
        # Manifests are still served while draining: a load in flight may ask for one again.
        if self._streams.readiness.draining:
            raise Draining("the server is shutting down and takes no new streams; retry on another server")

    def _end(self, code: grpc.StatusCode) -> None:
        if self._holds_slot:
            self._holds_slot = False
            self._streams.slots.give_back(self._client)
        # What the stream's buffers took goes back to the kernel, not only to malloc's free lists.
        release_free_memory()
        seconds = time.monotonic() - self._started
        self._streams.stats.stream_ended(
            self.model, transport=self.transport, sent=self.sent, read=self.read, seconds=seconds
        )
        if self._file is not None:
            name, offset = self._file
            logger.info(
                "%s end: model=%r file=%r peer=%s offset=%d bytes=%d seconds=%.3f code=%s",
                self._kind,
                self.model_id[:200],
                name,
                self.peer,
                offset,
                self.sent,
                seconds,
                code.name,
            )
            return
        logger.info(
            "%s end: model=%r peer=%s tensors=%d bytes=%d seconds=%.3f gbps=%.2f code=%s",
            self._kind,
            self.model_id[:200],
            self.peer,
            self.tensors,
            self.sent,
            seconds,
            self.sent / seconds / 1e9 if seconds else 0.0,
            code.name,
        )
