"""Checks of what a client asks for, and its request turned into the plan's terms.

Every check here runs before any work is done for the request, and refuses with InvalidRequest.
The limits on what a plan may hold (plan.MAX_*) live with the plan, which enforces them for every
caller; check_stream_request applies the tensor count early, before the request is converted.
"""

from __future__ import annotations

from weightstream.protocol import shm, wire
from weightstream.protocol.wire import TensorSlice
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import InvalidRequest
from weightstream_server.serving.read_plan import Requested, check_tensor_count


def check_stream_request(request: pb.StreamTensorsRequest) -> None:
    """Refuse a request whose sizes are out of bounds."""
    check_chunk_bytes(request.max_chunk_bytes)
    check_tensor_count(len(request.tensors))


def check_chunk_bytes(max_chunk_bytes: int) -> None:
    """Refuse a requested chunk size out of bounds (0, the server's default, is always fine)."""
    if max_chunk_bytes and not wire.MIN_CHUNK_BYTES <= max_chunk_bytes <= wire.MAX_CHUNK_BYTES:
        raise InvalidRequest(
            f"max_chunk_bytes {max_chunk_bytes} is outside {wire.MIN_CHUNK_BYTES}..{wire.MAX_CHUNK_BYTES}"
            " (0 means the server's default)"
        )


def chunk_bytes(max_chunk_bytes: int, default: int) -> int:
    """The chunk size a request that asked for max_chunk_bytes (0: the server's default) gets."""
    return wire.clamp_chunk_bytes(max_chunk_bytes or default)


def requested_tensors(request: pb.StreamTensorsRequest) -> list[Requested]:
    """The request's tensors as (name, byte ranges, slice or None), for plan_reads."""
    return [
        (
            t.name,
            [(r.start, r.end) for r in t.ranges],
            TensorSlice(t.slice.dim, t.slice.start, t.slice.stop) if t.HasField("slice") else None,
        )
        for t in request.tensors
    ]


def ring_size(slots: int, slot_bytes: int, chunk_bytes: int, max_ring_bytes: int) -> tuple[int, int]:
    """The (slots, slot_bytes) a shared stream gets for what it asked (0: the defaults); refuses sizes out of bounds."""
    slots = slots or shm.DEFAULT_SLOTS
    slot_bytes = slot_bytes or shm.default_slot_bytes(chunk_bytes)
    if not shm.MIN_SLOTS <= slots <= shm.MAX_SLOTS:
        raise InvalidRequest(f"slots {slots} is outside {shm.MIN_SLOTS}..{shm.MAX_SLOTS} (0 means {shm.DEFAULT_SLOTS})")
    if not wire.MIN_CHUNK_BYTES <= slot_bytes <= wire.MAX_CHUNK_BYTES or slot_bytes % shm.SLOT_ALIGN:
        raise InvalidRequest(
            f"slot_bytes {slot_bytes} is outside {wire.MIN_CHUNK_BYTES}..{wire.MAX_CHUNK_BYTES} or not a "
            f"multiple of {shm.SLOT_ALIGN} (0 means {shm.CHUNKS_PER_SLOT} chunks)"
        )
    if slots * slot_bytes > max_ring_bytes:
        raise InvalidRequest(
            f"a ring of {slots} x {slot_bytes} bytes is larger than the {max_ring_bytes} bytes this "
            "server grants a stream (OpenSharedMemoryResponse.max_ring_bytes)"
        )
    return slots, slot_bytes
