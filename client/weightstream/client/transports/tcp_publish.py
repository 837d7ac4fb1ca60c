"""A publish's bytes over the data port: the part's tensors written as frames, client to server.

The PublishTensors call (authenticated, its status how the publish ended) carries the PublishStart
with data_port set; the server's first answer announces the port and a one-time ticket, the client
connects (TcpTransport.connect: the handshake and fallback rules of tcp streams) and writes each
tensor's CHUNK frames, each with its CRC32C, then END with the counts (weightstream.protocol.tcp).
The payload goes out from the tensor's own host memory (sendall of a view: one kernel copy); a
tensor on a device is copied to host memory first, one tensor at a time. The call's last answer
says the revision is current. The request side of the call stays open, empty, until then.

A connection the server breaks (a bad chunk, a layout refused) ends the publish with the call's
status, which names what was wrong.

Concurrency: one publish per call; the call's request iterator runs on gRPC's thread.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator, Sequence

import grpc

from weightstream.client.errors import UnavailableError
from weightstream.client.revisions import OutChunk
from weightstream.client.transports.tcp import TcpTransport, ended_with_error, raise_if_no_data_port
from weightstream.protocol import tcp
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc


def publish_over_data_port(
    stub: pb_grpc.WeightStreamServiceStub,
    transport: TcpTransport,
    start: pb.PublishStart,
    chunks: Iterator[OutChunk],
    *,
    metadata: Sequence[tuple[str, str]],
) -> pb.PublishResponse:
    """Publish one part over the data port; DataPortUnusable when the server has none (or it cannot be
    reached), before any byte was sent; grpc.RpcError for what the server refused."""
    announced = pb.PublishStart()
    announced.CopyFrom(start)
    announced.data_port = True
    answered = threading.Event()

    def requests() -> Iterator[pb.PublishRequest]:
        yield pb.PublishRequest(start=announced)
        answered.wait()  # the request side stays open until the last answer

    call = stub.PublishTensors(requests(), metadata=tuple(metadata))
    try:
        try:
            announcement = next(call)
        except grpc.RpcError as exc:
            raise_if_no_data_port(exc)
            raise
        conn = transport.connect(announcement.data_host, announcement.data_port, announcement.ticket)
        with contextlib.closing(conn):
            try:
                _send_frames(conn, chunks)
            except OSError as exc:
                # The server broke the connection: the call says why.
                if ended_with_error(call):
                    raise call from None  # the server's status and message
                raise UnavailableError(f"the data connection broke while publishing: {exc}") from None
            return next(call)
    finally:
        answered.set()
        call.cancel()


def _send_frames(conn: socket.socket, chunks: Iterator[OutChunk]) -> None:
    count = sent = 0
    for chunk in chunks:
        name = chunk.tensor.encode()
        payload = len(chunk.payload)
        if chunk.encoding:
            header = tcp.delta_header(name, chunk.offset, chunk.length, chunk.crc32c, payload, chunk.encoding)
        else:
            header = tcp.chunk_header(name, chunk.offset, chunk.length, chunk.crc32c)
        conn.sendall(header)
        conn.sendall(chunk.payload)
        count += 1
        sent += payload
    conn.sendall(tcp.end_frame(count, sent))
