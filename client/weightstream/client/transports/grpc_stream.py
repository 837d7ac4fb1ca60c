"""The gRPC transport: chunk bytes inside StreamTensors messages, on any network.

Each message is read as raw bytes and decoded by weightstream.protocol.framing, never as protobuf objects,
so payloads are checksummed and placed straight from the received message: gRPC's copy into the
message and the placer's copy out of it into the tensor are the only ones on this side (on CUDA
the placer goes through pinned staging, see placement.py).

The call is read on a helper thread (call_reader.py), so that a call whose cancel does not end
it cannot hold the stream's thread: the generator raises StreamAbandoned instead. Memory: besides
the batch being placed, up to call_reader.READ_AHEAD + 1 received messages wait for their turn.

Concurrency: as for every transport, one stream per thread, each generator used by one thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import grpc

from weightstream.client.errors import IntegrityError
from weightstream.client.transports.base import Batches, ChunkRef, Landing, StreamCancel, method_path
from weightstream.client.transports.call_reader import CallReader
from weightstream.protocol import framing
from weightstream.protocol.names import TransportName
from weightstream.v1 import weightstream_pb2 as pb

STREAM_TENSORS_METHOD = method_path("StreamTensors")


class GrpcTransport:
    """StreamTensors on one channel, its messages read raw."""

    name: TransportName = "grpc"

    def __init__(self, channel: grpc.Channel) -> None:
        self._method: grpc.UnaryStreamMultiCallable[pb.StreamTensorsRequest, bytes] = channel.unary_stream(
            STREAM_TENSORS_METHOD,
            request_serializer=pb.StreamTensorsRequest.SerializeToString,
            response_deserializer=None,
        )

    def stream(
        self,
        request: pb.StreamTensorsRequest,
        metadata: Sequence[tuple[str, str]],
        cancel: StreamCancel,
        land: Landing | None = None,
    ) -> Batches:
        """Chunks of request, one batch per message; a batch's addresses lie inside that message."""
        call = self._method(request, metadata=tuple(metadata))
        cancel.on_cancel(call.cancel)
        messages = CallReader[bytes](call, cancel, name="weightstream-grpc-call")
        try:
            for message in messages:
                try:
                    chunks = framing.decode_response(message)
                except framing.FramingError as exc:
                    raise IntegrityError(f"model {request.model!r}: malformed stream message: {exc}") from exc
                # The message's own memory: payloads are read from here, never sliced out. The
                # message object stays referenced (by `message`) until the next batch is asked for.
                base = ctypes.cast(ctypes.c_char_p(message), ctypes.c_void_p).value or 0
                yield [
                    ChunkRef(
                        c.tensor, c.offset, c.crc32c, c.length, base + c.data_start, c.data_length,
                        encoding=c.encoding, encoded_length=c.encoded_length,
                    )
                    for c in chunks
                ]  # fmt: skip
        finally:
            call.cancel()
            messages.close()
