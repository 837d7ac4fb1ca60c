"""How chunk bytes reach the client: the small protocol every data transport implements.

A transport runs one StreamTensors request and yields batches of ChunkRef: each chunk's fields and
the address where its bytes lie in this process's memory (inside a received gRPC message, inside a
shared-memory slot, or already in their destination). The client checks and places every chunk of
a batch before it asks for the next one; a batch's addresses stay valid until then, and no longer.
Closing the generator cancels the stream and frees what the transport holds. gRPC errors propagate
as grpc.RpcError, a broken data connection as TransportError; the load session (session.py)
decides whether to resume, and errors.translated turns them into the client's exceptions.

Receiving in place: a transport that reads bytes from a socket may ask the load where a chunk's
bytes belong (land(tensor, offset, length) -> address or None) before it reads them, read them
there, and hand them over as a ChunkRef with in_place set; the load then checks their CRC32C
where they lie and copies nothing. land answers None where the bytes must not go straight in (no
such tensor, out of bounds, a device tensor, or a range that already holds checked bytes).

Cancelling from another thread: a transport registers how to stop its stream (for gRPC,
call.cancel) with the StreamCancel it is given; the client's idle watchdog and the thread that
collects parallel streams call StreamCancel.cancel from their own threads. The stream's generator
then raises grpc.RpcError (CANCELLED) on the thread reading it, or, when the call has not ended
within a grace after its cancel (a call stuck inside gRPC), call_reader.StreamAbandoned.

Concurrency: one transport object may run several streams at once, one per thread; each stream's
generator is used by one thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

from weightstream.client.cuda_host import HostRegion
from weightstream.client.errors import WeightStreamError
from weightstream.protocol.names import TransportName
from weightstream.v1 import weightstream_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["WeightStreamService"]


def method_path(name: str) -> str:
    """The gRPC path of WeightStreamService's method name, as the generated code describes it."""
    return f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name[name].name}"


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
    # The bytes were received at their destination, at the address land() gave (see the module docstring).
    in_place: bool = False
    # For a chunk received in place: the CRC32C of its bytes as they landed, when the transport
    # computed it while receiving them (None: the session computes it).
    landed_crc32c: int | None = None
    # weightstream.v1 ChunkEncoding: set, the received bytes at address are an encoded payload of
    # encoded_length bytes (a delta) that stands for length bytes; crc32c is of those.
    encoding: int = 0
    encoded_length: int = 0

    @property
    def payload_bytes(self) -> int:
        """The bytes that should have arrived at address: length, or an encoded payload's size."""
        return self.encoded_length if self.encoding else self.length


# land(tensor, offset, length): where those bytes may be received directly, or None.
Landing = Callable[[str, int, int], int | None]


class TransportError(Exception):
    """A data connection failed in a way a resume can mend; error is what the load raises if it cannot."""

    def __init__(self, error: WeightStreamError) -> None:
        super().__init__(error.message)
        self.error = error


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


Batches = Generator[Sequence[ChunkRef], None, None]


class Transport(Protocol):
    """One data path: runs a StreamTensors request and yields its chunks in batches (see the module docstring)."""

    @property
    def name(self) -> TransportName:
        """Reported in LoadReport.transport: "grpc", "shm" or "tcp" (the one its streams now use)."""
        ...

    def stream(
        self,
        request: pb.StreamTensorsRequest,
        metadata: Sequence[tuple[str, str]],
        cancel: StreamCancel,
        land: Landing | None = None,
    ) -> Batches: ...
