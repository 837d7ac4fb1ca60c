"""The same-host transport: chunk bytes read from a shared-memory ring the server fills.

negotiate() proves that the server sees the client's directory (a nonce file written here, read
back there) and returns a ShmTransport, or None when the server cannot use it; the client
then streams over gRPC. Each stream() takes the segment the server announces from its hand-over
socket and maps it (names, sizes, the hand-over and the mapping itself are weightstream.protocol.shm's,
shared with the server), yields the chunks of each
filled slot as one batch, with their addresses inside the mapping, and returns the slot (a credit)
once the caller asks for the next batch.

Each chunk is placed straight from its slot. On CUDA, when the device allows it, the first copy
registers the ring with CUDA (cuda_host.HostRegion) and each chunk is one DMA copy from its slot to
the device; otherwise it goes through pinned staging (placement.py). Memory: the mapping of one
ring per stream (slots * slot_bytes), shared with the server, unmapped when the stream ends.

The call's messages are read on a helper thread (call_reader.py), so that a call whose cancel
does not end it cannot hold the stream's thread: the generator raises StreamAbandoned instead.

Concurrency: as for every transport, one stream per thread, each generator used by one thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import secrets
import socket
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from weightstream.client import cuda_host
from weightstream.client.errors import FailedPreconditionError, IntegrityError
from weightstream.client.transports.base import Batches, ChunkRef, Landing, StreamCancel, method_path
from weightstream.client.transports.call_reader import CallReader
from weightstream.protocol import shm, wire
from weightstream.protocol.names import TransportName
from weightstream.v1 import weightstream_pb2 as pb

logger = logging.getLogger(__name__)

OPEN_SHARED_MEMORY_METHOD = method_path("OpenSharedMemory")
STREAM_TENSORS_SHARED_METHOD = method_path("StreamTensorsShared")
# Owner read-write, group read: a server in another container of the pod, running as another user
# of the pod's fsGroup, can still read it.
NONCE_MODE = 0o640
NONCE_BYTES = 32
NEGOTIATE_TIMEOUT_S = 10.0
# The hand-over is one connection to a socket that is already listening.
HANDOVER_TIMEOUT_S = 10.0


class ShmTransport:
    """StreamTensorsShared on one channel, its segments mapped from shm_dir.

    slots and slot_bytes are the ring asked for (slot_bytes 0: shm.default_slot_bytes of the
    request's chunks); max_ring_bytes is what the server grants (OpenSharedMemoryResponse), and caps the ring.
    """

    name: TransportName = "shm"

    def __init__(
        self,
        channel: grpc.Channel,
        shm_dir: str | Path,
        *,
        max_ring_bytes: int,
        slots: int = shm.DEFAULT_SLOTS,
        slot_bytes: int = 0,
    ) -> None:
        self.shm_dir = Path(shm_dir)
        self.max_ring_bytes = max_ring_bytes
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._method: grpc.StreamStreamMultiCallable[pb.StreamTensorsSharedRequest, pb.StreamTensorsSharedResponse]
        self._method = channel.stream_stream(
            STREAM_TENSORS_SHARED_METHOD,
            request_serializer=pb.StreamTensorsSharedRequest.SerializeToString,
            response_deserializer=pb.StreamTensorsSharedResponse.FromString,
        )

    @classmethod
    def negotiate(
        cls,
        channel: grpc.Channel,
        shm_dir: str | Path,
        metadata: Sequence[tuple[str, str]],
        *,
        timeout: float | None = NEGOTIATE_TIMEOUT_S,
        required: bool = False,
    ) -> ShmTransport | None:
        """A transport if the server at channel sees shm_dir as this process does; None (logged once) if not.

        None when this process cannot write to shm_dir, or the server answers FAILED_PRECONDITION
        (another directory, or none) or UNIMPLEMENTED (an older server); with required, those raise
        FailedPreconditionError instead. Other gRPC errors propagate.
        """
        directory = Path(shm_dir)
        nonce = secrets.token_bytes(NONCE_BYTES)
        name = shm.new_nonce_name()
        path = directory / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            _refused(required, f"cannot write to {directory}: {exc.strerror or exc}")
            return None
        try:
            try:
                os.fchmod(fd, NONCE_MODE)
                os.write(fd, nonce)
            finally:
                os.close(fd)
            open_shared_memory = channel.unary_unary(
                OPEN_SHARED_MEMORY_METHOD,
                request_serializer=pb.OpenSharedMemoryRequest.SerializeToString,
                response_deserializer=pb.OpenSharedMemoryResponse.FromString,
            )
            try:
                response = open_shared_memory(
                    pb.OpenSharedMemoryRequest(nonce_file=name, nonce=nonce), timeout=timeout, metadata=tuple(metadata)
                )
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                    details = exc.details() if isinstance(exc, grpc.Call) else ""
                    _refused(required, f"the server says {code.name}: {details}")
                    return None
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return cls(channel, directory, max_ring_bytes=response.max_ring_bytes)

    def stream(
        self,
        request: pb.StreamTensorsRequest,
        metadata: Sequence[tuple[str, str]],
        cancel: StreamCancel,
        land: Landing | None = None,
    ) -> Batches:
        """Chunks of request, one batch per filled slot; the slot is returned when the next batch is asked for."""
        slots, slot_bytes = self._ring(request)
        # Messages to the server: the request, then an "attached" message, then credits.
        outgoing: queue.SimpleQueue[pb.StreamTensorsSharedRequest | None] = queue.SimpleQueue()
        outgoing.put(pb.StreamTensorsSharedRequest(request=request, slots=slots, slot_bytes=slot_bytes))
        call = self._method(_drain(outgoing), metadata=tuple(metadata))
        cancel.on_cancel(call.cancel)
        # Reading messages ahead is safe here: a slot is only handed back below, on this thread.
        messages = CallReader[pb.StreamTensorsSharedResponse](call, cancel, name="weightstream-shm-call")
        ring: _Ring | None = None
        try:
            announcement = next(messages)
            ring = _Ring.open(self.shm_dir, announcement, request.model)
            # Tells the server that the segment is mapped.
            outgoing.put(pb.StreamTensorsSharedRequest())
            for message in messages:
                # One batch per slot, each slot returned as soon as it is placed: the server
                # refills it while the rest of the message is placed (a message may carry many).
                for slot, chunks in itertools.groupby(message.chunks, key=lambda c: c.slot):
                    yield [ring.ref(chunk) for chunk in chunks]
                    outgoing.put(pb.StreamTensorsSharedRequest(released_slots=[slot]))
        finally:
            outgoing.put(None)
            call.cancel()
            messages.close()
            if ring is not None:
                ring.close()

    def _ring(self, request: pb.StreamTensorsRequest) -> tuple[int, int]:
        """The ring to ask for: self.slots of the default slot size (or slot_bytes), capped by the grant."""
        slot_bytes = self.slot_bytes or shm.default_slot_bytes(wire.clamp_chunk_bytes(request.max_chunk_bytes))
        slots = self.slots
        if self.max_ring_bytes:
            slots = max(shm.MIN_SLOTS, min(slots, self.max_ring_bytes // slot_bytes))
        return slots, slot_bytes


def _refused(required: bool, why: str) -> None:
    if required:
        raise FailedPreconditionError(f"the shared-memory transport cannot be used: {why}")
    logger.info("shared memory not used, streaming over gRPC: %s", why)


def _take_segment(directory: Path, name: str, ticket: bytes, model: str) -> int:
    """The segment's descriptor, from the server's hand-over socket name in directory."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as conn:
        conn.settimeout(HANDOVER_TIMEOUT_S)
        try:
            with shm.socket_address(directory, name) as address:
                conn.connect(address)
            conn.sendall(ticket)
            answer, fds, _, _ = socket.recv_fds(conn, len(shm.HANDOVER_OK), 1)
        except OSError as exc:
            raise IntegrityError(
                f"model {model!r}: cannot take the segment from {name!r} in {directory}: {exc}"
            ) from exc
    if answer != shm.HANDOVER_OK or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise IntegrityError(f"model {model!r}: the server's socket {name!r} gave no segment (it answered {answer!r})")
    return fds[0]


def _drain(
    outgoing: queue.SimpleQueue[pb.StreamTensorsSharedRequest | None],
) -> Iterator[pb.StreamTensorsSharedRequest]:
    while (message := outgoing.get()) is not None:
        yield message


class _Ring:
    """The server's segment, taken over its hand-over socket and mapped (shm.map_segment);
    chunk addresses point into it until close().

    Mapped read-only, unless the process uses CUDA: then read-write, because registering read-only
    memory with CUDA needs a device that supports it. This side never writes to it.
    """

    def __init__(self, mapping: shm.Mapping, slots: int, slot_bytes: int, model: str) -> None:
        self.mapping = mapping
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.model = model
        # The mapping as CUDA copies see it: registered by the first one (cuda_host.HostRegion).
        self.region = cuda_host.HostRegion(mapping.address, mapping.size, writable=mapping.writable)

    @classmethod
    def open(cls, directory: Path, announcement: pb.StreamTensorsSharedResponse, model: str) -> _Ring:
        name, slots, slot_bytes = announcement.segment_socket, announcement.slots, announcement.slot_bytes
        if not shm.is_socket_name(name) or not slots or not slot_bytes:
            raise IntegrityError(
                f"model {model!r}: the server announced segment socket {name[:200]!r} for {slots} x {slot_bytes} "
                "bytes, not a shared-memory ring"
            )
        size = shm.ring_bytes(slots, slot_bytes)
        fd = _take_segment(directory, name, announcement.ticket, model)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size != size:
                raise IntegrityError(f"model {model!r}: the segment from {name!r} is not a ring of {size} bytes")
            if not shm.is_sealed(fd):
                raise IntegrityError(f"model {model!r}: the segment from {name!r} is not sealed against truncation")
            try:
                mapping = shm.map_segment(fd, size, writable=cuda_host.in_use())
            except OSError as exc:
                raise IntegrityError(f"model {model!r}: cannot map the segment from {name!r}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        return cls(mapping, slots, slot_bytes, model)

    def ref(self, chunk: pb.TensorChunk) -> ChunkRef:
        """Where chunk's bytes lie in the mapping; a chunk outside its slot is an IntegrityError."""
        size = chunk.encoded_length if chunk.encoding else chunk.length
        if not chunk.HasField("slot") or chunk.slot >= self.slots or chunk.slot_offset + size > self.slot_bytes:
            raise IntegrityError(
                f"model {self.model!r}: tensor {chunk.tensor!r}: chunk at offset {chunk.offset} lies outside the "
                f"ring (slot {chunk.slot if chunk.HasField('slot') else None}, slot offset {chunk.slot_offset}, "
                f"{size} bytes; {self.slots} slots of {self.slot_bytes} bytes)"
            )
        address = shm.slot_address(self.mapping.address, self.slot_bytes, chunk.slot, chunk.slot_offset)
        return ChunkRef(
            chunk.tensor, chunk.offset, chunk.crc32c, chunk.length, address, size, self.region,
            encoding=chunk.encoding, encoded_length=chunk.encoded_length,
        )  # fmt: skip

    def close(self) -> None:
        """Unregister and unmap; the caller has waited for copies from the ring (Placers.settle)."""
        if self.mapping.address:
            self.region.release()
            self.mapping.close()
