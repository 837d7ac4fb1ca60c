"""The same-host transport: chunk bytes read from a shared-memory ring the server fills.

negotiate() proves that the server sees the client's directory (a nonce file written here, read
back there) and returns a SharedMemoryTransport, or None when the server cannot use it; the client
then streams over gRPC. Each stream() maps the segment the server announces, yields the chunks of
each filled slot as one batch, with their addresses inside the mapping, and returns the slot (a
credit) once the caller asks for the next batch.

Copies per byte on this side: slot -> parameter (one memmove). On CUDA, when the device allows it,
the first copy registers the ring with CUDA (cuda_host.HostRegion) and each chunk is one DMA copy
from its slot to the device; otherwise slot -> pinned staging -> device. Memory: the
mapping of one ring per stream (slots * slot_bytes), shared with the server.

Concurrency: as for every transport, one stream per thread, each iterator used by one thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import queue
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from weightstream import wire
from weightstream.client import cuda_host
from weightstream.client.errors import FailedPreconditionError, IntegrityError
from weightstream.client.transport import ChunkRef, StreamCancel
from weightstream.v1 import weightstream_pb2 as pb

logger = logging.getLogger(__name__)

OPEN_SHARED_MEMORY_METHOD = "/weightstream.v1.WeightStreamService/OpenSharedMemory"
STREAM_TENSORS_SHARED_METHOD = "/weightstream.v1.WeightStreamService/StreamTensorsShared"
NONCE_PREFIX = wire.SHM_NONCE_PREFIX
# Owner read-write, group read: a server in another container of the pod, running as another user
# of the pod's fsGroup, can still read it.
NONCE_MODE = 0o640
NONCE_BYTES = 32
# The ring asked for: 4 slots of 4 chunks (64 MiB at 4 MiB chunks). Measured here, few large slots
# beat many small ones: fewer messages each way, and a smaller segment to allocate per stream.
DEFAULT_SLOTS = 4
CHUNKS_PER_SLOT = 4
SEGMENT_PREFIX = wire.SHM_SEGMENT_PREFIX
NEGOTIATE_TIMEOUT_S = 10.0


class SharedMemoryTransport:
    """StreamTensorsShared on one channel, its segments mapped from shm_dir.

    slots and slot_bytes are the ring asked for (slot_bytes 0: CHUNKS_PER_SLOT of the request's chunks);
    max_ring_bytes is what the server grants (OpenSharedMemoryResponse), and caps the ring.
    """

    name = "shm"

    def __init__(
        self,
        channel: grpc.Channel,
        shm_dir: str | Path,
        *,
        max_ring_bytes: int,
        slots: int = DEFAULT_SLOTS,
        slot_bytes: int = 0,
    ) -> None:
        self.shm_dir = Path(shm_dir)
        self.max_ring_bytes = max_ring_bytes
        self.slots = slots
        self.slot_bytes = slot_bytes
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
    ) -> SharedMemoryTransport | None:
        """A transport if the server at channel sees shm_dir as this process does; None (logged once) if not.

        None when this process cannot write to shm_dir, or the server answers FAILED_PRECONDITION
        (another directory, or none) or UNIMPLEMENTED (an older server); with required, those raise
        FailedPreconditionError instead. Other gRPC errors propagate.
        """
        directory = Path(shm_dir)
        nonce = secrets.token_bytes(NONCE_BYTES)
        name = f"{NONCE_PREFIX}{secrets.token_hex(8)}"
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
        self, request: pb.StreamTensorsRequest, metadata: Sequence[tuple[str, str]], cancel: StreamCancel
    ) -> Iterator[Sequence[ChunkRef]]:
        """Chunks of request, one batch per filled slot; the slot is returned when the next batch is asked for."""
        slots, slot_bytes = self._ring(request)
        # Messages to the server: the request, then an "attached" message, then credits.
        outgoing: queue.SimpleQueue[pb.StreamTensorsSharedRequest | None] = queue.SimpleQueue()
        outgoing.put(pb.StreamTensorsSharedRequest(request=request, slots=slots, slot_bytes=slot_bytes))
        call = self._method(_drain(outgoing), metadata=tuple(metadata))
        cancel.on_cancel(call.cancel)
        ring: _Ring | None = None
        try:
            announcement = next(call)
            ring = _Ring.open(self.shm_dir, announcement, request.model)
            # Tells the server that the segment is mapped, so that it removes the file now.
            outgoing.put(pb.StreamTensorsSharedRequest())
            for message in call:
                # One batch per slot, each slot returned as soon as it is placed: the server
                # refills it while the rest of the message is placed (a message may carry many).
                for slot, chunks in itertools.groupby(message.chunks, key=lambda c: c.slot):
                    yield [ring.ref(chunk) for chunk in chunks]
                    outgoing.put(pb.StreamTensorsSharedRequest(released_slots=[slot]))
        finally:
            outgoing.put(None)
            call.cancel()
            if ring is not None:
                ring.close()

    def _ring(self, request: pb.StreamTensorsRequest) -> tuple[int, int]:
        """The ring to ask for: self.slots of CHUNKS_PER_SLOT chunks (or slot_bytes), capped by the grant."""
        chunk_bytes = wire.clamp_chunk_bytes(request.max_chunk_bytes)
        slot_bytes = self.slot_bytes or min(CHUNKS_PER_SLOT * chunk_bytes, wire.MAX_CHUNK_BYTES)
        slots = self.slots
        if self.max_ring_bytes:
            slots = max(2, min(slots, self.max_ring_bytes // slot_bytes))
        return slots, slot_bytes


def _refused(required: bool, why: str) -> None:
    if required:
        raise FailedPreconditionError(f"the shared-memory transport cannot be used: {why}")
    logger.info("shared memory not used, streaming over gRPC: %s", why)


def _drain(
    outgoing: queue.SimpleQueue[pb.StreamTensorsSharedRequest | None],
) -> Iterator[pb.StreamTensorsSharedRequest]:
    while (message := outgoing.get()) is not None:
        yield message


class _Ring:
    """The server's segment, mapped (libc mmap: no buffer object, so no copy and no numpy).

    Mapped read-only, unless the process uses CUDA: then read-write where the file allows it (the
    same user as the server), because registering read-only memory with CUDA needs a device that
    supports it; read-only otherwise. This side never writes to it. Chunk addresses point into it until close().
    """

    def __init__(self, address: int, size: int, slots: int, slot_bytes: int, model: str, writable: bool) -> None:
        self.address = address
        self.size = size
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.model = model
        # The mapping as CUDA copies see it: registered by the first one (cuda_host.HostRegion).
        self.region = cuda_host.HostRegion(address, size, writable=writable)

    @classmethod
    def open(cls, directory: Path, announcement: pb.StreamTensorsSharedResponse, model: str) -> _Ring:
        name, slots, slot_bytes = announcement.segment, announcement.slots, announcement.slot_bytes
        if not name.startswith(SEGMENT_PREFIX) or not wire.is_plain_file_name(name) or not slots or not slot_bytes:
            raise IntegrityError(
                f"model {model!r}: the server announced segment {name[:200]!r} of {slots} x {slot_bytes} bytes, "
                "not a shared-memory ring"
            )
        size = slots * slot_bytes
        path = directory / name
        flags = os.O_NOFOLLOW | os.O_CLOEXEC
        writable = cuda_host.in_use()
        try:
            try:
                fd = os.open(path, flags | (os.O_RDWR if writable else os.O_RDONLY))
            except PermissionError:
                if not writable:
                    raise
                writable = False  # another user's file, readable through the group
                fd = os.open(path, flags | os.O_RDONLY)
        except OSError as exc:
            raise IntegrityError(f"model {model!r}: cannot open segment {name!r} in {directory}: {exc}") from exc
        try:
            if os.fstat(fd).st_size < size:
                raise IntegrityError(f"model {model!r}: segment {name!r} is smaller than its {size} bytes")
            protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            address = _libc.mmap(None, size, protection, mmap.MAP_SHARED | _MAP_POPULATE, fd, 0)
        finally:
            os.close(fd)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise IntegrityError(f"model {model!r}: cannot map segment {name!r}: {os.strerror(err)}")
        return cls(address, size, slots, slot_bytes, model, writable)

    def ref(self, chunk: pb.TensorChunk) -> ChunkRef:
        """Where chunk's bytes lie in the mapping; a chunk outside its slot is an IntegrityError."""
        if not chunk.HasField("slot") or chunk.slot >= self.slots or chunk.slot_offset + chunk.length > self.slot_bytes:
            raise IntegrityError(
                f"model {self.model!r}: tensor {chunk.tensor!r}: chunk at offset {chunk.offset} lies outside the "
                f"ring (slot {chunk.slot if chunk.HasField('slot') else None}, slot offset {chunk.slot_offset}, "
                f"{chunk.length} bytes; {self.slots} slots of {self.slot_bytes} bytes)"
            )
        address = self.address + chunk.slot * self.slot_bytes + chunk.slot_offset
        return ChunkRef(chunk.tensor, chunk.offset, chunk.crc32c, chunk.length, address, chunk.length, self.region)

    def close(self) -> None:
        """Unregister and unmap; the caller has waited for copies from the ring (Placers.settle)."""
        if self.address:
            self.region.release()
            _libc.munmap(self.address, self.size)
            self.address = 0


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
# Map every page at once: one call instead of a fault per 4 KiB page on first read.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
