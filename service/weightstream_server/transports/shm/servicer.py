"""The same-host transport: OpenSharedMemory and StreamTensorsShared, chunk bytes in a shared-memory ring.

A client next to the server (same pod, same host) offers a directory both can see (a pod's emptyDir
with medium Memory, or /dev/shm). OpenSharedMemory checks that the server sees it: the client wrote a
nonce file there, and the server must read back the same bytes. StreamTensorsShared then serves the
same chunks as StreamTensors, but their bytes lie in a ring of slots in one segment (a sealed
memfd, handed to the client over a Unix socket in that directory: segments.py), and the gRPC
messages carry only (tensor, offset, CRC32C, slot, slot offset). The ring's flow control and
filling are in ring.py; the stream's checks, plan and counting are the StreamSession's, as for
every stream.

Copies per byte on this side: where every file is local and in the page cache and no slice gathers
rows, one: the kernel reads the file straight into the slot (reader.DirectReader; the CRC32C is
then taken on the slot). Otherwise (S3, a cold page cache, a server cache, gathered slices) two:
the read into the streamer's ring or the cache, then one memmove into the slot; the chunk source
(chunks.serve_chunks, shared with StreamTensors) takes the CRC32C of the source bytes, so a fault
in the copy or in the ring's bookkeeping is caught. The client checks the CRC32C on the slot and
copies the slot into its parameter once. The direct read costs the server less CPU per byte and
is faster from a warm page cache; from a cold one the streamer's parallel reads are faster, so
they keep those loads (benchmarks/shm_load.py measures both; docs/concepts/transports.md has the figures).

Memory: each stream holds one segment of slots * slot_bytes, at most the server's read-ahead
setting (OpenSharedMemoryResponse.max_ring_bytes).

Threading: each stream runs on its gRPC worker thread (reads, copies, sends) plus one thread of its
own that hands the segment over and then reads the client's credits (ring.read_credits), and,
until the first message has come, one that waits for it (rpc.first_message).

Admission: a server without a shared-memory directory refuses the call (FAILED_PRECONDITION) before
it waits for anything; otherwise the call takes a stream slot first (the StreamSession), and its
first message must come within FIRST_MESSAGE_TIMEOUT_S, or it ends DEADLINE_EXCEEDED: a silent
client holds a slot and a worker for seconds, never for as long as it likes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import ClientGone, InvalidRequest, ShmUnavailable
from weightstream_server.serving import validation
from weightstream_server.serving.reader import DirectReader, page_cached, reads_directly
from weightstream_server.serving.stream_session import Streams
from weightstream_server.transports import rpc
from weightstream_server.transports.shm.ring import Credits, FilledSlot, copied, fill_slots, read_credits, read_into
from weightstream_server.transports.shm.segments import Segment, check_nonce

logger = logging.getLogger(__name__)

# Threads of a direct stream for the reads that miss the page cache (a file only partly cached):
# several requests in flight for the disk.
READ_THREADS = 8
# How long a stream that is done waits for its client to map the segment before giving up.
ATTACH_TIMEOUT_S = 60.0
# How long a call waits for its first message; the client sends it as it opens the call.
FIRST_MESSAGE_TIMEOUT_S = 5.0


class ShmServicer:
    """OpenSharedMemory and StreamTensorsShared. Safe to call from many threads."""

    def __init__(self, streams: Streams) -> None:
        self._streams = streams

    @property
    def max_ring_bytes(self) -> int:
        # The ring is this stream's read-ahead as far as memory goes, so the same bound serves.
        return self._streams.settings.read_ahead_bytes

    def OpenSharedMemory(
        self, request: pb.OpenSharedMemoryRequest, context: grpc.ServicerContext
    ) -> pb.OpenSharedMemoryResponse:
        try:
            check_nonce(self._directory(), request.nonce_file, request.nonce)
            return pb.OpenSharedMemoryResponse(max_ring_bytes=self.max_ring_bytes)
        except Exception as exc:
            rpc.abort(context, self._streams.stats, "OpenSharedMemory", "", exc)

    def StreamTensorsShared(
        self, requests: Iterator[pb.StreamTensorsSharedRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StreamTensorsSharedResponse]:
        """The first message names the segment; each later one carries the chunks of one filled slot.

        However the stream ends, it leaves no segment behind.
        """
        try:
            directory = self._directory()
        except ShmUnavailable as exc:
            rpc.abort(context, self._streams.stats, "StreamTensorsShared", "", exc)
        with self._streams.session(context, method="StreamTensorsShared", kind="shared stream") as session:
            first = rpc.first_message(requests, FIRST_MESSAGE_TIMEOUT_S, "StreamTensorsSharedRequest")
            if first is None or not first.HasField("request"):
                raise InvalidRequest("the first StreamTensorsSharedRequest must carry the request")
            chunk_bytes = session.start(first.request)
            slots, slot_bytes = validation.ring_size(first.slots, first.slot_bytes, chunk_bytes, self.max_ring_bytes)
            # Every chunk fits in one slot.
            plan = session.plan_reads(min(chunk_bytes, slot_bytes))
            manifest = session.manifest
            with (
                session.streamer() as streamer,
                Segment(directory, slots, slot_bytes) as segment,
                contextlib.closing(Credits(slots)) as credits,  # closed before the segment
            ):
                context.add_callback(credits.close)
                releases = (message.released_slots for message in requests)
                threading.Thread(
                    target=read_credits,
                    args=(releases, credits, segment, ATTACH_TIMEOUT_S),
                    name="weightstream-shm-credits",
                    daemon=True,
                ).start()
                # Straight into the slots when the bytes are local and in the page cache; from
                # storage the streamer's reads are faster (reader.DirectReader).
                direct = (
                    self._streams.cache is None
                    and not session.sends_deltas
                    and reads_directly(manifest, plan)
                    and page_cached(manifest, plan)
                )
                logger.debug(
                    "shared stream %r from %s: %d tensors, %d bytes, ring %s (%d x %d bytes), %s",
                    session.model_id,
                    session.peer,
                    session.tensors,
                    plan.total_bytes,
                    segment.name,
                    slots,
                    slot_bytes,
                    "read into the slots" if direct else "copied into the slots from the streamer or the cache",
                )
                yield pb.StreamTensorsSharedResponse(
                    segment_socket=segment.socket_name, ticket=segment.ticket, slots=slots, slot_bytes=slot_bytes
                )
                with contextlib.ExitStack() as reads:  # closed (its reads finished) before the segment
                    if direct:
                        reader = reads.enter_context(
                            DirectReader(manifest, plan, session.count_read, READ_THREADS, session.block_recorder())
                        )
                        writes = map(read_into, reader.reads())
                    else:
                        writes = map(copied, session.chunks(streamer))
                    filled_slots = fill_slots(writes, segment, credits, session.waiting_on_client)
                    yield from session.send((_slot_message(filled), filled.nbytes) for filled in filled_slots)
                # A stream that fits in the ring is done before the client has even taken the
                # segment; ending now would close the socket before it came.
                if not credits.wait_attached(ATTACH_TIMEOUT_S):
                    if credits.error is not None:
                        raise credits.error
                    if not context.is_active():
                        raise ClientGone()
                    raise InvalidRequest(f"the client did not map {segment.name} within {ATTACH_TIMEOUT_S:.0f} s")

    def _directory(self) -> Path:
        directory = self._streams.settings.shm_dir
        if directory is None:
            raise ShmUnavailable("this server has no shared-memory directory (--shm-dir); use StreamTensors")
        return directory


def _slot_message(filled: FilledSlot) -> pb.StreamTensorsSharedResponse:
    """The response announcing one filled slot: every chunk in it."""
    return pb.StreamTensorsSharedResponse(
        chunks=[
            pb.TensorChunk(
                tensor=chunk.place.tensor,
                offset=chunk.place.offset,
                crc32c=chunk.crc32c,
                length=chunk.place.length,
                slot=filled.slot,
                slot_offset=chunk.slot_offset,
                encoding=chunk.encoding,  # type: ignore[arg-type]
                encoded_length=chunk.encoded_length,
            )
            for chunk in filled.chunks
        ]
    )


def add_to_server(servicer: ShmServicer, server: grpc.Server) -> None:
    """Register the two shared-memory methods (a second generic handler for WeightStreamService)."""
    rpc.register(server, rpc.handler(servicer.OpenSharedMemory), rpc.handler(servicer.StreamTensorsShared))
