"""How chunk bytes reach the client: the data transports behind one small protocol.

A transport runs one StreamTensors request and yields batches of ChunkRef: each chunk's fields and
the address where its bytes lie in this process's memory (inside a received gRPC message, or
inside a shared-memory slot). The client checks and places every chunk of a batch before it asks
for the next one; a batch's addresses stay valid until then, and no longer. Closing the iterator
cancels the stream and frees what the transport holds. gRPC errors propagate as grpc.RpcError; the
client translates them (client.py) and decides whether to resume.

Cancelling from another thread: a transport registers how to stop its stream (for gRPC,
call.cancel) with the StreamCancel it is given; the client's idle watchdog and the thread that
collects parallel streams call StreamCancel.cancel from their own threads. The stream's iterator
then raises grpc.RpcError (CANCELLED) on the thread reading it.

Concurrency: one transport object may run several streams at once, one per thread; each stream's
iterator is used by one thread.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from weightstream import framing
from weightstream.client.cuda_host import HostRegion
from weightstream.client.errors import IntegrityError
from weightstream.v1 import weightstream_pb2 as pb

STREAM_TENSORS_METHOD = "/weightstream.v1.WeightStreamService/StreamTensors"


@dataclass(frozen=True)
class ChunkRef:
    """One received chunk: length bytes at address, for tensor from byte offset, with their CRC32C."""

    tensor: str
    offset: int
    crc32c: int
    length: int
    # Where the bytes lie now; 0 with length 0.
    address: int
    # Bytes that actually arrived (for gRPC, the payload's size); must equal length.
    received: int
    # The host memory address lies in, when CUDA may register it (a shared-memory ring): a CUDA
    # placer then copies from it to the device directly, and the batch's memory must outlive the
    # copy until Placers.settle().
    region: HostRegion | None = None


class StreamCancel:
    """Stops one stream from any thread; reason says who stopped it (None while it runs).

    Thread-safe: on_cancel is called by the transport on the stream's thread, cancel by any thread.
    An action registered after cancel() runs at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._actions: list[Callable[[], object]] = []
        self.reason: str | None = None

    def on_cancel(self, action: Callable[[], object]) -> None:
        with self._lock:
            if self.reason is None:
                self._actions.append(action)
                return
        action()

    def cancel(self, reason: str) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
            actions, self._actions = self._actions, []
        for action in actions:
            action()


class Transport(Protocol):
    # Reported in LoadReport.transport: "grpc" or "shm".
    name: str

    def stream(
        self, request: pb.StreamTensorsRequest, metadata: Sequence[tuple[str, str]], cancel: StreamCancel
    ) -> Iterator[Sequence[ChunkRef]]: ...


class GrpcTransport:
    """Chunk bytes inside StreamTensors messages, read raw and decoded by framing (no protobuf objects)."""

    name = "grpc"

    def __init__(self, channel: grpc.Channel) -> None:
        # The data stream is read as raw message bytes, so that payloads are checksummed and placed
        # straight from the received message.
        self._method = channel.unary_stream(
            STREAM_TENSORS_METHOD,
            request_serializer=pb.StreamTensorsRequest.SerializeToString,
            response_deserializer=None,
        )

    def stream(
        self, request: pb.StreamTensorsRequest, metadata: Sequence[tuple[str, str]], cancel: StreamCancel
    ) -> Iterator[Sequence[ChunkRef]]:
        call = self._method(request, metadata=tuple(metadata))
        cancel.on_cancel(call.cancel)
        try:
            for message in call:
                try:
                    chunks = framing.decode_response(message)
                except framing.FramingError as exc:
                    raise IntegrityError(f"model {request.model!r}: malformed stream message: {exc}") from exc
                # The message's own memory: payloads are read from here, never sliced out. The
                # message object stays referenced (by `message`) until the next batch is asked for.
                base = ctypes.cast(ctypes.c_char_p(message), ctypes.c_void_p).value or 0
                yield [
                    ChunkRef(c.tensor, c.offset, c.crc32c, c.length, base + c.data_start, c.data_length) for c in chunks
                ]
        finally:
            call.cancel()
